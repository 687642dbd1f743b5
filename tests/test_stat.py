"""--stat (issue 17): which statistic of the error must stay within tolerance changes the verdict
where it should, per stage and for the output, and every report says which one was used."""
import json

import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit.measure import measure

from conftest import run_cli


class Ref(nn.Module):
    def forward(self, x):
        return x * 1.0


class Cand(nn.Module):
    def __init__(self, err):
        super().__init__()
        self.register_buffer("err", err)

    def forward(self, x):
        return x * 1.0 + self.err


def _x():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 64, generator=g)


def _outlier():
    """One element far off, the rest tiny: the elementwise and max rules fail, mean and median pass."""
    e = torch.full((64, 64), 1e-6)
    e[3, 5] = 0.5
    return e


def _small_refs():
    """The same absolute error everywhere, more than atol + rtol |r| where |r| is small but less than
    atol + rtol max|r|: elementwise fails, max passes (the reference has a few large values)."""
    return torch.full((64, 64), 5e-4)


def _big_x():
    x = _x() * 1e-3
    x[0, :8] = 50.0
    return x


@pytest.mark.parametrize("stat,outlier_ok,small_ok", [
    ("elementwise", False, False),
    ("max", False, True),
    ("mean", True, False),
    ("median", True, False),
])
def test_each_stat_changes_the_verdict_where_it_should(stat, outlier_ok, small_ok):
    x = _x()
    r = diffkit.compare(Ref(), Cand(_outlier()), [x], stat=stat)
    assert (r.verdict == "match") == outlier_ok, r.summary_line()
    xb = _big_x()
    r2 = diffkit.compare(Ref(), Cand(_small_refs()), [xb], stat=stat)
    assert (r2.verdict == "match") == small_ok, r2.summary_line()
    out = r2.output
    assert out.stat == stat
    if stat != "elementwise":
        # the bound is atol + rtol * the same statistic of |reference|, computed from the values
        ref_abs = xb.abs().flatten().double()
        scale = {"max": ref_abs.max(), "mean": ref_abs.mean(), "median": ref_abs.quantile(0.5)}[stat]
        assert out.stat_bound == pytest.approx(1e-4 + 1e-4 * float(scale), rel=1e-5)
        err = (Cand(_small_refs())(xb) - xb).abs().flatten().double()
        want = {"max": err.max(), "mean": err.mean(), "median": err.quantile(0.5)}[stat]
        assert out.stat_error == pytest.approx(float(want), rel=1e-4)
        assert f"--stat {stat}" in r2.summary_line()


@pytest.mark.parametrize("stat", ["mean", "median"])
def test_a_stat_that_passes_what_allclose_fails_never_claims_a_kernelbench_pass(tmp_path, stat):
    """One element off by 0.5: the median/mean rule matches (the verdict --stat asks for), but every trial fails
    torch.allclose, and the answer says so instead of "passes 5 of 5 KernelBench trials"."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text("import torch, torch.nn as nn\nclass Model(nn.Module):\n    def forward(self, x):\n"
                   "        return torch.tanh(x)\ndef get_inputs():\n    return [torch.randn(128, 64)]\n"
                   "def get_init_inputs():\n    return []\n")
    cand.write_text("import torch, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
                    "        y = torch.tanh(x)\n        y[3, 5] += 0.5\n        return y\n")
    r = diffkit.diff_files(str(ref), str(cand), stat=stat)
    assert r.verdict == "match", r.summary_line()
    assert r.trials and all(t["allclose"] and t["kernelbench"] is False for t in r.trials), r.trials
    line = r.summary_line()
    assert "KernelBench trials" not in line and f"torch.allclose fails {len(r.trials)} of them" in line, line
    proc = run_cli("diff", ref, cand, "--stat", stat, "--no-report")
    assert proc.returncode == 0 and "passes 5 of 5" not in proc.stdout, proc.stdout[-1500:]
    assert proc.stdout.count("KernelBench's torch.allclose FAILS it") == 5, proc.stdout[-1500:]
    plain = diffkit.diff_files(str(ref), str(cand))  # KernelBench's own rule: no second answer
    assert plain.verdict == "diverged" and all(t["kernelbench"] is None for t in plain.trials)


def test_nan_fails_under_every_stat():
    x = _x()
    e = torch.zeros(64, 64)
    e[0, 0] = float("nan")
    for stat in ("max", "mean", "median"):
        st = measure(x, x + e, 1e-4, 1e-4, stat)
        assert not st.ok, stat


def test_intermediate_stages_are_judged_by_the_stat_too():
    class R(nn.Module):
        def forward(self, x):
            h = x * 2.0
            return h - 2.0 * x

    class C(nn.Module):
        def forward(self, x):
            h = x * 2.0 + _outlier()
            return h - 2.0 * x - _outlier()

    x = _x()
    strict_elem = diffkit.compare(R(), C(), [x], strict=True)
    strict_mean = diffkit.compare(R(), C(), [x], strict=True, stat="mean")
    assert strict_elem.first_divergence is not None
    assert strict_mean.first_divergence is None, strict_mean.summary_line()


def test_cli_stat_flag_in_json_and_reports(tmp_path):
    ref = tmp_path / "ref.py"
    ref.write_text("import torch, torch.nn as nn\n"
                   "class Model(nn.Module):\n    def forward(self, x):\n        return x * 1.0\n"
                   "def get_inputs():\n    return [torch.randn(32, 32)]\n"
                   "def get_init_inputs():\n    return []\n")
    cand = tmp_path / "cand.py"
    cand.write_text("import torch, torch.nn as nn\n"
                    "class ModelNew(nn.Module):\n    def forward(self, x):\n        y = x * 1.0\n"
                    "        y[0, 0] += 1.0\n        return y\n")
    outs = {}
    for stat in ("elementwise", "median"):
        rd = tmp_path / stat
        p = run_cli("diff", str(ref), str(cand), "--stat", stat, "--trials", "1", "--report-dir", str(rd), "--json",
                    str(rd / "r.json"))
        outs[stat] = p
        d = json.loads((rd / "r.json").read_text())
        # passed: the rule in force; allclose: KernelBench's torch.allclose, which the element off by 1 fails
        assert d["output"]["passed"] == (stat == "median") and d["output"]["allclose"] is False
        assert p.returncode == (0 if stat == "median" else 1), p.stdout + p.stderr
        if stat == "median":
            assert "--stat median" in (rd / "index.html").read_text()
            assert "--stat median" in p.stdout
            assert "--stat median" in (rd / "summary.md").read_text()
            import csv
            rows = list(csv.DictReader((rd / "stages.csv").open()))
            assert rows and all(r["stat"] == "median" for r in rows if r["max_abs"])
    bad = run_cli("diff", str(ref), str(cand), "--stat", "p99")
    assert bad.returncode == 2 and "p99" in bad.stderr


def test_infinities_in_different_places_fail_every_stat():
    r = torch.tensor([float("inf"), 1.0, 2.0, 3.0])
    c = torch.tensor([1.0, float("inf"), 2.0, 3.0])
    for stat in ("max", "mean", "median"):
        assert not measure(r, c, 1e-4, 1e-4, stat).ok, stat
    same = torch.tensor([float("inf"), 1.0, 2.0, 3.0])
    assert measure(r, same, 1e-4, 1e-4, "median").ok
