"""The fast metric paths (CPU host path; the Triton kernel on CUDA) give the exact path's answer."""
import itertools
import math
import os

import pytest
import torch

from diffkit import host_kernel
from diffkit import measure as M


@pytest.fixture(params=["native", "torch"])
def host_engine(request, monkeypatch):
    """Each CPU host-path test twice: through the native one-pass kernel, and through the torch passes."""
    if request.param == "native":
        if not host_kernel.available():
            pytest.skip(f"no native kernel here: {host_kernel.why()}")
    else:
        monkeypatch.setattr(M, "_native", lambda r, c: False)
    return request.param


def _exact(r, c, atol, rtol):
    shape = tuple(r.shape)
    pending = M.PendingStats(M._packed_exact(r.reshape(-1), c.reshape(-1), atol, rtol), shape, atol, rtol)
    return pending.result(), pending


def _assert_agrees_with_exact(r, c, atol, rtol):
    """The fast path's Stats equal the exact float64 path's: counts exactly (the rule runs in the
    tensors' own precision, as torch.allclose's does), values to float32 rounding, the same worst element."""
    got = M.measure_async(r, c, atol, rtol)
    st = got.result()
    want, wp = _exact(r, c, atol, rtol)
    assert (st.ref_nan, st.ref_inf, st.cand_nan, st.cand_inf) == (want.ref_nan, want.ref_inf, want.cand_nan,
                                                                  want.cand_inf)
    assert abs(st.mismatches - want.mismatches) <= max(1, want.mismatches // 1000)
    for f in ("max_abs", "mean_abs", "max_rel", "cosine"):
        assert getattr(st, f) == pytest.approx(getattr(want, f), rel=1e-5, abs=1e-12), f
    assert got.rel_l2 == pytest.approx(wp.rel_l2, rel=1e-4, abs=1e-12)
    assert st.worst.index == want.worst.index
    return st


def _pair(kind: str, n: int, dtype: torch.dtype, cand_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n, generator=g, dtype=torch.float64) * 3
    c = r + 1e-5 * torch.randn(n, generator=g, dtype=torch.float64)
    if kind in ("bad", "specials"):
        idx = torch.randint(0, n, (max(1, n // 50),), generator=g)
        c[idx] += torch.randn(idx.numel(), generator=g, dtype=torch.float64)
    if kind == "zeros":
        r[: n // 3] = 0.0
        c[: n // 5] = 0.0
    if kind == "specials":
        r[n // 2] = c[n // 2] = math.inf
        c[n // 3] = math.nan
        r[n - 1] = -math.inf
    if kind == "range" and torch.finfo(dtype).max > 1e30 and torch.finfo(cand_dtype).max > 1e30:
        # magnitudes whose squares leave float32's range: huge in the first half, tiny in the second
        r[: n // 2] *= 1e25
        c[: n // 2] *= 1e25
        r[n // 2:] *= 1e-25
        c[n // 2:] *= 1e-25
    if kind == "subnormal":
        # references below the normal range among normal ones, the candidate off by 1e-3 there: relative errors of
        # up to ~1e36, which a division that flushes such divisors to zero would make infinite
        tiny = min(torch.finfo(dtype).tiny, torch.finfo(cand_dtype).tiny) / 8
        r[::7] = tiny * (1 + torch.arange(0, n, 7, dtype=torch.float64) % 3)
        c[::7] = r[::7] + 1e-3
    return r.to(dtype), c.to(cand_dtype)


@pytest.mark.parametrize("kind", ["close", "bad", "zeros", "specials", "range"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                    (torch.bfloat16, torch.float32), (torch.float64, torch.float32)],
                         ids=["f32", "f16", "bf16-f32", "f64-f32"])
@pytest.mark.parametrize("n", [1, 37, 5000])
def test_host_path_agrees_with_the_exact_path(monkeypatch, kind, dtypes, n, host_engine):
    monkeypatch.setattr(M, "CHUNK_HOST", 512)  # several chunks at n=5000, and a short last one
    monkeypatch.setattr(M, "NATIVE_SPAN", 700)  # native: spans of a full block and a tail each
    r, c = _pair(kind, n, *dtypes, seed=n)
    atol, rtol = 1e-4, 1e-3
    st = _assert_agrees_with_exact(r, c, atol, rtol)
    assert st.ok == _exact(r, c, atol, rtol)[0].ok


def test_host_path_reads_every_element_once_per_pass_in_cache_sized_chunks(host_engine):
    """A tensor far larger than a chunk: the largest error sits in the last chunk and is found."""
    r = torch.zeros(3 * M.CHUNK_HOST + 5)
    c = r.clone()
    c[-2] = 0.25
    st = M.measure(r, c, 1e-4, 1e-4)
    assert st.max_abs == 0.25 and st.mismatches == 1 and st.worst.index == (r.numel() - 2,)


@pytest.mark.parametrize("kind", ["close", "bad", "specials"])
@pytest.mark.parametrize("layout", ["permuted", "one_side_transposed", "offset_view"])
def test_host_path_reads_a_permuted_layout_in_logical_order(monkeypatch, kind, layout, host_engine):
    """Records kept as permute/transpose views are read a group at a time in row-major order (no
    flattened copy): the same Stats as their contiguous copies give, worst element included, with
    chunk and group boundaries falling inside rows of every dimension."""
    monkeypatch.setattr(M, "CHUNK_HOST", 7)
    monkeypatch.setattr(M, "GROUP_ROWS", 3)
    monkeypatch.setattr(M, "NATIVE_SPAN", 100)  # native: spans and gathered pieces end inside rows too
    monkeypatch.setattr(M, "GATHER", 7)
    shape = (5, 3, 4, 6)
    r, c = _pair(kind, math.prod(shape), torch.float32, torch.float32, seed=len(layout))
    r, c = r.view(6, 4, 5, 3).permute(2, 3, 1, 0), c.view(6, 4, 5, 3).permute(2, 3, 1, 0)
    if layout == "one_side_transposed":
        c = c.contiguous()
    elif layout == "offset_view":
        r, c = r[1:, :, 1:], c[1:, :, 1:]
    assert not r.is_contiguous()
    got = M.measure_many([(r, c, 1e-4, 1e-3)])[0].result()
    want = M.measure(r.contiguous(), c.contiguous(), 1e-4, 1e-3)
    for f in ("numel", "max_abs", "max_rel", "mismatches", "ref_nan", "ref_inf", "cand_nan", "cand_inf"):
        assert getattr(got, f) == getattr(want, f), f
    for f in ("mean_abs", "cosine"):  # sums: added in another grouping when gathered (native)
        assert getattr(got, f) == pytest.approx(getattr(want, f), rel=1e-12), f
    assert got.worst.index == want.worst.index and got.worst.abs_err == want.worst.abs_err
    _assert_agrees_with_exact(r, c, 1e-4, 1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["close", "bad", "zeros", "specials", "range", "subnormal"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                    (torch.bfloat16, torch.float32)], ids=["f32", "f16", "bf16-f32"])
@pytest.mark.parametrize("n", [1, 37, 100_003])
def test_triton_kernel_agrees_with_the_exact_path(kind, dtypes, n):
    from diffkit import metrics_kernel

    if not metrics_kernel.available():
        pytest.skip("no Triton")
    r, c = _pair(kind, n, *dtypes, seed=n)
    r, c = r.cuda(), c.cuda()
    atol, rtol = 1e-4, 1e-3
    _assert_agrees_with_exact(r, c, atol, rtol)


@pytest.mark.cuda
def test_triton_batch_measures_many_small_pairs_in_one_launch():
    from diffkit import metrics_kernel

    if not metrics_kernel.available():
        pytest.skip("no Triton")
    pairs = []
    for i in range(50):
        r, c = _pair("bad" if i % 3 == 0 else "close", 10 + 37 * i, torch.float32, torch.float32, seed=i)
        pairs.append((r.cuda(), c.cuda()))
    batch = M.measure_many([(r, c, 1e-4, 1e-3) for r, c in pairs])
    for (r, c), got in zip(pairs, batch):
        want, _ = _exact(r, c, 1e-4, 1e-3)
        st = got.result()
        assert st.mismatches == want.mismatches and st.worst.index == want.worst.index
        assert st.max_abs == pytest.approx(want.max_abs, rel=1e-6)


@pytest.mark.cuda
def test_marked_tiles_anywhere_in_a_long_pair_are_measured_again(monkeypatch):
    """Tiles the finite-first pass marked are measured again (the REDO launch) and `combine` folds a pair's tiles
    COMBINE_ROWS at a time: NaN and infinities in a pair of more tiles than that, in its first window and past it
    (its last element too), in a contiguous pair launched on its own, in one read through the table and in one read
    as rows of lanes, give the exact answer."""
    from diffkit import metrics_kernel as K

    if not K.available():
        pytest.skip("no Triton")
    T = K.TILE
    n = (K.COMBINE_ROWS + 12) * T + 123
    g = torch.Generator().manual_seed(5)
    r = torch.randn(n, generator=g)
    c = r + 1e-5 * torch.randn(n, generator=g)
    for at in (17, 3 * T + 5, (K.COMBINE_ROWS + 3) * T + 7, n - 1):
        c[at] = math.nan
    r[(K.COMBINE_ROWS + 9) * T] = c[(K.COMBINE_ROWS + 9) * T] = math.inf  # (agree)
    r[2 * T + 9] = -math.inf  # (the candidate finite there: disagree)
    wide = torch.randn(n // 32 - 1, 64, generator=g)  # (fewer elements than n: read through the table in both)
    wide_c = wide + 1e-5 * torch.randn(wide.shape, generator=g)
    wide_c[5, 3] = wide_c[-1, 31] = math.nan
    wide_c[(K.COMBINE_ROWS + 5) * T // 32, 0] = math.inf
    rows = (wide.cuda()[:, 16:48], wide_c.cuda()[:, 16:48])  # (rows of 32: read as rows of lanes)
    assert K.layout(*rows)[0] == K.READ_ROWS
    for direct_min in (K.DIRECT_MIN, n):  # through the table; the contiguous pair on its own
        monkeypatch.setattr(K, "DIRECT_MIN", direct_min)
        pairs = [(r.cuda(), c.cuda()), rows]
        got = M.measure_many([(a, b, 1e-4, 1e-3) for a, b in pairs])
        for k, ((a, b), pending) in enumerate(zip(pairs, got)):
            have = pending.result()
            want, _ = _exact(a, b, 1e-4, 1e-3)
            assert (have.ref_nan, have.ref_inf, have.cand_nan, have.cand_inf) == \
                (want.ref_nan, want.ref_inf, want.cand_nan, want.cand_inf), (direct_min, k)
            assert have.mismatches == want.mismatches and have.worst.index == want.worst.index, (direct_min, k)
            assert have.max_abs == pytest.approx(want.max_abs, rel=1e-6), (direct_min, k)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_batches_whose_every_tile_is_marked_agree_with_the_exact_path(dtype, monkeypatch):
    """The compiled kernels at their shipped tile sizes on batches where the finite-first pass marks every tile (a
    candidate full of NaN, all infinite, +Inf against -Inf): contiguous pairs of many tiles through the table and
    launched on their own, transposed, row-read and permuted ones, and NaN in the strided pairs only."""
    from diffkit import metrics_kernel as K

    if not K.available():
        pytest.skip("no Triton")
    T = K.TILE
    monkeypatch.setattr(K, "DIRECT_MIN", 6 * T)  # the largest pairs launched on their own
    sizes = (1, 37, 2 * T + 5, 7 * T + 3, 9 * T)
    for name, batch in _special_batches(dtype, sizes, scale=T // 64, device="cuda").items():
        _agree_with_exact(batch, K.packed_batch(batch, 1e-4, 1e-3), 1e-4, 1e-3, name, nan_ok=True)


@pytest.mark.cuda
def test_float32_batches_of_any_size_launch_the_programs_the_first_one_compiled():
    """After a first batch of float32 pairs, batches of one, two, three and five pairs compile no program more (an
    odd number of pairs used to leave the address table's parts at 8-byte offsets: another program for Triton,
    compiled in the middle of a diff), and each pair gets its own answer."""
    from diffkit import metrics_kernel

    if not metrics_kernel.available():
        pytest.skip("no Triton")
    partials, combine = metrics_kernel._kernels()
    if not hasattr(partials, "device_caches"):
        pytest.skip("this Triton keeps its compiled programs elsewhere")

    def programs() -> int:
        return sum(len(cache[0]) for fn in (partials, combine) for cache in fn.device_caches.values())

    def measured(count: int, seed: int) -> None:
        pairs = [tuple(t.cuda() for t in _pair("bad", 50 + 17 * i, torch.float32, torch.float32, seed=seed + i))
                 for i in range(count)]
        for (r, c), got in zip(pairs, M.measure_many([(r, c, 1e-4, 1e-3) for r, c in pairs])):
            want, _ = _exact(r, c, 1e-4, 1e-3)
            assert got.result().mismatches == want.mismatches and got.result().worst.index == want.worst.index

    measured(4, 0)
    first = programs()
    assert first >= 2  # the table's pass, the pass over marked tiles, the combining pass
    for count in (1, 2, 3, 5):
        measured(count, 10 * count)
        assert programs() == first, count


@pytest.mark.cuda
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float16, torch.float32)],
                         ids=["f32", "f16-f32"])
def test_pairs_read_where_they_lie_agree_with_the_exact_path(dtypes):
    """Non-contiguous pairs (transposed, sliced with gaps, permuted on one side, expanded, too many dims) measured in
    one batch with contiguous ones, by the compiled kernels at their shipped tile sizes: small pairs, and large ones
    whose tiles span many blocks (a slice of a fused q/k/v projection, a transposed activation), with the contiguous
    copies they no longer need left unmade."""
    from diffkit import metrics_kernel

    if not metrics_kernel.available():
        pytest.skip("no Triton")
    g = torch.Generator().manual_seed(3)
    # a fused q/k/v projection's output (batch 2, 1000 positions, 8 heads of 64) laid out per head: [3, 2, 8, 1000, 64]
    proj = torch.randn(2, 1000, 3, 8, 64, generator=g, dtype=torch.float64)
    noisy = proj + 1e-3 * torch.randn(proj.shape, generator=g, dtype=torch.float64)
    qkv, nqkv = (t.to(d).cuda().permute(2, 0, 3, 1, 4) for t, d in ((proj, dtypes[0]), (noisy, dtypes[1])))
    big = [(qkv, nqkv),  # five dims that do not merge
           (qkv[1], nqkv[1]),  # q: 2 x 8 x 1000 x 64, with gaps
           (qkv[2].transpose(1, 2), nqkv[2].transpose(1, 2).contiguous())]  # one side transposed back
    assert not any(r.is_contiguous() for r, _ in big)
    pairs = _strided_pairs(*dtypes, device="cuda") + big
    pairs.append(tuple(t.cuda() for t in _pair("bad", 5000, *dtypes, seed=1)))  # a contiguous pair in the batch
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = M.measure_many([(r, c, 1e-4, 1e-3) for r, c in pairs])
    results = [pending.result() for pending in got]
    # the one pair with too many dims to merge is copied (a few hundred bytes); the large ones are not
    smallest = min(r.numel() * r.element_size() for r, _ in big)
    assert torch.cuda.max_memory_allocated() - before < smallest // 4
    for k, ((r, c), pending, have) in enumerate(zip(pairs, got, results)):
        want, wp = _exact(r, c, 1e-4, 1e-3)
        assert (have.ref_nan, have.ref_inf, have.cand_nan, have.cand_inf) == \
            (want.ref_nan, want.ref_inf, want.cand_nan, want.cand_inf), k
        # (the rule runs in float32, the exact path in float64: an element on the boundary may count apart)
        assert abs(have.mismatches - want.mismatches) <= max(1, want.mismatches // 1000), k
        assert have.worst.index == want.worst.index, k
        assert str((have.worst.ref, have.worst.cand)) == str((want.worst.ref, want.worst.cand)), k
        for f in ("max_abs", "mean_abs", "max_rel", "cosine"):
            assert getattr(have, f) == pytest.approx(getattr(want, f), rel=1e-5, abs=1e-12), (k, f)
        assert pending.rel_l2 == pytest.approx(wp.rel_l2, rel=1e-4, abs=1e-12), k


def test_host_path_outside_float32_squares_range_matches_the_exact_path(host_engine):
    """Squares that overflow (or underflow) float32 send that chunk down the exact float64 path."""
    for r, c in ((torch.tensor([1.0, 2.0]), torch.tensor([-1e25, 2.0])),
                 (torch.tensor([3e19, 1e19]), torch.tensor([3e19 + 1e18, 1e19])),
                 (torch.tensor([1e-23, 2e-23]), torch.tensor([3e-23, 2e-23]))):
        st = _assert_agrees_with_exact(r, c, 1e-4, 1e-4)
        assert math.isfinite(st.cosine)


def test_native_kernel_is_built_where_a_c_compiler_is():
    """With a C compiler on PATH the one-pass CPU kernel must build and load (else every CPU diff would
    silently take the slower torch passes)."""
    import shutil

    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler here")
    assert host_kernel.available(), host_kernel.why()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_native_kernel_keeps_the_first_of_equal_maxima_across_spans_and_blocks(monkeypatch, dtype):
    """Equal largest errors in several blocks and spans: the worst element is the first (as argmax).
    (float32 pairs: blocks in float32 lanes, a block searched again only when its maximum is new.)"""
    if not host_kernel.available():
        pytest.skip(f"no native kernel here: {host_kernel.why()}")
    monkeypatch.setattr(M, "NATIVE_SPAN", 1000)
    r = torch.zeros(5000, dtype=dtype)
    for first in (700, 10):  # a block of its own / the first block
        c = r.clone()
        c[[first, 1030, 1031, 3999]] = 0.5
        st = M.measure(r, c, 1e-4, 1e-4)
        assert st.worst.index == (first,) and st.mismatches == 4 and st.max_abs == 0.5
        c[2500] = math.nan  # a NaN disagreement is worse than anything out of tolerance
        assert M.measure(r, c, 1e-4, 1e-4).worst.index == (2500,)


def test_many_pairs_on_worker_threads_each_get_their_own_answer(monkeypatch, host_engine):
    """Hundreds of pairs of mixed sizes and layouts measured together on two worker threads (small spans
    batched, a large pair split into spans): each pair's Stats are its own exact ones."""
    monkeypatch.setattr(M, "NATIVE_SPAN", 1 << 14)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pairs = []
        for i in range(300):
            n = 40_000 if i == 7 else 1 + (i * 37) % 900
            r, c = _pair(("close", "bad", "specials")[i % 3], n, torch.float32,
                         torch.float64 if i % 5 == 0 else torch.float32, seed=i)
            if i % 4 == 0 and n % 3 == 0:
                r, c = r.view(3, -1).t(), c.view(3, -1).t()  # read through the gather
            pairs.append((r, c))
        got = M.measure_many([(r, c, 1e-4, 1e-3) for r, c in pairs])
    finally:
        torch.set_num_threads(threads)
    for (r, c), pending in zip(pairs, got):
        st, want = pending.result(), _exact(r.contiguous(), c.contiguous(), 1e-4, 1e-3)[0]
        assert (st.mismatches, st.worst.index, st.cand_nan, st.ref_inf) == \
            (want.mismatches, want.worst.index, want.cand_nan, want.ref_inf)
        assert st.max_abs == pytest.approx(want.max_abs, rel=1e-6)


def test_native_relative_error_agrees_with_the_torch_rule_and_leaves_specials_to_it(monkeypatch):
    from diffkit.align_layout import _rel_err

    if not host_kernel.available():
        pytest.skip(f"no native kernel here: {host_kernel.why()}")
    g = torch.Generator().manual_seed(5)
    r = torch.randn(4, 300, generator=g)
    c = r + 0.01 * torch.randn(4, 300, generator=g)
    fast = M.native_rel_l2(c, r)
    monkeypatch.setattr(M, "_native", lambda r, c: False)
    assert fast == pytest.approx(_rel_err(c, r), rel=1e-5) and fast > 0
    monkeypatch.undo()
    c[1, 7] = math.nan
    assert M.native_rel_l2(c, r) is None  # NaN/Inf: the torch rule (finite elements on both sides)
    assert M.native_rel_l2(c.t(), r.t()) is None  # (in any layout)
    assert M.native_rel_l2(r, r) == 0.0 and M.native_rel_l2(r, torch.zeros_like(r)) == math.inf


@pytest.mark.parametrize("layout", ["both permuted alike", "one side permuted", "both transposed", "expanded",
                                    "strided slice", "gathered in pieces"])
def test_native_relative_error_reads_any_layout_as_row_major_copies_give_it(layout, monkeypatch):
    """A pair not in row-major order is measured by the native kernel all the same (its memory in place when
    both sides are laid out alike over dense memory, else gathered): the relative error of contiguous copies,
    up to the order of the sums."""
    if not host_kernel.available():
        pytest.skip(f"no native kernel here: {host_kernel.why()}")
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 40, 3, 16, generator=g)
    noisy = base + 1e-3 * torch.randn(base.shape, generator=g)
    if layout == "both permuted alike":
        c, r = noisy.permute(0, 2, 1, 3), base.permute(0, 2, 1, 3)
    elif layout == "one side permuted":
        c, r = noisy.permute(0, 2, 1, 3).contiguous(), base.permute(0, 2, 1, 3)
    elif layout == "both transposed":
        c, r = noisy.reshape(240, 48).t(), base.reshape(240, 48).t()
    elif layout == "expanded":
        row = base[0, 0, 0]
        c, r = (row + 0.01).expand(50, 16), row.expand(50, 16)
    elif layout == "strided slice":
        c, r = noisy.reshape(-1, 48)[:, ::3], base.reshape(-1, 48)[:, ::3]
    else:
        monkeypatch.setattr(M, "GATHER", 97)  # many pieces, none a whole row
        c, r = noisy.permute(3, 1, 0, 2), base.permute(3, 1, 0, 2).contiguous()
    assert not (c.is_contiguous() and r.is_contiguous())
    got, want = M.native_rel_l2(c, r), M.native_rel_l2(c.contiguous(), r.contiguous())
    assert got is not None and got > 0 and got == pytest.approx(want, rel=1e-6)
    monkeypatch.setattr(M, "REL_GATHER_MAX", 10)  # past it, a pair that must be gathered goes to the torch passes
    in_place = layout in ("both permuted alike", "both transposed")
    assert (M.native_rel_l2(c, r) is not None) == in_place
    bad = c.contiguous()
    bad.view(-1)[5] = math.inf
    assert M.native_rel_l2(bad.t() if bad.dim() == 2 else bad.transpose(0, 1), r.t() if r.dim() == 2 else
                           r.transpose(0, 1)) is None  # a non-finite value: the torch rule, in any layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_out_of_tolerance_is_counted_exactly_as_torch_isclose_counts_it(dtype, host_engine):
    """Errors placed right at the tolerance edge (and a few between float32's atol and the real one, where
    the reference is 0): the count is torch.isclose's to the element, in the pair's own precision (what
    KernelBench's torch.allclose decides)."""
    g = torch.Generator().manual_seed(11)
    n = 200_003
    r = (torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, n, dtype=torch.float64)).to(dtype)
    atol = rtol = 1e-4
    edge = atol + rtol * r.double().abs()
    jitter = 1 + 1e-6 * torch.randn(n, generator=g, dtype=torch.float64)
    c = (r.double() + edge * jitter * torch.randn(n, generator=g, dtype=torch.float64).sign()).to(dtype)
    r[:50] = 0
    c[:50] = torch.linspace(float(torch.tensor(atol, dtype=torch.float32)) * 0.999999, atol * 1.000001, 50)
    want = int((~torch.isclose(c, r, rtol=rtol, atol=atol)).sum())
    assert 0 < want < n
    assert M.measure(r, c, atol, rtol).mismatches == want


def test_tensors_without_memory_of_their_own_are_measured_by_the_torch_passes():
    """A zero tensor (no storage) and a wrapper subclass hold no data the kernel could read: measured all the
    same (they used to reach the kernel as null pointers)."""
    z = torch._efficientzerotensor(600)
    assert not host_kernel.supports(z)
    st = M.measure(z, torch.ones(600), 1e-4, 1e-4)
    assert st.mismatches == 600 and st.max_abs == 1.0


def test_float32_blocks_of_tiny_values_keep_their_sums(host_engine):
    """float32 values near 1e-18 whose differences (1e-24) square below float32's range: the relative l2
    error, the mean and the worst element are those of the exact path (such blocks are summed in float64)."""
    g = torch.Generator().manual_seed(3)
    r = (torch.rand(4096, generator=g) + 0.5) * 1e-18
    c = r * (1 + 1e-6 * torch.randn(4096, generator=g))
    assert M.measure_async(r, c, 0.0, 1e-3).rel_l2 > 1e-7
    _assert_agrees_with_exact(r, c, 0.0, 1e-3)
    c[1500] = r[1500] * 1.5
    st = _assert_agrees_with_exact(r, c, 0.0, 1e-3)
    assert st.worst.index == (1500,) and st.mismatches == 1
    big = torch.randn(4096, generator=g) * 1e4  # and squares near float32's top, but within it
    _assert_agrees_with_exact(big * 1e13, big * 1e13 * (1 + 1e-5), 1e-4, 1e-4)


def test_float32_blocks_find_the_float64_maximum_where_float32_rounding_ties_or_reorders():
    """A float32 pair's blocks run in float32 lanes in the native kernel, but the largest |c - r| and the worst
    element are those of the float64 rules: |c - r| of 0.99999999 and of 1.00000001 in two blocks both round to
    1.0 in float32, and the second is the larger; excesses past the tolerance that float32 puts in another order;
    a ratio |c| / |r| past float32's range.  (The torch passes, without a C compiler, take |c - r| in float32 and
    may name the first of two such elements.)"""
    if not host_kernel.available():
        pytest.skip(f"no native kernel here: {host_kernel.why()}")
    r = torch.randn(1200, generator=torch.Generator().manual_seed(0)) * 1e-8
    r[100], r[700] = 1e-8, -1e-8
    c = r.clone()
    c[100] += 1.0
    c[700] += 1.0
    for atol in (1e-5, 10.0):  # mismatches (the worst element: largest excess) and none (largest |c - r|)
        st = M.measure(r, c, atol, 1e-5)  # (its cosine, ~2e-7, is float32 cancellation on every path)
        want = _exact(r, c, atol, 1e-5)[0]
        assert st.worst.index == want.worst.index == (700,) and st.mismatches == want.mismatches
        assert st.max_abs == want.max_abs == pytest.approx(1.00000001, rel=1e-12)
    g = torch.Generator().manual_seed(1)
    r = torch.rand(4096, generator=g) + 0.5  # errors just past the bound, in every block
    bound = 1e-5 + 1e-5 * r.double()
    c = (r.double() + bound * (1 + 1e-3 * torch.rand(4096, generator=g, dtype=torch.float64))).float()
    _assert_agrees_with_exact(r, c, 1e-5, 1e-5)
    r, c = torch.ones(512), torch.ones(512)
    r[3], c[3] = 1e-20, 1e19
    assert M.measure(r, c, 1e-5, 1e-5).max_rel == pytest.approx(1e39, rel=1e-6)
    r[3], c[3] = 1e-40, 1.0  # a denormal reference
    assert math.isfinite(M.measure(r, c, 1e-5, 1e-5).max_rel)


def test_relative_error_of_tiny_values_is_not_lost(host_engine):
    """float64 values near 1e-200 (products of two of them underflow): the largest |c - r| / |r| is still found."""
    r = torch.full((2048,), 1e-200, dtype=torch.float64)
    c = 2 * r
    c[100] = 4e-200
    assert M.measure(r, c, 1e-4, 1e-4).max_rel == pytest.approx(3.0)


def test_a_compiler_given_with_arguments_and_a_broken_cached_library(monkeypatch, tmp_path):
    """`$CC` as a command with arguments is used; a cached library that fails the self-test is built again."""
    import shutil

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("DIFFKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", f"{os.path.basename(cc)} -O1")
    monkeypatch.setattr(host_kernel, "_state", {})
    assert host_kernel.available(), host_kernel.why()
    path = host_kernel._state["path"]
    with open(path + ".new", "wb") as fh:  # a library cut short (a build killed half-way, a full disk)
        fh.write(b"\x7fELF broken")
    os.replace(path + ".new", path)  # (a new file: the loaded one stays mapped as it was)
    monkeypatch.setattr(host_kernel, "_state", {})
    assert host_kernel.available(), host_kernel.why()
    assert host_kernel._state["path"] == path  # rebuilt where it was
    r = torch.randn(3000)
    assert M.measure(r, r + 1, 1e-4, 1e-4).mismatches == 3000


def test_without_a_compiler_the_torch_passes_measure(monkeypatch, tmp_path):
    """No C compiler: `available()` says why, and measuring gives the exact path's answer all the same."""
    monkeypatch.setattr(host_kernel, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DIFFKIT_CACHE", str(tmp_path / "cache"))
    assert not host_kernel.available() and "no-such-cc" in host_kernel.why()
    r, c = _pair("specials", 3000, torch.float32, torch.float32, seed=3)
    _assert_agrees_with_exact(r, c, 1e-4, 1e-3)


def _special_batches(dtype: torch.dtype, sizes: tuple[int, ...], scale: int = 1,
                     device: str = "cpu") -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Batches where every tile is marked by the finite-first pass (the metric kernel's worst case, a candidate full
    of NaN): each pair all NaN on one side or both, all +Inf, +Inf against -Inf; of `sizes` (contiguous: read
    through the table, or launched on their own past DIRECT_MIN), transposed, a slice with gaps read as rows of
    lanes, four dims permuted on one side (`scale` stretches the last three over more tiles).  Besides: NaN and
    infinities in strided and row-read pairs only, beside clean contiguous ones; a batch of large pairs only."""
    g = torch.Generator().manual_seed(11)

    def made(fill_r, fill_c, *shape):
        r = torch.randn(*shape, generator=g, dtype=torch.float64) * 3
        c = r + 1e-5 * torch.randn(*shape, generator=g, dtype=torch.float64)
        if fill_r is not None:
            r.fill_(fill_r)
        if fill_c is not None:
            c.fill_(fill_c)
        return r.to(device, dtype), c.to(device, dtype)

    out = {}
    for name, fr, fc in (("cand NaN", None, math.nan), ("both +Inf", math.inf, math.inf),
                         ("both NaN", math.nan, math.nan), ("+Inf against -Inf", math.inf, -math.inf)):
        batch = [made(fr, fc, n) for n in sizes]
        r, c = made(fr, fc, 4, 9 * scale, 9)
        batch.append((r.transpose(1, 2), c.transpose(1, 2)))
        r, c = made(fr, fc, 3, 6 * scale, 11, 8)
        batch.append((r[1, :, 2:9], c[1, :, 2:9].contiguous()))
        r, c = made(fr, fc, 2, 3 * scale, 4, 40)
        batch.append((r.permute(3, 1, 0, 2).contiguous().permute(2, 1, 3, 0), c))
        out[name] = batch
    batch = [made(None, None, n) for n in sizes[-2:]]
    r, c = made(None, None, 4, 9 * scale, 9)
    c[3, -1, 7] = math.nan
    batch.append((r.transpose(1, 2), c.transpose(1, 2)))
    r, c = made(None, None, 3, 6 * scale, 11, 8)
    c[2, -1, 8] = math.nan
    r[0, 0, 2] = math.inf
    batch.append((r[1, :, 2:9], c[1, :, 2:9].contiguous()))
    out["NaN and Inf in strided pairs only"] = batch
    out["large pairs only"] = [made(None, math.nan, sizes[-1]), made(None, None, sizes[-1] - 100),
                               made(math.inf, None, sizes[-1] + 100)]
    return out


def _agree_with_exact(batch: list, got: torch.Tensor, atol: float, rtol: float, key, nan_ok: bool = False) -> None:
    """Each pair's packed vector (`packed_batch`) gives the exact path's counts, worst element, statistics and
    relative L2 error (`nan_ok`: a statistic NaN on both paths agrees)."""
    for k, (r, c) in enumerate(batch):
        st = M.PendingStats(got[k], tuple(r.shape), atol, rtol)
        want, wp = _exact(r, c, atol, rtol)
        have = st.result()
        assert (have.ref_nan, have.ref_inf, have.cand_nan, have.cand_inf, have.mismatches) == \
            (want.ref_nan, want.ref_inf, want.cand_nan, want.cand_inf, want.mismatches), (key, k)
        assert have.worst.index == want.worst.index, (key, k)
        for f in ("max_abs", "mean_abs", "max_rel", "cosine"):
            assert getattr(have, f) == pytest.approx(getattr(want, f), rel=1e-5, abs=1e-12, nan_ok=nan_ok), (key, k, f)
        assert st.rel_l2 == pytest.approx(wp.rel_l2, rel=1e-4, abs=1e-12, nan_ok=nan_ok), (key, k)


def _strided_pairs(dtype: torch.dtype, cand_dtype: torch.dtype,
                   device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs the metric kernel reads where they lie, through their layouts (and one it must copy first), their
    values made in float64 and laid out afterwards (on `device`: a copy between devices would make them
    contiguous): errors, ties, NaNs and infinities at places whose logical order differs from their order in
    memory."""
    g = torch.Generator().manual_seed(5)

    def made(*shape):
        r = torch.randn(*shape, generator=g, dtype=torch.float64) * 3
        c = r + 1e-5 * torch.randn(*shape, generator=g, dtype=torch.float64)
        flat = c.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 40),), generator=g)
        flat[idx] += torch.randn(idx.numel(), generator=g, dtype=torch.float64)
        return r.to(device), c.to(device)

    out = []
    r, c = made(5, 7, 9)  # both sides transposed alike: 9 x 7 x 5 read with strides 1, 9, 63
    out.append((r.to(dtype).transpose(0, 2), c.to(cand_dtype).transpose(0, 2)))
    r, c = made(3, 6, 11, 8)  # a slice with gaps (one of q/k/v in a fused projection) against a contiguous side
    out.append((r.to(dtype)[1, :, 2:9], c[1, :, 2:9].to(cand_dtype).contiguous()))
    r, c = made(2, 3, 4, 40)  # four dims permuted on one side only, a long inner dim (wider than a block)
    out.append((r.to(dtype).permute(3, 1, 0, 2).contiguous().permute(2, 1, 3, 0), c.to(cand_dtype)))
    r, c = made(3, 5, 3, 7)  # four short dims: a step of a block carries through every digit within a tile
    out.append((r.to(dtype).permute(2, 0, 3, 1).contiguous().permute(1, 3, 0, 2), c.to(cand_dtype).transpose(1, 2)
                .contiguous().transpose(1, 2)))
    r, c = made(6, 5, 13)  # an expanded side (strides 0) against a contiguous one
    base = r[:, :1, :1]
    out.append((base.to(dtype).expand(6, 5, 13), (base + (c - r)).to(cand_dtype)))
    r, c = made(4, 9, 9)  # NaN and infinities (the full rules' pass reads through the layout too)
    c[1, 2, 3] = math.nan
    r[2, 5, 1] = c[2, 5, 1] = math.inf
    r[3, 0, 8] = -math.inf
    out.append((r.to(dtype).transpose(1, 2), c.to(cand_dtype).transpose(1, 2)))
    tie_r = torch.zeros(8, 12, dtype=torch.float64, device=device)
    tie_c = tie_r.clone()
    tie_c[5, 2] = tie_c[2, 9] = 0.5  # equal maxima: memory order (transposed) meets [5, 2] first, logical [2, 9]
    out.append((tie_r.t().contiguous().t().to(dtype), tie_c.t().contiguous().t().to(cand_dtype)))
    r, c = made(2, 4, 3, 3, 5)  # five dims in reversed memory order (none merge) against contiguous ones
    c[1, 2, 1, 1, 3] += 50.0  # the worst element in the second half of the first dim
    out.append((r.to(dtype).permute(4, 3, 2, 1, 0).contiguous().permute(4, 3, 2, 1, 0), c.to(cand_dtype)))
    # read a row of lanes at a time (the last dim contiguous on both sides, its size a multiple of the rows' width):
    # heads transposed back against contiguous ones, a NaN among them (the full rules read them element by element)
    r, c = made(2, 3, 5, 16)
    c[1, 2, 4, 7] = math.nan
    out.append((r.to(dtype).transpose(1, 2), c.to(cand_dtype).transpose(1, 2).contiguous()))
    r, c = made(2, 5, 96)  # the middle third of a fused projection (rows start 16-byte aligned)
    out.append((r.to(dtype)[..., 32:64], c[..., 32:64].to(cand_dtype).contiguous()))
    r, c = made(3, 4, 33)  # rows that do not start aligned: their launch reads them an element a load (kept last
    # but one: `strided[:-2]` leaves it out, so its batch reads aligned rows four elements a load)
    out.append((r.to(dtype)[..., 1:33], c[..., 1:33].to(cand_dtype)))
    r, c = made(2, 3, 2, 3, 2, 3)  # six dims reversed, none merging: copied first
    out.append((r.to(dtype).permute(5, 4, 3, 2, 1, 0), c.to(cand_dtype).permute(5, 4, 3, 2, 1, 0)))
    return out


def test_a_calls_pairs_go_in_order_in_batches_the_first_small_the_copies_bounded(monkeypatch):
    """`measure._batches`: every pair once, in order; the first batch at most FIRST_BATCH_PAIRS (the device waits
    for it), the others at most BATCH_PAIRS, and no batch copies more than BATCH_COPY_BYTES to contiguous memory
    (a pair that alone copies more goes alone)."""
    monkeypatch.setattr(M, "BATCH_COPY_BYTES", 3 * 64 * 64 * 4)
    monkeypatch.setattr(M, "FIRST_BATCH_PAIRS", 2)
    monkeypatch.setattr(M, "BATCH_PAIRS", 6)
    x = torch.randn(64, 64)
    items = [((x.t() if k % 5 == 0 else x), x, 1e-4, 1e-4) for k in range(75)]  # every fifth a transposed side
    from diffkit import metrics_kernel as K

    monkeypatch.setattr(K, "DIRECT_MIN", 1)  # (every pair "large": its transposed side copied, not read in place)
    planned = list(M._batches(items, list(range(len(items)))))
    parts = [p for p, _ in planned]
    assert all(rows == [K._row(*items[i][:2]) for i in p] for p, rows in planned)  # (each pair's row, once)
    assert [i for p in parts for i in p] == list(range(len(items)))
    assert len(parts[0]) <= M.FIRST_BATCH_PAIRS and all(len(p) <= M.BATCH_PAIRS for p in parts[1:])
    assert max(len(p) for p in parts[1:]) > M.FIRST_BATCH_PAIRS  # (the later batches may be larger)
    assert all(sum(K.planned(*items[i][:2])[1] for i in p) <= M.BATCH_COPY_BYTES for p in parts)
    assert len(parts) < len(items)  # (batches, not a launch a pair)


def test_a_calls_contiguous_pairs_are_batched_before_the_others_each_kind_in_order():
    """`measure._contiguous_first`: the order `measure_many` batches a call's CUDA pairs in (so a batch's pairs are
    mostly read one way, one launch); every pair once, the pairs contiguous on both sides first."""
    x = torch.randn(6, 8)
    kinds = [x, x.t(), x[:, ::2], x, x.t().contiguous(), x[1:], x.expand(2, 6, 8)[0], x.t()]
    items = [(t, t.clone() if k % 2 else t, 1e-4, 1e-4) for k, t in enumerate(kinds)]
    flat = [i for i, (r, c, _, _) in enumerate(items) if r.is_contiguous() and c.is_contiguous()]
    other = [i for i in range(len(items)) if i not in flat]
    assert flat and other
    assert M._contiguous_first(items, list(range(len(items)))) == flat + other
    picked = [7, 3, 1, 0]  # (a group's own indices, in its own order)
    assert M._contiguous_first(items, picked) == [i for i in picked if i in flat] + [i for i in picked if i in other]


def test_each_pair_is_read_the_way_its_layout_allows_and_promised_aligned_only_where_it_is():
    """How the CUDA kernel reads a pair (`metrics_kernel.READ_*`) and whether its launch may read four elements a
    load (`_aligned`: a wrong promise would be a misaligned load on the device), decided on the host from the
    pair's shape, strides and addresses: no GPU needed."""
    from diffkit import metrics_kernel as K

    def way(r, c):
        row = K._row(r, c)
        return (None if row is None else row[0]), K._aligned(r, c, row)

    x = torch.randn(2, 5, 96)
    heads = torch.randn(2, 3, 5, 16)
    cases = {
        "contiguous": ((x, x.clone()), (K.READ_FLAT, True)),
        "contiguous, length not a multiple of 4": ((x[0, 0, :7], x[0, 0, :7].clone()), (K.READ_FLAT, False)),
        "contiguous, one element in": ((x.view(-1)[1:961], x.view(-1)[:960].clone()), (K.READ_FLAT, False)),
        "heads transposed against contiguous ones": ((heads.transpose(1, 2), heads.transpose(1, 2).contiguous()),
                                                     (K.READ_ROWS, True)),
        "the middle third of a fused projection": ((x[..., 32:64], x[..., 32:64].contiguous()), (K.READ_ROWS, True)),
        "rows one element in": ((torch.randn(3, 4, 33)[..., 1:33], torch.randn(3, 4, 32)), (K.READ_ROWS, False)),
        "rows four elements in, strides of 36": ((torch.randn(3, 4, 36)[..., 4:36], torch.randn(3, 4, 32)),
                                                 (K.READ_ROWS, True)),
        "rows strided by 34": ((torch.randn(3, 4, 34)[..., :32], torch.randn(3, 4, 32)), (K.READ_ROWS, False)),
        "a transposed matrix": ((torch.randn(8, 12).t(), torch.randn(12, 8)), (K.READ_STRIDED, True)),
        "a last dim shorter than a row of lanes": ((x[..., :10], x[..., :10].contiguous()), (K.READ_STRIDED, True)),
        "six dims reversed (copied first)": ((torch.randn(2, 3, 2, 3, 2, 4).permute(5, 4, 3, 2, 1, 0),
                                              torch.randn(4, 2, 3, 2, 3, 2)), (None, True)),
    }
    got = {name: way(*pair) for name, (pair, _) in cases.items()}
    assert got == {name: want for name, (_, want) in cases.items()}


def test_triton_kernels_under_the_interpreter_agree_with_the_exact_path(monkeypatch):
    """The metric kernels' logic on the CPU (TRITON_INTERPRET=1), with tiles and lanes made small so
    pairs span many tiles, the combining loop runs several rounds and ties of maxima cross tiles; batches where
    every tile is marked (`_special_batches`) too."""
    import sys

    if torch.cuda.is_available():
        pytest.skip("the compiled kernels are tested on this machine's GPU (tests marked cuda)")
    if "triton" in sys.modules:
        pytest.skip("Triton is imported already: its interpreter is chosen when it is imported")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (read by Triton when it is imported)
    pytest.importorskip("triton")
    from diffkit import metrics_kernel as K

    monkeypatch.setattr(K, "BLOCK", 16)
    monkeypatch.setattr(K, "GROUP", 4)  # (a step of a block reads four rows of lanes)
    monkeypatch.setattr(K, "TILE_BLOCKS", 2)
    monkeypatch.setattr(K, "TILE", 32)
    monkeypatch.setattr(K, "COMBINE_ROWS", 4)
    monkeypatch.setattr(K, "DIRECT_MIN", 500)  # the larger pairs take the direct launch
    K._kernels.cache_clear()
    try:
        # FAST: a tile assumed finite first (tiles holding a NaN/Inf measured again); False: the full rules only
        # LANE_SUMS_64 False: float32 sums within a tile (magnitudes out of their range measured again)
        for (fast, sums64), dtypes in itertools.product(((True, True), (True, False), (False, True)),
                                                        ((torch.float32, torch.float32),
                                                         (torch.float16, torch.float16),
                                                         (torch.float64, torch.float32))):
            monkeypatch.setattr(K, "FAST", fast)
            monkeypatch.setattr(K, "LANE_SUMS_64", sums64)
            pairs = [_pair(kind, n, *dtypes, seed=n) for kind, n in
                     (("close", 1), ("bad", 37), ("zeros", 300), ("specials", 301), ("bad", 1000), ("specials", 700),
                      ("range", 200), ("subnormal", 90))]
            tie_r = torch.zeros(200, dtype=dtypes[0])
            tie_c = tie_r.clone()
            tie_c[[70, 150]] = 0.5  # equal maxima in different tiles: the first one is the worst
            pairs.append((tie_r, tie_c.to(dtypes[1])))
            if torch.finfo(dtypes[0]).max > 1e30:
                # finite values whose differences' squares leave float32's range (overflow: both sides'
                # squares fit; underflow: both sides above 1e-18, their differences far below)
                big = torch.full((40,), 1e19, dtype=torch.float64)
                big[::2] = 3.0
                pairs.append((big.to(dtypes[0]), (-big).to(dtypes[1])))
                tiny = torch.full((70,), 2e-18, dtype=torch.float64)
                pairs.append((tiny.to(dtypes[0]), (tiny + 3e-23).to(dtypes[1])))
            atol, rtol = 1e-4, 1e-3
            # errors around the tolerance itself (about half of them out): the rule's boundary is exercised
            g = torch.Generator().manual_seed(7)
            edge_r = (torch.randn(333, generator=g, dtype=torch.float64) * 3).to(dtypes[0]).to(torch.float64)
            step = (atol + rtol * edge_r.abs()) * (0.5 + torch.rand(333, generator=g, dtype=torch.float64))
            pairs.append((edge_r.to(dtypes[0]), (edge_r + step * torch.sign(torch.randn(333, generator=g,
                                                                                          dtype=torch.float64)))
                          .to(dtypes[1])))
            # the batch as it is and one pair shorter (an odd count pads the address table's parts); its
            # non-contiguous pairs alone; its contiguous ones alone
            strided = _strided_pairs(*dtypes)
            for batch in (pairs + strided, pairs[1:] + strided, strided, strided[:-2], pairs):
                _agree_with_exact(batch, K.packed_batch(batch, atol, rtol), atol, rtol, fast)
            if fast and not sums64 and dtypes[0] == dtypes[1]:  # (as shipped) every tile marked: the REDO launch's
                for name, batch in _special_batches(dtypes[0], (1, 37, 300, 700, 1000)).items():  # worst case
                    _agree_with_exact(batch, K.packed_batch(batch, atol, rtol), atol, rtol, (dtypes, name),
                                      nan_ok=True)
    finally:
        K._kernels.cache_clear()
