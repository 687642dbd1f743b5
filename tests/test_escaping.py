"""Every rendering escapes for its own format and survives partial results.

Names, paths and messages come from user code (module names, taps, file names, exception text), so
each surface must write them as text: HTML through autoescaped templates, JUnit through
ElementTree, Markdown and CSV with their own rules.  And every renderer must cope with a stage that
was never compared (shapes differ), a stage missing a side, NaN/Inf numbers, no re-run, no stages.
"""
import base64
import csv
import dataclasses
import io
import math
import re
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit import describe, measure, plots, render, report
from diffkit.result import ErrorInfo, Result

SCRIPT = "<script>alert(1)</script>"


def _tapped(name, factor):
    class M(nn.Module):
        def forward(self, x):
            return diffkit.tap(name, x * factor) + 1

    return M()


@pytest.fixture(scope="module")
def evil():
    """A diverged result whose stage, paths, warnings and finding carry markup and control characters."""
    result = diffkit.compare(_tapped(SCRIPT, 2.0), _tapped(SCRIPT, 3.0), [torch.randn(4, 4)])
    result.ref_path = "<b>ref</b>.py"
    result.cand_path = "c|and`tick`.py"
    result.warnings.append("<img src=x onerror=alert(2)> | & done")
    stage = result.stage(f"tap:{SCRIPT}")
    stage.diagnosis.append(diffkit.Finding("odd<kind>", "detail with <i>markup</i> | pipe\x00\x1b", 0.5))
    return result


def _shape_mismatch():
    class Ref(nn.Module):
        def forward(self, x):
            return x * 2

    class Short(nn.Module):
        def forward(self, x):
            return (x * 2)[:, :-1]

    return diffkit.compare(Ref(), Short(), [torch.randn(3, 6)])


def _non_finite():
    """A diverged result whose numbers are NaN/Inf, whose first divergence was not re-run and one of
    whose stages lost its reference record."""
    class Ref(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2

    class Bad(nn.Module):
        def forward(self, x):
            y = torch.tanh(x)
            return torch.where(x > 0, torch.full_like(x, float("nan")), y) * 2

    result = diffkit.compare(Ref(), Bad(), [torch.randn(4, 5)])
    nan, inf = float("nan"), float("inf")
    fd = result.first_divergence
    fd.stats = dataclasses.replace(fd.stats, max_abs=inf, mean_abs=nan, max_rel=nan, cosine=nan,
                                   worst=measure.Worst((0, 1), nan, inf, inf))
    fd.local = None
    fd.inherited_max_abs = nan
    result.stages[0].ref = None
    return result


def _error_without_stages():
    return Result(verdict="error", stages=[], first_divergence=None,
                  error=ErrorInfo("candidate", "build", f"nvcc said {SCRIPT}\x00\x07 <- here", "", "tb\x0c\x1f end"),
                  output=None, atol=None, rtol=None, ref_path="r.py", cand_path="c.py")


def _without_values(result):
    """The result as read back from result.json: plain data, no tensor values."""
    return Result.from_json(result.to_json())


def _empty_match():
    return Result(verdict="match", stages=[], first_divergence=None, error=None, output=None, atol=1e-4, rtol=1e-4)


PARTIAL = {"shape_mismatch": _shape_mismatch, "non_finite": _non_finite, "error_without_stages": _error_without_stages,
           "empty_match": _empty_match, "values_not_kept": lambda: _without_values(_shape_mismatch()),
           "non_finite_values_not_kept": lambda: _without_values(_non_finite())}


# ----------------------------------------------------------------------------- HTML
def test_html_report_writes_a_script_stage_name_as_text(evil):
    html = report.html_report(evil)
    assert "<script" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b>ref</b>" not in html and "&lt;b&gt;ref&lt;/b&gt;.py" in html
    assert "<img src=x" not in html and "<i>markup</i>" not in html and "odd&lt;kind&gt;" in html


def test_html_images_are_png_data_uris(evil):
    html = report.html_report(evil)
    sources = re.findall(r'<img alt="[^"]*" src="([^"]*)"', html)
    assert len(sources) >= 3 and len(sources) == html.count("<img")
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG")


SVG_BREAKOUT = "</svg><script>alert(3)</script>\x00"


def test_svg_charts_write_a_stage_name_as_text():
    """A stage name that closes the <svg> and opens a script is text in the charts too (and characters XML
    cannot hold are dropped, so each chart still parses)."""
    result = diffkit.compare(_tapped(SVG_BREAKOUT, 2.0), _tapped(SVG_BREAKOUT, 3.0), [torch.randn(4, 4)])
    fd = result.first_divergence
    assert SVG_BREAKOUT in fd.ref_name
    html = report.html_report(result)
    assert "<script" not in html and html.count("<svg") == html.count("</svg>") >= 3
    charts = [ET.fromstring(s) for s in re.findall(r"<svg\b.*?</svg>", html, re.S)]
    labels = [t.text for c in charts for t in c.iter("text") if t.get("class") == "marker-label"]
    assert labels == [f"first divergence: stage {fd.index} {fd.ref_name[:40].replace(chr(0), '')}"]
    assert "&lt;/svg&gt;&lt;script&gt;alert(3)&lt;/script&gt;" in html


def test_notebook_views_write_names_as_text(evil):
    for html in (evil._repr_html_(), *(s._repr_html_() for s in evil.stages)):
        assert "<script" not in html and "<i>" not in html
    assert "&lt;script&gt;" in evil._repr_html_()


# ----------------------------------------------------------------------------- JUnit
def test_junit_parses_and_holds_names_as_text(evil, tmp_path):
    text = render.junit_xml(evil)
    assert "<script>" not in text
    names = [c.get("name") for c in ET.fromstring(text).iter("testcase")]
    assert any(SCRIPT in n for n in names)  # escaped on the way out, the same text on the way back
    path = tmp_path / "junit.xml"
    path.write_text(text, encoding="utf-8")
    from junitparser import JUnitXml

    cases = [c for suite in JUnitXml.fromfile(str(path)) for c in suite]
    failed = [c for c in cases if c.result]
    assert len(failed) == len(evil.diverged_stages)
    assert any("\x00" not in (c.result[0].text or "") and "pipe" in (c.result[0].text or "") for c in failed)


def test_junit_drops_characters_xml_cannot_hold(tmp_path):
    text = render.junit_xml(_error_without_stages())
    root = ET.fromstring(text)
    error = root.find("./testsuite/testcase/error")
    assert error is not None and SCRIPT in error.get("message") and "\x00" not in error.get("message")
    assert root.find("testsuite").get("errors") == "1" and root.find("testsuite").get("tests") == "1"


# ----------------------------------------------------------------------------- Markdown
def _cells(row: str) -> list[str]:
    return re.split(r"(?<!\\)\|", row.strip())[1:-1]


def test_markdown_escapes_pipes_html_and_backticks(evil):
    md = render.summary_markdown(evil)
    assert "<b>" not in md and "&lt;b&gt;ref&lt;/b&gt;.py" in md
    assert "<script" not in md and "&lt;script&gt;" in md and "<img" not in md
    assert "c\\|and\\`tick\\`.py" in md  # inside <code>, so a backtick opens no code span
    header, rule, *rows = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert rows and all(len(_cells(r)) == len(_cells(header)) == 6 for r in rows)
    assert "> ⚠️ &lt;img src=x onerror=alert(2)&gt; \\| &amp; done" in md


def test_markdown_code_survives_backticks():
    assert render.md_code("a`b``c") == "<code>a\\`b\\`\\`c</code>"
    assert render.md_escape("x|y\n<z>&") == "x\\|y &lt;z&gt;&amp;"


# ----------------------------------------------------------------------------- CSV
@pytest.mark.parametrize("cell", ['=HYPERLINK("http://x","y")', "+1", "-x", "@SUM(A1)", "\tx", "\rx"])
def test_csv_text_that_looks_like_a_formula_gets_a_quote(cell):
    assert render.csv_safe(cell) == "'" + cell


@pytest.mark.parametrize("value", [-1.5, 0, 3, float("nan"), None, "plain", "a=b"])
def test_csv_numbers_and_plain_text_pass_unchanged(value):
    out = render.csv_safe(value)
    assert out is value or (isinstance(value, float) and math.isnan(out))


def test_stages_csv_quotes_formula_names_but_not_numbers():
    result = diffkit.compare(_tapped("t", 2.0), _tapped("t", 2.5), [-torch.rand(3, 3)])
    first, second = result.stages[0], result.stages[1]
    first.ref = dataclasses.replace(first.ref, name='=HYPERLINK("http://x","y")')
    second.ref = dataclasses.replace(second.ref, name="+1")
    second.cand = dataclasses.replace(second.cand, name="-x")
    second.note = "@SUM(A1)"
    rows = list(csv.DictReader(io.StringIO(render.stages_csv(result))))
    assert len(rows) == len(result.stages)
    assert rows[0]["ref_name"] == "'=HYPERLINK(\"http://x\",\"y\")"
    assert (rows[1]["ref_name"], rows[1]["cand_name"], rows[1]["note"]) == ("'+1", "'-x", "'@SUM(A1)")
    assert rows[1]["index"] == "1" and not rows[1]["ref_shape"].startswith("'")
    for r in rows:
        for col in ("max_abs", "mean_abs", "cosine"):
            if r[col]:
                float(r[col])  # numeric cells stay numbers, never quoted


# ----------------------------------------------------------------------------- partial results
@pytest.mark.parametrize("kind", sorted(PARTIAL))
def test_every_renderer_survives_partial_results(kind, tmp_path):
    result = PARTIAL[kind]()
    head = describe.headline(result)
    assert head.startswith("diffkit: ")
    describe.divergence_lines(result)
    describe.assertion_message(result)
    for color in (False, True):
        assert render.text_report(result, color=color).rstrip().endswith(head)
    html = report.html_report(result)
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    result._repr_html_()
    for s in result.stages:
        s._repr_html_()
        plots.worst_elements(s)
    assert render.summary_markdown(result).startswith("## diffkit:")
    ET.fromstring(render.junit_xml(result))
    assert len(list(csv.DictReader(io.StringIO(render.stages_csv(result))))) == len(result.stages)
    paths = report.write_report(result, str(tmp_path / kind))
    assert set(paths) == {"html", "csv", "json", "markdown", "junit"}


def test_a_stage_without_values_says_so_instead_of_drawing():
    result = _without_values(diffkit.compare(_tapped("t", 2.0), _tapped("t", 3.0), [torch.randn(4, 4)]))
    html = report.html_report(result)
    assert "values not kept" in html and "<svg" in html  # the error profile needs no values
    assert html.count("<svg") == 1 and "<img" not in html


def test_headline_says_output_shape_mismatch_in_kernelbench_words():
    result = _shape_mismatch()
    assert result.verdict == "diverged" and result.output_stage.stats is None
    assert describe.headline(result) == "diffkit: DIVERGED: Output shape mismatch: Expected [3, 6], got [3, 5]"
    assert "Not compared: shape mismatch" in describe.assertion_message(result)


def test_headline_and_message_of_non_finite_numbers():
    result = _non_finite()
    head = describe.headline(result)
    assert "DIVERGED at stage" in head and "max_abs=inf" in head and "mean_abs=nan" in head
    message = describe.assertion_message(result)
    assert "Greatest absolute difference: inf" in message and "Mismatched elements:" in message


# ----------------------------------------------------------------------------- worst elements
def test_worst_elements_rank_by_excess_over_tolerance_like_stats_worst():
    ref = torch.tensor([100.0, 0.0, 1.0, 5.0])
    # element 0 is off by 0.005 but within rtol (1e-4 * 100 = 0.01); element 1 is off by 0.001 with
    # nothing to absorb it; element 2 by 0.002 against 1e-4 + 1e-4
    cand = torch.tensor([100.005, 0.001, 1.002, 5.0])
    stats = measure.measure(ref, cand, 1e-4, 1e-4)
    rows = measure.worst_elements(ref, cand, 1e-4, 1e-4, k=4)
    assert [r["index"] for r in rows][:2] == [[2], [1]]
    assert tuple(rows[0]["index"]) == stats.worst.index
    assert rows[0]["excess"] == pytest.approx(0.002 - 2e-4, rel=1e-3)


def test_worst_elements_put_nan_disagreements_first():
    ref = torch.zeros(2, 3)
    cand = ref.clone()
    cand[0, 0] = 5.0
    cand[1, 2] = float("nan")
    rows = measure.worst_elements(ref, cand, 1e-4, 1e-4, k=2)
    assert rows[0]["index"] == [1, 2] and rows[0]["abs_err"] == float("inf")
    assert rows[1]["index"] == [0, 0] and rows[1]["abs_err"] == 5.0
    assert tuple(rows[0]["index"]) == measure.measure(ref, cand, 1e-4, 1e-4).worst.index


def test_report_worst_elements_lead_with_the_stage_s_worst(evil):
    fd = evil.first_divergence
    rows = plots.worst_elements(fd)
    assert rows and tuple(rows[0]["index"]) == tuple(fd.stats.worst.index)
