"""Folding: a candidate's loop results that no reference record can pair with are carried as
lineage, not records -- the diff's answer and the dataflow of what is recorded stay as they were."""
import importlib
import json
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import diffkit
from diffkit.align import record_numel
from diffkit.options import FOLD_AFTER

from conftest import run_cli

C = importlib.import_module("diffkit.capture")


class ElmanRef(nn.Module):
    """The reference: PyTorch's own two-layer tanh RNN (a handful of records; its final hidden state,
    [layers, batch, hidden], has no step result's size)."""

    def __init__(self, n_in=5, n_hidden=7):
        super().__init__()
        self.rnn = nn.RNN(n_in, n_hidden, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


class Unrolled(nn.Module):
    """The candidate: the same recurrence unrolled by hand, with a helper object holding the state and
    a while loop (no resemblance to the reference's structure beyond the parameter names).  `bad_from`:
    from that step on the second layer's update forgets the hidden bias."""

    def __init__(self, n_in=5, n_hidden=7, bad_from=None):
        super().__init__()
        self.rnn = nn.RNN(n_in, n_hidden, num_layers=2, batch_first=True)
        self.bad_from = bad_from

    class _State:
        def __init__(self, h):
            self.h = h

        def advance(self, pre):
            self.h = torch.tanh(pre + self.h)
            return self.h

    def forward(self, x):
        for layer in range(2):
            w_ih, w_hh = getattr(self.rnn, f"weight_ih_l{layer}"), getattr(self.rnn, f"weight_hh_l{layer}")
            b_ih, b_hh = getattr(self.rnn, f"bias_ih_l{layer}"), getattr(self.rnn, f"bias_hh_l{layer}")
            inp = torch.einsum("btk,hk->bth", x, w_ih) + b_ih
            st = self._State(x.new_zeros(x.shape[0], w_hh.shape[0]))
            seq, t = [], 0
            while t < x.shape[1]:
                broken = layer == 1 and self.bad_from is not None and t >= self.bad_from
                bias = torch.zeros_like(b_hh) if broken else b_hh
                seq.append(st.advance(inp[:, t] + st.h @ w_hh.T + bias - st.h))
                t += 1
            x = torch.stack(seq, dim=1)
        return x


def _pair(bad_from=None, steps=40):
    ref, cand = _seeded(ElmanRef, lambda: Unrolled(bad_from=bad_from))
    x = torch.randn(3, steps, 5)
    return ref, cand, x


@pytest.mark.parametrize("bad_from", [None, 30])
def test_folding_keeps_the_verdict_and_the_first_divergence(bad_from):
    ref, cand, x = _pair(bad_from)
    folded = diffkit.compare(ref, cand, [x])
    ref, cand, x = _pair(bad_from)
    whole = diffkit.compare(ref, cand, [x], fold=False)
    assert folded.verdict == whole.verdict == ("match" if bad_from is None else "diverged")
    info = folded.meta["cand_folded"]
    assert info["results"] > 0 and info["recorded_per_site"] == FOLD_AFTER
    assert "cand_folded" not in whole.meta
    assert folded.meta["cand_records"] < whole.meta["cand_records"]
    if bad_from is not None:
        assert folded.first_divergence.ref_name == whole.first_divergence.ref_name
        assert folded.first_divergence.stats.mismatches == whole.first_divergence.stats.mismatches
    text = importlib.import_module("diffkit.render").text_report(folded)
    assert f"{info['results']} candidate loop results were folded" in text


def test_each_call_site_keeps_its_first_records():
    ref, cand, x = _pair(steps=30)
    folded = diffkit.compare(ref, cand, [x])
    sites = folded.meta["cand_folded"]["sites"]
    # the helper's update line makes two results (the sum, its tanh) per step and layer: FOLD_AFTER recorded
    line = Unrolled._State.advance.__code__.co_firstlineno + 1
    assert sites[next(s for s in sites if s.endswith(f"test_fold.py:{line}"))] == 2 * 2 * 30 - FOLD_AFTER


_STEP = "def advance(pre, h, w, b):\n    return torch.tanh(pre + h @ w.T + b)\n"
_STEP_NS: dict = {"torch": torch}
exec(compile(_STEP, "<diffkit-test-step>", "exec"), _STEP_NS)


class StepLoop(nn.Module):
    """ElmanRef's recurrence as a loop calling a step function; `fresh`: the step function is compiled
    again at every step (a new code object each time, as a wrapper generating its kernel code might)."""

    def __init__(self, fresh: bool):
        super().__init__()
        self.rnn = nn.RNN(5, 7, num_layers=2, batch_first=True)
        self.fresh = fresh

    def forward(self, x):
        for layer in range(2):
            w_ih, w_hh = getattr(self.rnn, f"weight_ih_l{layer}"), getattr(self.rnn, f"weight_hh_l{layer}")
            b_ih, b_hh = getattr(self.rnn, f"bias_ih_l{layer}"), getattr(self.rnn, f"bias_hh_l{layer}")
            inp = torch.einsum("btk,hk->bth", x, w_ih) + b_ih
            h, seq = x.new_zeros(x.shape[0], 7), []
            for t in range(x.shape[1]):
                if self.fresh:
                    ns = {"torch": torch}
                    exec(compile(_STEP, "<diffkit-test-step>", "exec"), ns)
                    step = ns["advance"]
                else:
                    step = _STEP_NS["advance"]
                h = step(inp[:, t], h, w_hh, b_hh)
                seq.append(h)
            x = torch.stack(seq, dim=1)
        return x


def test_code_compiled_again_each_step_folds_as_one_call_site():
    """A call site is its file, function and line, not its code object: a step function compiled afresh
    at every step folds exactly as the same function compiled once."""
    x = torch.randn(3, 30, 5)
    got = {}
    for fresh in (False, True):
        ref, cand = _seeded(ElmanRef, lambda: StepLoop(fresh))
        r = diffkit.compare(ref, cand, [x])
        assert r.verdict == "match"
        got[fresh] = (r.meta["cand_records"], r.meta["cand_folded"]["results"], r.meta["cand_folded"]["sites"])
    assert got[True] == got[False] and got[False][1] > 0


def _capture(model, inputs, fold):
    with torch.no_grad():
        with C.capture(model, inputs=tuple(inputs), fold=fold) as trace:
            model(*inputs)
    return trace


class Scan(nn.Module):
    """A loop whose results have sizes nothing pairs with, then a pairable projection of its end."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) * 0.3)
        self.b = nn.Parameter(torch.randn(6))
        self.proj = nn.Linear(6, 4)

    def forward(self, x):
        h = x[0]
        for _ in range(20):
            h = torch.tanh(h @ self.w + self.b)
        return self.proj(h)


def test_a_record_after_a_folded_chain_reads_what_the_chain_read():
    model, x = Scan(), torch.randn(3, 6)
    whole = _capture(model, [x], None)
    trace = _capture(model, [x], frozenset({4}))  # only the projection's size pairs
    assert sum(trace.folded.values()) > 0 and len(trace.records) < len(whole.records)
    out = trace.records[-1]
    assert out.is_output and out.value is not None
    torch.testing.assert_close(out.value, whole.records[-1].value, rtol=0, atol=0)
    assert {"w", "b", "proj.weight", "proj.bias"} <= set(out.params)
    # the projection's input comes, through the folded chain, from the model's input record
    assert 0 in _ancestors(trace, out) and trace.records[0].kind == "input"


class Scatter(nn.Module):
    """Results written row by row into a buffer (item assignment), then reduced."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.5, -2.0, 0.5]))

    def forward(self, x):
        buf = x.new_zeros(x.shape[0], 3)
        for i in range(x.shape[0]):
            buf[i] = x[i] * self.scale
        return buf.sum(dim=0, keepdim=True).expand(2, 3).contiguous()


def test_folded_writes_into_a_buffer_keep_their_lineage():
    model, x = Scatter(), torch.randn(30, 3)
    trace = _capture(model, [x], frozenset({6}))
    assert sum(trace.folded.values()) > 0
    out = trace.records[-1]
    torch.testing.assert_close(out.value, (x * model.scale).sum(0, keepdim=True).expand(2, 3).detach())
    reads, params, todo = set(), set(out.params), [r.index for r in out.inputs]
    while todo:
        i = todo.pop()
        if i not in reads:
            reads.add(i)
            params |= set(trace.records[i].params)
            todo += [r.index for r in trace.records[i].inputs]
    assert 0 in reads and "scale" in params


def test_no_fold_set_records_every_result():
    model, x = Scan(), torch.randn(3, 6)
    trace = _capture(model, [x], None)
    assert trace.folded == {} and sum(1 for r in trace.records if r.op.endswith("tanh")) == 20


REF = textwrap.dedent("""
    import torch, torch.nn as nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.GRU(4, 6, batch_first=True)

        def forward(self, x):
            return self.cell(x)[0]

    def get_inputs():
        return [torch.randn(2, 25, 4)]

    def get_init_inputs():
        return []
""")

CAND = textwrap.dedent("""
    import torch, torch.nn as nn
    import torch.nn.functional as F

    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.GRU(4, 6, batch_first=True)

        def forward(self, x):
            g = self.cell
            h = x.new_zeros(x.shape[0], 6)
            outs = []
            for t in range(x.shape[1]):
                a = F.linear(x[:, t], g.weight_ih_l0, g.bias_ih_l0).split(6, dim=-1)
                b = F.linear(h, g.weight_hh_l0, g.bias_hh_l0).split(6, dim=-1)
                r = torch.sigmoid(a[0] + b[0])
                z = torch.sigmoid(a[1] + b[1])
                n = torch.tanh(a[2] + r * b[2])
                h = (1 - z) * n + z * h
                outs.append(h)
            return torch.stack(outs, 1)

    def get_inputs():
        return [torch.randn(2, 25, 4)]

    def get_init_inputs():
        return []
""")


def test_cli_diff_folds_and_says_so(tmp_path):
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(REF)
    cand.write_text(CAND)
    out = tmp_path / "r.json"
    proc = run_cli("diff", str(ref), str(cand), "--trials", "2", "--no-report", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["verdict"] == "match" and data["meta"]["cand_folded"]["results"] > 0
    assert "candidate loop results were folded" in proc.stdout
    plain = run_cli("diff", str(ref), str(cand), "--trials", "1", "--no-report", "--no-fold", "--json", str(out))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "cand_folded" not in json.loads(out.read_text())["meta"]


class WriteIntoFolded(nn.Module):
    """The last of a loop's folded results is written into by a recorded op through a view, then read."""

    def forward(self, x, h):
        for i in range(12):
            buf = x[i].reshape(2, 3) * 2.0
        buf[:, :1].copy_(h)
        return buf.sum(1)


def _ancestors(trace, rec):
    seen, todo = set(), [r.index for r in rec.inputs]
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo += [r.index for r in trace.records[i].inputs]
    return seen


def test_a_recorded_write_into_a_folded_tensor_is_read_by_what_follows():
    x, h = torch.randn(12, 6), torch.randn(2, 1)
    trace = _capture(WriteIntoFolded(), [x, h], frozenset({2}))
    assert sum(trace.folded.values()) > 0
    out = trace.records[-1]
    torch.testing.assert_close(out.value, (x[11].reshape(2, 3) * 2.0).index_put((torch.arange(2)[:, None],
                                                                                 torch.zeros(2, 1, dtype=torch.long)),
                                                                                h).sum(1))
    h_rec = next(r.index for r in trace.records if r.kind == "input" and r.shape == (2, 1))
    x_rec = next(r.index for r in trace.records if r.kind == "input" and r.shape == (12, 6))
    assert {h_rec, x_rec} <= _ancestors(trace, out)


def test_a_folded_write_makes_an_earlier_record_of_that_memory_stale():
    """A kernel's raw write bumps no version counter: once folded, it must still stop the record made
    before it from standing for the memory's new contents."""
    st = C._State(None, True, None, fold=frozenset())
    buf = torch.zeros(4)
    rec = st.add(name="buf", kind="op", label="buf", function="f", file="", line=0, op="torch.zeros", tensor=buf)
    assert st.ref_of(buf).index == rec.index
    st.fold_into([((0,), buf)], (frozenset({7}), frozenset({"w"})), in_place=True)
    assert st.ref_of(buf) is None
    params: list[str] = []
    assert 7 in st._folded_sources(buf, params) and params == ["w"]


# -- writes into a buffer of the output's size, one step at a time (the preallocated-output style)
class TwoGRUs(nn.Module):
    """The reference: two stacked single-layer bidirectional GRUs (a record per layer, [T, B, 2H])."""

    def __init__(self):
        super().__init__()
        self.lower = nn.GRU(4, 5, bidirectional=True)
        self.upper = nn.GRU(10, 5, bidirectional=True)

    def forward(self, x):
        return self.upper(self.lower(x)[0])[0]


class SlabWriter(nn.Module):
    """The candidate: each direction's step result is stored into its columns of a buffer allocated
    per layer (`slab[t, :, col:col + H] = h`), which the next layer reads whole.  `bad_step`: the lower
    layer's backward direction stores half its state at that step."""

    def __init__(self, bad_step=None):
        super().__init__()
        self.lower = nn.GRU(4, 5, bidirectional=True)
        self.upper = nn.GRU(10, 5, bidirectional=True)
        self.bad_step = bad_step

    def _direction(self, gru, sfx, seq, slab, col, backwards, corrupt):
        H = gru.hidden_size
        pre = F.linear(seq, getattr(gru, "weight_ih_l0" + sfx), getattr(gru, "bias_ih_l0" + sfx))
        h = seq.new_zeros(seq.shape[1], H)
        for t in (range(seq.shape[0] - 1, -1, -1) if backwards else range(seq.shape[0])):
            g = pre[t]
            hh = F.linear(h, getattr(gru, "weight_hh_l0" + sfx), getattr(gru, "bias_hh_l0" + sfx))
            r = torch.sigmoid(g[:, :H] + hh[:, :H])
            z = torch.sigmoid(g[:, H:2 * H] + hh[:, H:2 * H])
            n = torch.tanh(g[:, 2 * H:] + r * hh[:, 2 * H:])
            h = (1 - z) * n + z * h
            slab[t, :, col:col + H] = h * 0.5 if (corrupt and t == self.bad_step) else h

    def forward(self, x):
        for k, gru in enumerate((self.lower, self.upper)):
            slab = x.new_empty(x.shape[0], x.shape[1], 2 * gru.hidden_size)
            for d in range(2):
                self._direction(gru, "_reverse" if d else "", x, slab, d * gru.hidden_size, d == 1,
                                k == 0 and d == 1 and self.bad_step is not None)
            x = slab
        return x


def _seeded(make_ref, make_cand):
    """The reference and the candidate, each built from seed 0 (their parameters alike)."""
    torch.manual_seed(0)
    ref = make_ref()
    torch.manual_seed(0)
    return ref, make_cand()


def _slab_diff(bad_step, fold, steps=30):
    ref, cand = _seeded(TwoGRUs, lambda: SlabWriter(bad_step))
    return diffkit.compare(ref, cand, [torch.randn(steps, 3, 4)], fold=fold)


def test_step_writes_into_a_full_size_buffer_fold_and_the_filled_buffer_pairs():
    """Every step's store writes into a tensor of the layer output's size, so by size alone each could
    pair; but a partly filled buffer pairs with nothing the reference has (it makes no writes).  The
    stores fold, and the buffer is recorded once, filled, when the next layer reads it: it pairs
    with the reference's lower layer, which the partly filled records could not."""
    folded, whole = _slab_diff(None, True), _slab_diff(None, False)
    assert folded.verdict == whole.verdict == "match"
    writes = [s for s in folded.stages if s.cand is not None and s.cand.names()[0].startswith("_direction:slab")]
    paired = [s for s in writes if s.ref is not None]
    assert len(paired) == 1 and paired[0].ref.names()[0] == "lower[0]" and paired[0].status == "ok"
    # recorded: FOLD_AFTER stores of the first direction's site, then the filled buffer, at most once per layer
    assert len(writes) <= FOLD_AFTER + 2
    assert folded.meta["cand_records"] * 10 < whole.meta["cand_records"]


def test_a_wrong_step_in_a_folded_buffer_shows_at_the_filled_buffer():
    bad = 20
    folded = _slab_diff(bad, True)
    assert folded.verdict == "diverged"
    fd = folded.first_divergence
    assert fd.ref_name == "lower[0]" and fd.cand.names()[0].startswith("_direction:slab")
    assert fd.stats.mismatches == 3 * 5  # one step's backward half, batch 3 x hidden 5


class StepWriterRef(nn.Module):
    """A reference that itself fills a buffer step by step: the candidate's stores pair with its own."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) * 0.3)

    def forward(self, x):
        out = torch.zeros(x.shape[0], 6)
        h = torch.zeros(6)
        for t in range(x.shape[0]):
            h = torch.tanh(x[t] + h @ self.w)
            out[t] = h
        return out * 2


def test_stores_are_kept_where_the_reference_makes_stores_of_that_size():
    ref, cand = _seeded(StepWriterRef, StepWriterRef)
    res = diffkit.compare(ref, cand, [torch.randn(20, 6)])
    assert res.verdict == "match"
    stores = [s for s in res.stages if s.ref is not None and s.cand is not None and s.ref.kind == "write"]
    assert len(stores) == 20 and all(s.status == "ok" for s in stores)


class KernelSteps(nn.Module):
    """A two-layer loop whose kernel writes each step's state into a row of the layer's output buffer
    and returns nothing (the out-parameter style); the reference is one two-layer nn.RNN."""

    def __init__(self, ops):
        super().__init__()
        self.rnn = nn.RNN(4, 6, num_layers=2)
        self.ops = ops

    def forward(self, x):
        for k in range(2):
            out = torch.empty(x.shape[0], x.shape[1], 6)
            h = x.new_zeros(x.shape[1], 6)
            for t in range(x.shape[0]):
                h = torch.tanh(F.linear(x[t], getattr(self.rnn, f"weight_ih_l{k}"), getattr(self.rnn, f"bias_ih_l{k}"))
                               + F.linear(h, getattr(self.rnn, f"weight_hh_l{k}"), getattr(self.rnn, f"bias_hh_l{k}")))
                self.ops.scale_into(out[t], h, 1.0)
            x = out
        return x.sum(-1)


class TwoLayerRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(4, 6, num_layers=2)

    def forward(self, x):
        return self.rnn(x)[0].sum(-1)


def test_a_kernel_writing_rows_of_the_output_buffer_folds_and_the_buffer_is_recorded(ops):
    ref, cand = _seeded(TwoLayerRNN, lambda: KernelSteps(ops))
    res = diffkit.compare(ref, cand, [torch.randn(25, 2, 4)])
    assert res.verdict == "match"
    stores = [s for s in res.stages if s.cand is not None and s.cand.kind == "write"]
    # FOLD_AFTER kernel calls recorded, then the first layer's buffer (its rows read by the second
    # layer) and the second's (read by the sum), each once, filled
    filled_buffers = [s for s in stores if tuple(s.cand.shape) == (25, 2, 6)]
    assert len(filled_buffers) == 2 and len(stores) <= FOLD_AFTER + 2
    filled = next(s for s in res.stages if s.ref is not None and s.ref.names()[0] == "rnn[0]")
    assert filled.cand is not None and filled.cand.index == max(s.cand.index for s in stores) and filled.status == "ok"


class NestedBuffers(nn.Module):
    """Each step indexes the layer's slot of one buffer for all layers and stores into it
    (``outs[layer][:, t] = h``): `outs[layer]` has the layer output's size, so by size each view could
    pair; made again and again, it is the same memory each time."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(5, 7, num_layers=2, batch_first=True)

    def forward(self, x):
        outs = x.new_empty(2, x.shape[0], x.shape[1], 7)
        seq = x
        for layer in range(2):
            w_ih, w_hh = getattr(self.rnn, f"weight_ih_l{layer}"), getattr(self.rnn, f"weight_hh_l{layer}")
            b = getattr(self.rnn, f"bias_ih_l{layer}") + getattr(self.rnn, f"bias_hh_l{layer}")
            h = x.new_zeros(x.shape[0], 7)
            for t in range(x.shape[1]):
                h = torch.tanh(seq[:, t] @ w_ih.T + h @ w_hh.T + b)
                outs[layer][:, t] = h
            seq = outs[layer]
        return seq


def test_the_same_view_made_each_step_folds():
    ref, cand = _seeded(ElmanRef, NestedBuffers)
    x = torch.randn(3, 40, 5)
    folded = diffkit.compare(ref, cand, [x])
    whole = diffkit.compare(ref, cand, [x], fold=False)
    assert folded.verdict == whole.verdict == "match"
    line = NestedBuffers.forward.__code__.co_firstlineno + 9  # outs[layer][:, t] = h
    sites = folded.meta["cand_folded"]["sites"]
    site = next(s for s in sites if s.endswith(f"test_fold.py:{line}"))
    # per layer the view is recorded once, then made again 39 times; every store fills part of the
    # buffer, so none is recorded (the filled buffer is, when read)
    assert sites[site] == 2 * 39 + 2 * 40
    views = [r for r in folded.stages if r.cand is not None and r.cand.op == "Tensor.__getitem__"
             and tuple(r.cand.shape) == (3, 40, 7)]
    assert len(views) <= 2 + 2  # each layer's slot viewed to store into, and to read it back
    assert folded.meta["cand_records"] * 3 < whole.meta["cand_records"]


# -- a pending buffer's record: its value before an in-place reader, a layer's slot, a kernel's inputs
class ScaledSlabs(SlabWriter):
    """SlabWriter whose lower output is scaled in place, and back, before the upper layer reads it:
    the filled buffer is recorded before the first in-place op changes it."""

    def forward(self, x):
        for k, gru in enumerate((self.lower, self.upper)):
            slab = x.new_empty(x.shape[0], x.shape[1], 2 * gru.hidden_size)
            for d in range(2):
                self._direction(gru, "_reverse" if d else "", x, slab, d * gru.hidden_size, d == 1, False)
            if k == 0:
                slab.mul_(2.0)
                torch.mul(slab, 0.5, out=slab)
            x = slab
        return x


def test_a_filled_buffer_is_recorded_before_an_in_place_op_changes_it():
    ref, cand = _seeded(TwoGRUs, ScaledSlabs)
    x = torch.randn(30, 3, 4)
    rt = _capture(ref, [x], None)
    with torch.no_grad():  # as a diff captures it: folding against the reference's sizes and writes
        with C.capture(cand, inputs=(x,), fold=frozenset(record_numel(r) for r in rt.records),
                       fold_writes=frozenset(record_numel(r) for r in rt.records if C.written_in_place(r))) as ct:
            cand(x)
    assert sum(ct.folded.values()) > 0
    lower = next(r for r in rt.records if r.name == "lower[0]").value
    doubled = next(i for i, r in enumerate(ct.records) if r.op.endswith("mul_"))
    filled = ct.records[doubled - 1]  # recorded just before the first in-place op, as the stores left it
    assert filled.kind == "write" and filled.name.startswith("_direction:slab")
    torch.testing.assert_close(filled.value, lower)
    res = diffkit.compare(ref, cand, [x])
    assert res.verdict == "match"


class SlotWriter(SlabWriter):
    """SlabWriter with one allocation for both layers' outputs: each layer names its slot, its steps
    store into it."""

    def forward(self, x):
        both = x.new_empty(2, x.shape[0], x.shape[1], 2 * self.lower.hidden_size)
        for k, gru in enumerate((self.lower, self.upper)):
            slot = both[k]
            for d in range(2):
                self._direction(gru, "_reverse" if d else "", x, slot, d * gru.hidden_size, d == 1,
                                k == 0 and d == 1 and self.bad_step is not None)
            x = slot
        return x


@pytest.mark.parametrize("bad_step", [None, 20])
def test_a_layer_slot_of_a_shared_buffer_is_recorded_filled(bad_step):
    ref, cand = _seeded(TwoGRUs, lambda: SlotWriter(bad_step))
    res = diffkit.compare(ref, cand, [torch.randn(30, 3, 4)])
    lower = next(s for s in res.stages if s.ref is not None and s.ref.names()[0] == "lower[0]")
    assert lower.cand is not None and lower.cand.kind == "write" and lower.cand.names()[0].startswith("_direction:slab")
    if bad_step is None:
        assert res.verdict == "match" and lower.status == "ok"
    else:
        assert res.first_divergence.ref_name == "lower[0]" and res.first_divergence.stats.mismatches == 3 * 5


class KernelReadsRows(nn.Module):
    """A kernel copies each step's input row out of a projection it only reads (out-parameter style)."""

    def __init__(self, ops):
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.rnn = nn.RNN(6, 6, num_layers=2)
        self.ops = ops

    def forward(self, x):
        p = self.proj(x)
        seq = p
        for k in range(2):
            out = torch.empty(x.shape[0], x.shape[1], 6)
            h = x.new_zeros(x.shape[1], 6)
            for t in range(x.shape[0]):
                row = torch.empty(x.shape[1], 6)
                self.ops.scale_into(row, seq[t], 1.0)
                h = torch.tanh(F.linear(row, getattr(self.rnn, f"weight_ih_l{k}"), getattr(self.rnn, f"bias_ih_l{k}"))
                               + F.linear(h, getattr(self.rnn, f"weight_hh_l{k}"), getattr(self.rnn, f"bias_hh_l{k}")))
                out[t] = h
            seq = out
        return seq + p


class ProjRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.rnn = nn.RNN(6, 6, num_layers=2)

    def forward(self, x):
        p = self.proj(x)
        return self.rnn(p)[0] + p


def test_a_kernels_read_only_argument_is_not_recorded_as_written(ops):
    ref, cand = _seeded(ProjRNN, lambda: KernelReadsRows(ops))
    res = diffkit.compare(ref, cand, [torch.randn(20, 2, 4)])
    assert res.verdict == "match"
    kernel_writes = [s.cand for s in res.stages if s.cand is not None and s.cand.op.startswith("ext:")]
    assert kernel_writes and all(tuple(c.shape) == (2, 6) for c in kernel_writes)  # the rows only


# -- a reference that returns a multi-layer recurrence's final state (KernelBench's "...Hn" models): the
# module's output sequence is a sibling record, which only the candidate's last layer can stand for

class StackedLSTMFinalState(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.lstm = nn.LSTM(5, 6, num_layers=layers, batch_first=True)

    def forward(self, x):
        _, (h_n, _) = self.lstm(x)
        return h_n


def _lstm_step(x_t, h, c, w_ih, w_hh, b, forget_bias=True):
    gates = torch.addmm(b, x_t, w_ih.t()) + h @ w_hh.t()
    i, f, g, o = gates.chunk(4, dim=1)
    if not forget_bias:
        f = f - b.chunk(4)[1]
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


class HandLSTM(nn.Module):
    """Each layer's sequence goes into a buffer one step at a time (``seq.select(1, t).copy_(h)``);
    `keep_last=False`: the last layer keeps no sequence, only its state; `bad_layer`: that layer's forget
    gate misses its bias."""

    def __init__(self, layers=3, keep_last=True, bad_layer=None):
        super().__init__()
        self.lstm = nn.LSTM(5, 6, num_layers=layers, batch_first=True)
        self.layers, self.keep_last, self.bad_layer = layers, keep_last, bad_layer

    def forward(self, x):
        finals = []
        feed = x
        for j in range(self.layers):
            w_ih, w_hh = getattr(self.lstm, f"weight_ih_l{j}"), getattr(self.lstm, f"weight_hh_l{j}")
            b = getattr(self.lstm, f"bias_ih_l{j}") + getattr(self.lstm, f"bias_hh_l{j}")
            h = c = x.new_zeros(x.shape[0], 6)
            seq = x.new_empty(x.shape[0], x.shape[1], 6)
            for t in range(x.shape[1]):
                h, c = _lstm_step(feed[:, t], h, c, w_ih, w_hh, b, forget_bias=j != self.bad_layer)
                if self.keep_last or j < self.layers - 1:
                    seq.select(1, t).copy_(h)
            finals.append(h)
            feed = seq
        return torch.stack(finals)


def _final_state_diff(**kw):
    ref, cand = _seeded(StackedLSTMFinalState, lambda: HandLSTM(**kw))
    return diffkit.compare(ref, cand, [torch.randn(2, 24, 5)])


@pytest.mark.parametrize("keep_last", [True, False])
def test_a_layer_buffer_pairs_only_with_what_it_computed(keep_last):
    res = _final_state_diff(keep_last=keep_last)
    assert res.verdict == "match"
    # no stage out of tolerance: a lower layer's buffer is not taken for the module's output sequence
    assert not [s for s in res.stages if s.status not in ("ok", "unmatched")]
    assert not [w for w in res.warnings if "out of tolerance" in w]
    seq_stage = [s for s in res.stages if s.ref is not None and s.ref.name == "lstm[0]"]
    assert len(seq_stage) == 1
    if keep_last:  # the last layer's filled buffer (nothing reads it: recorded when the forward returns)
        assert seq_stage[0].status == "ok" and seq_stage[0].cand.kind == "write"
    else:  # nothing in the candidate computes it
        assert seq_stage[0].cand is None
    # the step stores record nothing (a part-filled buffer): one record per layer's filled buffer
    buffers = [s.cand for s in res.stages if s.cand is not None and s.cand.kind == "write"]
    assert len(buffers) == (3 if keep_last else 2)
    assert all(tuple(b.shape) == (2, 24, 6) for b in buffers)


@pytest.mark.parametrize("bad_layer,keep_last", [(1, True), (2, False)])
def test_a_wrong_layer_is_not_reported_at_a_lower_layers_buffer(bad_layer, keep_last):
    res = _final_state_diff(bad_layer=bad_layer, keep_last=keep_last)
    assert res.verdict == "diverged"
    first = res.first_divergence
    # the first divergence is a stage computed from every layer's weights (the output, or the last
    # layer's sequence), never the first layer's buffer compared against the module's output
    # (the output keeps the name of the module part it is, `lstm[1][0]`, with `output` an alias)
    assert first.ref.is_output or first.ref.name == "lstm[0]", first.ref.name
    before = [s for s in res.stages if s.index < first.index and s.status not in ("ok", "unmatched")]
    assert not before


# -- a reference that reads the last step of an LSTM's output through a linear layer (KernelBench's LSTM
# models): many candidate step results share that slice's size, and its inputs and parameters

class LastStepHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=3, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1, :])


class LoopedHead(nn.Module):
    """Per layer, the input projection for all steps at once and a Python loop over the steps; the
    last layer keeps only its state.  `shift`: added to the cell state inside the output's tanh."""

    def __init__(self, shift=0.0):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=3, batch_first=True)
        self.fc = nn.Linear(8, 3)
        self.shift = shift

    def forward(self, x):
        b = x.shape[0]
        h = c = x.new_zeros(b, 8)
        seq = x
        for j in range(3):
            xp = torch.matmul(seq, getattr(self.lstm, f"weight_ih_l{j}").T) + getattr(self.lstm, f"bias_ih_l{j}")
            h = c = x.new_zeros(b, 8)
            outs = []
            for t in range(seq.shape[1]):
                z = xp[:, t] + torch.mm(h, getattr(self.lstm, f"weight_hh_l{j}").T) + getattr(self.lstm, f"bias_hh_l{j}")
                zi, zf, zg, zo = z.split(8, dim=1)
                c = torch.sigmoid(zf) * c + torch.sigmoid(zi) * torch.tanh(zg)
                h = torch.sigmoid(zo) * torch.tanh(c + self.shift)
                if j < 2:
                    outs.append(h)
            if j < 2:
                seq = torch.stack(outs, 1)
        return self.fc(h)


def test_the_last_step_pairs_with_what_the_head_reads():
    ref, cand = _seeded(LastStepHead, LoopedHead)
    res = diffkit.compare(ref, cand, [torch.randn(3, 30, 6)])
    assert res.verdict == "match"
    assert not [s for s in res.stages if s.status not in ("ok", "unmatched")]
    last = [s for s in res.stages if s.ref is not None and s.ref.op.endswith("__getitem__")]
    assert len(last) == 1 and last[0].status == "ok" and last[0].cand is not None
    # the final step's state, not an earlier one of similar values (nor a gate of another shape)
    fc_input = [s.cand for s in res.stages if s.cand is not None and s.cand.is_output][0].inputs
    assert last[0].cand.index in fc_input


def test_a_wrong_step_is_reported_at_the_last_step():
    ref, cand = _seeded(LastStepHead, lambda: LoopedHead(shift=0.05))
    res = diffkit.compare(ref, cand, [torch.randn(3, 30, 6)])
    assert res.verdict == "diverged"
    first = res.first_divergence
    assert first.ref.op.endswith("__getitem__")
    fc_input = [s.cand for s in res.stages if s.cand is not None and s.cand.is_output][0].inputs
    assert first.cand.index in fc_input


# -- stores and in-place ops outside loops, after the partial-store rule (an independent review's cases)

class MLPRef(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class FlatMLP(MLPRef):
    """Batch and time merged into one axis ([B*T, H], as a kernel would), tanh for GELU; `scale` on fc1."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        b, t, _ = x.shape
        hid = torch.addmm(self.fc1.bias, x.reshape(-1, 16), self.fc1.weight.t() * self.scale)
        act = torch.tanh(hid)
        return (act @ self.fc2.weight.t() + self.fc2.bias).view(b, t, 16)


@pytest.mark.parametrize("scale,where", [(1.0, "act"), (3.0, "fc1")])
def test_a_flattened_wrong_stage_still_pairs(scale, where):
    ref, cand = _seeded(MLPRef, lambda: FlatMLP(scale))
    res = diffkit.compare(ref, cand, [torch.randn(2, 5, 16)])
    assert res.first_divergence is not None and res.first_divergence.ref.name == where
    assert tuple(res.first_divergence.cand.shape) == (10, 32)


class ScaledQRef(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        q = q * 0.25
        return self.proj(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class InPlaceScaledQ(ScaledQRef):
    def forward(self, x):
        qkv = self.qkv(x)
        q = qkv[..., :16]
        q.mul_(0.3)  # wrong factor, in place on the projection
        return self.proj(torch.softmax(q @ qkv[..., 16:32].transpose(-1, -2), -1) @ qkv[..., 32:])


def test_an_in_place_op_on_part_of_a_result_is_its_own_stage():
    ref, cand = _seeded(ScaledQRef, InPlaceScaledQ)
    res = diffkit.compare(ref, cand, [torch.randn(2, 5, 16)])
    first = res.first_divergence
    assert first.cand.op.endswith("mul_") and tuple(first.cand.shape) == (2, 5, 16)
    assert first.ref.op.endswith("mul")


class MaskedHeadRef(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))
        return y.masked_fill(torch.arange(8) == 0, 0.0)


class StoreIntoOutput(MaskedHeadRef):
    def forward(self, x):
        y = torch.relu(x @ self.fc1.weight.t() + self.fc1.bias) @ self.fc2.weight.t() + self.fc2.bias
        y[..., 0] = 0
        return y


def test_a_store_into_the_returned_tensor_keeps_its_dataflow():
    ref, cand = _seeded(MaskedHeadRef, StoreIntoOutput)
    res = diffkit.compare(ref, cand, [torch.randn(2, 5, 16)])
    assert res.verdict == "match"
    out = [s.cand for s in res.stages if s.cand is not None and s.cand.is_output][0]
    # the output stands for the filled buffer's record (the store's), computed from the projection, not
    # straight from the model's input (record 0)
    assert out.inputs and 0 not in out.inputs


class SameValuesKernel(nn.Module):
    """A kernel storing into an empty() buffer exactly what that memory holds already (as memory reused
    from an identical earlier run can): nothing visibly changes, so the write is put on the buffer."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        out = torch.empty(x.shape)
        out.copy_(h)
        self.ops.scale_into(out, h, 1.0)  # writes h into memory that holds h
        return out * 2


def test_a_kernel_write_that_changes_nothing_is_put_on_its_output_buffer(ops):
    from diffkit.compare import run_captured

    trace = run_captured(SameValuesKernel(ops), [torch.randn(4, 6)])
    writes = [r for r in trace.records if r.kind == "write" and r.op.startswith("ext:")]
    assert len(writes) == 1 and writes[0].label == "out", [(r.name, r.label) for r in writes]
