"""Alignment pass by pass (name, outputs, order, value, deferred), and measure's named packing."""
import math

import pytest
import torch
import torch.nn as nn

from diffkit import align as A
from diffkit import measure as M
from diffkit.align import AlignState, Pair, align, pass_deferred, pass_name, pass_order, pass_outputs, pass_value
from diffkit.capture import Record, capture


def _rec(index, name, value, *, scope="", label=None, rebound=False, is_output=False, shape=None):
    label = label if label is not None else name.rsplit(":", 1)[-1].split(".")[-1]
    return Record(index=index, name=name, kind="op", scope=scope, label=label, function="forward", file="", line=0,
                  op="", shape=tuple(value.shape if shape is None else shape), dtype=torch.float32, device="cpu",
                  value=value, is_output=is_output, rebound=rebound)


def _pairs(state):
    return {ci: (p.ref, p.via) for ci, p in state.pairs.items()}


def test_name_pass_pairs_equal_names_and_refuses_different_element_counts():
    torch.manual_seed(0)
    x, y = torch.randn(4, 6), torch.randn(24)
    ref = [_rec(0, "blk.forward:x", x), _rec(1, "blk.forward:y", y)]
    cand = [_rec(0, "blk.forward:y", torch.randn(5)),  # same name, other element count
            _rec(1, "blk.forward:x", x.clone())]
    state = AlignState.start(ref, cand)
    pass_name(state)
    assert _pairs(state) == {1: (0, "name")}
    p = state.pairs[1]
    assert p.confidence == A.NAME_CONFIDENCE and p.transform == () and p.paired_by == "name"
    assert not state.deferred


def test_name_pass_takes_the_layout_closest_in_value_when_only_element_counts_agree():
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    state = AlignState.start([_rec(0, "f:x", x)], [_rec(0, "f:x", x.t().contiguous())])
    pass_name(state)
    # another shape under the same name may be another role: only proposed, for after the dataflow pass
    assert not state.pairs and state.proposed == {0: 0}
    A.pass_proposed(state)  # free still, and the values confirm the permuted layout
    p = state.pairs[0]
    assert p.via == "name" and p.transform[0] in ("permute", "unpermute")
    torch.testing.assert_close(A.to_ref_layout(state.cand[0].value, x.shape, p.transform), x)


def test_rebound_name_whose_values_disagree_is_deferred_and_value_pass_finds_the_right_partner():
    # `h = f(h)` twice in the reference; the candidate's only `h` holds the second binding's tensor
    torch.manual_seed(0)
    h1, h2 = torch.randn(8, 4), torch.randn(8, 4)
    ref = [_rec(0, "f:h", h1, rebound=True), _rec(1, "f:h#2", h2, rebound=True)]
    cand = [_rec(0, "f:h", h2.clone(), rebound=True)]
    state = AlignState.start(ref, cand)
    pass_name(state)
    assert not state.pairs
    assert state.deferred[0].ref == 0 and state.deferred[0].via == "name"
    assert state.deferred[0].rel_err > A.NAME_MATCH_REL_ERR
    pass_value(state)
    assert _pairs(state) == {0: (1, "value")}
    pass_deferred(state)  # the candidate is paired now: the deferred name pair does not stand
    assert _pairs(state) == {0: (1, "value")}
    al = align(ref, cand)
    assert [(p.ref, p.cand, p.via) for p in al.pairs] == [(1, 0, "value")] and al.ref_unmatched == [0]


def test_rebound_name_confirmed_by_value_pairs_by_name_with_lower_confidence():
    torch.manual_seed(0)
    h = torch.randn(8, 4)
    state = AlignState.start([_rec(0, "f:h", h, rebound=True)], [_rec(0, "f:h", h + 1e-3, rebound=True)])
    pass_name(state)
    p = state.pairs[0]
    assert p.via == "name" and p.confidence == A.REBOUND_NAME_CONFIDENCE < A.NAME_CONFIDENCE


def test_deferred_name_pair_stands_when_no_value_partner_is_found():
    torch.manual_seed(0)
    ref = [_rec(0, "f:h", torch.randn(8, 4), rebound=True)]
    cand = [_rec(0, "f:h", torch.randn(8, 4), rebound=True)]  # unrelated values: a real bug, same place
    al = align(ref, cand)
    assert [(p.ref, p.cand, p.via, p.confidence) for p in al.pairs] == [(0, 0, "name", A.DEFERRED_CONFIDENCE)]


def test_order_pass_pairs_within_a_scope_by_label_and_element_count_lcs():
    torch.manual_seed(0)
    v = {n: torch.randn(n) for n in (8, 4)}
    ref = [_rec(0, "blk.forward:a", v[8], scope="blk"), _rec(1, "blk.forward:b", v[8], scope="blk"),
           _rec(2, "blk.forward:c", v[4], scope="blk"), _rec(3, "other.forward:x", v[8], scope="other")]
    # the candidate renamed its function: no name agrees, labels and element counts line up
    cand = [_rec(0, "blk.fused:a", v[8], scope="blk"), _rec(1, "blk.fused:z", v[8], scope="blk"),
            _rec(2, "blk.fused:c", v[4], scope="blk"), _rec(3, "blk.fused:x", v[8], scope="blk"),
            _rec(4, "blk.fused:c", v[8], scope="blk")]  # label c, but not c's element count
    state = AlignState.start(ref, cand)
    pass_name(state)
    assert not state.pairs
    pass_order(state)
    assert _pairs(state) == {0: (0, "order"), 2: (2, "order")}  # `x` is in another scope on the reference side
    assert all(p.confidence == A.ORDER_CONFIDENCE for p in state.pairs.values())


def test_value_pass_pairs_a_renamed_fused_output_in_a_permuted_layout_and_records_the_transform():
    torch.manual_seed(0)
    pair_bias = torch.randn(2, 7, 7, 3)  # (B, N, N, H); the kernel writes (B, H, N, N)
    ref = [_rec(0, "f:other", torch.randn(2, 7, 7, 3)), _rec(1, "f:pair", pair_bias)]
    cand = [_rec(0, "f:fused_out", pair_bias.permute(0, 3, 1, 2).contiguous())]
    state = AlignState.start(ref, cand)
    pass_name(state)
    pass_order(state)
    assert not state.pairs
    pass_value(state)
    p = state.pairs[0]
    assert (p.ref, p.via) == (1, "value") and p.transform[0] in ("permute", "unpermute")
    assert p.describe_transform().startswith(("permute", "reshape+permute"))
    torch.testing.assert_close(A.to_ref_layout(cand[0].value, pair_bias.shape, p.transform), pair_bias)
    assert p.confidence == A.VALUE_CONFIDENCE_BEST  # identical values
    # a value partner that is only close (a missing bias, say) is paired with less confidence
    state = AlignState.start(ref, [_rec(0, "f:fused_out", pair_bias + 0.2)])
    pass_value(state)
    assert state.pairs[0].ref == 1 and A.VALUE_CONFIDENCE_WORST <= state.pairs[0].confidence < A.VALUE_CONFIDENCE_BEST


def test_value_pass_is_skipped_without_value_match():
    x = torch.randn(6)
    state = AlignState.start([_rec(0, "f:a", x)], [_rec(0, "f:b", x.clone())], value_match=False)
    pass_value(state)
    assert not state.pairs


def test_outputs_always_pair_and_a_shape_mismatch_is_recorded_as_the_transform():
    ref = [_rec(0, "f:h", torch.randn(3)), _rec(1, "output", torch.randn(2, 3), is_output=True)]
    cand = [_rec(0, "f:h", torch.randn(3)), _rec(1, "result", torch.randn(5), is_output=True)]
    state = AlignState.start(ref, cand)
    pass_outputs(state)
    p = state.pairs[1]
    assert (p.ref, p.via, p.transform, p.confidence) == (1, "name", A.SHAPE_MISMATCH, A.OUTPUT_CONFIDENCE)
    cand[1] = _rec(1, "result", ref[1].value.reshape(6), is_output=True)
    state = AlignState.start(ref, cand)
    pass_outputs(state)
    assert state.pairs[1].transform == ("reshape",)


def test_fixed_pairs_stand_and_later_passes_leave_them_alone():
    x = torch.randn(4)
    ref = [_rec(0, "f:a", x), _rec(1, "f:b", x)]
    cand = [_rec(0, "f:b", x.clone())]
    al = align(ref, cand, fixed={0: (0, ())})
    assert [(p.ref, p.cand, p.via, p.confidence) for p in al.pairs] == [(0, 0, "name", A.NAME_CONFIDENCE)]
    assert al.ref_unmatched == [1]


def test_a_pass_inserted_into_passes_runs_in_its_place():
    # the contract a new pass (dataflow, between outputs and order) relies on
    x, y = torch.randn(4), torch.randn(4)
    ref = [_rec(0, "f:a", x), _rec(1, "f:b", y)]
    cand = [_rec(0, "g:p", y.clone()), _rec(1, "g:q", x.clone())]
    seen = []

    def pass_first_to_last(state):
        seen.append(dict(state.pairs))
        state.add(0, 0, "dataflow", 0.8)  # deliberately "wrong": later passes must not undo it

    passes = list(A.PASSES)
    assert passes == [pass_name, pass_outputs, A.pass_dataflow, A.pass_proposed, pass_order, pass_value,
                      A.pass_read_inputs, A.pass_reader_layout, pass_deferred, A.pass_consistency]
    passes.insert(passes.index(pass_order), pass_first_to_last)
    al = align(ref, cand, passes=passes)
    assert seen == [{}]
    # the value pass is one-to-one: `x`'s reference record is taken, so the candidate's `x` stays unpaired
    assert [(p.ref, p.cand, p.via) for p in al.pairs] == [(0, 0, "dataflow")] and al.cand_unmatched == [1]
    with pytest.raises(ValueError):
        Pair(ref=0, cand=0, via="name", confidence=0.0)


def test_every_pair_of_a_captured_model_records_its_pass_and_a_confidence():
    class Ref(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 6)

        def forward(self, x):
            h = self.proj(x)
            h = torch.relu(h)
            pair = h * 3
            return pair.sum(-1)

    class Cand(Ref):
        def forward(self, x):
            h = torch.relu(self.proj(x))
            fused_out = (h * 3).t().contiguous()
            return fused_out.sum(0)

    torch.manual_seed(0)
    x = torch.randn(5, 6)
    ref_m, cand_m = Ref(), Cand()
    cand_m.load_state_dict(ref_m.state_dict())
    with torch.no_grad():
        with capture(ref_m, inputs=(x,)) as rt:
            ref_m(x)
        with capture(cand_m, inputs=(x,)) as ct:
            cand_m(x)
    al = align(rt.records, ct.records)
    assert al.pairs and all(p.via in ("name", "dataflow", "order", "value") and 0 < p.confidence <= 1
                            for p in al.pairs)
    by_label = {ct.records[p.cand].label: p for p in al.pairs}
    # `h` names the projection and the ReLU in the reference: the candidate's `h` (the ReLU) pairs by
    # dataflow with the ReLU, not by name with the projection
    assert rt.records[by_label["h"].ref].op.endswith("relu") and by_label["h"].via == "dataflow"
    # `pair` is computed by the candidate's `h * 3`; its transposed copy `fused_out` only re-lays it out
    assert rt.records[by_label["h * 3"].ref].label == "pair" and by_label["h * 3"].via == "dataflow"
    assert "fused_out" not in by_label
    assert any(ct.records[p.cand].is_output and rt.records[p.ref].is_output for p in al.pairs)


# -- measure: every slot of the packed metrics lands in its Stats field


def _brute_force(r, c, atol, rtol):
    """Stats computed element by element in float64, independently of measure's vectors."""
    rv = [float(v) for v in r.reshape(-1).to(torch.float64)]
    cv = [float(v) for v in c.reshape(-1).to(torch.float64)]
    fin = math.isfinite
    diff, excess, rel, bad, disagree = [], [], [], 0, []
    for i, (a, b) in enumerate(zip(rv, cv)):
        if fin(a) and fin(b):
            d = abs(b - a)
            bad += d > atol + rtol * abs(a)
        else:
            d = 0.0
            agree = (math.isnan(a) and math.isnan(b)) or (math.isinf(a) and a == b)
            if not agree:
                bad += 1
                disagree.append(i)
        diff.append(d)
        excess.append(d - (atol + rtol * abs(a)) if fin(a) else -math.inf)
        rel.append(d / abs(a) if fin(a) and fin(b) and a != 0 else 0.0)
    fr = [a if fin(a) else 0.0 for a in rv]
    fc = [b if fin(b) else 0.0 for b in cv]
    nr, nc = math.sqrt(sum(a * a for a in fr)), math.sqrt(sum(b * b for b in fc))
    worst = disagree[0] if disagree else max(range(len(rv)), key=lambda i: (excess[i] if bad else diff[i], -i))
    return dict(numel=len(rv), max_abs=max(diff), mean_abs=sum(diff) / len(rv), max_rel=max(rel), mismatches=bad,
                cosine=sum(a * b for a, b in zip(fr, fc)) / (nr * nc),
                ref_nan=sum(map(math.isnan, rv)), ref_inf=sum(map(math.isinf, rv)),
                cand_nan=sum(map(math.isnan, cv)), cand_inf=sum(map(math.isinf, cv)),
                worst=worst, rel_l2=math.sqrt(sum(d * d for d in diff)) / nr)


def _special_pair(shared_specials: bool, shared_nan: bool = False, within_tolerance: bool = False):
    torch.manual_seed(0)
    r = torch.randn(3, 7)
    c = r + 1e-6 * torch.randn(3, 7)
    c[2, 0] += 5e-5  # the largest error, within tolerance
    if not within_tolerance:
        c[1, 4] += 0.5  # out of tolerance
        c[2, 0] += 1e-3  # out of tolerance, by less
    r[0, 2] = c[0, 2] = float("inf")  # the same infinity: agreement
    if shared_nan:
        r[2, 5] = c[2, 5] = float("nan")  # NaN on both sides: a mismatch (equal_nan=False)
    elif shared_specials:
        r[2, 5] = c[2, 5] = -float("inf")
    else:
        r[2, 5] = float("nan")  # a NaN only the reference has
        c[1, 1] = float("nan")  # a NaN the reference lacks: the worst element, whatever else
        c[2, 6] = -float("inf")
    return r, c


@pytest.mark.parametrize("path", ["exact", "host"])
@pytest.mark.parametrize("shared_specials,within", [(False, False), (True, False), (True, True)],
                         ids=["specials-disagree", "specials-shared", "all-within-tolerance"])
def test_measure_named_packing_round_trips_against_a_float64_brute_force(monkeypatch, shared_specials, within, path):
    """Both CPU paths against a pure-Python float64 count: the exact float64 reductions (to 1e-12) and
    the host fast path in float32 (to float32 rounding), with several chunks so the combining step
    reads every slot; counts and the worst element must be exactly the same."""
    monkeypatch.setattr(M, "CHUNK", 5)
    monkeypatch.setattr(M, "CHUNK_HOST", 4)  # chunks with and without NaN/Inf side by side
    if path == "exact":
        monkeypatch.setattr(M, "_measure_host", lambda r, c, atol, rtol, shape: M.PendingStats(
            M._packed_exact(r.reshape(-1), c.reshape(-1), atol, rtol), shape, atol, rtol))  # (given unflattened)
    r, c = _special_pair(shared_specials, within_tolerance=within)
    atol = rtol = 1e-4
    pending = M.measure_async(r, c, atol, rtol)
    st = pending.result()
    want = _brute_force(r, c, atol, rtol)
    assert st.numel == want["numel"] and st.mismatches == want["mismatches"]
    assert (st.ref_nan, st.ref_inf, st.cand_nan, st.cand_inf) == (want["ref_nan"], want["ref_inf"], want["cand_nan"],
                                                                  want["cand_inf"])
    close = 1e-12 if path == "exact" else 1e-5
    for f in ("max_abs", "mean_abs", "max_rel", "cosine"):
        assert getattr(st, f) == pytest.approx(want[f], rel=close), f
    assert pending.rel_l2 == pytest.approx(want["rel_l2"], rel=close if path == "exact" else 1e-3)
    worst = want["worst"]
    assert st.worst.index == (worst // 7, worst % 7)
    assert st.worst.ref == float(r.reshape(-1)[worst]) or math.isnan(st.worst.ref)
    cw = float(c.reshape(-1)[worst])
    assert st.worst.cand == cw or (math.isnan(cw) and math.isnan(st.worst.cand))
    if within:  # nothing out of tolerance: the worst element is the largest error
        assert st.worst.index == (2, 0) and st.ok
    elif shared_specials:  # the element furthest out of tolerance
        assert st.worst.index == (1, 4) and st.worst.abs_err == pytest.approx(abs(cw - st.worst.ref))
    else:  # the first NaN/Inf the reference does not share, whatever else
        assert st.worst.index == (1, 1) and st.worst.abs_err == math.inf
    assert (st.atol, st.rtol) == (atol, rtol) and st.ok == within
    assert repr(M.measure(r, c, atol, rtol)) == repr(st)  # repr: NaN == NaN


def test_measure_a_nan_both_sides_share_is_a_mismatch_and_the_worst():
    r, c = _special_pair(True, shared_nan=True)
    s = M.measure(r, c, 1e-4, 1e-4)
    assert s.worst.index == (2, 5) and s.mismatches == 3  # the shared NaN plus two out of tolerance
    assert not torch.allclose(c, r, atol=1e-4, rtol=1e-4, equal_nan=False)


def test_relative_error_of_complex_values_including_empty_ones():
    """The float64 fallback of the layout check keeps complex values complex (an empty pair, whose
    float32 norms are zero, takes it)."""
    from diffkit.align_layout import _rel_err

    empty = torch.zeros(0, dtype=torch.complex64)
    assert _rel_err(empty, empty) == 0.0
    r, c = torch.tensor([1 + 2j, 3 - 1j]), torch.tensor([1 + 1j, 3 - 1j])
    assert _rel_err(c, r) == pytest.approx(float((c - r).abs().norm() / r.abs().norm()))


# --- a recurrent module against a hand-written loop: the module makes its final states side by side, the
# loop makes the last hidden state from the last cell state; what the output layer reads pairs with what
# the output layer reads, and no gate of an early step stands in for a final state
class _LSTMRef(nn.Module):
    def __init__(self, i=12, h=20):
        super().__init__()
        self.lstm = nn.LSTM(i, h, batch_first=True)
        self.head = nn.Linear(h, 5)

    def forward(self, x):
        seq, _ = self.lstm(x)
        return self.head(seq[:, -1, :])


class _LSTMChunked(_LSTMRef):  # gates by chunk, the input projection for every step at once
    def __init__(self, i=12, h=20, last_step_bug=False):
        super().__init__(i, h)
        self.bug = last_step_bug

    def forward(self, x):
        m = self.lstm
        proj = torch.einsum("btk,gk->btg", x, m.weight_ih_l0) + (m.bias_ih_l0 + m.bias_hh_l0)
        h = x.new_zeros(x.shape[0], m.hidden_size)
        c = torch.zeros_like(h)
        steps = x.shape[1]
        for t in range(steps):
            i_, f_, g_, o_ = (proj[:, t] + h @ m.weight_hh_l0.t()).chunk(4, dim=1)
            c = torch.sigmoid(f_) * c + torch.sigmoid(i_) * torch.tanh(g_)
            h = torch.sigmoid(o_) * torch.tanh(c * 1.01 if self.bug and t == steps - 1 else c)  # LAST-STEP
        return self.head(h)


def _cell(x_t, h, c, w_ih, w_hh, b):  # a helper per step, gates sliced out of the weights by rows
    n = h.shape[1]
    pre = [torch.addmm(b[k * n:(k + 1) * n], x_t, w_ih[k * n:(k + 1) * n].t()) + h @ w_hh[k * n:(k + 1) * n].t()
           for k in range(4)]
    c_new = pre[1].sigmoid() * c + pre[0].sigmoid() * pre[2].tanh()
    return pre[3].sigmoid() * c_new.tanh(), c_new


class _LSTMSliced(_LSTMRef):
    def forward(self, x):
        m = self.lstm
        b = m.bias_ih_l0 + m.bias_hh_l0
        state = (x.new_zeros(x.shape[0], m.hidden_size),) * 2
        outs = []
        for t in range(x.shape[1]):
            state = _cell(x[:, t], *state, m.weight_ih_l0, m.weight_hh_l0, b)
            outs.append(state[0])
        return self.head(torch.stack(outs, dim=1)[:, -1])


@pytest.mark.parametrize("cls,kw", [(_LSTMChunked, {}), (_LSTMSliced, {})])
def test_a_hand_written_lstm_loop_matches_the_module(cls, kw):
    import diffkit

    torch.manual_seed(0)
    ref = _LSTMRef()
    cand = cls(**kw)
    cand.load_state_dict(ref.state_dict())
    r = diffkit.compare(ref, cand, [torch.randn(3, 9, 12)])
    assert r.verdict == "match" and r.first_divergence is None, r.summary_line()


def test_a_bug_in_the_last_step_of_a_hand_written_lstm_is_found_in_that_step():
    import inspect

    import diffkit

    torch.manual_seed(0)
    ref = _LSTMRef()
    cand = _LSTMChunked(last_step_bug=True)
    cand.load_state_dict(ref.state_dict())
    r = diffkit.compare(ref, cand, [torch.randn(3, 9, 12)])
    fd = r.first_divergence
    lines, first = inspect.getsourcelines(_LSTMChunked.forward)
    bug_line = first + next(i for i, text in enumerate(lines) if "LAST-STEP" in text)
    assert r.verdict == "diverged" and fd is not None
    # the stage that goes wrong is the step's hidden state (not a gate of the first step paired by position)
    assert fd.cand.line == bug_line, (fd.ref_name, fd.cand_name, fd.cand.line)
    assert fd.stats.cosine > 0.99, "paired with a tensor of another role"


def test_a_step_the_reference_takes_too_is_not_swallowed_as_the_end_of_the_one_before():
    # the candidate reuses statistics cached on an earlier call (tensors from outside this forward): its
    # `x - m` is the reference's `x - mean`, and its `/ s` the reference's own division, not the end of it
    import diffkit

    class Standardise(nn.Module):
        def forward(self, x):
            centred = x - x.mean(0, keepdim=True)
            return torch.tanh(centred / (x.std(0, keepdim=True) + 1e-3))

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.memo = None

        def forward(self, x):
            if self.memo is None:
                self.memo = (x.mean(0, keepdim=True), x.std(0, keepdim=True) + 1e-3)
            mu, sd = self.memo
            return torch.tanh(torch.div(x - mu, sd))

    cand = Cached()
    cand(torch.randn(20, 6) * 3 + 2)  # an earlier call fills the cache
    r = diffkit.compare(Standardise(), cand, [torch.randn(20, 6)])
    fd = r.first_divergence
    assert r.verdict == "diverged" and fd.cand_name.endswith("x - mu"), (fd.ref_name, fd.cand_name)
    assert fd.ref_name.endswith("centred") or "mean" in fd.ref_name, fd.ref_name
