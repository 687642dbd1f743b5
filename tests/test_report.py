"""Reports: HTML (checked in a real headless browser), CSV, JSON, Markdown, JUnit, and the notebook."""
import json
import os
import re
import shutil
import xml.etree.ElementTree as ET

import pandas as pd
import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit.render import junit_xml
from diffkit.report import write_report

from conftest import KERNELS, REFS, ROOT, run_cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def results(ops):
    diverged = diffkit.diff_files(os.path.join(REFS, "axial_attention.py"),
                                  os.path.join(KERNELS, "axial_attention_missing_bias.py"))
    match = diffkit.diff_files(os.path.join(REFS, "triangle_multiplicative_update.py"),
                               os.path.join(KERNELS, "triangle_multiplicative_update_cpp.py"))
    error = diffkit.diff_files(os.path.join(REFS, "invariant_point_attention.py"),
                               os.path.join(KERNELS, "invariant_point_attention_crash.py"))
    return {"diverged": diverged, "match": match, "error": error}


@pytest.mark.parametrize("kind", ["diverged", "match", "error"])
def test_report_directory(kind, results, tmp_path):
    result = results[kind]
    assert result.verdict == kind
    paths = write_report(result, str(tmp_path / kind))
    assert set(paths) == {"html", "csv", "json", "markdown", "junit"}
    frame = pd.read_csv(paths["csv"])
    assert len(frame) == len(result.stages) and "status" in frame.columns
    data = json.load(open(paths["json"]))
    for key in ("verdict", "tolerance", "first_divergence", "root_cause", "error", "stages", "output"):
        assert key in data
    assert data["verdict"] == kind
    md = open(paths["markdown"]).read()
    assert md.startswith(f"## diffkit:") and kind in md.splitlines()[0]
    from junitparser import JUnitXml

    xml = JUnitXml.fromfile(paths["junit"])
    cases = [c for suite in xml for c in suite]
    judged = [s for s in result.stages if s.stats is not None or s.failed]
    assert len(cases) == len(judged) + (1 if result.error else 0)
    failed = [c for c in cases if c.result]
    assert len(failed) == len(result.diverged_stages) + (1 if result.error else 0)
    if kind == "diverged":
        first = next(c for c in failed if "row_attn.out_proj" in c.name)
        assert "max_abs=" in first.result[0].message
    html = open(paths["html"], encoding="utf-8").read()
    assert html.startswith("<!DOCTYPE html>") and "http://" not in html and "https://" not in html
    assert 'src="http' not in html and "<script" not in html and "<link" not in html and "url(" not in html
    assert os.path.getsize(paths["html"]) < 3_000_000
    svgs = re.findall(r"<svg\b.*?</svg>", html, re.S)
    assert len(svgs) == html.count("<svg")
    for svg in svgs:
        ET.fromstring(svg)
    if kind == "diverged":
        fd, rc = result.first_divergence, result.root_cause
        # the profile, then a histogram and an error-vs-reference chart per drawn stage
        assert len(svgs) == 1 + 2 * html.count('<div class="charts">') and len(svgs) >= 3
        for stage in (fd, rc):
            assert f'<h2 id="stage-{stage.index}">' in html and f'href="#stage-{stage.index}"' in html
        assert "first divergence: stage %d row_attn.out_proj" % fd.index in html


def test_names_are_escaped(tmp_path):
    class Evil(nn.Module):
        def forward(self, x):
            return diffkit.tap("<script>alert(1)</script>", x * 2)

    class EvilCand(nn.Module):
        def forward(self, x):
            return diffkit.tap("<script>alert(1)</script>", x * 3)

    result = diffkit.compare(Evil(), EvilCand(), [torch.randn(4, 4)])
    result.ref_path = "<b>ref</b>.py"
    paths = write_report(result, str(tmp_path))
    html = open(paths["html"], encoding="utf-8").read()
    assert "<script>" not in html and "&lt;script&gt;" in html and "<b>ref</b>" not in html
    assert "<script>" not in junit_xml(result)


def test_notebook_objects(results):
    result = results["diverged"]
    html = result._repr_html_()
    assert "DIVERGED" in html and "row_attn.out_proj" in html
    stage = result.stage("row_attn.out_proj")
    assert "missing_bias" in stage._repr_html_()
    import matplotlib.figure

    assert isinstance(result.plot(), matplotlib.figure.Figure)
    assert isinstance(stage.heatmap(), matplotlib.figure.Figure)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_html_in_a_real_browser(results, tmp_path):
    from playwright.sync_api import sync_playwright

    paths = write_report(results["diverged"], str(tmp_path / "browser"))
    shot = os.path.join(ROOT, "reports", "browser-screenshot.png")
    os.makedirs(os.path.dirname(shot), exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1300, "height": 1800})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto("file://" + os.path.abspath(paths["html"]))
        banner = page.inner_text(".banner")
        widths = page.evaluate("Array.from(document.images).map(i => i.complete ? i.naturalWidth : 0)")
        page.screenshot(path=shot)
        browser.close()
    assert errors == []
    assert "DIVERGED" in banner and "row_attn.out_proj" in banner and "missing_bias" in banner
    assert len(widths) >= 3 and all(w > 0 for w in widths)
    assert os.path.getsize(shot) > 10_000


def test_cli_writes_report_and_single_files(tmp_path, ops):
    proc = run_cli("diff", os.path.join(REFS, "axial_attention.py"), os.path.join(KERNELS, "axial_attention_tail.py"),
                   "--report-dir", str(tmp_path / "rep"), "--html", str(tmp_path / "one.html"), "--markdown",
                   str(tmp_path / "one.md"), "--junit", str(tmp_path / "one.xml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for name in ("index.html", "stages.csv", "result.json", "summary.md", "junit.xml"):
        assert (tmp_path / "rep" / name).exists()
    assert "unwritten_region" in (tmp_path / "one.md").read_text()
    one = (tmp_path / "one.html").read_text()
    assert one.count("<img") >= 3 and one.count("<svg") >= 3 and (tmp_path / "one.xml").exists()


def test_example_notebook_runs(ops):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(ROOT, "examples", "walkthrough.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = json.dumps([o.get("data", {}).get("text/plain", "") or o.get("text", "") for o in outputs])
    assert "row_attn.out_proj" in text and "missing_bias" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)


def test_junit_fails_a_divergence_that_no_stage_row_carries():
    # a candidate returning its tensor inside a tuple diverges on the output's structure alone (every stage
    # row is within tolerance): CI reads junit.xml, which must carry a failure
    import xml.etree.ElementTree as ET

    import torch

    import diffkit
    from diffkit.render import junit_xml

    class Ref(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2

    class Held(Ref):
        def forward(self, x):
            return (super().forward(x),)

    x = torch.randn(5, 3)
    r = diffkit.compare(Ref(), Held(), [x])
    assert r.verdict == "diverged" and not any(s.failed for s in r.stages)
    suite = ET.fromstring(junit_xml(r)).find("testsuite")
    assert suite.get("failures") == "1" and suite.find("testcase[@name='verdict']/failure") is not None
    ok = ET.fromstring(junit_xml(diffkit.compare(Ref(), Ref(), [x]))).find("testsuite")
    assert ok.get("failures") == "0" and ok.find("testcase[@name='verdict']") is None


def test_a_match_calls_its_first_stage_out_of_tolerance_no_divergence():
    """A candidate that applies a scale earlier than the reference: an intermediate differs, the output matches.
    The stage is shown, but not as a divergence: every surface says the output matches."""
    import torch

    from diffkit.render import banner, format_table, summary_markdown, text_report

    class Ref(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            q = self.lin(x)
            return (q @ q.transpose(0, 1)) * 0.25

    class Early(Ref):
        def forward(self, x):
            q = self.lin(x) * 0.5
            return q @ q.transpose(0, 1)

    torch.manual_seed(0)
    ref = Ref()
    cand = Early()
    cand.load_state_dict(ref.state_dict())
    r = diffkit.compare(ref, cand, [torch.randn(5, 8)])
    assert r.verdict == "match" and r.first_divergence is not None
    text = text_report(r)
    assert "first divergence" not in text
    assert f"first stage out of tolerance (the output matches): stage {r.first_divergence.index}" in text
    assert "<-- first out of tolerance (the output matches)" in format_table(r)
    assert "### First stage out of tolerance (the output matches)" in summary_markdown(r)
    assert banner(r)["fd_label"].startswith("first stage out of tolerance")
