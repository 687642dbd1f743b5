"""The diff core on the proving ground: every broken candidate's first divergence is its declared
stage, every correct candidate matches, the crash is an error with the place named."""
import json
import os

import pandas as pd
import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit.align import align, best_layout
from diffkit.capture import capture
from diffkit.measure import measure

from conftest import KERNELS, REFS, candidates, diff_once, run_cli, same_pair

CASES = [pytest.param(*c, id=c[0], marks=same_pair(c[2])) for c in candidates()]


@pytest.mark.parametrize("name,ref,cand,exp", CASES)
def test_proving_ground(name, ref, cand, exp, ops):
    result = diff_once(ref, cand)
    if exp is None:
        assert result.verdict == "match", result.summary_line()
        assert result.first_divergence is None, result.summary_line()
        assert result.output is not None and result.output.ok
        return
    if exp.get("verdict") == "error":
        assert result.verdict == "error"
        assert result.error.side == "candidate"
        assert exp["raises_in"] in result.error.stage and exp["raises_at"] + ":" in result.error.stage
        compared = result.compared
        assert compared and all(s.status == "ok" for s in compared), "stages before the crash are compared"
        return
    fd = result.first_divergence
    assert fd is not None, result.summary_line()
    assert fd.matches(exp["stage"]), f"expected {exp['stage']}, got {fd.ref_name} / {fd.cand_name}: {result.summary_line()}"
    assert all(s.status in ("ok", "unmatched") for s in result.stages[: fd.index])
    assert fd.stats.mismatches > 0


def test_json_csv_and_exit_codes(tmp_path, ops):
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    # (run in tmp_path: the default report folders, reports/<candidate>/, are written there, not in the repository)
    proc = run_cli("diff", os.path.join(REFS, "axial_attention.py"),
                   os.path.join(KERNELS, "axial_attention_missing_bias.py"), "--json", str(out_json), "--csv",
                   str(out_csv), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "first divergence" in proc.stdout and "row_attn.out_proj" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("diffkit: DIVERGED at stage") and "row_attn.out_proj" in last
    data = json.loads(out_json.read_text())
    assert set(data) >= {"verdict", "tolerance", "first_divergence", "error", "stages", "output"}
    assert data["verdict"] == "diverged" and data["tolerance"]["atol"] == 1e-4
    fd = data["first_divergence"]
    assert set(fd) >= {"index", "ref_name", "cand_name", "shape", "max_abs", "mean_abs", "mismatch_fraction", "worst",
                       "diagnosis"}
    assert fd["ref_name"] == "row_attn.out_proj"
    for row in data["stages"]:
        assert set(row) >= {"index", "ref_name", "cand_name", "paired_by", "ref_shape", "cand_shape", "dtype", "max_abs",
                            "mean_abs", "max_rel", "mismatch_fraction", "cosine", "status"}
        assert row["status"] in ("ok", "diverged", "after-divergence", "unmatched")
    assert set(data["output"]) >= {"max_abs", "mean_abs", "allclose"} and data["output"]["allclose"] is False
    frame = pd.read_csv(out_csv)
    assert len(frame) == len(data["stages"]) and (frame["status"] == "diverged").sum() == 1

    ok = run_cli("diff", os.path.join(REFS, "axial_attention.py"), os.path.join(KERNELS, "axial_attention_cpp.py"),
                 cwd=tmp_path)
    assert ok.returncode == 0 and "MATCH" in ok.stdout
    crash = run_cli("diff", os.path.join(REFS, "invariant_point_attention.py"),
                    os.path.join(KERNELS, "invariant_point_attention_crash.py"), "--json", str(out_json), cwd=tmp_path)
    assert crash.returncode == 2 and "frame_apply" in crash.stdout
    data = json.loads(out_json.read_text())
    assert data["verdict"] == "error" and data["error"]["side"] == "candidate" and "frame_apply" in data["error"]["stage"]
    assert any(s["status"] == "ok" for s in data["stages"])


def _models():
    torch.manual_seed(0)

    class Ref(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            h = self.lin(x)
            act = torch.relu(h)
            return act * 2

    return Ref


def test_compare_api_and_assert_models_close():
    Ref = _models()

    class Scaled(Ref):
        def forward(self, x):
            h = self.lin(x)
            act = torch.relu(h) * 1.01
            return act * 2

    ref, cand = Ref(), Scaled()
    cand.load_state_dict(ref.state_dict())
    x = torch.randn(4, 6)
    result = diffkit.compare(ref, cand, [x])
    assert result.verdict == "diverged"
    assert result.first_divergence.ref_name == "forward:act"
    assert result.stage("lin").status == "ok"
    assert result.to_frame().shape[0] == len(result.stages)
    json.loads(result.to_json())
    with pytest.raises(AssertionError, match=r"forward:act") as info:
        diffkit.testing.assert_models_close(ref, cand, [x])
    assert "Greatest absolute difference" in str(info.value)
    same = Ref()
    same.load_state_dict(ref.state_dict())
    assert diffkit.testing.assert_models_close(ref, same, [x]).verdict == "match"
    other = Ref()  # different weights: the first stage already differs
    with pytest.raises(AssertionError, match=r"First diverging stage \d+: reference 'lin'"):
        diffkit.testing.assert_models_close(ref, other, [x])


def test_output_shape_mismatch_is_diverged():
    Ref = _models()

    class WrongShape(Ref):
        def forward(self, x):
            return (torch.relu(self.lin(x)) * 2)[:, :5]

    ref, cand = Ref(), WrongShape()
    cand.load_state_dict(ref.state_dict())
    result = diffkit.compare(ref, cand, [torch.randn(3, 6)])
    assert result.verdict == "diverged"
    assert "Output shape mismatch: Expected [3, 6], got [3, 5]" in result.summary_line()


def test_match_with_failing_intermediate_is_a_warning_unless_strict():
    Ref = _models()

    class Hidden(Ref):
        def forward(self, x):
            h = self.lin(x)
            act = torch.relu(h)
            act = act + 1e-3 * (act > 1e9)  # a no-op
            return act * 2

    class LeakyMid(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            h = self.lin(x) + 0.5  # wrong intermediate ...
            act = torch.relu(h - 0.5)  # ... undone before it matters
            return act * 2

    ref, cand = Ref(), LeakyMid()
    cand.load_state_dict(ref.state_dict())
    x = torch.randn(5, 6)
    result = diffkit.compare(ref, cand, [x])
    assert result.verdict == "match" and result.warnings
    assert result.first_divergence is not None
    assert diffkit.compare(ref, cand, [x], strict=True).verdict == "diverged"


def test_nan_in_candidate_is_a_divergence():
    r = torch.tensor([1.0, float("nan"), 3.0])
    # torch.allclose(equal_nan=False), KernelBench's rule: a NaN never agrees, not even with a NaN
    same = measure(r, r.clone(), 1e-4, 1e-4)
    assert not same.ok and same.mismatches == 1 and same.worst.index == (1,)
    inf = torch.tensor([1.0, float("inf")])
    assert measure(inf, inf.clone(), 1e-4, 1e-4).ok  # equal infinities do agree
    c = torch.tensor([1.0, float("nan"), float("nan")])
    s = measure(r, c, 1e-4, 1e-4)
    assert not s.ok and s.cand_nan == 2 and s.mismatches == 2 and s.worst.index == (1,)
    i = torch.tensor([1, 2, 3])
    s = measure(i, torch.tensor([1, 2, 4]), 10.0, 10.0)
    assert s.mismatches == 1  # integers compare exactly, whatever the tolerance


def test_value_alignment_allows_reshape_and_permutation():
    torch.manual_seed(0)
    n, L, h, d = 3, 5, 2, 4
    qkv = torch.randn(n, L, 3, h, d)
    # a fused kernel's flat output (n*L, 3*h*d) equals the reference's (n, L, 3, h, d) reshaped
    t, err = best_layout(qkv.reshape(n * L, 3 * h * d), qkv)
    assert t == ("reshape",) and err == 0
    bias = torch.randn(2, 7, 7, 3)  # (B, N, N, H) vs (B, H, N, N)
    t, err = best_layout(bias.permute(0, 3, 1, 2).contiguous(), bias)
    assert err == 0 and t[0] in ("permute", "unpermute")

    class RefM(nn.Module):
        def forward(self, x):
            pair = x * 3
            return pair.sum()

    class CandM(nn.Module):
        def forward(self, x):
            fused_out = x.permute(0, 3, 1, 2).contiguous() * 3  # computed in the kernel's own layout
            return fused_out.sum()

    x = torch.randn(2, 7, 7, 3)
    with capture(RefM(), inputs=(x,)) as rt:
        RefM()(x)
    with capture(CandM(), inputs=(x,)) as ct:
        CandM()(x)
    al = align(rt.records, ct.records)
    by = {ct.records[p.cand].label: p for p in al.pairs}
    p = next(p for lbl, p in by.items() if lbl == "fused_out")
    assert rt.records[p.ref].label == "pair" and p.paired_by in ("dataflow", "value") and p.transform


def test_load_pair_copies_weights_and_reports(tmp_path):
    ref = tmp_path / "ref.py"
    ref.write_text("import torch, torch.nn as nn\n"
                   "class Model(nn.Module):\n"
                   "    def __init__(self):\n        super().__init__(); self.a = nn.Linear(3, 3); self.b = nn.Linear(3, 2)\n"
                   "    def forward(self, x):\n        return self.b(self.a(x))\n"
                   "def get_inputs():\n    return [torch.randn(2, 3)]\n"
                   "def get_init_inputs():\n    return []\n")
    cand = tmp_path / "cand.py"
    cand.write_text("import torch, torch.nn as nn\n"
                    "class ModelNew(nn.Module):\n"
                    "    def __init__(self):\n        super().__init__(); self.extra = nn.Linear(3, 3); self.a = nn.Linear(3, 3)\n"
                    "        self.b = nn.Linear(3, 4)\n"
                    "    def forward(self, x):\n        x.mul_(0)\n        return self.b(self.a(x))[:, :2]\n")
    pair = diffkit.load_pair(str(ref), str(cand), sync=True)  # --sync-weights (KernelBench copies nothing)
    w = pair.weights
    assert "a.weight" in w.copied and "a.bias" in w.copied  # created in another order: values differed
    assert ("b.weight", (2, 3), (4, 3)) in w.shape_mismatch
    assert "extra.weight" in w.cand_only
    torch.testing.assert_close(pair.cand.a.weight, pair.ref.a.weight)
    assert pair.ref.training and pair.cand.training  # left as constructed, as KernelBench leaves them
    # each side has its own inputs: a candidate writing into its input cannot touch the reference's
    pair.cand(*pair.cand_inputs)
    assert pair.ref_inputs[0].abs().sum() > 0


# ------------------------------------------------------------------------ a mask written two ways
class _PaddedAttention(nn.Module):
    """Attention over padded keys: the reference masks padding with -inf before the softmax."""

    def __init__(self, dim=16):
        super().__init__()
        self.score = nn.Linear(dim, dim, bias=False)

    def forward(self, x, valid):
        logits = torch.einsum("bqd,bkd->bqk", self.score(x), x)
        logits = logits.masked_fill(valid[:, None, :] == 0, float("-inf"))
        return torch.softmax(logits, -1) @ x


class _PaddedAttentionBigNegative(_PaddedAttention):
    """The same, the padding pushed down by a large finite number instead (and one fused call)."""

    def forward(self, x, valid):
        penalty = (1.0 - valid.float())[:, None, :] * -3.0e4
        logits = torch.baddbmm(penalty, self.score(x), x.transpose(1, 2))
        return torch.softmax(logits, -1) @ x


def test_a_mask_written_as_a_large_number_against_infinity_is_named_and_the_json_stays_valid(tmp_path):
    torch.manual_seed(3)
    ref, cand = _PaddedAttention(), _PaddedAttentionBigNegative()
    cand.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, 16)
    valid = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    result = diffkit.compare(ref, cand, [x, valid])
    assert result.verdict == "match", result.summary_line()
    masked = [s for s in result.stages if s.failed]
    assert masked and all(s.diagnosis and s.diagnosis[0].kind == "mask_value" for s in masked), \
        [(s.ref_name, s.diagnosis) for s in masked]
    words = masked[0].diagnosis[0].detail
    assert "-inf" in words and "-3e+04" in words and "every other element agrees" in words, words
    assert not result.what_if and not any(f.kind in ("scale", "offset") for s in masked for f in s.diagnosis)
    # (the statistics of such a stage hold infinities: the JSON written is still strict JSON)
    text = result.to_json()
    assert json.loads(text)["verdict"] == "match" and "Infinity" not in text and "NaN" not in text


# --------------------------------------------- a stage computed otherwise is not where the error starts
class _Norm(nn.Module):
    def __init__(self, dim=24):
        super().__init__()
        self.gain = nn.Parameter(torch.rand(dim) + 0.5)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        inv = torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
        h = x * inv * self.gain
        return self.down(torch.nn.functional.gelu(self.up(h)))


class _NormDividing(_Norm):
    """The norm divides by the root (a quantity the reference never holds: its reciprocal); the MLP uses
    GELU's tanh approximation -- the bug."""

    def forward(self, x):
        root = torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6)
        h = self.gain * (x / root)
        return self.down(torch.nn.functional.gelu(self.up(h), approximate="tanh"))


def test_a_quantity_computed_otherwise_is_passed_over_for_where_the_error_goes_on():
    torch.manual_seed(5)
    ref, cand = _Norm(), _NormDividing()
    cand.load_state_dict(ref.state_dict())
    result = diffkit.compare(ref, cand, [torch.randn(3, 7, 24) * 3])
    assert result.verdict == "diverged"
    fd = result.first_divergence
    assert "gelu" in (fd.ref.op + fd.cand.op).lower(), (fd.ref_name, fd.cand_name)
    earlier = [s for s in result.stages if s.failed and s.index < fd.index]
    assert earlier and any("sqrt" in s.cand.op for s in earlier)
    assert any("every stage reading it agrees" in w for w in result.warnings), result.warnings
    assert result.root_cause is None or "sqrt" not in result.root_cause.cand.op, result.root_cause.cand_name
    # the same division with the exact GELU: a match
    class Exact(_NormDividing):
        def forward(self, x):
            root = torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6)
            return self.down(torch.nn.functional.gelu(self.up(self.gain * (x / root))))

    exact = Exact()
    exact.load_state_dict(ref.state_dict())
    ok = diffkit.compare(ref, exact, [torch.randn(3, 7, 24)])
    assert ok.verdict == "match", ok.summary_line()


# ------------------------------------------ axes merged without the transpose back, read by the same layer
class _Patches(nn.Module):
    """Groups of channels merged per position: (B, G, N, C) brought to (B, N, G * C) for a projection."""

    def __init__(self, groups=3, width=5):
        super().__init__()
        self.mix = nn.Conv1d(width, groups * width, 1)
        self.proj = nn.Linear(groups * width, 7)
        self.g, self.c = groups, width

    def forward(self, x):  # x: (B, width, N)
        b, _, n = x.shape
        t = self.mix(x).view(b, self.g, self.c, n).permute(0, 1, 3, 2)  # (B, G, N, C)
        merged = t.permute(0, 2, 1, 3).reshape(b, n, self.g * self.c)
        return self.proj(merged)


class _PatchesMergedInPlaceOrder(_Patches):
    def forward(self, x):
        b, _, n = x.shape
        t = self.mix(x).view(b, self.g, self.c, n).transpose(2, 3)
        flat = t.contiguous().view(b, n, -1)  # BUG: (G, N) axes not swapped back before merging
        return torch.nn.functional.linear(flat, self.proj.weight, self.proj.bias)


def test_axes_merged_out_of_order_are_the_stage_that_merges_them_not_the_layer_reading_them():
    torch.manual_seed(11)
    ref, cand = _Patches(), _PatchesMergedInPlaceOrder()
    cand.load_state_dict(ref.state_dict())
    result = diffkit.compare(ref, cand, [torch.randn(2, 5, 4)])
    assert result.verdict == "diverged"
    fd = result.first_divergence
    assert not fd.cand.is_output and tuple(fd.cand.shape) == (2, 4, 15), (fd.ref_name, fd.cand_name)
    assert fd.diagnosis and fd.diagnosis[0].kind == "permutation", fd.diagnosis
    assert "merged without the transpose" in fd.diagnosis[0].detail
    # merged in the right order: a match, the layer's input compared as it is
    class Right(_Patches):
        def forward(self, x):
            b, _, n = x.shape
            t = self.mix(x).view(b, self.g, self.c, n)
            return torch.nn.functional.linear(t.permute(0, 3, 1, 2).reshape(b, n, -1), self.proj.weight,
                                              self.proj.bias)

    right = Right()
    right.load_state_dict(ref.state_dict())
    assert diffkit.compare(ref, right, [torch.randn(2, 5, 4)]).verdict == "match"


def test_rows_left_unwritten_are_a_region_not_a_factor_of_zero_per_row():
    class Pool(nn.Module):
        def forward(self, x):
            return torch.nn.functional.avg_pool2d(x, 2) * 1.5

    class StopsEarly(nn.Module):
        """A per-sample loop that stops one sample short: that sample's output stays as allocated."""

        def forward(self, x):
            out = torch.zeros(x.shape[0], x.shape[1], x.shape[2] // 2, x.shape[3] // 2)
            for b in range(x.shape[0] - 1):
                out[b] = torch.nn.functional.avg_pool2d(x[b:b + 1], 2)[0] * 1.5
            return out

    r = diffkit.compare(Pool(), StopsEarly(), [torch.randn(3, 4, 6, 6)])
    fd = r.first_divergence
    kinds = [f.kind for f in fd.diagnosis]
    assert kinds and kinds[0] == "unwritten_region" and "scale" not in kinds, fd.diagnosis


# ----------------------------------------------------- non-finite values on both sides, reductions' sizes
def test_nan_in_the_reference_itself_and_infinities_of_the_other_sign_are_named_not_fitted():
    class LogRatio(nn.Module):
        def forward(self, a, b):
            return torch.log(a) - torch.log1p(b)

    class LogRatioSame(nn.Module):
        def forward(self, a, b):
            return torch.log(a) - torch.log1p(b)

    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(40, generator=g), torch.rand(40, generator=g)
    r = diffkit.compare(LogRatio(), LogRatioSame(), [a, b])
    assert r.verdict == "diverged"  # NaN never equals NaN under torch.allclose, KernelBench's rule
    words = " ".join(f.detail for f in r.first_divergence.diagnosis)
    assert "the reference itself holds NaN" in words, r.first_divergence.diagnosis
    assert not any(f.kind in ("approximation", "scale", "offset") for f in r.first_divergence.diagnosis)
    json.loads(r.to_json(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))  # (strict JSON)

    class Edges(nn.Module):
        def forward(self, x):
            return torch.where(x.abs() > 1.5, x * float("inf"), torch.tanh(x))

    class EdgesFlipped(nn.Module):
        def forward(self, x):
            return torch.where(x.abs() > 1.5, x.abs() * float("inf"), torch.tanh(x))

    e = diffkit.compare(Edges(), EdgesFlipped(), [torch.randn(300, generator=g) * 2])
    fd = e.first_divergence
    assert fd.diagnosis and fd.diagnosis[0].kind == "sign" and "+inf" in fd.diagnosis[0].detail, fd.diagnosis
    assert not any(f.kind in ("scale", "offset", "approximation") for f in fd.diagnosis) and not e.what_if


def test_a_variance_with_the_other_correction_is_named_by_the_count_it_reduced():
    class Spread(nn.Module):
        def forward(self, x):
            return x.var(dim=1, unbiased=False) + 0.1

    class SpreadUnbiased(nn.Module):
        def forward(self, x):
            c = x - x.mean(1, keepdim=True)
            return (c * c).sum(1) / (x.shape[1] - 1) + 0.1

    r = diffkit.compare(Spread(), SpreadUnbiased(), [torch.randn(12, 75) * 3])
    fd = r.first_divergence
    words = " ".join(f.detail for f in fd.diagnosis)
    assert "d/(d−1), d = 75" in words and "divided by d−1" in words, fd.diagnosis


@pytest.mark.parametrize("kind", ["row_totals", "indices", "all_zero"])
def test_no_fitted_offset_per_element_and_integer_or_all_zero_results_said_as_they_are(kind):
    ref_fn, cand_fn = {"row_totals": (lambda x: x.abs().sum(1), lambda x: x.abs().amax(1)),
                       "indices": (lambda x: x.argmax(1), lambda x: x.argmin(1)),
                       "all_zero": (lambda x: torch.relu(x).amax(1), lambda x: torch.relu(-x.abs()).amax(1))}[kind]

    class Wrap(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x) * 1  # (a stage of its own)

    r = diffkit.compare(Wrap(ref_fn), Wrap(cand_fn), [torch.randn(30, 9)])
    fd = r.first_divergence
    assert r.verdict == "diverged" and fd is not None
    # a 1-D error is "explained" by one offset per element: nothing is said rather than that
    assert not any("matching no 1-D parameter" in f.detail for f in fd.diagnosis), fd.diagnosis
    if kind == "indices":
        assert fd.diagnosis and fd.diagnosis[0].kind == "integer_values" and "other indices" in \
            fd.diagnosis[0].detail, fd.diagnosis
    if kind == "all_zero":
        assert fd.diagnosis and fd.diagnosis[0].kind == "unwritten_region" and "0 in all" in fd.diagnosis[0].detail
        assert not any(f.kind == "scale" for f in fd.diagnosis)


# ------------------------------- a stack of blocks under another container, iterated in a loop
class _Unit(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Stack(nn.Module):
    def __init__(self, d=20):
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.body = nn.Sequential(_Unit(d), _Unit(d), _Unit(d))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.stem(x)
        x = self.body(x)
        return self.head(x)


class _Tower(nn.Module):
    """The same stack: its blocks in a ModuleList under another name, run in a loop; the patch-embedding
    style stem as a product plus its bias one step later; block `bad` (if any) reads its down-projection
    transposed in memory."""

    def __init__(self, d=20, bad=None):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.units = nn.ModuleList([_Unit(d) for _ in range(3)])
        self.out = nn.Linear(d, 4)
        self.bad = bad

    def forward(self, x):
        x = (x @ self.inp.weight.t()) + self.inp.bias
        for i, u in enumerate(self.units):
            w = u.down.weight.reshape(u.down.weight.shape[1], -1).t() if i == self.bad else u.down.weight
            x = x + torch.nn.functional.linear(torch.relu(u.up(u.norm(x))), w, u.down.bias)
        return self.out(x)


@pytest.mark.parametrize("bad", [None, 2])
def test_blocks_under_another_container_in_a_loop_are_each_compared(bad):
    torch.manual_seed(9)
    ref = _Stack()
    torch.manual_seed(9)
    cand = _Tower(bad=bad)
    r = diffkit.compare(ref, cand, [torch.randn(6, 20)])
    assert r.verdict == ("match" if bad is None else "diverged"), r.summary_line()
    compared = {s.ref_name for s in r.stages if s.stats is not None}
    assert {"body.2.norm", "body.2.up"} <= compared, sorted(compared)  # the last block is compared too
    if bad is not None:
        fd = r.first_divergence
        assert fd.ref_name.startswith(f"body.{bad}"), (fd.ref_name, fd.cand_name)


def test_a_factor_near_one_is_named_only_when_it_is_the_constant():
    from diffkit.diagnose import _name_scale

    sizes = {4096, 64}
    assert _name_scale(4096 / 4095, (8, 64, 64), sizes)[1]
    assert not _name_scale(1.0015, (8, 64, 64), sizes)[1]  # 6× farther from 1 than d/(d−1), d = 4096
    assert not _name_scale(0.999, (8, 64, 64), sizes)[1]


def test_a_mask_the_candidate_writes_as_infinity_is_a_mask_too():
    class Finite(_PaddedAttention):
        def forward(self, x, valid):
            logits = torch.einsum("bqd,bkd->bqk", self.score(x), x)
            logits = logits.masked_fill(valid[:, None, :] == 0, -3.0e4)
            return torch.softmax(logits, -1) @ x

    torch.manual_seed(3)
    ref, cand = Finite(), _PaddedAttention()
    cand.load_state_dict(ref.state_dict())
    valid = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    r = diffkit.compare(ref, cand, [torch.randn(2, 6, 16), valid])
    fd = r.first_divergence
    assert r.verdict == "match" and fd is not None and fd.diagnosis and fd.diagnosis[0].kind == "mask_value", \
        [(s.ref_name, s.status, s.diagnosis) for s in r.stages]
    assert "candidate holds -inf" in fd.diagnosis[0].detail and not r.what_if


def test_locating_a_long_chain_of_failing_stages_does_not_recurse():
    # every stage after the first divergence of a deep model fails: deciding which failing stages are left
    # behind walks them all, from the last back, without a call per stage on the stack
    from diffkit.capture import Record
    from diffkit.locate import locate, undone_stages
    from diffkit.measure import Stats
    from diffkit.result import RecordInfo, Stage

    n = 3000
    stages, records = [], []
    for i in range(n):
        info = RecordInfo(index=i, name=f"step{i}", kind="op", op="torch.add", shape=(4,), dtype="float32",
                          inputs=(i - 1,) if i else (), is_output=i == n - 1)
        stats = Stats(numel=4, max_abs=1.0, mean_abs=1.0, max_rel=1.0, mismatches=4, cosine=1.0, ref_nan=0, ref_inf=0,
                      cand_nan=0, cand_inf=0, worst=None, atol=1e-4, rtol=1e-4)
        stages.append(Stage(index=i, ref=info, cand=info, stats=stats, status="diverged"))
        records.append(Record(index=i, name=f"step{i}", kind="op", scope="", label="", function="", file="", line=0,
                              op="torch.add", shape=(4,), dtype=torch.float32, device="cpu", value=None,
                              inputs=[i - 1] if i else [], is_output=i == n - 1))
    first = locate(stages, undone_stages(stages, records))
    assert first is stages[0] and all(s.status == "after-divergence" for s in stages[1:])


def test_parts_concatenated_the_other_way_and_a_window_padded_on_one_side_are_named():
    class Joined(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 5), nn.Linear(6, 3)

        def forward(self, x):
            return torch.tanh(torch.cat([self.a(x), self.b(x)], dim=-1))

    class JoinedSwapped(Joined):
        def forward(self, x):
            parts = [self.b(x), self.a(x)]
            return torch.tanh(torch.cat(parts, dim=-1))

    torch.manual_seed(4)
    ref, cand = Joined(), JoinedSwapped()
    cand.load_state_dict(ref.state_dict())
    r = diffkit.compare(ref, cand, [torch.randn(7, 6)])
    assert r.first_divergence.diagnosis and "rolled by 5 along axis 1" in r.first_divergence.diagnosis[0].detail, \
        r.first_divergence.diagnosis

    class Smooth(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 3, 5, padding=2)

        def forward(self, x):
            return self.conv(x) * 2

    class SmoothLeftPadded(Smooth):
        def forward(self, x):
            return torch.nn.functional.conv1d(torch.nn.functional.pad(x, (4, 0)), self.conv.weight, self.conv.bias) * 2

    ref, cand = Smooth(), SmoothLeftPadded()
    cand.load_state_dict(ref.state_dict())
    r = diffkit.compare(ref, cand, [torch.randn(2, 2, 30)])
    words = " ".join(f.detail for f in r.first_divergence.diagnosis)
    assert "shifted by 2 along axis 2" in words and "padding put on one side" in words, r.first_divergence.diagnosis
