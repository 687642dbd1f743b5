"""`--harden` in what diffkit writes: the HTML report's matrix section, a JUnit test case per setting, summary.md's
block, the suite's harden column (index.html, summary.json, summary.csv, summary.md, junit.xml) and exit code, and
the pytest fixture failing a test the matrix breaks.  The renderers are given a Result of a real (small) diff with a
hand-made `Harden` attached; without --harden every output carries no trace of it."""
import dataclasses
import json
import os
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit import suite as S
from diffkit.render import codespans, harden_cell, harden_setting_line, junit_xml, summary_markdown
from diffkit.report import html_report, write_report
from diffkit.result import Finding, Harden, HardenSetting, Result

from conftest import KERNELS, REFS

pytest_plugins = ["pytester"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.GroupNorm(2, 8)

    def forward(self, x):
        return torch.relu(self.norm(self.proj(x)))


@pytest.fixture(scope="module")
def plain() -> Result:
    net = Net()
    result = diffkit.compare(net, net, [torch.randn(4, 8)])
    assert result.verdict == "match" and result.harden is None
    return result


def make_harden(result: Result) -> Harden:
    """A matrix with one setting of each verdict, a named stage where one diverges, a finding about the problem."""
    norm = next(s for s in result.stages if s.ref_name and "norm" in s.ref_name).divergence_dict()
    norm["diagnosis"] = [{"kind": "default_init_shortcut", "detail": "writes the bias mean", "confidence": 0.8}]
    return Harden("breaks", [
        HardenSetting("init", "GroupNorm affine parameters drawn at random", "diverged", 0.31, 0.05, "auto",
                      first_divergence=norm, root_cause=norm, seconds=0.12),
        HardenSetting("inputs", "inputs[0] x 100", "match", 2e-6, 1e-7, "auto", seconds=0.1),
        HardenSetting("shape", "batch_size 4 -> 5", "error",
                      error="the candidate raised RuntimeError: <expected 4 rows>", seconds=0.01),
        HardenSetting("precision", "TF32 on", "skipped", note="no GPU here"),
    ], [Finding("input_independent", "the output does not depend on inputs[1] <mask>", 0.9)], seconds=1.25)


@pytest.fixture(scope="module")
def hardened(plain) -> Result:
    return dataclasses.replace(plain, harden=make_harden(plain))


def test_html_section_holds_the_matrix_linked_from_the_top(hardened):
    html = html_report(hardened)
    top, section = html.index('href="#harden"'), html.index('<h2 id="harden">')
    assert top < section < html.index("<h2>Stages</h2>")
    body = html[section:html.index("</table>", section)]
    for text in ("GroupNorm affine parameters drawn at random", "inputs[0] x 100", "batch_size 4 -&gt; 5",
                 "TF32 on", "diverged", "skipped", "no GPU here", "&lt;expected 4 rows&gt;",
                 "the reference&#39;s float64 noise floor", "default_init_shortcut", "0.31", "4 settings, 2 break"):
        assert text in body, text
    assert "stage " in body and "norm" in body  # the first wrong stage
    finding = body.index("input_independent")
    assert finding < body.index("<table>")  # the findings above the matrix
    assert "inputs[1] &lt;mask&gt;" in body and "<mask>" not in html
    assert "1.2 s" in html  # the matrix's time
    assert "breaks</b> under init, shape; about the problem: input_independent" in html[top:section]


def test_notebook_view_has_the_matrix(hardened, plain):
    assert 'id="harden"' in hardened._repr_html_() and "GroupNorm affine" in hardened._repr_html_()
    assert "harden" not in plain._repr_html_().replace("test_harden_report.py", "")


def test_junit_has_a_case_per_setting(hardened, plain):
    root = ET.fromstring(junit_xml(hardened, "diffkit.net"))
    suite = root.find("testsuite")
    cases = [c for c in suite.iter("testcase") if c.get("classname") == "diffkit.net.harden"]
    assert [c.get("name") for c in cases] == ["harden init: GroupNorm affine parameters drawn at random",
                                              "harden inputs: inputs[0] x 100", "harden shape: batch_size 4 -> 5",
                                              "harden precision: TF32 on"]
    init, inputs, shape, tf32 = cases
    assert init.find("failure").get("type") == "diverged" and "norm" in init.find("failure").get("message")
    assert "default_init_shortcut" in init.find("failure").text
    assert len(inputs) == 0
    assert shape.find("failure").get("type") == "error" and "<expected 4 rows>" in shape.find("failure").text
    assert tf32.find("skipped").get("message") == "no GPU here"
    plain_suite = ET.fromstring(junit_xml(plain, "diffkit.net")).find("testsuite")
    assert int(suite.get("tests")) == int(plain_suite.get("tests")) + 4
    assert (suite.get("failures"), suite.get("skipped"), suite.get("errors")) == ("2", "1", "0")


def test_summary_markdown_block(hardened):
    md = summary_markdown(hardened)
    block = md[md.index("### Hardening (--harden): ❌ breaks"):]
    assert "4 settings, 2 break, 1 skipped, 1.2 s" in block
    assert "GroupNorm affine parameters drawn at random: diverged" in block
    assert "batch\\_size" not in block and "&lt;expected 4 rows&gt;" in block  # escaped as Markdown
    assert "inputs\\[0\\] x 100" not in block  # a setting that passes is not listed
    assert "**input\\_independent**" in block or "**input_independent**" in block


def test_without_harden_no_trace(plain, tmp_path):
    def trace(text: str) -> bool:  # (this file's name, where the models are defined, says "harden" too)
        return "harden" in text.replace("test_harden_report.py", "").lower()

    paths = write_report(plain, str(tmp_path))
    for kind in ("html", "markdown", "junit", "json"):
        assert not trace(open(paths[kind], encoding="utf-8").read()), kind
    entry = S.entry_from_result(S.SuiteEntry("p", "r.py", "c.py"), plain)
    entries = [entry]
    for text in (S.index_html(entries), S.summary_json(entries), S.summary_csv(entries), S.junit_xml(entries),
                 S.summary_markdown(entries), json.dumps(entry.to_dict())):
        assert not trace(text)
    assert S.exit_code(entries) == 0 and S.harden_counts_text(entries) == ""


def test_suite_column_and_exit_code(hardened, plain):
    robust = dataclasses.replace(plain, harden=Harden("robust", [HardenSetting("inputs", "inputs[0] x 10", "match",
                                                                               1e-7, 1e-8)], seconds=0.5))
    broken = Result.from_json(hardened.to_json())  # as the suite reads a pair's result.json back
    entries = [S.entry_from_result(S.SuiteEntry("broken", "r.py", "c.py"), broken),
               S.entry_from_result(S.SuiteEntry("robust", "r.py", "c2.py"), robust),
               S.SuiteEntry("missing", None, "c3.py", verdict="error", error="no reference")]
    assert [e.harden for e in entries] == ["breaks: init, shape", "robust", None]
    assert entries[0].breaks and not entries[1].breaks and "GroupNorm affine" in entries[0].harden_detail
    assert S.exit_code(entries[:2]) == 1 and S.exit_code(entries[1:2]) == 0 and S.exit_code(entries) == 2
    assert S.expected_exit(broken) == 1 and S.expected_exit(robust) == 0
    html = S.index_html(entries)
    assert "<th>harden</th>" in html and "breaks: init, shape" in html and "1 break under --harden" in html
    rows = json.loads(S.summary_json(entries))
    assert [r["harden"] for r in rows] == ["breaks: init, shape", "robust", None]
    assert S.summary_csv(entries).splitlines()[0].endswith(",harden")
    md = S.summary_markdown(entries)
    assert "| harden |" in md and "1 break under --harden" in md.splitlines()[0]
    assert "| breaks: init, shape |" in md
    suite = ET.fromstring(S.junit_xml(entries)).find("testsuite")
    case = next(c for c in suite.iter("testcase") if c.get("name") == "broken")
    assert case.find("failure").get("type") == "harden" and suite.get("failures") == "1"
    assert S.SuiteEntry.from_dict(entries[0].to_dict()) == entries[0]  # the --resume marker keeps it
    warned = dataclasses.replace(robust, harden=dataclasses.replace(robust.harden, findings=hardened.harden.findings))
    entry = S.entry_from_result(S.SuiteEntry("warned", "r.py", "c.py"), warned)
    assert entry.harden == "robust" and entry.harden_detail.startswith("input_independent: ") and not entry.breaks
    assert "harden" in S.PASS_THROUGH


def test_setting_names_in_code_type_stay_text():
    assert str(codespans("`x<b>` (input 0) x 100 & `y`")) == \
        "<code>x&lt;b&gt;</code> (input 0) x 100 &amp; <code>y</code>"
    assert str(codespans(None)) == ""


def test_harden_words(hardened):
    h = hardened.harden
    assert harden_cell(h) == "breaks: init, shape" and harden_cell(None) is None
    line = harden_setting_line(h.settings[0])
    assert line.startswith("init: GroupNorm affine parameters drawn at random: diverged, max |error| 0.31")
    assert "first wrong stage" in line and "(default_init_shortcut)" in line


PYTESTER_TEST = '''
import sys

import torch

import diffkit.compare
from diffkit.result import Harden, HardenSetting


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


def fake(verdict):
    real = sys.modules["diffkit.compare"].compare

    def compare(ref, cand, inputs, atol=None, rtol=None, harden=False, **kw):
        result = real(ref, cand, inputs, atol, rtol, **kw)
        if harden:
            result.harden = Harden(verdict, [HardenSetting("init", "Linear bias drawn at random", "match"),
                                             HardenSetting("shape", "rows 4 -> 5", "error" if verdict == "breaks"
                                                           else "match", error="the candidate raised ValueError")])
        return result
    return compare


def test_breaks(diffkit, monkeypatch):
    monkeypatch.setattr(sys.modules["diffkit.compare"], "compare", fake("breaks"))
    net = Net()
    diffkit.compare(net, net, [torch.randn(2, 4)], harden=True)


def test_robust(diffkit, monkeypatch):
    monkeypatch.setattr(sys.modules["diffkit.compare"], "compare", fake("robust"))
    net = Net()
    assert diffkit.compare(net, net, [torch.randn(2, 4)], harden=True).harden.verdict == "robust"
'''


def test_fixture_fails_a_test_the_matrix_breaks(pytester):
    pytester.makepyfile(test_hardened=PYTESTER_TEST)
    result = pytester.runpytest("--diffkit-report-dir", str(pytester.path / "out"), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*diffkit --harden: *breaks with rows 4 -> 5: the candidate raised ValueError*",
                                 "*shape: rows 4 -> 5: error; the candidate raised ValueError*",
                                 "*diffkit report: *test_breaks*index.html*"])


FILES_TEST = '''
def test_sakana(diffkit):
    diffkit.compare({ref!r}, {cand!r}, harden=True)


def test_plain(diffkit):
    assert diffkit.compare({ref!r}, {cand!r}).harden is None
'''


def test_fixture_on_files_fails_the_sakana_pattern_under_init(pytester):
    pytester.makepyfile(test_files=FILES_TEST.format(ref=os.path.join(REFS, "hk_conv3d_groupnorm_mean.py"),
                                                     cand=os.path.join(KERNELS, "harden",
                                                                       "conv3d_groupnorm_bias_mean.py")))
    result = pytester.runpytest("--diffkit-report-dir", str(pytester.path / "out"), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*diffkit --harden: passes KernelBench (5/5); breaks with random GroupNorm*",
                                 "*init: random GroupNorm*: diverged*first wrong stage*output*",
                                 "*diffkit report: *test_sakana*index.html*"])
    html = (pytester.path / "out" / "test_files.py__test_sakana" / "index.html").read_text(encoding="utf-8")
    assert 'id="harden"' in html


def test_suite_passes_harden_to_every_pair():
    ctx = S.suite.make_context("suite", ["d", "--harden", "--trials", "2"])
    argv = S.diff_argv(ctx, ctx.params)
    assert argv == ["--trials", "2", "--harden"]
    assert S.Runner("out", argv, [None], None).command(S.SuiteEntry("p", "r.py", "c.py"))[-1] == "--harden"
    ctx = S.suite.make_context("suite", ["d"])
    assert "--harden" not in S.diff_argv(ctx, ctx.params)
