"""Comparisons of whole outputs in bounded memory (issue 46): KernelBench's torch.allclose and the bitwise check
of a candidate's two runs work on slices of a large output, and answer exactly what the one-shot calls answer."""
import pytest
import torch

from diffkit import measure, modelstate


def _one_shot_bitwise(a, b):
    """The bitwise comparison as one whole-tensor computation (what `bitwise_difference` answered before it was
    sliced)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    mask = a.contiguous().view(ints) != b.contiguous().view(ints)
    n = int(mask.sum())
    if n == 0:
        return None
    idx = mask.nonzero()
    rows = mask.reshape(-1, mask.shape[-1]).any(dim=1).nonzero().flatten()
    return {"elements": n, "numel": mask.numel(),
            "max_abs": float(torch.nan_to_num((a.double() - b.double()).abs(), nan=float("inf")).max()),
            "at": [list(map(int, ix)) for ix in idx[:modelstate.MAX_SHOWN].tolist()],
            "span": [[int(idx[:, d].min()), int(idx[:, d].max())] for d in range(mask.dim())],
            "row_span": [int(rows.min()), int(rows.max())]}


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4, 5), (40, 1, 33)])
@pytest.mark.parametrize("chunk", [3, 64, 1 << 24])
def test_the_sliced_bitwise_check_answers_as_the_whole_one(monkeypatch, shape, chunk):
    monkeypatch.setattr(modelstate, "BITWISE_CHUNK", chunk)
    gen = torch.Generator().manual_seed(hash((shape, chunk)) % 1000)
    for case in range(12):
        a = torch.randn(shape, generator=gen)
        b = a.clone()
        flat = b.view(-1)
        for _ in range(case % 6):  # none, one or a few elements changed, some to NaN
            i = int(torch.randint(0, flat.numel(), (1,), generator=gen))
            flat[i] = float("nan") if case % 4 == 3 else flat[i] + 0.5
        if case == 11:
            b = a * (1 + 1e-7)  # every element differs in its last bits, as a race in a reduction leaves it
        assert modelstate.bitwise_difference(a, b) == _one_shot_bitwise(a, b)


def test_a_non_contiguous_pair_is_compared_in_its_logical_order(monkeypatch):
    monkeypatch.setattr(modelstate, "BITWISE_CHUNK", 5)
    a = torch.randn(6, 8).t()
    b = a.clone()
    b[2, 3] += 1
    b[7, 5] += 2
    d = modelstate.bitwise_difference(a, b)
    assert d["at"] == [[2, 3], [7, 5]] and d["span"] == [[2, 7], [3, 5]] and d["max_abs"] == pytest.approx(2.0)


@pytest.mark.parametrize("chunk", [7, 1 << 26])
def test_kernelbenchs_allclose_over_slices_is_its_answer(monkeypatch, chunk):
    monkeypatch.setattr(measure, "ALLCLOSE_CHUNK", chunk)
    gen = torch.Generator().manual_seed(chunk % 97)
    for case in range(120):
        n = int(torch.randint(2, 300, (1,), generator=gen))
        a = torch.randn(n, generator=gen)
        b = a + torch.randn(n, generator=gen) * 1e-5 * (case % 4)
        if case % 5 == 0:
            b[int(torch.randint(0, n, (1,), generator=gen))] = float("nan")
        if case % 7 == 0:
            a[int(torch.randint(0, n, (1,), generator=gen))] = float("inf")
        want = bool(torch.allclose(a, b, atol=1e-4, rtol=1e-4))
        assert measure.kernelbench_allclose(a, b, 1e-4, 1e-4) == want
        # a non-contiguous pair (a transposed matrix) takes the one-shot call
        at, bt = torch.stack([a, a]).t(), torch.stack([b, b]).t()
        assert not at.is_contiguous() and measure.kernelbench_allclose(at, bt, 1e-4, 1e-4) == want
