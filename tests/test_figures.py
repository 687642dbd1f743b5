"""The report page's pictures without matplotlib (issue 46): palette PNG maps, inline SVG charts with real axes,
one self-contained file, odd values (NaN, 0-d, one element, 1e300) drawn, the user's RNG and imports left alone."""
import dataclasses
import io
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit import figures, report

from conftest import ROOT

SVG = re.compile(r"<svg\b.*?</svg>", re.S)


def _tapped(name, fn):
    class M(nn.Module):
        def forward(self, x):
            return diffkit.tap(name, fn(x)) + 1

    return M()


def _diverged(ref_fn, cand_fn, x, name="t"):
    result = diffkit.compare(_tapped(name, ref_fn), _tapped(name, cand_fn), [x])
    assert result.verdict == "diverged"
    return result


def _svgs(html):
    return [ET.fromstring(s) for s in SVG.findall(html)]


def _texts(svg, cls):
    group = next(g for g in svg.iter("g") if g.get("class") == cls)
    return [t.text for t in group.iter("text")]


def _section(html, stage):
    """The HTML of a drawn stage's section (from its heading to the next heading)."""
    start = html.index(f'<h2 id="stage-{stage.index}"')
    end = html.find("<h2", start + 1)
    return html[start:end if end >= 0 else len(html)]


@pytest.fixture(scope="module")
def demo():
    torch.manual_seed(0)
    x = torch.randn(3, 40, 50)
    return _diverged(lambda t: t * 2, lambda t: t * 2 + (t > 1.5) * 0.3, x)


def test_the_page_is_one_file_with_no_external_reference(demo):
    html = report.html_report(demo)
    assert "<svg" in html and "<img" in html
    for bad in ('src="http', "src='http", "<script", "<link", "url(", "http://", "https://", "@import"):
        assert bad not in html, bad
    for src in re.findall(r'<img [^>]*src="([^"]*)"', html):
        assert src.startswith("data:image/png;base64,")


def test_every_svg_parses_and_the_charts_have_labelled_axes(demo):
    html = report.html_report(demo)
    svgs = _svgs(html)
    assert len(svgs) == html.count("<svg") == 3  # the profile, the histogram, error vs reference
    profile, hist, scatter = svgs
    assert _texts(profile, "yticks") and all(re.fullmatch(r"1|10|100|1000|0\.1|0\.01|1e-?\d+", t)
                                             for t in _texts(profile, "yticks"))
    assert [int(t) for t in _texts(profile, "xticks")] == sorted(int(t) for t in _texts(profile, "xticks"))
    assert "stage (execution order)" in ET.tostring(profile, encoding="unicode")
    ys = _texts(hist, "yticks")
    assert ys[:2] == ["1", "10"]  # counts at powers of ten from one element up
    xs = [float(t) for t in _texts(hist, "xticks")]
    assert len(xs) >= 3 and xs == sorted(xs) and min(xs) <= 0 <= max(xs)
    hist_text = ET.tostring(hist, encoding="unicode")
    assert "candidate − reference" in hist_text and ">count<" in hist_text
    assert len(_texts(scatter, "xticks")) >= 3 and len(_texts(scatter, "yticks")) >= 3
    assert "reference value" in ET.tostring(scatter, encoding="unicode")


def test_the_profile_marks_the_first_divergence_the_atol_and_non_finite_stages():
    class Ref(nn.Module):
        def forward(self, x):
            a = diffkit.tap("a", x * 2)
            b = diffkit.tap("b", a + 1)
            return diffkit.tap("c", b * 3)

    class Cand(nn.Module):
        def forward(self, x):
            a = diffkit.tap("a", x * 2)
            b = diffkit.tap("b", a + 1.5)
            return diffkit.tap("c", b * 3)

    result = diffkit.compare(Ref(), Cand(), [torch.randn(6, 7)])
    fd = result.first_divergence
    plain = ET.fromstring(figures.error_profile(result))
    assert not any(el.get("class") == "nonfinite" for el in plain.iter("path"))
    last = result.compared[-1]
    last.stats = dataclasses.replace(last.stats, max_abs=float("inf"), mean_abs=float("nan"))
    svg = ET.fromstring(figures.error_profile(result))
    labels = [t.text for t in svg.iter("text") if t.get("class") == "marker-label"]
    assert labels and labels[0] == f"first divergence: stage {fd.index} {fd.ref_name}"
    assert any(el.get("class") == "atol" for el in svg.iter("line"))
    crosses = [el for el in svg.iter("path") if el.get("class") == "nonfinite"]
    assert len(crosses) == 1 and crosses[0].get("d").count("M") == 1
    assert any(t.text == "NaN/Inf" for t in svg.iter("text"))


def test_maps_are_pooled_pngs_drawn_at_a_whole_multiple_with_their_labels():
    from PIL import Image

    x = torch.randn(2, 300, 90)
    result = _diverged(lambda t: t, lambda t: t * 1.5, x)
    html = report.html_report(result)
    sec = _section(html, result.first_divergence)
    imgs = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]*)" width="(\d+)" height="(\d+)"', sec)
    assert len(imgs) == 3 + 2  # reference, candidate, |difference|, and the two leading-axis slices
    import base64

    for alt, data, w, h in imgs:
        png = Image.open(io.BytesIO(base64.b64decode(data)))
        assert png.mode == "P" and max(png.size) <= 192
        assert int(w) % png.size[0] == 0 and int(h) % png.size[1] == 0
    assert Image.open(io.BytesIO(base64.b64decode(imgs[0][1]))).size == (90, 150)  # 300 rows pooled by 2
    assert "axis 1 (300)" in sec and "axis 2 (90)" in sec and "block max-pooled to 150×90 cells" in sec
    assert "|difference| at [0]" in sec and "|difference| at [1]" in sec
    assert "image-rendering:pixelated" in html and 'class="cells"' in sec


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-d", "1-element", "1x1"])
def test_tiny_stages_draw(shape):
    x = torch.full(shape, 0.7)
    result = _diverged(lambda t: t * 2, lambda t: t * 3, x)
    html = report.html_report(result)
    sec = _section(html, result.first_divergence)
    assert "could not draw" not in sec
    assert sec.count('class="cells"') == 3 and sec.count("<svg") == 2
    for s in _svgs(sec):
        assert s.tag == "svg"


def test_a_nan_stage_draws():
    x = torch.randn(5, 6)
    result = _diverged(lambda t: t * 2, lambda t: torch.where(t > 0, torch.full_like(t, float("nan")), t * 2), x)
    html = report.html_report(result)
    sec = _section(html, result.first_divergence)
    assert "could not draw" not in html
    assert sec.count('class="cells"') == 3 and len(_svgs(sec)) == 2
    assert "not finite" in sec  # the histogram says how many differences it left out


def test_all_nan_and_huge_values_do_not_break_the_axes():
    x = torch.rand(4, 5, dtype=torch.float64) + 1
    result = _diverged(lambda t: t * 1e300, lambda t: t * 1.5e300, x)
    assert result.first_divergence.stats.max_abs > 1e299
    html = report.html_report(result)
    assert "could not draw" not in html
    profile = _svgs(html)[0]
    hist, scatter = _svgs(_section(html, result.first_divergence))
    ys = _texts(profile, "yticks")
    assert ys and ys[-1] in ("1e300", "1e301") and len(ys) <= 8
    assert all(float(t) > 1e299 for t in _texts(hist, "xticks"))
    assert len(_texts(scatter, "yticks")) >= 2
    nan = _diverged(lambda t: t, lambda t: t * float("nan"), torch.randn(3, 3))
    html = report.html_report(nan)
    assert "could not draw" not in html and "no finite differences" in html


def test_huge_spans_get_finite_ticks():
    assert figures.linear_ticks(-1.7e308, 1.7e308) == [-1.7e308, 0.0, 1.7e308]
    assert figures.linear_ticks(0.0, 1.0) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert figures.linear_ticks(-0.17, 0.17) == pytest.approx([-0.1, 0.0, 0.1])
    assert figures.log_ticks(-324, 300)[-1] == 300 and len(figures.log_ticks(-324, 300)) <= 8
    assert figures.int_ticks(0, 43) == [0, 5, 10, 15, 20, 25, 30, 35, 40]


def test_a_stage_that_cannot_be_drawn_keeps_the_report(demo, monkeypatch):
    def broken(stage):
        raise RuntimeError("no <maps> today")

    monkeypatch.setattr(figures, "stage_maps", broken)
    html = report.html_report(demo)
    sec = _section(html, demo.first_divergence)
    assert "could not draw this stage: RuntimeError: no &lt;maps&gt; today" in sec
    assert len(_svgs(sec)) == 2 and "worst elements" in sec  # the rest of the stage is still drawn


def test_the_banner_and_the_table_link_to_the_drawn_sections(demo):
    html = report.html_report(demo)
    fd = demo.first_divergence
    assert html.count(f'id="stage-{fd.index}"') == 1
    banner = html[html.index('<div class="banner"'):html.index("</div></div>", html.index('<div class="banner"'))]
    assert f'<a href="#stage-{fd.index}">stage {fd.index}</a>' in banner
    table = html[html.index("<h2>Stages</h2>"):]
    assert f'<a href="#stage-{fd.index}">{fd.index}</a>' in table
    linked = set(re.findall(r'href="#(stage-\d+)"', html))
    assert linked and linked <= set(re.findall(r'id="(stage-\d+)"', html))


def test_writing_a_report_leaves_the_user_s_rng_alone(tmp_path):
    result = _diverged(lambda t: t, lambda t: t + 0.5, torch.randn(300, 300))  # sampled: > 2 000 points
    state = torch.get_rng_state()
    report.write_report(result, str(tmp_path))
    assert torch.equal(state, torch.get_rng_state())
    a, b = figures.error_vs_reference(*figures.plots.values(result.first_divergence)), \
        figures.error_vs_reference(*figures.plots.values(result.first_divergence))
    assert a == b and "2000 of 90000 finite elements" in a


def test_writing_a_report_does_not_import_matplotlib(tmp_path):
    code = ("import sys, torch, diffkit, diffkit.report\n"
            "r = diffkit.compare(torch.nn.Tanh(), torch.nn.Sigmoid(), [torch.randn(4, 8, 8)])\n"
            "assert r.verdict == 'diverged'\n"
            f"paths = diffkit.report.write_report(r, {str(tmp_path)!r})\n"
            "html = open(paths['html'], encoding='utf-8').read()\n"
            "assert html.count('class=\"cells\"') >= 3, html\n"
            "print('matplotlib' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"


def test_the_lookup_tables_follow_matplotlib():
    import matplotlib
    import numpy as np

    for name in ("viridis", "magma"):
        want = np.round(matplotlib.colormaps[name](np.linspace(0, 1, 256))[:, :3] * 255)
        got = np.frombuffer(figures.lut(name), dtype=np.uint8).reshape(256, 3)
        assert np.abs(got - want).max() <= 6, name
        assert tuple(got[0]) == tuple(want[0]) and tuple(got[-1]) == tuple(want[-1])
