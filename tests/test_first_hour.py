"""Issue 45, "the first hour of a new user": what a first report, summary and terminal answer teach.

- the report draws the stages that introduce error of their own, not a run of near-identical inherited ones
  (those are listed in one line linking into the stage table);
- one diagnosis line per finding on every surface (terminal, summary.md, index.html);
- a suite's summaries carry a what-if explanation in their diagnosis column;
- text cut to a terminal's columns ends in "…";
- the answer on stdout, diffkit's notes (the `report:` line, usage errors) on stderr, as the README says.
"""
import csv
import html
import io
import json
import os
import re

import pytest
from markupsafe import escape

from conftest import ROOT, run_cli

from diffkit import describe
from diffkit.render import format_table, md_code, md_escape, summary_markdown, text_report
from diffkit.measure import Stats
from diffkit.report import html_report
from diffkit.result import Finding, RecordInfo, Result, Stage

# ----------------------------------------------------------------------------- a pair with two independent bugs
# six Linear+ReLU layers; the candidate leaves out l1's bias (the first divergence and root cause) and, four
# layers on, uses a leaky ReLU for a5: a5 introduces error of its own, every other stage after l1 only inherits
DEPTH = 6
TWO_BUGS_REF = f'''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        for i in range(1, {DEPTH} + 1):
            setattr(self, f"l{{i}}", nn.Linear(16, 16))
            setattr(self, f"a{{i}}", nn.ReLU())

    def forward(self, x):
        for i in range(1, {DEPTH} + 1):
            x = getattr(self, f"a{{i}}")(getattr(self, f"l{{i}}")(x))
        return x


def get_inputs():
    return [torch.randn(8, 16)]


def get_init_inputs():
    return []
'''
TWO_BUGS_CAND = f'''import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        for i in range(1, {DEPTH} + 1):
            setattr(self, f"l{{i}}", nn.Linear(16, 16))
            setattr(self, f"a{{i}}", nn.LeakyReLU(0.5) if i == 5 else nn.ReLU())

    def forward(self, x):
        x = self.a1(x @ self.l1.weight.t())  # l1's bias left out
        for i in range(2, {DEPTH} + 1):
            x = getattr(self, f"a{{i}}")(getattr(self, f"l{{i}}")(x))
        return x
'''


@pytest.fixture(scope="module")
def two_bugs(tmp_path_factory):
    """`diffkit diff` of the two-bug pair: (process, its stdout, the report folder, the Result read back)."""
    d = tmp_path_factory.mktemp("two_bugs")
    (d / "ref.py").write_text(TWO_BUGS_REF)
    (d / "cand.py").write_text(TWO_BUGS_CAND)
    out = d / "report"
    proc = run_cli("diff", d / "ref.py", d / "cand.py", "--trials", "1", "--report-dir", out, cwd=str(d))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = Result.from_json((out / "result.json").read_text(encoding="utf-8"))
    return proc, out, result


def _page_text(page: str) -> str:
    """index.html as text: no pictures, no styles, no tags, entities read."""
    page = re.sub(r"<style.*?</style>", "", page, flags=re.S)
    page = re.sub(r"<svg.*?</svg>", "", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def test_the_report_draws_the_stage_that_introduces_its_own_error_and_lists_the_inherited(two_bugs):
    _, out, result = two_bugs
    fd = result.first_divergence
    assert fd is not None and fd.ref_name == "l1" and result.root_cause is fd
    later = result.stage("a5")
    # (re-run alone on the reference's inputs: out of tolerance there introduces, within it only inherits)
    assert later.failed and later.local is not None and not later.local.ok, later.to_dict()
    inherited = [s for s in result.diverged_stages if s is not fd and s is not later]
    assert len(inherited) >= 5 and all(s.local is not None and s.local.ok for s in inherited), \
        [(s.index, s.name, s.local) for s in inherited]
    page = (out / "index.html").read_text(encoding="utf-8")
    # the later introducing stage has a section of its own, headed as such
    heading = re.search(rf'<h2 id="stage-{later.index}">([^<]*)', page)
    assert heading and "Introduces error of its own" in heading.group(1), heading
    assert f'<h2 id="stage-{fd.index}">First divergence' in page
    # the inherited ones have no section: one line lists each (index, name, max |error|) with a link to its row
    line = re.search(r'<div id="inherited"[^>]*>(.*?)</div>', page, flags=re.S)
    assert line, "no line listing the inherited stages"
    for s in inherited:
        assert f'id="stage-{s.index}"' not in page, f"stage {s.index} {s.name} inherits its error but is drawn"
        assert f'<a href="#row-{s.index}">stage {s.index}</a>' in line.group(1)
        assert f'<tr id="row-{s.index}"' in page  # (the link's target, in the stage table)
        assert describe.fmt(s.stats.max_abs, ".3g") in line.group(1)
    assert f"stage {later.index}<" not in line.group(1)


def _findings(result: Result) -> list[str]:
    details = [f.detail for s in result.stages for f in s.diagnosis] + [f.detail for f in result.findings]
    return list(dict.fromkeys(d for d in details if d))


def test_each_finding_is_said_once_in_the_terminal_the_summary_and_the_report(two_bugs):
    proc, out, result = two_bugs
    found = _findings(result)
    assert found, "the pair should be diagnosed (missing_bias at l1)"
    headline = describe.headline(result)
    terminal = "\n".join(ln for ln in proc.stdout.splitlines() if ln.strip() != headline)
    markdown = (out / "summary.md").read_text(encoding="utf-8").replace(md_code(headline), "")
    page = _page_text((out / "index.html").read_text(encoding="utf-8"))
    page = page.replace(headline, "")
    for detail in found:
        assert terminal.count(detail) <= 1, f"said {terminal.count(detail)} times in the terminal: {detail}"
        assert markdown.count(md_escape(detail)) <= 1, f"said more than once in summary.md: {detail}"
        assert page.count(detail) <= 1, f"said {page.count(detail)} times in index.html: {detail}"
    # and said at least once in each (a dedupe that drops the finding altogether would pass the above)
    fd_detail = result.first_divergence.diagnosis[0].detail
    assert fd_detail in terminal and md_escape(fd_detail) in markdown and fd_detail in page


def _stage(index, name, findings, local_ok=None) -> Stage:
    rec = RecordInfo(index=index, name=name, kind="module", op="nn.Linear", shape=(4,), dtype="float32")
    st = Stats(4, 0.5, 0.2, 1.0, 4, 0.9, 0, 0, 0, 0, None, 1e-4, 1e-4)
    local = None if local_ok is None else Stats(4, 0.0 if local_ok else 0.5, 0.0, 0.0, 0 if local_ok else 4, 1.0,
                                                0, 0, 0, 0, None, 1e-4, 1e-4)
    return Stage(index=index, ref=rec, cand=rec, paired_by="name", stats=st, status="diverged", diagnosis=findings,
                 local=local)


def test_a_finding_two_stages_carry_is_said_once():
    """The root cause and the first divergence carrying the same finding (or one stage carrying it twice): one
    diagnosis line on each surface."""
    same = Finding("scale", "candidate = 2 × reference", 0.9)
    rc = _stage(0, "a", [same, Finding("scale", "candidate = 2 × reference", 0.9)], local_ok=False)
    fd = _stage(1, "b", [same], local_ok=True)
    result = Result(verdict="diverged", stages=[rc, fd], first_divergence=fd, error=None, output=None, atol=1e-4,
                    rtol=1e-4, root_cause=rc)
    assert describe.headline(result).count(same.detail) == 0
    assert text_report(result).count(same.detail) == 1
    assert summary_markdown(result).count(same.detail) == 1
    assert describe.assertion_message(result).count(same.detail) == 1
    assert _page_text(html_report(result)).count(same.detail) == 1


# ----------------------------------------------------------------------------- the suite's diagnosis column
@pytest.mark.slow  # (builds kernels/fused/fused_ops.cpp on a fresh machine)
def test_the_suite_summaries_carry_a_what_if_explanation(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("suite", "--refs", "references", "--cands", "kernels/fused", "--select",
                   "gemm_batchnorm_softmax_running_stats*", "--trials", "1", "--no-isolate", "--report-dir", out)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    [row] = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert row["verdict"] == "diverged"
    assert row["diagnosis"] == "what-if: running_stats", row
    assert "(what-if)" in row["diagnosis_detail"] and "running statistics" in row["diagnosis_detail"]
    [crow] = list(csv.DictReader(io.StringIO((out / "summary.csv").read_text(encoding="utf-8"))))
    assert crow["diagnosis"] == "what-if: running_stats"
    assert "| what-if: running_stats |" in (out / "summary.md").read_text(encoding="utf-8")
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<b>what-if: running_stats</b>" in page and str(escape(row["diagnosis_detail"])) in page


# ----------------------------------------------------------------------------- text cut to a terminal's columns
def test_the_stage_table_cuts_long_text_with_an_ellipsis():
    long_name = "blocks.0.attention.projection." + "x" * 80
    rec = RecordInfo(index=0, name=long_name, kind="module", op="nn.Linear", shape=(1024, 2048, 4096, 8192, 3),
                     dtype="float32")
    short = RecordInfo(index=1, name="out", kind="module", op="nn.Linear", shape=(4,), dtype="float32")
    stages = [Stage(index=0, ref=rec, cand=rec, paired_by="dataflow", status="unmatched"),
              Stage(index=1, ref=short, cand=short, paired_by="name", status="unmatched")]
    result = Result(verdict="match", stages=stages, first_divergence=None, error=None, output=None, atol=None,
                    rtol=None)
    lines = format_table(result).splitlines()
    row, other = lines[1], lines[2]
    assert long_name not in row and (long_name[:20] + "") in row
    assert "…" in row.split("1024")[0], row  # the name, cut, says so
    shape = describe.shape_text(rec.shape)
    assert shape not in row and shape[:10] in row and row.count("…") == 2, row  # and so does the shape
    assert "dataflow" in row  # a pass's name fits its column
    # the columns stay aligned: max_abs and status start where the short row's do
    assert row.index("unmatched") == other.index("unmatched"), (row, other)
    assert describe.clip("abc", 3) == "abc" and describe.clip("abcd", 3) == "ab…" and describe.clip("", 0) == ""


@pytest.mark.parametrize("width", [80, 100, 140])
def test_the_suite_bar_cuts_the_pairs_in_flight_with_an_ellipsis(monkeypatch, width):
    import rich.console
    import rich.progress

    from diffkit.suite import _Progress

    buf = io.StringIO()
    console = rich.console.Console(file=buf, width=width, force_terminal=True, color_system=None)
    monkeypatch.setattr(rich.progress, "get_console", lambda: console)
    names = [f"level_2_problem_{i}_sample_0_kernel" for i in range(1, 6)]
    with _Progress(12, interactive=True) as p:
        p.running(names)
        p._bar.refresh()
    shown = [ln for ln in re.split(r"[\r\n]", buf.getvalue()) if "level_2_pro" in ln]
    assert shown, buf.getvalue()
    last = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown[-1])
    assert last.rstrip().endswith("…"), last  # we cut it, and say so
    # rich did not have to squeeze the bar's own columns to make room (nor cut the line itself)
    assert "diffkit suite" in last and "0/12" in last, last
    assert len(last.split("diffkit suite")[1].split("0/12")[0]) >= 30, last  # the bar itself
    assert len(last.rstrip()) <= width


# ----------------------------------------------------------------------------- stdout and stderr
def test_the_answer_goes_to_stdout_and_diffkits_notes_to_stderr(two_bugs, tmp_path):
    proc, out, result = two_bugs
    assert proc.stdout.rstrip().splitlines()[-1] == describe.headline(result)
    assert "report:" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == f"report: {out / 'index.html'}"
    missing = run_cli("diff", "references/gelu.py", tmp_path / "nonexistent.py")
    assert missing.returncode == 2
    assert missing.stdout.startswith("diffkit: ERROR: candidate read failed") and "not found" in missing.stdout
    assert "diffkit: ERROR" not in missing.stderr
    flag = run_cli("diff", "references/gelu.py", "references/gelu.py", "--atol", "abc")
    assert flag.returncode == 2 and not flag.stdout.strip() and "Invalid value for '--atol'" in flag.stderr
    # the rule is written where a new user reads it
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    top = readme.split("## Big models: streaming")[0]
    assert "goes to standard output; the rest goes to standard error: the `report: PATH` line" in \
        " ".join(top.split())
