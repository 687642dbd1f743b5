"""Folding: a candidate's loop results that no reference record can pair with are carried as
lineage, not records -- the diff's answer and the dataflow of what is recorded stay as they were."""
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit.options import FOLD_AFTER

C = importlib.import_module("diffkit.capture")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    torch.manual_seed(0)
    ref = ElmanRef()
    torch.manual_seed(0)
    cand = Unrolled(bad_from=bad_from)
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
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(ref), str(cand), "--trials", "2",
                           "--no-report", "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["verdict"] == "match" and data["meta"]["cand_folded"]["results"] > 0
    assert "candidate loop results were folded" in proc.stdout
    plain = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(ref), str(cand), "--trials", "1",
                            "--no-report", "--no-fold", "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
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
