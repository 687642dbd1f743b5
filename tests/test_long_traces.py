"""Long traces (a recurrence written as a Python loop: thousands of steps of the same few calls) are
aligned in time linear in their length: the dataflow pass looks for a record's counterpart in a window
past its anchors (`align_tuning.DATAFLOW_WINDOW`), the order pass's longest common subsequence is computed on
bit rows, the value pass scores only the free reference records, and a record's rivals (the records after it
that could be its stage instead) are looked for only as far as a decision needs them.  What is checked here: the
window pairs as the whole trace would, rivals found lazily pair as rivals found in full, the work grows linearly,
and the LCS is the one the plain table gives."""
import random

import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit import align as A
from diffkit import align_dataflow as AD
from diffkit import align_layout as AL
from diffkit import align_values as AV


class LoopRNN(nn.Module):
    """A reference: an RNN cell stepped in a loop over the concatenation of input and state."""

    def __init__(self, n_in=6, n_hid=12, n_out=5):
        super().__init__()
        self.n_hid = n_hid
        self.i2h = nn.Linear(n_in + n_hid, n_hid)
        self.h2o = nn.Linear(n_hid, n_out)

    def forward(self, x):
        h = torch.zeros(x.size(1), self.n_hid)
        outs = []
        for t in range(x.size(0)):
            h = torch.tanh(self.i2h(torch.cat((x[t], h), dim=1)))
            outs.append(self.h2o(h))
        return torch.stack(outs)


class SplitWeightsRNN(nn.Module):
    """A candidate in another style: the input's part of the cell for all steps at once (one matmul),
    the state's part per step, states written into a preallocated slab, the head applied once.
    `drift_from`: from that step on the state's product is scaled by 1.01 (a late, small error)."""

    def __init__(self, n_in=6, n_hid=12, n_out=5, drift_from=None, bias=True):
        super().__init__()
        self.n_hid, self.drift_from, self.bias = n_hid, drift_from, bias
        self.i2h = nn.Linear(n_in + n_hid, n_hid)
        self.h2o = nn.Linear(n_hid, n_out)

    def forward(self, x):
        steps, batch, n_in = x.shape
        w_in, w_state = self.i2h.weight[:, :n_in], self.i2h.weight[:, n_in:]
        flat = x.reshape(steps * batch, n_in)
        pre = (torch.addmm(self.i2h.bias, flat, w_in.t()) if self.bias else flat @ w_in.t()).view(steps, batch, -1)
        slab = x.new_empty(steps, batch, self.n_hid)
        state = x.new_zeros(batch, self.n_hid)
        for t in range(steps):
            mixed = state @ w_state.t()
            if self.drift_from is not None and t >= self.drift_from:
                mixed = mixed * 1.01
            state = torch.tanh(pre[t] + mixed)
            slab[t] = state
        return nn.functional.linear(slab, self.h2o.weight, self.h2o.bias)


def _diff(cand_kw, steps, **settings):
    torch.manual_seed(0)
    ref = LoopRNN()
    cand = SplitWeightsRNN(**cand_kw)
    cand.load_state_dict(ref.state_dict())
    x = torch.randn(steps, 3, 6)
    return diffkit.compare(ref, cand, [x], health=False, rerun=False, explain=False, **settings)


def _pairs(result):
    return sorted((str(s.ref.name if s.ref else None), str(s.cand.name if s.cand else None)) for s in result.stages)


@pytest.mark.parametrize("cand_kw, first", [
    ({}, None),  # matches
    ({"drift_from": 30}, "i2h#31"),  # the 31st step's cell (t = 30) is the first wrong stage
    ({"bias": False}, "i2h"),  # the bias left out of the input's part: wrong from the first step
], ids=["match", "late_drift", "no_bias"])
def test_the_window_pairs_a_long_loop_as_the_whole_trace_does(monkeypatch, cand_kw, first):
    monkeypatch.setattr(AD, "DATAFLOW_WINDOW_FROM", 10**9)
    whole = _diff(cand_kw, 48)
    monkeypatch.setattr(AD, "DATAFLOW_WINDOW_FROM", 0)
    monkeypatch.setattr(AD, "DATAFLOW_WINDOW", 12)  # a few steps' records: far smaller than the trace
    windowed = _diff(cand_kw, 48)
    fd = windowed.first_divergence
    assert (fd.ref_name if fd else None) == first
    assert windowed.verdict == whole.verdict
    assert _pairs(windowed) == _pairs(whole)


@pytest.mark.parametrize("cand_kw", [{}, {"drift_from": 20}, {"bias": False}], ids=["match", "late_drift", "no_bias"])
@pytest.mark.parametrize("window_from", [0, 10**9], ids=["windowed", "whole"])
def test_rivals_looked_for_only_where_they_matter_pair_as_all_of_them_do(monkeypatch, cand_kw, window_from):
    """The records after a candidate record that could be its stage instead (`_Rivals`) are found only as far as a
    decision needs them; found in full up front (as before), every pair is the same, and the lazy search looks at
    far fewer records."""
    monkeypatch.setattr(AD, "DATAFLOW_WINDOW_FROM", window_from)
    monkeypatch.setattr(AD, "DATAFLOW_WINDOW", 12)
    looked = [0]
    real_more = AD._Rivals._more

    def counted(self):
        looked[0] += 1
        return real_more(self)

    monkeypatch.setattr(AD._Rivals, "_more", counted)
    lazy = _diff(cand_kw, 40)
    lazy_looked, looked[0] = looked[0], 0
    real_init = AD._Rivals.__init__

    def eager(self, *args, **kw):
        real_init(self, *args, **kw)
        if self._scan is not None:
            self.lists()

    monkeypatch.setattr(AD._Rivals, "__init__", eager)
    full = _diff(cand_kw, 40)
    assert _pairs(lazy) == _pairs(full) and lazy.verdict == full.verdict
    assert (lazy.first_divergence.ref_name if lazy.first_divergence else None) == \
           (full.first_divergence.ref_name if full.first_divergence else None)
    assert 3 * lazy_looked <= 2 * looked[0], (lazy_looked, looked[0])


def _cover_walks(monkeypatch, steps):
    """How many covers the dataflow pass derives for a loop of `steps` steps."""
    calls = [0]
    real = AD.cover_of

    def counted(*args, **kw):
        calls[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(AD, "cover_of", counted)
    result = _diff({}, steps)
    monkeypatch.setattr(AD, "cover_of", real)
    assert result.verdict == "match"
    return calls[0]


def test_the_dataflow_pass_works_linearly_in_a_long_loop(monkeypatch):
    monkeypatch.setattr(AD, "DATAFLOW_WINDOW_FROM", 0)
    monkeypatch.setattr(AD, "DATAFLOW_WINDOW", 16)
    short, long = _cover_walks(monkeypatch, 60), _cover_walks(monkeypatch, 240)
    # four times the steps: about four times the work (each pair re-derives the covers in its window);
    # over the whole trace it is about sixteen times (each pair re-derives every later step's)
    assert long < 6 * short, (short, long)


def _lcs_table(a, b):
    """The longest common subsequence from a full table of rest lengths (the definition)."""
    n, m = len(a), len(b)
    rest = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            rest[i][j] = rest[i + 1][j + 1] + 1 if a[i] == b[j] else max(rest[i + 1][j], rest[i][j + 1])
    out, i, j = [], 0, 0
    while i < n and j < m:
        if a[i] == b[j]:
            out.append((i, j))
            i, j = i + 1, j + 1
        elif rest[i + 1][j] >= rest[i][j + 1]:
            i += 1
        else:
            j += 1
    return out


def test_the_bit_row_lcs_is_the_tables():
    rng = random.Random(5)
    for _ in range(400):
        alphabet = [("add", 4), ("mul", 4), ("tanh", 8), ("linear", 8), ("cat", 12)][:rng.randint(1, 5)]
        a = [rng.choice(alphabet) for _ in range(rng.randint(0, 40))]
        b = [rng.choice(alphabet) for _ in range(rng.randint(0, 40))]
        assert A._lcs(a, b) == _lcs_table(a, b), (a, b)
    # past 63 elements a row spans several machine words
    a = [("op", i % 7) for i in range(150)]
    b = [("op", i % 5) for i in range(170)]
    assert A._lcs(a, b) == _lcs_table(a, b)


def test_a_long_loop_through_the_cli_pairs_every_step(tmp_path):
    """Past DATAFLOW_WINDOW_FROM reference records with the defaults: a 600-step loop diffed as a user
    runs it names the step where the candidate starts to drift."""
    ref = tmp_path / "ref.py"
    cand = tmp_path / "cand.py"
    import inspect
    body = "import torch\nimport torch.nn as nn\n\n"
    ref.write_text(body + inspect.getsource(LoopRNN).replace("class LoopRNN", "class Model")
                   + "\n\ndef get_inputs():\n    return [torch.randn(600, 3, 6)]\n\n\ndef get_init_inputs():\n    return []\n")
    cand.write_text(body + inspect.getsource(SplitWeightsRNN).replace("class SplitWeightsRNN", "class ModelNew")
                    .replace("drift_from=None", "drift_from=450") + "\n")
    import json
    import subprocess
    import sys
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "cli.py", "diff", str(ref), str(cand), "--trials", "1", "--no-report",
                           "--no-explain", "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["verdict"] == "diverged"
    assert got["first_divergence"]["ref_name"] == "i2h#451"


def test_the_value_search_takes_its_contenders_among_the_allowed_ones():
    """Only the free reference records the dataflow allows count toward the few compared in full: one allowed
    record behind six closer but disallowed ones is still found (scoring only free records must keep that)."""
    from diffkit.capture import Record

    def rec(i, v):
        return Record(index=i, name=f"r{i}", kind="op", scope="", label=f"r{i}", function="forward", file="", line=0,
                      op="", shape=tuple(v.shape), dtype=torch.float32, device="cpu", value=v)

    torch.manual_seed(0)
    target = torch.randn(64)
    ref = [rec(i, target + 1e-4 * torch.randn(64)) for i in range(A.VALUE_CONTENDERS)]
    ref.append(rec(len(ref), target + 0.05 * torch.randn(64)))
    cand = [rec(0, target.clone())]
    state = A.AlignState.start(ref, cand)
    group = AV._contenders(state, list(range(len(ref))), {})
    best = AV._closest_by_value(state, cand[0], cand[0].value, AL._fingerprint(cand[0], v=cand[0].value), group,
                               allowed=lambda ri: ri == len(ref) - 1)
    assert best is not None and best.ref == len(ref) - 1
    state.add(0, len(ref) - 1, "value", 0.5)  # paired now: no longer a contender
    assert AV._closest_by_value(state, cand[0], cand[0].value, AL._fingerprint(cand[0], v=cand[0].value), group,
                               allowed=lambda ri: ri == len(ref) - 1) is None


def test_values_screened_as_beyond_reach_are_beyond_every_layout():
    """`_beyond` (the value pass's screen of its few closest contenders) says a contender cannot match only where
    `best_layout` in full agrees: same shapes, other shapes holding the values permuted or reordered, zeros,
    NaNs and infinities (never screened), at the edge of the limit."""
    g = torch.Generator().manual_seed(7)
    c = torch.randn(6, 8, generator=g)
    cases = [c + 0.1 * torch.randn(6, 8, generator=g),  # close: kept
             torch.randn(6, 8, generator=g),  # unrelated: beyond
             c.t().contiguous() * 1.05,  # the values transposed: a permutation brings them close
             c.flatten()[torch.randperm(48, generator=g)].reshape(8, 6),  # reordered: no axis permutation, still
             torch.zeros(6, 8),  # a zero reference: never screened
             torch.where(torch.arange(48).reshape(6, 8) == 5, float("nan"), torch.randn(6, 8, generator=g)),
             c * 2.0,  # relative error (to the reference) 0.5: at the limit
             c * 2.1,  # just past it
             None]
    got = AV._beyond(c, cases, A.VALUE_MATCH_REL_ERR)
    for v, beyond in zip(cases, got):
        if v is None:
            assert not beyond
            continue
        err = A.best_layout(c, v).rel_err
        if beyond:
            assert err > A.VALUE_MATCH_REL_ERR, err
    assert got[1] and got[7] and not got[0] and not got[2] and not got[4] and not got[5] and not got[6]
    for _ in range(200):  # random pairs near the limit, same and other shapes
        v = c * (1.6 + 0.8 * torch.rand(1, generator=g)) + 0.2 * torch.randn(6, 8, generator=g)
        if torch.rand(1, generator=g) < 0.5:
            v = v.t().contiguous()
        (beyond,) = AV._beyond(c, [v], A.VALUE_MATCH_REL_ERR)
        assert not beyond or A.best_layout(c, v).rel_err > A.VALUE_MATCH_REL_ERR
