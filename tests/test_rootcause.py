"""Root cause, diagnosis, --tolerance auto and reference health."""
import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit.compare import reference_health, reinit_zero_parameters, run_captured

from conftest import candidates, diff_once, same_pair

CASES = [pytest.param(*c, id=c[0], marks=same_pair(c[2])) for c in candidates()
         if c[3] is None or c[3].get("verdict") != "error"]
KINDS = {"missing_bias", "offset", "scale", "sign", "permutation", "transposed_weight", "unwritten_region", "boundary",
         "wrong_reduction_axis", "nan_inf", "nondeterministic", "precision", "approximation"}


@pytest.mark.parametrize("name,ref,cand,exp", CASES)
def test_root_cause_and_kind(name, ref, cand, exp, ops):
    result = diff_once(ref, cand)
    if exp is None:
        # a correct candidate: no divergence, no root cause, and no finding anywhere
        # (a kernel whose output changes between two runs on equal inputs is named even when it passes)
        assert result.root_cause is None and all(f.kind == "nondeterministic" for s in result.stages
                                                 for f in s.diagnosis), result.summary_line()
        if any(s.diagnosis for s in result.stages):
            assert result.verdict == "match" and any("nondetermin" in w or "differ" in w for w in result.warnings)
        return
    rc = result.root_cause
    assert rc is not None and rc.matches(exp["stage"]), (exp, rc and rc.ref_name, result.summary_line())
    if rc.local is not None:
        assert not rc.local.ok  # wrong on the reference's own inputs
    else:  # could not be re-run: it must say why, and be the first divergence
        assert rc.replay_note.startswith("not re-run") and rc is result.first_divergence
    if exp.get("kind"):
        kinds = [f.kind for f in rc.diagnosis]
        assert kinds and kinds[0] == exp["kind"], (exp["kind"], [(f.kind, f.detail) for f in rc.diagnosis])
        assert all(f.detail and 0 < f.confidence <= 1 for f in rc.diagnosis)
    data = result.to_dict()
    assert "local_max_abs" in data["root_cause"] and "inherited_max_abs" in data["root_cause"]
    assert all("local_max_abs" in row for row in data["stages"])


def test_every_kind_is_exercised():
    declared = {c[3]["kind"] for c in candidates() if c[3] and c[3].get("kind")}
    assert KINDS <= declared, KINDS - declared


def test_stages_after_the_root_only_inherit(ops):
    from conftest import KERNELS, REFS
    import os

    result = diffkit.diff_files(os.path.join(REFS, "axial_attention.py"),
                                os.path.join(KERNELS, "axial_attention_missing_bias.py"))
    replayed = [s for s in result.stages if s.local is not None]
    # the bias is dropped in both axial blocks: exactly those two stages are wrong on correct inputs
    introducing = {s.ref_name for s in replayed if not s.local.ok}
    assert introducing == {"row_attn.out_proj", "col_attn.out_proj"}, introducing
    later = [s for s in replayed if s.status == "after-divergence" and s.ref_name not in introducing]
    assert len(later) > 10 and all(s.inherited_max_abs > 0 for s in later)


class Chain(nn.Module):
    def __init__(self, bug=0.0):
        super().__init__()
        self.bug = bug
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        shifted = h + self.bug  # a small error, inside tolerance here ...
        act = torch.tanh(shifted)
        wide = act * 50.0  # ... that crosses it only here, several stages later
        return self.b(wide)


def test_small_error_is_traced_to_the_stage_that_introduced_it():
    torch.manual_seed(0)
    ref, cand = Chain(), Chain(bug=4e-5)
    cand.load_state_dict(ref.state_dict())
    x = torch.randn(6, 8)
    result = diffkit.compare(ref, cand, [x])
    fd, rc = result.first_divergence, result.root_cause
    assert fd is not None and fd.ref_name == "forward:wide"
    assert rc is not None and rc.ref_name == "forward:shifted" and rc.index < fd.index
    assert rc.stats.ok and rc.local.max_abs == pytest.approx(4e-5, rel=0.1)
    assert [f.kind for f in rc.diagnosis][:1] == ["offset"]
    assert "root cause" in result.summary_line()


class DeepStack(nn.Module):
    """24 residual tanh blocks; `shift` adds and removes a constant (float32 rounds x to its ulp)."""

    def __init__(self, shift=0.0, blocks=24, dim=16, bug=0.0, exact=False):
        super().__init__()
        self.shift, self.bug, self.exact = shift, bug, exact
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            h = x if self.exact else (x + self.shift) - self.shift
            x = x + 0.5 * torch.tanh(layer(h))
        return x + self.bug


def _pair(**cand_kw):
    torch.manual_seed(0)
    shift = cand_kw.pop("shift", 0.0)
    ref = DeepStack(shift=shift)
    cand = DeepStack(shift=shift, **cand_kw)
    cand.load_state_dict(ref.state_dict())
    return ref, cand, [torch.randn(8, 16)]


def test_auto_tolerance_passes_a_correct_candidate_that_fixed_1e4_fails():
    # the reference rounds x to float32's ulp at 4096 (~5e-4) in every block; the candidate does not
    ref, cand, x = _pair(shift=4096.0, exact=True)
    fixed = diffkit.compare(ref, cand, x)
    assert fixed.verdict == "diverged"
    auto = diffkit.compare(ref, cand, x, tolerance="auto")
    assert auto.verdict == "match", auto.summary_line()
    assert auto.fixed_verdict == "diverged" and any("fixed tolerance says diverged" in w for w in auto.warnings)
    assert auto.to_dict()["tolerance_mode"] == "auto"


def test_auto_tolerance_fails_a_1e5_bug_that_fixed_1e4_hides():
    ref, cand, x = _pair(bug=1e-5)
    assert diffkit.compare(ref, cand, x).verdict == "match"  # hidden under atol=1e-4
    auto = diffkit.compare(ref, cand, x, tolerance="auto")
    assert auto.verdict == "diverged" and auto.fixed_verdict == "match"
    out = auto.stage("output")
    assert out.auto["cand_rmse"] > out.auto["bound"] and out.auto["ref_rmse"] < 1e-5


def test_reference_health_warnings():
    class Dropper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.lin(x))

    m = Dropper().train()
    x = [torch.randn(16, 4)]
    notes = reference_health(m, x, run_captured(m, x), True)
    assert any("random" in n and "drop" in n for n in notes)

    class Zero(nn.Module):
        def __init__(self):
            super().__init__()
            self.final = nn.Linear(4, 4)
            nn.init.zeros_(self.final.weight)
            nn.init.zeros_(self.final.bias)

        def forward(self, x):
            return self.final(x)

    z = Zero()
    notes = reference_health(z, x, run_captured(z, x), True)
    assert any("all zeros" in n for n in notes) and any("final.weight" in n for n in notes)
    cand = Zero()
    assert reinit_zero_parameters(z, cand) == ["final.weight"]
    assert z.final.weight.abs().sum() > 0 and torch.equal(z.final.weight, cand.final.weight)


# ----------------------------------------------------------------- re-runs and the model's own state
class _CountingRef(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps += 1
        scaled = self.lin(x) * self.steps
        return torch.tanh(scaled)


class _CountingAten(_CountingRef):  # the counter bumped through the aten overload, the output slightly off
    def forward(self, x):
        torch.ops.aten.add_.Tensor(self.steps, 1.0)
        scaled = torch.addmm(self.lin.bias, x, self.lin.weight.t()).mul(self.steps)
        return torch.tanh(scaled * 1.001)


class _CountingSetitem(_CountingRef):  # a new counter value written over the old one, read before and after
    def forward(self, x):
        self.steps[...] = self.steps + 1
        scaled = torch.addmm(self.lin.bias, x, self.lin.weight.t()).mul(self.steps)
        return torch.tanh(scaled * 1.001)


class _NormRef(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8, momentum=0.5)

    def forward(self, x):
        return torch.tanh(self.norm(self.fc(x)) + self.norm.running_mean)


class _NormCand(_NormRef):  # training-mode batch norm (its running statistics change), its output off
    def forward(self, x):
        h = self.norm(self.fc(x)) + self.norm.running_mean
        return torch.tanh(h * 1.001)


@pytest.mark.parametrize("cand_cls", [_CountingAten, _CountingSetitem])
def test_a_call_that_changes_or_read_changing_state_is_not_re_run_into_a_false_root_cause(cand_cls):
    """Re-running `steps += 1` (through an aten overload), or `steps + 1` after the forward wrote the counter
    again, would count once more: the root cause would be the counter.  The error is the output's own."""
    torch.manual_seed(0)
    ref, cand = _CountingRef(), cand_cls()
    cand.load_state_dict(ref.state_dict())
    result = diffkit.compare(ref, cand, [torch.randn(4, 6)], health=False)
    assert result.verdict == "diverged" and result.first_divergence.ref_name == "output"
    assert result.root_cause.ref_name == "output", [(s.ref_name, s.cand_name, s.local and s.local.max_abs)
                                                    for s in result.stages]
    assert float(cand.steps) == 1.0  # the diff's own re-runs left the counter as the forward left it


def test_a_training_mode_batch_norm_is_re_run_and_its_statistics_kept():
    """Its output does not read the running statistics it updates: it is re-run (its error is measured as its
    own), and the statistics are as the forward left them after the diff's re-runs."""
    torch.manual_seed(0)
    ref, cand = _NormRef(), _NormCand()
    cand.load_state_dict(ref.state_dict())
    x = torch.randn(16, 8)
    with torch.no_grad():
        probe = _NormRef()
        probe.load_state_dict(ref.state_dict())
        probe(x.clone())
    result = diffkit.compare(ref, cand, [x], health=False)
    norm = next(s for s in result.stages if s.ref_name == "norm")
    assert norm.local is not None and norm.local.max_abs == 0.0, norm.replay_note
    assert result.root_cause.ref_name == "output"
    assert torch.equal(cand.norm.running_mean, probe.norm.running_mean)
    assert int(cand.norm.num_batches_tracked) == 1


class _LinTanh(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        pre = self.lin(x)
        return self.head(torch.tanh(pre * 0.1))


class _ExtraShift(_LinTanh):  # one step the reference does not have, in the forward itself
    def forward(self, x):
        pre = torch.nn.functional.linear(x, self.lin.weight, self.lin.bias)
        pre = pre + 0.05
        return torch.nn.functional.linear((pre * 0.1).tanh(), self.head.weight, self.head.bias)


def _shifted(t, by):  # ... and inside a helper, two steps (a scale, then a shift)
    return t.mul(1.0).sub(by)


class _ExtraInHelper(_LinTanh):
    def forward(self, x):
        z = x @ self.lin.weight.t() + self.lin.bias
        z = _shifted(z, 0.3)
        return self.head(torch.tanh(z * 0.1))


@pytest.mark.parametrize("cls,line_of", [(_ExtraShift, "pre = pre + 0.05"), (_ExtraInHelper, "return t.mul(1.0).sub(by)")])
def test_a_step_the_reference_does_not_have_is_named_with_where_it_was_made(cls, line_of):
    import inspect

    torch.manual_seed(0)
    ref = _LinTanh()
    cand = cls()
    cand.load_state_dict(ref.state_dict())
    r = diffkit.compare(ref, cand, [torch.randn(8, 32)])
    assert r.verdict == "diverged"
    fd = r.first_divergence
    lines, first = inspect.getsourcelines(cls.forward if line_of.startswith("pre") else _shifted)
    line = first + next(i for i, text in enumerate(lines) if line_of in text)
    rc = r.root_cause or fd
    # the stage that goes wrong is the step itself (a new value of the reference's variable finishes its
    # stage, as a bias added apart would), or the note of the stage it feeds names the step and its line
    if rc.cand.line != line:
        assert "does not have" in rc.replay_note and f"test_rootcause.py:{line}" in rc.replay_note, rc.replay_note
        assert "its inputs match the reference" not in rc.replay_note


class _Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 21)

    def forward(self, x):
        return torch.relu(self.lin(x))


class _ProjColumnTiles(_Proj):  # 8-column tiles; the last, partial one (5 columns) is never written
    def forward(self, x):
        y = x.new_zeros(x.shape[0], 21)
        for c0 in range(0, 16, 8):
            y[:, c0:c0 + 8] = x @ self.lin.weight[c0:c0 + 8].t() + self.lin.bias[c0:c0 + 8]
        return y.clamp_min(0)


class _Blur(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x)


class _BlurRowTiles(_Blur):  # output rows in tiles of 4 through unfold; the last partial tile skipped
    def forward(self, x):
        n, _, h, w = x.shape
        out = torch.zeros(n, 4, h - 2, w - 2)
        cols = torch.nn.functional.unfold(x, 3)  # n, 27, (h-2)*(w-2)
        full = (self.conv.weight.reshape(4, -1) @ cols + self.conv.bias[:, None]).view(n, 4, h - 2, w - 2)
        rows = ((h - 2) // 4) * 4
        out[:, :, :rows] = full[:, :, :rows]
        return out


@pytest.mark.parametrize("ref_cls,cand_cls,inputs,axis", [
    (_Proj, _ProjColumnTiles, lambda: [torch.randn(5, 12)], 1),
    (_Blur, _BlurRowTiles, lambda: [torch.randn(2, 3, 13, 9)], 2),
])
def test_an_unwritten_tail_along_any_axis_is_named(ref_cls, cand_cls, inputs, axis):
    torch.manual_seed(0)
    ref = ref_cls()
    cand = cand_cls()
    cand.load_state_dict(ref.state_dict())
    r = diffkit.compare(ref, cand, inputs())
    found = [f for s in r.stages for f in s.diagnosis if f.kind == "unwritten_region"]
    assert r.verdict == "diverged" and found, [(s.ref_name, [f.kind for f in s.diagnosis]) for s in r.stages if s.failed]
    assert any(f"along axis {axis}" in f.detail or "rows" in f.detail for f in found), found[0].detail
