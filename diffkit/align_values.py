"""Matching by values: the value pass (`pass_value`: a leftover candidate tensor pairs with the free reference
tensor of equal element count whose values are closest, screened by fingerprints), and the questions of
values the other passes ask (`_holds_another`, `_later_holds`).  Part of `diffkit.align`."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .align_graph import Cover
from .align_layout import _fingerprint, best_layout, record_numel
from .align_state import AlignState, _value_err
from .align_tuning import (ANOTHER_ROLE_REL_ERR, BEYOND_MAX_NUMEL, IDENTICAL_REL_ERR, VALUE_CONFIDENCE_BEST,
                           VALUE_CONFIDENCE_WORST, VALUE_CONTENDERS, VALUE_MATCH_REL_ERR, VALUE_PRIOR_OTHER_SCOPE,
                           VALUE_PRIOR_POSITION, VALUE_UNSUPPORTED_REL_ERR)
from .capture import Record


def value_confidence(rel_err: float) -> float:
    """A value pair's confidence: VALUE_CONFIDENCE_BEST for identical values, falling linearly
    with the relative error to VALUE_CONFIDENCE_WORST at VALUE_MATCH_REL_ERR."""
    closeness = 1.0 - min(max(rel_err, 0.0) / VALUE_MATCH_REL_ERR, 1.0)
    return VALUE_CONFIDENCE_WORST + (VALUE_CONFIDENCE_BEST - VALUE_CONFIDENCE_WORST) * closeness


@dataclass
class _Contenders:
    """The reference records of one element count that may have a fingerprint (a floating dtype), their
    fingerprints computed as they are asked for (`rows`): most of a long trace's records are paired by the time
    the value pass looks, and only the free ones are scored."""

    refs: list[int]
    positions: torch.Tensor  # each record's index relative to the reference's length (0..1)
    scopes: list[str]
    scope_ids: torch.Tensor  # each record's scope as a number (`scope_id`), to compare them all at once
    ref_ids: torch.Tensor  # `refs` as a tensor
    fingerprint: Callable[[int], torch.Tensor | None] = field(repr=False, default=lambda ri: None)
    _rows: torch.Tensor | None = field(default=None, repr=False)  # one row per record, NaN until computed
    _known: torch.Tensor | None = field(default=None, repr=False)  # rows computed
    _valid: torch.Tensor | None = field(default=None, repr=False)  # rows computed that have a fingerprint

    def scope_id(self, scope: str) -> int:
        """The number standing for `scope` in `scope_ids` (-1: no record of this group has it)."""
        ids = self.__dict__.get("_ids")
        if ids is None:
            ids = self.__dict__["_ids"] = {sc: k for k, sc in enumerate(dict.fromkeys(self.scopes))}
        return ids.get(scope, -1)

    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions `idx` (into `refs`) that have a fingerprint, and their fingerprints (computed now where
        not yet), in the order given."""
        if self._known is None:
            self._known = torch.zeros(len(self.refs), dtype=torch.bool)
            self._valid = torch.zeros(len(self.refs), dtype=torch.bool)
        for k in idx[~self._known[idx]].tolist():
            fp = self.fingerprint(self.refs[k])
            self._known[k] = True
            if fp is None:
                continue
            if self._rows is None:
                self._rows = torch.full((len(self.refs), fp.numel()), math.nan, dtype=fp.dtype)
            self._rows[k] = fp
            self._valid[k] = True
        idx = idx[self._valid[idx]]
        return idx, (self._rows[idx] if self._rows is not None else torch.empty(0, 0, dtype=torch.float64))

    def all_rows(self) -> tuple[list[int], torch.Tensor]:
        """Every record that has a fingerprint, and the fingerprints (one row each)."""
        idx, fps = self.rows(torch.arange(len(self.refs)))
        return [self.refs[k] for k in idx.tolist()], fps


@dataclass
class _ValueMatch:
    ref: int
    transform: tuple
    rel_err: float
    score: float  # rel_err plus the contender's prior: the lowest wins


def _contenders(state: AlignState, refs: list[int], fingerprints: dict[int, torch.Tensor | None]) -> _Contenders:
    """The group of reference records `refs` (those of a floating dtype), their fingerprints kept in
    `fingerprints` (by record index) as they are computed."""

    def fingerprint(ri: int) -> torch.Tensor | None:
        if ri not in fingerprints:
            fingerprints[ri] = _fingerprint(state.ref[ri], v=state.ref_value(state.ref[ri]))
        return fingerprints[ri]

    have = [ri for ri in refs if state.ref[ri].dtype.is_floating_point and record_numel(state.ref[ri]) > 0
            and fingerprints.get(ri, True) is not None]
    scopes = [state.ref[ri].scope for ri in have]
    ids = {sc: k for k, sc in enumerate(dict.fromkeys(scopes))}
    return _Contenders(refs=have, positions=torch.tensor([ri / max(len(state.ref), 1) for ri in have],
                                                         dtype=torch.float64),
                       scopes=scopes, scope_ids=torch.tensor([ids[sc] for sc in scopes], dtype=torch.long),
                       ref_ids=torch.tensor(have, dtype=torch.long), fingerprint=fingerprint)


def _numel_group(state: AlignState, numel: int) -> _Contenders:
    """`_contenders` of every reference record of `numel` elements, built once per alignment."""
    groups = state.__dict__.setdefault("_numel_groups", {})
    if numel not in groups:
        groups[numel] = _contenders(state, state.by_numel("ref").get(numel, []),
                                    state.__dict__.setdefault("_ref_fingerprints", {}))
    return groups[numel]


def _beyond(c: torch.Tensor, values: list[torch.Tensor | None], limit: float) -> list[bool]:
    """For each of `values` (each as many elements as `c`), whether `best_layout` of `c` against it must come out
    above relative error `limit`, found at once for them all: of the same shape, its plain error (the only one
    `best_layout` takes); of another, the error of both sides sorted, below which no reordering of the
    elements goes.  Computed in float64, with a margin for the float32 norms of `_rel_err`; False wherever
    that cannot be said (a NaN or an infinity, a zero reference, a value not at hand or too large)."""
    out = [False] * len(values)
    if c.numel() > BEYOND_MAX_NUMEL or not c.is_floating_point() or c.layout != torch.strided:
        return out
    flat = c.detach().reshape(-1).to(torch.float64)
    if not bool(torch.isfinite(flat).all()):
        return out
    ok = [j for j, v in enumerate(values) if v is not None and v.is_floating_point() and v.layout == torch.strided
          and v.device == c.device and v.numel() == c.numel()]
    for same in (True, False):
        js = [j for j in ok if (tuple(values[j].shape) == tuple(c.shape)) == same]
        if not js:
            continue
        refs = torch.stack([values[j].detach().reshape(-1).to(torch.float64) for j in js])
        mine = flat.expand_as(refs)
        if not same:
            refs, mine = torch.sort(refs, dim=1).values, torch.sort(flat).values.expand_as(refs)
        err = (mine - refs).norm(dim=1) / refs.norm(dim=1)
        for j, e, fin in zip(js, err.tolist(), torch.isfinite(refs).all(dim=1).tolist()):
            out[j] = fin and math.isfinite(e) and e > limit * (1 + 1e-4)
    return out


def _closest_by_value(state: AlignState, c: Record, c_value: torch.Tensor, fc: torch.Tensor,
                      group: _Contenders, allowed: Callable[[int], bool] = lambda ri: True) -> _ValueMatch | None:
    """The free contender (one `allowed`) whose values are closest to `c`'s within VALUE_MATCH_REL_ERR
    (priors break near-ties), screening by fingerprint before comparing the few best in full."""
    free = (~state.ref_taken()[group.ref_ids]).nonzero().squeeze(1)  # (scored alone: most may be paired)
    free, fps = group.rows(free)
    if free.numel() == 0:
        return None
    scale = float(fc.abs().max()) or 1.0
    prior = (VALUE_PRIOR_OTHER_SCOPE * (group.scope_ids[free] != group.scope_id(c.scope)).to(torch.float64)
             + VALUE_PRIOR_POSITION * (group.positions[free] - c.index / max(len(state.cand), 1)).abs())
    score = (fps - fc).abs().max(dim=1).values / scale + prior
    # the VALUE_CONTENDERS of lowest score among the free ones `allowed` (asked lazily, best first)
    picked = []
    for k in torch.argsort(score, stable=True).tolist():
        if allowed(group.refs[int(free[k])]):
            picked.append((int(free[k]), float(prior[k])))
            if len(picked) == VALUE_CONTENDERS:
                break
    top, priors = [k for k, _ in picked], [p for _, p in picked]
    best: _ValueMatch | None = None
    values: list[torch.Tensor | None] = []  # (fetched once: a streaming diff's reference values may be stored)
    beyond: list[bool] = []
    for n, (k, p) in enumerate(zip(top, priors)):
        ri = group.refs[k]
        if n == 1:  # the closest fingerprint did not hold `c`'s values: the rest screened at once
            values = [state.ref_value(state.ref[group.refs[j]]) for j in top[1:]]
            beyond = _beyond(c_value, values, VALUE_MATCH_REL_ERR)
        if n and beyond[n - 1]:
            continue  # further from `c`'s values than any layout could bring within VALUE_MATCH_REL_ERR
        layout = best_layout(c_value, values[n - 1] if n else state.ref_value(state.ref[ri]))
        err = layout.rel_err
        if err <= VALUE_MATCH_REL_ERR and (best is None or err + p < best.score):
            best = _ValueMatch(ref=ri, transform=layout.transform, rel_err=err, score=err + p)
        if err < IDENTICAL_REL_ERR and (k == top[0] or p <= min(priors)):
            break  # the closest fingerprint holds identical values: no need to look further
    return best


def pass_value(state: AlignState) -> None:
    """Pair each unpaired candidate record whose value is at hand with the free reference record of
    equal element count whose values are closest in some layout (see `best_layout`), within
    VALUE_MATCH_REL_ERR, and whose pairing does not contradict the dataflow (`compatible`).
    One-to-one.  Skipped unless `state.value_match`."""
    if not state.value_match:
        return
    rcov, ccov = state.covers()
    by_numel: dict[int, list[int]] = {}
    for r in state.ref:
        by_numel.setdefault(record_numel(r), []).append(r.index)
    for c in state.cand:
        if c.index in state.pairs:
            continue
        numel = record_numel(c)
        if not by_numel.get(numel):  # no reference record of its size: nothing to fetch or fingerprint
            continue
        group = _numel_group(state, numel)
        if not group.refs or bool(state.ref_taken()[group.ref_ids].all()):
            continue  # (every reference record of its size is paired)
        c_value = state.cand_value(c)
        if c_value is None:
            continue
        fc = _fingerprint(c, v=c_value)
        if fc is None:
            continue
        best = _closest_by_value(state, c, c_value, fc, group,
                                 lambda ri: state.compatible(c.index, ri, ccov, rcov))
        if best is not None and best.rel_err > VALUE_UNSUPPORTED_REL_ERR \
                and not _params_support(ccov[c.index], rcov[best.ref]):
            best = None  # close values, but computed from other parameters: a coincidence of the data
        if best is not None:
            state.add(c.index, best.ref, "value", value_confidence(best.rel_err), best.transform)
            state.errors[c.index] = best.rel_err


def _params_support(c_cover: Cover, r_cover: Cover) -> bool:
    """The parameters read upstream agree: none on either side, or some of the same ones."""
    return (not c_cover[1] and not r_cover[1]) or bool(c_cover[1] & r_cover[1])


def _cached_fingerprint(state: AlignState, side: str, i: int) -> torch.Tensor | None:
    """`_fingerprint` of one side's record, computed once per alignment."""
    cache = state.__dict__.setdefault("_fingerprints", {})
    key = (side, i)
    if key not in cache:
        rec = (state.ref if side == "ref" else state.cand)[i]
        v = (state.ref_value if side == "ref" else state.cand_value)(rec)
        cache[key] = _fingerprint(rec, v=v) if v is not None else None
    return cache[key]


def _later_holds(state: AlignState, contenders: list[int], later: list[int], bar: float) -> bool:
    """Whether one of the candidate records `later` holds the values of one of the reference records
    `contenders` within relative error `bar` (the closest by fingerprint, VALUE_CONTENDERS of them,
    compared in full)."""
    if not later:
        return False
    fps = [(x, _cached_fingerprint(state, "cand", x)) for x in later]
    fps = [(x, f) for x, f in fps if f is not None]
    if not fps:
        return False
    stacked = torch.stack([f for _, f in fps])
    for ri in contenders:
        fr = _cached_fingerprint(state, "ref", ri)
        if fr is None:
            continue
        scale = float(fr.abs().max()) or 1.0
        order = torch.argsort((stacked - fr).abs().max(dim=1).values / scale)[:VALUE_CONTENDERS].tolist()
        for k in order:
            err = _value_err(state, state.cand[fps[k][0]], state.ref[ri])
            if err is not None and err <= bar:
                return True
    return False


def _holds_another(state: AlignState, ci: int, ri: int) -> _ValueMatch | None:
    """The reference record other than `ri` whose values the candidate record holds (in some layout,
    within ANOTHER_ROLE_REL_ERR), closest first by fingerprint; None if it holds no other's."""
    c = state.cand[ci]
    w = state.cand_value(c)
    fc = _fingerprint(c, v=w) if w is not None else None
    if fc is None:
        return None
    refs, fps = _numel_group(state, record_numel(c)).all_rows()
    if not refs or refs == [ri]:
        return None
    scale = float(fc.abs().max()) or 1.0
    order = torch.argsort((fps - fc).abs().max(dim=1).values / scale, stable=True).tolist()
    for other in [refs[k] for k in order if refs[k] != ri][:VALUE_CONTENDERS]:
        layout = best_layout(w, state.ref_value(state.ref[other]).to(w.device))
        if layout.rel_err <= ANOTHER_ROLE_REL_ERR:
            return _ValueMatch(ref=other, transform=layout.transform, rel_err=layout.rel_err, score=layout.rel_err)
    return None
