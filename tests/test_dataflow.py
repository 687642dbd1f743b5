"""Dataflow: what capture records about where each tensor came from, and what align, root cause and
diagnosis make of it (pairing by dataflow, not by value)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import diffkit
from diffkit import align as A
from diffkit.capture import capture


def _trace(model, *inputs):
    with torch.no_grad(), capture(model, inputs=inputs) as trace:
        model(*inputs)
    return trace


def _by_label(trace):
    """Records by label (the first record of each label)."""
    out = {}
    for r in trace.records:
        out.setdefault(r.label, r)
    return out


def _ins(rec):
    return [r.index for r in rec.inputs]


# ------------------------------------------------------------------------------------------ capture
class ViewsAndWrites(nn.Module):
    def forward(self, x):
        h = x * 2
        rows = h.view(4, 6)
        h.add_(1)  # in place: a new record whose input is the old one
        after = rows * 3  # a view made before the write still sees it
        alias = h.data  # a view capture does not record (attribute access)
        total = alias + 0.5
        h[0] = after[0, :6].reshape(6)  # a store into the tensor: a write record reading both
        return h.sum(0)


def test_views_and_in_place_writes_map_to_the_records_they_come_from():
    t = _trace(ViewsAndWrites(), torch.randn(4, 6))
    by = _by_label(t)
    h, rows, added = by["h"], by["rows"], t.records[by["rows"].index + 1]
    assert added.op == "Tensor.add_" and _ins(added) == [h.index]
    assert _ins(rows) == [h.index]
    # `rows` is a view of `h`: reading it after `h.add_(1)` reads that write too
    assert _ins(by["after"]) == [rows.index, added.index]
    # `h.data` is not recorded: it maps to the latest record holding `h`'s storage
    assert _ins(by["total"]) == [added.index]
    store = next(r for r in t.records if r.kind == "write")
    assert store.label == "h" and added.index in _ins(store) and by["after"].index < max(_ins(store))
    out = t.output
    assert _ins(out) == [store.index]


class Params(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6, 6))
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        a = F.linear(x, self.w.t())  # a view of a parameter, made inline
        wt = self.w.t().contiguous()  # weight preparation: a record made from a parameter alone
        b = a @ wt
        c = self.norm(b)
        d = self.ext.linear(c, self.lin.weight, None, 0, 0)  # an extension call taking a module's weight
        return d + self.lin.bias


def test_params_read_by_views_weight_preparation_modules_and_extension_calls(ops):
    m = Params()
    m.ext = ops  # an extension built before the capture, reached through the model
    t = _trace(m, torch.randn(5, 6))
    by = _by_label(t)
    assert by["a"].params == ("w",)
    assert by["wt"].params == ("w",) and not by["wt"].inputs  # made from the parameter alone
    assert by["b"].params == ("w",) and _ins(by["b"]) == [by["a"].index, by["wt"].index]
    assert set(t["norm"].params) == {"norm.weight", "norm.bias"}  # a torch.nn module reads all of its own
    d = by["d"]
    assert d.kind == "ext" and d.params == ("lin.weight",) and _ins(d) == [t["norm"].index]
    assert t.output.params == ("lin.bias",)


def test_capture_files_keep_dataflow(tmp_path, ops):
    from diffkit.store import CaptureFile, CaptureWriter

    m = Params()
    m.ext = ops
    x = torch.randn(5, 6)
    writer = CaptureWriter(str(tmp_path / "p.dkt"))
    with torch.no_grad(), capture(m, inputs=(x,), sink=writer) as live:
        m(x)
    back = CaptureFile.open(str(tmp_path / "p.dkt")).load()
    assert [(_ins(r), tuple(r.params)) for r in back] == [(_ins(r), r.params) for r in live]


# ------------------------------------------------------------------------------------------ align
class Block(nn.Module):
    """LayerNorm, a projection, GELU, an output projection with a residual."""

    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        y = self.norm(x)
        h = F.gelu(self.up(y))
        out = self.down(h)
        return x + out


class FusedNoBias(Block):
    """LayerNorm through one kernel whose result goes straight into another that computes the
    projection and GELU (2 reference stages), then the output projection as an einsum on the weight,
    leaving its bias out."""

    def forward(self, x):
        z = self.ext.linear_gelu(self.ext.layernorm(x, self.norm.weight, self.norm.bias, self.norm.eps, 0),
                                 self.up.weight, self.up.bias, 0)
        g = torch.einsum("nk,ok->no", z, self.down.weight)  # no bias: the bug
        return x + g


def _aligned(ref_m, cand_m, x):
    rt, ct = _trace(ref_m, x), _trace(cand_m, x)
    al = A.align(rt.records, ct.records, ref_params=dict(ref_m.named_parameters()),
                 cand_params=dict(cand_m.named_parameters()))
    return rt, ct, al


def _partner(al, ct, label):
    return next(p for p in al.pairs if ct.records[p.cand].label == label)


def test_dataflow_pairs_a_wrong_valued_fused_output_with_the_last_stage_it_covers(ops):
    torch.manual_seed(0)
    ref_m = Block()
    cand_m = FusedNoBias()
    cand_m.load_state_dict(ref_m.state_dict())
    cand_m.ext = ops
    rt, ct, al = _aligned(ref_m, cand_m, torch.randn(8, 16))
    inner = next(p for p in al.pairs if ct.records[p.cand].op.endswith(".layernorm"))
    assert rt.records[inner.ref].name == "norm" and inner.via == "dataflow"  # passed inline, still paired
    fused = _partner(al, ct, "z")
    assert rt.records[fused.ref].op.endswith("gelu") and fused.via == "dataflow"  # the last of up, gelu
    wrong = _partner(al, ct, "g")
    # einsum reads only `down.weight`; its values are off by the whole bias, yet it pairs by dataflow
    assert rt.records[wrong.ref].name == "down" and wrong.via == "dataflow"
    assert wrong.confidence == A.DATAFLOW_PARTIAL_CONFIDENCE
    assert [rt.records[i].name for i in al.ref_unmatched] == ["up"]
    result = diffkit.compare(ref_m, cand_m, [torch.randn(8, 16)])
    fd = result.first_divergence
    assert fd.ref_name == "down" and fd.cand.label == "g"
    assert fd.diagnosis and fd.diagnosis[0].kind == "missing_bias" and "down.bias" in fd.diagnosis[0].detail


class Gate(nn.Module):
    def __init__(self, d=12):
        super().__init__()
        self.gate = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, t):
        g = self.gate(t)
        return self.out(torch.sigmoid(g))


class GateRebound(Gate):
    """`g` is assigned twice: the matmul without its bias, then with it."""

    def forward(self, t):
        g = t @ self.gate.weight.t()
        g = g + self.gate.bias
        return self.out(torch.sigmoid(g))


def test_a_rebound_variable_pairs_by_dataflow_not_by_its_first_assignment():
    torch.manual_seed(0)
    ref_m, cand_m = Gate(), GateRebound()
    cand_m.load_state_dict(ref_m.state_dict())
    rt, ct, al = _aligned(ref_m, cand_m, torch.randn(6, 12))
    by_cand = al.by_cand()
    first, second = [r for r in ct.records if r.label == "g"]
    assert first.rebound and second.rebound
    assert first.index not in by_cand  # its name says `g`, its dataflow says "half of gate"
    assert rt.records[by_cand[second.index].ref].name == "gate" and by_cand[second.index].via == "dataflow"
    result = diffkit.compare(ref_m, cand_m, [torch.randn(6, 12)])
    assert result.verdict == "match" and result.first_divergence is None
    assert not any("out of tolerance" in w for w in result.warnings)


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn1(self.conv(x))).mean((2, 3))


class FusedBnRelu(nn.Module):
    """A fused BatchNorm+ReLU module of its own (another name, no `bn1`), reading the same statistics."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1_relu = nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.conv(x)
        return F.relu(self.bn1_relu(y)).mean((2, 3))


class BnReluKernel(ConvBnRelu):
    """One call (batch statistics, affine, ReLU) where the reference has BatchNorm then ReLU."""

    def forward(self, x):
        y = self.conv(x)
        mean, var = y.mean((0, 2, 3), keepdim=True), y.var((0, 2, 3), unbiased=False, keepdim=True)
        w, b = self.bn1.weight.view(1, -1, 1, 1), self.bn1.bias.view(1, -1, 1, 1)
        bn1_relu = torch.clamp_min((y - mean) * torch.rsqrt(var + self.bn1.eps) * w + b, 0.0)
        return bn1_relu.mean((2, 3))


@pytest.mark.parametrize("cand_cls", [FusedBnRelu, BnReluKernel])
def test_a_fused_bn_relu_is_not_paired_with_the_batchnorm_output(cand_cls):
    torch.manual_seed(0)
    ref_m, cand_m = ConvBnRelu(), cand_cls()
    cand_m.load_state_dict(ref_m.state_dict(), strict=False)
    x = torch.randn(2, 3, 6, 6)
    rt, ct, al = _aligned(ref_m, cand_m, x)
    bn1 = next(r.index for r in rt.records if r.name == "bn1")
    relu = next(r.index for r in rt.records if r.name == "relu")
    paired = {p.ref: p for p in al.pairs}
    if bn1 in paired:  # only a record holding the BatchNorm output itself may pair with it
        c = ct.records[paired[bn1].cand]
        torch.testing.assert_close(c.value, rt.records[bn1].value)
    assert relu in paired
    torch.testing.assert_close(ct.records[paired[relu].cand].value, rt.records[relu].value)
    result = diffkit.compare(ref_m, cand_m, [x])
    assert result.verdict == "match" and not any("out of tolerance" in w for w in result.warnings), result.warnings


def test_a_same_shaped_tensor_of_another_role_is_dropped_rather_than_reported():
    # the candidate's record named like the reference's holds another tensor of the same shape (the
    # pre-normalisation value); nothing downstream inherits its difference, so it is no finding
    class Ref(nn.Module):
        def forward(self, x):
            vlad = F.normalize(x, dim=-1)
            return vlad * 2

    class Cand(nn.Module):
        def forward(self, x):
            vlad = x.t().contiguous().t()  # the same name, another role
            return F.normalize(vlad, dim=-1) * 2

    x = torch.randn(6, 5)
    result = diffkit.compare(Ref(), Cand(), [x])
    assert result.verdict == "match" and result.first_divergence is None
    assert not any("out of tolerance" in w for w in result.warnings), result.warnings


# ------------------------------------------------------------------------------------------ root cause
class Amplify(nn.Module):
    def __init__(self, bug=0.0):
        super().__init__()
        self.bug = bug
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        shifted = h * (1 + self.bug)  # a relative error far inside tolerance, and below the noise bound ...
        diff = shifted - h  # ... still inside tolerance after the cancellation ...
        big = diff * 1e3  # ... out of it only here, a stage that is right on its own inputs
        return big + h


def test_walk_back_names_the_sub_tolerance_stage_an_inheriting_divergence_comes_from():
    torch.manual_seed(0)
    ref_m, cand_m = Amplify(), Amplify(bug=5e-6)
    cand_m.load_state_dict(ref_m.state_dict())
    result = diffkit.compare(ref_m, cand_m, [torch.randn(16, 8)])
    fd, rc = result.first_divergence, result.root_cause
    assert fd is not None and fd.local is not None and fd.local.ok  # the divergence only inherits
    assert rc is not None and rc.ref_name.endswith(":shifted") and rc.stats.ok and rc.index < fd.index
    data = result.to_dict()
    assert data["root_cause"] is not None and data["root_cause"]["ref_name"] == rc.ref_name
    assert "by dataflow" in rc.replay_note


def test_walk_back_follows_the_error_across_records_with_no_counterpart():
    from diffkit.rootcause import upstream_stages
    from diffkit.result import RecordInfo, Stage
    from diffkit.measure import measure

    from diffkit.capture import Record, Ref, Trace

    # candidate records 0 -> 1 (no counterpart) -> 2: the stage of 2 reaches the stage of 0 through 1

    trace = Trace(records=[Record(index=i, name=f"r{i}", kind="op", scope="", label=f"r{i}", function="f", file="",
                                  line=0, op="", shape=(2,), dtype=torch.float32, device="cpu",
                                  value=torch.zeros(2), inputs=tuple(Ref(j) for j in ins))
                           for i, ins in enumerate([(), (0,), (1,)])])
    st = measure(torch.zeros(2), torch.zeros(2), 1e-4, 1e-4)
    stages = {i: Stage(index=k, ref=RecordInfo.of(trace.records[i]), cand=RecordInfo.of(trace.records[i]), stats=st)
              for k, i in enumerate((0, 2))}
    assert upstream_stages(stages[2], trace, stages) == [stages[0]]


class _ShiftSilu(nn.Module):
    """A projection shifted by a constant, then SiLU, then a head (the activation as a module call)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(10, 20)
        self.head = nn.Linear(20, 5)

    def forward(self, x):
        return self.head(F.silu(self.proj(x) + 1.0))


class _ShiftSiluByHand(_ShiftSilu):
    """The same, the SiLU written out element by element (each piece its own record) and `bad` planting a
    mistake in it (the exponent's sign)."""

    bad = False

    def forward(self, x):
        h = self.proj(x) + 1.0
        e = torch.exp(h if self.bad else -h)
        return self.head(h / (1.0 + e))


@pytest.mark.parametrize("bad", [False, True])
def test_a_stage_written_out_by_hand_does_not_take_over_the_stage_before_it(bad):
    # `-h`, `exp(-h)`, `1 + …` each consume only `h` (the shifted projection's counterpart) and keep its
    # element count: none of them finishes the shift's stage, and none holds its values
    torch.manual_seed(3)
    ref_m, cand_m = _ShiftSilu(), _ShiftSiluByHand()
    cand_m.load_state_dict(ref_m.state_dict())
    cand_m.bad = bad
    x = torch.randn(6, 10)
    rt, ct, al = _aligned(ref_m, cand_m, x)
    shift = next(r.index for r in rt.records if r.op.endswith("add"))
    partner = {p.ref: p.cand for p in al.pairs}
    assert shift in partner and ct.records[partner[shift]].name == "forward:h"
    result = diffkit.compare(ref_m, cand_m, [x])
    if not bad:
        assert result.verdict == "match" and not any("out of tolerance" in w for w in result.warnings), result.warnings
    else:
        fd = result.first_divergence
        assert result.verdict == "diverged" and "silu" in fd.ref_name, fd.ref_name


class _LinHardswish(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 16)
        self.act = nn.Hardswish()

    def forward(self, x):
        return self.act(self.lin(x))


class _LinHardswishFused(_LinHardswish):
    """The linear by matmul, the Hardswish fused into the return: `z * (z + 3).clamp(0, top) / 6`, whose
    last division reads the product (not the projection). `top` 5 instead of 6 is the planted mistake."""

    top = 6.0

    def forward(self, x):
        z = x @ self.lin.weight.T + self.lin.bias
        return z * (z + 3).clamp(0, self.top) / 6


@pytest.mark.parametrize("top", [6.0, 5.0])
def test_the_record_a_fused_output_reads_is_not_taken_for_the_stage_the_output_finishes(top):
    # the reference's output (the Hardswish) reads `lin`; the candidate's output reads the product: that
    # product is no counterpart of `lin` when `z` holds lin's values and the product does not
    torch.manual_seed(4)
    ref_m, cand_m = _LinHardswish(), _LinHardswishFused()
    cand_m.load_state_dict(ref_m.state_dict())
    cand_m.top = top
    x = torch.randn(7, 12) * 3
    rt, ct, al = _aligned(ref_m, cand_m, x)
    lin = next(r.index for r in rt.records if r.name == "lin")
    partner = {p.ref: p.cand for p in al.pairs}
    assert lin in partner
    torch.testing.assert_close(ct.records[partner[lin]].value, rt.records[lin].value)
    result = diffkit.compare(ref_m, cand_m, [x])
    if top == 6.0:
        assert result.verdict == "match" and not any("out of tolerance" in w for w in result.warnings), result.warnings
    else:
        # (the model's output is the Hardswish module's: named `act`, as the user wrote it, `output` an alias)
        assert result.verdict == "diverged" and result.first_divergence.ref_name == "act"
        assert result.first_divergence.matches("output")
