"""What-if runs: which one kernel mistake, planted in the reference, reproduces the candidate?

When the candidate's divergent record covers several reference stages (a fused kernel: nothing
between its input and its output can be compared), localisation by capture cannot see inside it.
The reference can still answer the writer's question: run it again with one plausible mistake
planted at one of those stages, and see whether it then agrees with the candidate.

A mistake is a `Variant`: a catalogue `kind`, the reference record (`site`) it replaces, and how
(`apply(call, out)`: the live call that made the record and its result, to the value the mistaken
kernel would have produced).  It is planted through the capture machinery (`capture._State.mutator`):
the record's tensor is overwritten in place as it is recorded, so the rest of the forward reads it;
the user's source is never edited.  `catalogue(site, ...)` lists the variants that apply to a
record (`diffkit.whatif_catalogue`, a table of mutations); `search(...)` runs them (one forward each,
stopped at the divergent stage) and ranks them by how closely the mutated reference reproduces the
candidate there.

The catalogue (`KINDS`): drop_bias, extra_bias, running_stats, batch_stats, unbiased_variance,
biased_variance, epsilon, reduce_axis, scale, transposed_weight, transposed_operand,
swapped_operands, tanh_gelu, erf_gelu, low_precision, unwritten_tail, clamp, sign_flip,
unstable_softmax, norm_axes, block_stats, mixed_gelu, activation, swapped_order, bias_placement, skip_stage.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .capture import Record, StopCapture, Trace
from .measure import Stats, measure_async
from .options import Options
from .whatif_catalogue import KINDS, MUTATIONS, Variant, _NotApplicable, catalogue, is_site, model_constants

__all__ = ["KINDS", "PRIOR", "MUTATIONS", "DEFAULT_BUDGET", "Variant", "WhatIf", "Search", "catalogue", "is_site",
           "model_constants", "search", "rank_key", "window"]

# the order variants are tried in, and which of two equally good explanations is named first: the
# mistakes kernel writers make most often (from the seeds and the field notes) come first
PRIOR = {k: i for i, k in enumerate(("drop_bias", "scale", "transposed_weight", "swapped_operands",
                                     "transposed_operand", "reduce_axis", "unbiased_variance", "running_stats",
                                     "batch_stats", "biased_variance", "tanh_gelu", "erf_gelu", "mixed_gelu",
                                     "norm_axes", "block_stats", "activation", "swapped_order", "bias_placement",
                                     "skip_stage", "unwritten_tail",
                                     "sign_flip", "extra_bias", "unstable_softmax", "low_precision", "epsilon",
                                     "clamp"))}
assert set(PRIOR) == set(KINDS)

SAME_CODE_ALWAYS = 4  # same-code groups tried even past the wall-time budget (one forward each)
DEFAULT_BUDGET = Options.explain_budget  # forwards of the reference a search may spend (the option's default)


@dataclass
class WhatIf:
    """How close one variant (or two at once) brings the reference to the candidate at the divergent stage."""

    variants: list[Variant]
    stats: Stats  # the candidate against the mutated reference (NaN where both hold NaN agrees here)
    rel_l2: float  # ||c - r'|| / ||r'||
    same_code: bool = False  # one mistake made at every call of the same code (a kernel used twice)

    @property
    def explains(self) -> bool:
        return self.stats.mismatches == 0

    @property
    def mistakes(self) -> int:
        """How many different mistakes it plants (the same one at every call of a kernel counts once)."""
        return 1 if self.same_code else len(self.variants)

    def to_dict(self, before: Stats) -> dict:
        v = self.variants
        if self.same_code:
            kind = v[0].kind
            where = ", ".join(x.stage for x in v)
            detail = f"{v[0].detail.replace(f'`{v[0].stage}`', 'the same code')} (at every call: {where})"
        else:
            kind, detail = "+".join(dict.fromkeys(x.kind for x in v)), "; ".join(x.detail for x in v)
        return {"kind": kind, "stage": ", ".join(x.stage for x in v), "same_code": self.same_code,
                "detail": detail, "max_abs_before": before.max_abs,
                "max_abs_after": self.stats.max_abs, "explains": self.explains,
                "mismatches_after": self.stats.mismatches, "rel_l2_after": self.rel_l2,
                "mutations": [{"kind": x.kind, "stage": x.stage, "detail": x.detail, "aliases": list(x.aliases)}
                              for x in v]}


# ------------------------------------------------------------------------------------------ running
class _Mutator:
    """Planted in capture: replaces the value of the records at chosen indices, in place."""

    def __init__(self, variants: Sequence[Variant]):
        self.by_site = {v.site: v for v in variants}
        self.watching = [v.watch for v in variants if v.watch is not None]
        self.planted = 0

    def before_module(self, module: torch.nn.Module, args: tuple) -> None:
        for v in self.by_site.values():
            if v.before is not None:
                v.before(module, args)

    def plant(self, index: int, call: tuple, tensor: torch.Tensor, shared: bool = False) -> None:
        for watch in self.watching:
            watch(index, call, tensor)
        v = self.by_site.get(index)
        if v is None:
            return
        if shared:  # the result is memory the model or the call's arguments hold: writing it would change them
            raise _NotApplicable("the stage's result shares memory with a parameter or an argument")
        if v.fn is not None and call[1] is not v.fn:
            raise _NotApplicable("the run does not make the same records as the captured one")
        with torch.no_grad():
            try:
                new = v.apply(call, tensor)
            except StopCapture:
                raise
            except Exception as e:  # the mistake cannot be made on this call (shapes, dtypes)
                raise _NotApplicable(str(e)) from None
            if not isinstance(new, torch.Tensor) or tuple(new.shape) != tuple(tensor.shape):
                raise _NotApplicable()
            tensor.copy_(new.to(tensor.dtype))
        self.planted += 1


class _Grab:
    """A capture sink that keeps the value of one record and stops the forward there."""

    owns_values = True

    def __init__(self, index: int):
        self.index = index
        self.value: torch.Tensor | None = None

    def add(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        if rec.index == self.index and tensor is not None:
            self.value = tensor.detach().clone()
            raise StopCapture("what-if: reached the divergent stage")

    def update(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        pass

    def set_error(self, error: Any) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Search:
    """A what-if search's inputs: the live reference, how to run it, and what the candidate gave."""

    model: torch.nn.Module
    inputs: Sequence[Any]
    run: Callable[[torch.nn.Module, Sequence[Any], Any], None]  # one forward of the model with a sink
    target: int  # the reference record the candidate's divergent value is compared with
    cand_value: torch.Tensor  # the candidate's value there, in the reference's layout
    atol: float
    rtol: float
    window: list[int]  # the reference records the candidate's record covers (sites to plant at)
    budget: int = DEFAULT_BUDGET
    seconds_budget: float = math.inf  # wall time the search may spend: past it no further variant is tried
    progress: Callable[[int, int], None] | None = None
    forwards: int = 0
    seconds: float = 0.0
    tried: int = 0
    left: int = 0  # variants within the forward budget not tried for want of time (`seconds_budget`)
    results: list[WhatIf] = field(default_factory=list)


def _evaluate(s: Search, variants: Sequence[Variant], same_code: bool = False) -> WhatIf | None:
    mut = _Mutator(variants)
    grab = _Grab(s.target)
    try:
        s.run(s.model, s.inputs, grab, mut)
    finally:
        s.forwards += 1
    if grab.value is None or mut.planted < len(variants) or tuple(grab.value.shape) != tuple(s.cand_value.shape):
        return None
    mutated, cand = grab.value, s.cand_value.to(grab.value.device)
    if mutated.is_floating_point() and cand.is_floating_point():
        # reproducing the candidate includes its NaNs: a NaN on both sides agrees here
        both = torch.isnan(mutated) & torch.isnan(cand)
        if bool(both.any()):
            mutated, cand = mutated.masked_fill(both, 0.0), cand.masked_fill(both, 0.0)
    pending = measure_async(mutated, cand, s.atol, s.rtol)
    st = pending.result()
    rel = pending.rel_l2 if math.isfinite(pending.rel_l2) else math.inf
    if (st.ref_nan or st.ref_inf) and not (st.cand_nan or st.cand_inf):
        rel = math.inf
    return WhatIf(list(variants), st, rel, same_code)


def rank_key(w: WhatIf) -> tuple:
    """Best first: those within tolerance (by the order of magnitude of their error), then by how
    close they come; among equals the later stage (where the mistake shows first as itself) and the
    commoner mistake."""
    err = w.stats.max_abs if math.isfinite(w.stats.max_abs) else math.inf
    mag = math.floor(math.log10(err)) if 0 < err < math.inf else (-400 if err == 0 else 400)
    site = max(v.site for v in w.variants)
    prior = sum(PRIOR[v.kind] for v in w.variants)
    if w.explains:
        return (0, w.mistakes, mag, -site, prior)
    return (1, round(w.rel_l2, 4) if math.isfinite(w.rel_l2) else math.inf, w.mistakes, -site, prior)


def search(s: Search, model_consts: Sequence[float] = (), records: Sequence[Record] = (), pairs: int = 4) -> list[WhatIf]:
    """Try every variant at every site of the window (within the budget of forwards); when none
    reproduces the candidate within tolerance, try the best `pairs` two at a time, then the best one
    with each other mistake (`_with_the_best`).  Returns the results best first (`rank_key`)."""
    t0 = time.perf_counter()
    variants: list[Variant] = []
    by_index = {r.index: r for r in records}
    shapes = {r.index: tuple(r.shape) for r in records}
    for i in s.window:
        rec = by_index.get(i)
        if rec is not None:
            variants += catalogue(rec, s.model, model_consts, shapes, by_index)
    # a fair share of the budget for every kind at every site: the first variant of each (site, kind)
    # first, commoner mistakes and later sites first among those, then the second variants, and so on
    nth: dict[tuple, int] = {}
    order = []
    for v in variants:
        key = (v.site, v.kind)
        order.append((nth.get(key, 0), PRIOR[v.kind], -v.site))
        nth[key] = nth.get(key, 0) + 1
    variants = [v for _, v in sorted(zip(order, variants), key=lambda x: x[0])]
    baseline = _evaluate(s, [])  # the reference as it is: how far the candidate is without a mistake planted
    before = baseline.rel_l2 if baseline is not None else math.inf
    total = min(len(variants), s.budget)
    results: list[WhatIf] = []
    closer: set[int] = set()  # variants (by id) that bring the reference closer to the candidate
    # the single variants stop at a fifth of the wall-time budget short of its end: the passes after them (the
    # same mistake at every call, pairs) are few forwards and must not be what a loaded machine drops
    single_until = s.seconds_budget * 0.8
    for k, v in enumerate(variants[:s.budget]):
        if k and time.perf_counter() - t0 > single_until:
            s.left = total - k
            break
        s.tried += 1
        w = _evaluate(s, [v])
        if w is not None:
            results.append(w)
            if w.rel_l2 < before:
                closer.add(id(v))
        if s.progress is not None:
            s.progress(k + 1, total)
    # the same mistake at every call of the same code (a kernel the candidate uses for several stages),
    # for mistakes that brought the reference closer at one of those calls
    groups: dict[tuple, list[Variant]] = {}
    for v in variants:
        rec = by_index[v.site]
        groups.setdefault((rec.file, rec.line, rec.op, v.kind, v.detail.replace(f"`{v.stage}`", "``")), []).append(v)
    gain = {id(w.variants[0]): w.rel_l2 for w in results if id(w.variants[0]) in closer}
    candidates = [g for g in groups.values() if len({v.site for v in g}) > 1 and any(id(v) in closer for v in g)]
    # the groups whose one call came closest first; the first few are tried whatever the clock says (a load
    # spike must not change the answer), the rest while the budgets last
    candidates.sort(key=lambda g: min(gain.get(id(v), math.inf) for v in g))
    for n, g in enumerate(candidates):
        if n >= SAME_CODE_ALWAYS and (s.forwards >= 2 * s.budget or time.perf_counter() - t0 > s.seconds_budget):
            break
        s.tried += 1
        w = _evaluate(s, g, same_code=True)
        if w is not None:
            results.append(w)
    results.sort(key=rank_key)
    if results and not results[0].explains and pairs > 1:
        top: list[WhatIf] = []
        for w in results:
            if len(w.variants) == 1 and all(w.variants[0].site != t.variants[0].site for t in top):
                top.append(w)
            if len(top) == pairs:
                break
        for a in range(len(top)):
            for b in range(a + 1, len(top)):
                if s.forwards >= s.budget + pairs * pairs or time.perf_counter() - t0 > s.seconds_budget:
                    break
                w = _evaluate(s, [top[a].variants[0], top[b].variants[0]])
                if w is not None:
                    results.append(w)
        results.sort(key=rank_key)
        if not results[0].explains:
            results += _with_the_best(s, results, t0)
            results.sort(key=rank_key)
    s.results = results
    s.seconds = time.perf_counter() - t0
    return results


def _with_the_best(s: Search, results: list[WhatIf], t0: float) -> list[WhatIf]:
    """The best single mistake with one more at another site: a second mistake whose effect alone the first
    hides (a dropped bias after a wrong activation).  The closest variant of each (site, kind) first, while the
    forward budget (what the single variants left of it) and the time budget last; stops at one that explains."""
    singles = [w for w in results if len(w.variants) == 1]
    if not singles:
        return []
    first = singles[0].variants[0]
    done = {frozenset(map(id, w.variants)) for w in results if len(w.variants) == 2}
    seen: set[tuple] = set()
    out: list[WhatIf] = []
    for w in singles[1:]:
        v = w.variants[0]
        if v.site == first.site or (v.site, v.kind) in seen or frozenset((id(first), id(v))) in done:
            continue
        seen.add((v.site, v.kind))
        if s.forwards >= s.budget or time.perf_counter() - t0 > s.seconds_budget:
            break
        got = _evaluate(s, [first, v])
        if got is not None:
            out.append(got)
            if got.explains:
                break
    return out


def window(stages: Sequence[Any], ref: Trace, fd: Any) -> list[int]:
    """The reference records a divergent candidate record covers: those after the reference record
    of the last stage before it that agrees (the whole model when none does), up to its own."""
    last = -1
    for s in stages:
        if s is fd:
            break
        if s.status == "ok" and s.ref is not None and s.cand is not None:
            last = max(last, s.ref.index)
    end = fd.ref.index
    return [r.index for r in ref.records if last < r.index <= end and is_site(r)]
