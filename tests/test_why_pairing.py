"""Pairing that never mistakes a copy for a computation, and the first wrong step of a loop (issue 44).

Every candidate in kernels/why/pair_*.py and kernels/why/loop_*.py (numpy detours, hand-written recurrent
loops, in styles unlike each other) is diffed with `diffkit.diff_files`: a broken one must be reported at the
reference stage its DIFFKIT_EXPECT names (the attention that comes back from numpy, the first wrong step of a
loop -- not the collection built from the steps, not the head after it), a correct one must match with no
finding and no what-if; in neither is a copy of an input or a parameter (`.detach()`, `.cpu()`,
`.contiguous()`) a stage.  Then the rules on small models: copies of inputs and parameters make no record and
read as what they copy; a tensor made from a numpy array comes from what went out to numpy; stacked steps
pair position by position."""
import os

import numpy as np
import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit.capture import capture

from conftest import KERNELS, REFS, expectation, same_pair

WHY = os.path.join(KERNELS, "why")
COPY_OPS = ("detach", "cpu", "contiguous")


def _cases():
    if not os.path.isdir(WHY):
        return []
    return [(n, expectation(os.path.join(WHY, n))) for n in sorted(os.listdir(WHY))
            if n.startswith(("pair_", "loop_")) and n.endswith(".py")]


def test_there_are_broken_and_correct_candidates_of_both_kinds():
    cases = _cases()
    for prefix in ("pair_", "loop_"):
        mine = [(n, e) for n, e in cases if n.startswith(prefix)]
        assert sum(e.get("verdict") == "match" for _, e in mine) >= 2, mine
        assert sum(e.get("verdict") != "match" for _, e in mine) >= 2, mine
    assert all(os.path.exists(os.path.join(REFS, e["reference"])) for _, e in cases)


def _copy_stages(result):
    return [s.cand.name for s in result.stages if s.cand is not None and s.cand.kind == "op"
            and s.cand.op.rsplit(".", 1)[-1] in COPY_OPS and s.ref is None]


@pytest.mark.slow
@pytest.mark.parametrize("name,exp", [pytest.param(*c, id=c[0], marks=same_pair(os.path.join(WHY, c[0])))
                                      for c in _cases()])
def test_each_candidate_is_reported_at_its_first_wrong_stage(name, exp):
    result = diffkit.diff_files(os.path.join(REFS, exp["reference"]), os.path.join(WHY, name))
    # a copy taken only to call numpy (or out of habit) is the input or parameter it copies, no stage
    assert _copy_stages(result) == [], _copy_stages(result)
    if exp.get("verdict") == "match":
        assert result.verdict == "match", result.summary_line()
        assert result.first_divergence is None and result.findings == [] and result.what_if == []
        return
    assert result.verdict == "diverged", result.summary_line()
    fd = result.first_divergence
    assert fd is not None and fd.matches(exp["stage"]), result.summary_line()
    # a collection built from the steps (stacked, concatenated) inherits the error of the first wrong step
    collected = [s for s in result.stages if s.ref is not None and s.cand is not None
                 and s.ref.op.rsplit(".", 1)[-1] in ("stack", "cat")]
    assert all(s.index > fd.index and s.status == "after-divergence" for s in collected), \
        [(s.ref_name, s.status) for s in collected]
    want = exp.get("what_if")
    if want:
        assert result.what_if, result.meta.get("what_if")
        best = result.what_if[0]
        names = {n for m in best["mutations"] for n in [m["stage"], *m["aliases"]]}
        assert best["kind"] == want["kind"] and want["stage"] in names, result.what_if[:3]


# ----------------------------------------------------------------------------- copies of inputs and parameters
def _trace(model, *inputs):
    with torch.no_grad(), capture(model, inputs=inputs) as trace:
        model(*inputs)
    return trace


class _Copies(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        xc = x.detach().cpu()
        xk = x.contiguous()
        wc = self.w.clone()
        a = xc @ wc  # reads the input and the parameter, through copies
        b = self.lin(xk)
        h = (a + b).detach()  # a record's own memory: the record itself
        return h * 2


def test_copies_of_inputs_and_parameters_make_no_record_and_read_as_what_they_copy():
    t = _trace(_Copies(), torch.randn(5, 6))
    ops = [r.op.rsplit(".", 1)[-1] for r in t.records]
    assert not any(o in ("detach", "cpu", "contiguous", "clone") for o in ops), t.names()
    x = t.records[0]
    assert x.kind == "input"
    by = {r.label: r for r in t.records}
    assert [r.index for r in by["a"].inputs] == [x.index] and by["a"].params == ("w",)
    assert [r.index for r in t["lin"].inputs] == [x.index]
    total = by["a + b"]
    assert [r.index for r in t.output.inputs] == [total.index]

    class Written(nn.Module):  # an in-place write through an input's copy is a write into the input
        def forward(self, x):
            xd = x.detach()
            xd.mul_(2)
            return x + 1

    t = _trace(Written(), torch.randn(4, 3))
    (mul,) = [r for r in t.records if r.op.endswith("mul_")]
    assert [r.index for r in mul.inputs] == [0] and [r.index for r in t.output.inputs] == [0, mul.index]

    class Half(nn.Module):  # a copy that changes the values (a cast) is still a computation
        def forward(self, x):
            return x.to(torch.float16).float() * 2

    t = _trace(Half(), torch.randn(4, 3))
    assert [r.op.rsplit(".", 1)[-1] for r in t.records[1:3]] == ["to", "float"], t.names()


# ----------------------------------------------------------------------------- values through numpy
class _Numpy(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))
        self.post = nn.Linear(4, 4)

    def forward(self, x):
        h = self.pre(x)
        w = self.w.detach().numpy()
        y = np.tanh(np.asarray(h) @ w)  # what went out: pre's output and the parameter
        first = torch.tensor(y)  # seen by capture: made from what went out
        second = torch.from_numpy(y * 2)  # not seen: recorded when a recorded call reads it
        return self.post(first) + second


def test_a_tensor_made_from_numpy_comes_from_what_went_out_to_numpy():
    t = _trace(_Numpy(), torch.randn(3, 4))
    pre = t["pre"]
    made = [r for r in t.records if r.op.rsplit(".", 1)[-1] == "tensor"]
    assert len(made) == 1 and [r.index for r in made[0].inputs] == [pre.index] and made[0].params == ("w",)
    back = [r for r in t.records if r.op == "numpy"]  # torch.from_numpy's result, once read
    assert len(back) == 1 and [r.index for r in back[0].inputs] == [pre.index] and back[0].params == ("w",)
    assert back[0].index in [r.index for r in t.output.inputs]

    class Const(nn.Module):  # a tensor capture knows nothing of, with nothing sent to numpy: no import
        def __init__(self):
            super().__init__()
            self.table = torch.arange(4.0)  # a plain attribute, made before the forward

        def forward(self, x):
            return x + self.table

    t = _trace(Const(), torch.randn(2, 4))
    assert not any(r.op == "numpy" for r in t.records)
    assert [r.index for r in t.output.inputs] == [0]




def test_numpy_through_the_whole_model_pairs_its_result_with_the_stage_it_replaced():
    class Ref(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(5, 5)
            self.b = nn.Linear(5, 5)

        def forward(self, x):
            act = torch.relu(self.a(x))
            return self.b(act)

    class Cand(Ref):
        def forward(self, x):
            w, c = self.a.weight.detach().numpy(), self.a.bias.detach().numpy()
            hidden = np.maximum(x.detach().numpy() @ w.T + c, 0) * 1.5  # wrong: scaled
            back = torch.as_tensor(hidden)
            return self.b(back)

    torch.manual_seed(0)
    ref = Ref()
    torch.manual_seed(0)
    cand = Cand()
    result = diffkit.compare(ref, cand, [torch.randn(4, 5)])
    assert result.verdict == "diverged"
    fd = result.first_divergence
    assert fd.ref_name == "forward:act" and fd.cand_name == "forward:back", result.summary_line()
    assert fd.paired_by == "dataflow"  # what went out to numpy (x, a's parameters) is what the relu read


# ----------------------------------------------------------------------------- steps of a loop
class _Steps(nn.Module):
    def __init__(self, lag=False, reverse=False):
        super().__init__()
        self.cell = nn.RNNCell(3, 4)
        self.lag, self.reverse = lag, reverse

    def forward(self, x):
        outs = [torch.zeros(x.shape[1], 4)]
        for t in range(x.shape[0]):
            prev = outs[max(t - 1, 0)] if self.lag else outs[-1]
            outs.append(torch.tanh(x[t] @ self.cell.weight_ih.t() + self.cell.bias_ih
                                   + prev @ self.cell.weight_hh.t() + self.cell.bias_hh))
        steps = outs[1:][::-1] if self.reverse else outs[1:]
        return torch.stack(steps).sum(-1)


class _RefSteps(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.RNNCell(3, 4)

    def forward(self, x):
        h = torch.zeros(x.shape[1], 4)
        seq = []
        for t in range(x.shape[0]):
            h = self.cell(x[t], h)
            seq.append(h)
        return torch.stack(seq).sum(-1)


def _loop_diff(cand):
    torch.manual_seed(0)
    ref = _RefSteps()
    cand.load_state_dict(ref.state_dict())
    return diffkit.compare(ref, cand, [torch.randn(5, 2, 3)])


def test_the_first_wrong_step_is_reported_not_the_stacked_steps():
    result = _loop_diff(_Steps(lag=True))
    fd = result.first_divergence
    assert result.verdict == "diverged" and fd.matches("cell#2"), result.summary_line()
    by_ref = {s.ref_name: s for s in result.stages if s.ref is not None}
    assert by_ref["cell"].status == "ok"
    stacked = [s for s in result.stages if s.ref is not None and s.ref.op.endswith("stack")]
    assert stacked and stacked[0].cand is not None and stacked[0].index > fd.index

    # every step right, only the collection in the wrong order: the steps are not paired by position, and
    # the collection is where it goes wrong
    result = _loop_diff(_Steps(reverse=True))
    fd = result.first_divergence
    assert result.verdict == "diverged" and fd.ref is not None and fd.ref.op.endswith("stack"), result.summary_line()
    assert all(s.status == "ok" for s in result.stages if s.ref is not None and s.ref_name.startswith("cell")
               and s.cand is not None)
