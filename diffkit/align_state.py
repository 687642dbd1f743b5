"""What the alignment passes share (`AlignState`: both sides' records, values and dataflow, the pairs made so
far) and what they make (`Pair`, `Alignment`).  Part of `diffkit.align`."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .align_graph import Cover, Dataflow, compatible, covers, reused_name
from .align_layout import (RESHAPE, SHAPE_MISMATCH, Layout, _refines, _rel_err, best_layout, permuted, record_numel,
                           to_ref_layout)
from .align_tuning import (DATAFLOW_CONFIDENCE, NAME_CONFIDENCE, NAME_MATCH_REL_ERR, PREFETCH_BYTES,
                           REBOUND_NAME_CONFIDENCE, UNCHECKED_REBOUND_CONFIDENCE)
from .capture import Record
from .measure import _FAST_DTYPES as _FAST
from .measure import measure_async, measure_many, tolerances


ValueReader = Callable[[Record], "torch.Tensor | None"]


@dataclass
class Pair:
    """One candidate record paired with the reference record it should equal."""

    ref: int  # index into the reference's records
    cand: int  # index into the candidate's records
    via: str  # the pass that made it: "name" | "dataflow" | "order" | "value"
    confidence: float  # how strong that pass's evidence is, in (0, 1]: see the *_CONFIDENCE constants
    transform: tuple = ()  # how the candidate's value is brought into the reference's layout (see RESHAPE)

    def __post_init__(self):
        if not 0.0 < self.confidence <= 1.0:
            raise ValueError(f"a pair's confidence is in (0, 1], got {self.confidence!r}")

    @property
    def paired_by(self) -> str:
        """The pass that made the pair (the name stages and reports show)."""
        return self.via

    def describe_transform(self) -> str:
        """The transform in words for a report: '', 'reshape', 'permute(0, 2, 1)+reshape', …"""
        if not self.transform:
            return ""
        if self.transform[0] == "reshape":
            return "reshape"
        if self.transform[0] == "permute":
            return f"permute{tuple(self.transform[1])}+reshape"
        if self.transform[0] == "unpermute":
            return f"reshape+permute{tuple(self.transform[2])}"
        return str(self.transform)


@dataclass
class Alignment:
    """Pairs in candidate order, plus what stayed unmatched on either side."""

    pairs: list[Pair] = field(default_factory=list)
    ref_unmatched: list[int] = field(default_factory=list)
    cand_unmatched: list[int] = field(default_factory=list)
    dropped: list[Pair] = field(default_factory=list)  # pairs `pass_consistency` undid (two different roles)
    # full metrics measured while pairing (ref, cand, transform) -> measure.Stats, for locate to reuse
    measured: dict = field(default_factory=dict)
    # the candidate's parameter names -> the reference's counterparts it paired by (`param_map`,
    # `map_params_by_use`); diagnosis reads weights through it
    rename: dict = field(default_factory=dict)

    def by_cand(self) -> dict[int, Pair]:
        return {p.cand: p for p in self.pairs}


def _value_reader(fetch: ValueReader | None) -> ValueReader:
    """A record's value: the one it holds, else (given `fetch`) the one fetched lazily for it."""

    def value(rec: Record) -> torch.Tensor | None:
        if rec.value is not None or fetch is None:
            return rec.value
        return fetch(rec)

    return value


@dataclass
class Deferred:
    """A name or order pair set aside: a reused variable's name whose values disagree."""

    ref: int
    cand: int
    via: str  # the pass that proposed it
    rel_err: float  # the candidate's relative L2 distance from the reference in its best layout


def _new_bytes(t: torch.Tensor, kept) -> int:
    """The bytes `t` adds to what a record keeps (`kept`, its value or None): none where it lies in the same
    memory (the value itself, or a view of it)."""
    if isinstance(kept, torch.Tensor) and kept.device == t.device:
        try:
            if t.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr():
                return 0
        except (RuntimeError, NotImplementedError):
            pass
    return t.numel() * t.element_size()


@dataclass
class AlignState:
    """What the passes share: both sides' records, values and dataflow, and the pairs made so far.

    A pass reads the records, pairs with `add` (or `add_checked`, which sets a pair on a reused
    name aside in `deferred` when its values disagree) and leaves paired records alone.  Pairs are
    one-to-one: a reference record pairs with one candidate record at most."""

    ref: list[Record]
    cand: list[Record]
    ref_value: ValueReader  # a reference record's value, fetched lazily where the record holds none
    cand_value: ValueReader
    value_match: bool = True  # whether `pass_value` runs
    rename: dict[str, str] = field(default_factory=dict)  # candidate parameter name -> the reference's
    pairs: dict[int, Pair] = field(default_factory=dict)  # candidate index -> its pair
    paired_ref: dict[int, int] = field(default_factory=dict)  # reference index -> the candidate paired with it
    deferred: dict[int, Deferred] = field(default_factory=dict)  # candidate index -> the pair set aside
    proposed: dict[int, int] = field(default_factory=dict)  # candidate -> reference: a reused name, for later
    superseded: set = field(default_factory=set)  # candidate records whose stage a continuation took over
    errors: dict[int, float] = field(default_factory=dict)  # candidate index -> its pair's relative L2 error
    dropped: list[Pair] = field(default_factory=list)
    # (atol, rtol) by reference dtype: a pair whose error is asked for is measured in full once, and
    # locate reuses those metrics (`measured`: (ref, cand, transform) -> Stats)
    tolerance: Callable[[torch.dtype], tuple[float, float]] | None = None
    measured: dict = field(default_factory=dict)
    _flows: tuple | None = field(default=None, repr=False)

    @classmethod
    def start(cls, ref: list[Record], cand: list[Record], value_match: bool = True, *,
              fixed: dict[int, tuple] | None = None, ref_value: ValueReader | None = None,
              cand_value: ValueReader | None = None, rename: dict[str, str] | None = None) -> AlignState:
        """The state before any pass: `fixed` (candidate index → (reference index, transform[, relative
        error[, the pass that made it, "name" by default]])) are pairs made already (a streaming diff
        pairs as records are produced)."""
        state = cls(ref, cand, _value_reader(ref_value), _value_reader(cand_value), value_match, dict(rename or {}))
        for ci, fix in (fixed or {}).items():
            ri, transform = fix[0], fix[1]
            via = fix[3] if len(fix) > 3 else "name"
            if via == "dataflow":
                confidence = DATAFLOW_CONFIDENCE
            else:
                confidence = REBOUND_NAME_CONFIDENCE if reused_name(cand[ci], ref[ri]) else NAME_CONFIDENCE
            state.add(ci, ri, via, confidence, transform)
            if len(fix) > 2 and fix[2] is not None:
                state.errors[ci] = float(fix[2])
        return state

    @property
    def ref_flow(self) -> Dataflow:
        return self.flows()[0]

    @property
    def cand_flow(self) -> Dataflow:
        return self.flows()[1]

    def flows(self) -> tuple[Dataflow, Dataflow]:
        """Both sides' dataflow graphs (built once)."""
        if self._flows is None:
            self._flows = (Dataflow.of(self.ref), Dataflow.of(self.cand, self.rename))
        return self._flows

    def partner(self, ci: int) -> int | None:
        """The reference record a candidate record is paired with, if any."""
        p = self.pairs.get(ci)
        return None if p is None else p.ref

    def covers(self) -> tuple[list[Cover], list[Cover]]:
        """Both sides' covers (see `covers`) under the pairs made so far."""
        rf, cf = self.flows()
        paired = self.paired_ref
        partners = {ci: p.ref for ci, p in self.pairs.items()}
        return (covers(rf, {i: i for i in paired}.get), covers(cf, partners.get))

    def compatible(self, ci: int, ri: int, ccov: list[Cover], rcov: list[Cover]) -> bool:
        """`compatible` for one candidate and one reference record, under the given covers."""
        rf, cf = self.flows()
        if not (rf.known and cf.known):
            return True
        return compatible(ccov[ci], rcov[ri], cf.ancestors[ci], rf.ancestors[ri], self.paired_ref.get)

    def by_numel(self, side: str) -> dict[int, list[int]]:
        """One side's record indices by element count, in order (built once)."""
        key = "_numel_" + side
        hit = self.__dict__.get(key)
        if hit is None:
            hit = {}
            for r in (self.ref if side == "ref" else self.cand):
                hit.setdefault(record_numel(r), []).append(r.index)
            self.__dict__[key] = hit
        return hit

    def numel_agrees(self, ci: int, ri: int) -> bool:
        return record_numel(self.cand[ci]) == record_numel(self.ref[ri])

    def best(self, ci: int, ri: int) -> Layout | None:
        """`best_layout` of a candidate record against a reference record (cached), None where a
        value is not at hand."""
        cache = self.__dict__.setdefault("_layouts", {})
        key = (ci, ri)
        if key not in cache:
            w = self.cand_value(self.cand[ci])
            v = self.ref_value(self.ref[ri]) if w is not None else None
            cache[key] = best_layout(w, v.to(w.device)) if v is not None else None
        return cache[key]

    def layout(self, ci: int, ri: int) -> tuple:
        """The transform for a pair of equal element counts: none for equal shapes, else the layout
        closest in value (a plain reshape where the values are not at hand)."""
        c, r = self.cand[ci], self.ref[ri]
        if c.shape == r.shape:
            return ()
        got = self.best(ci, ri)
        return got.transform if got is not None else RESHAPE

    def add(self, ci: int, ri: int, via: str, confidence: float, transform: tuple | None = None) -> Pair:
        """Pair candidate `ci` with reference `ri` (`transform`: as given, else `layout`)."""
        pair = Pair(ref=ri, cand=ci, via=via, confidence=confidence,
                    transform=self.layout(ci, ri) if transform is None else transform)
        self.pairs[ci] = pair
        self.paired_ref.setdefault(ri, ci)
        taken = self.__dict__.get("_ref_taken")
        if taken is not None:
            taken[ri] = True
        return pair

    def ref_taken(self) -> torch.Tensor:
        """A bool per reference record: paired (`paired_ref`), kept up to date by `add` and `remove`."""
        taken = self.__dict__.get("_ref_taken")
        if taken is None:
            taken = self.__dict__["_ref_taken"] = torch.zeros(len(self.ref), dtype=torch.bool)
            if self.paired_ref:
                taken[torch.tensor(list(self.paired_ref), dtype=torch.long)] = True
        return taken

    def remove(self, ci: int) -> Pair:
        """Undo the pair of candidate `ci`."""
        pair = self.pairs.pop(ci)
        self.errors.pop(ci, None)
        if self.paired_ref.get(pair.ref) == ci:
            del self.paired_ref[pair.ref]
            taken = self.__dict__.get("_ref_taken")
            if taken is not None:
                taken[pair.ref] = False
        return pair

    def _pair_values(self, ci: int) -> tuple[Pair, torch.Tensor, torch.Tensor] | None:
        """A pair's reference value and its candidate value in the reference's layout, None where a
        value is not at hand or not floating."""
        p = self.pairs.get(ci)
        if p is None or p.transform == SHAPE_MISMATCH:
            return None
        r = self.ref[p.ref]
        w = self.cand_value(self.cand[ci])
        v = self.ref_value(r) if w is not None else None
        if v is None or not (v.is_floating_point() or v.is_complex()):
            return None
        return p, v, to_ref_layout(w, tuple(r.shape), p.transform).to(v.device)

    def _fast(self, v: torch.Tensor, cv: torch.Tensor) -> tuple[float, float] | None:
        """The tolerance to measure a pair's full metrics by, None where the fast metric paths do
        not take its dtypes."""
        if v.is_floating_point() and cv.is_floating_point() and v.dtype in _FAST and cv.dtype in _FAST:
            return (self.tolerance or (lambda d: tolerances(None, None, d)))(v.dtype)
        return None

    def _settle(self, ci: int, p: Pair, v: torch.Tensor, cv: torch.Tensor, pending) -> float:
        err = None
        if pending is not None:
            # the pair's full metrics (the stage will need them), its relative error with them
            st = pending.result()
            if not (st.ref_nan or st.ref_inf or st.cand_nan or st.cand_inf):
                self.measured[(p.ref, ci, p.transform)] = st
                err = pending.rel_l2
        if err is None:
            err = _rel_err(cv, v)
        self.errors[ci] = err
        return err

    def pair_error(self, ci: int) -> float | None:
        """The relative L2 distance of a pair's candidate (in the pair's layout) from its reference,
        None where a value is not at hand."""
        if ci in self.errors:
            return self.errors[ci]
        got = self._pair_values(ci)
        if got is None:
            return None
        p, v, cv = got
        tol = self._fast(v, cv)
        return self._settle(ci, p, v, cv, measure_async(v, cv, *tol) if tol is not None else None)

    def prefetch_errors(self, cis: Sequence[int]) -> None:
        """`pair_error` for many pairs at once: their metrics measured together (`measure_many`: one
        launch per batch on CUDA, worker threads on the CPU), so later `pair_error` calls find them."""
        todo, items, held = [], [], 0

        def flush():
            for (ci, (p, v, cv)), pending in zip(todo, measure_many(items) if items else ()):
                self._settle(ci, p, v, cv, pending)
            todo.clear()
            items.clear()

        for ci in cis:
            if ci in self.errors:
                continue
            got = self._pair_values(ci)
            if got is None:
                continue
            tol = self._fast(got[1], got[2])
            if tol is not None:
                todo.append((ci, got))
                items.append((got[1], got[2], *tol))
                # values read from a store (streaming), or copied into the reference's layout, are held only a
                # batch at a time; those the records keep anyway are not counted (a full capture's pairs go in
                # one batch: each batch costs its launches and a wait for its results)
                held += _new_bytes(got[1], self.ref[got[0].ref].value) + _new_bytes(got[2], self.cand[ci].value)
                if held >= PREFETCH_BYTES:
                    flush()
                    held = 0
        flush()

    def add_checked(self, ci: int, ri: int, via: str, confidence: float) -> None:
        """`add`, unless the pair is on a reused name (`reused_name`) and its values disagree beyond
        NAME_MATCH_REL_ERR: then it is set aside in `deferred` for the value pass to overrule."""
        c, r = self.cand[ci], self.ref[ri]
        if not reused_name(c, r):
            self.add(ci, ri, via, confidence)
            return
        w = self.cand_value(c)
        v = self.ref_value(r) if w is not None else None
        if v is None:
            self.add(ci, ri, via, min(confidence, UNCHECKED_REBOUND_CONFIDENCE))
            return
        layout = best_layout(w, v)
        if layout.rel_err > NAME_MATCH_REL_ERR:
            self.deferred[ci] = Deferred(ref=ri, cand=ci, via=via, rel_err=layout.rel_err)
            return
        self.add(ci, ri, via, min(confidence, REBOUND_NAME_CONFIDENCE), layout.transform)
        self.errors[ci] = layout.rel_err

    def alignment(self) -> Alignment:
        return Alignment(measured=self.measured, pairs=[self.pairs[ci] for ci in sorted(self.pairs)],
                         ref_unmatched=[r.index for r in self.ref if r.index not in self.paired_ref],
                         cand_unmatched=[c.index for c in self.cand if c.index not in self.pairs],
                         dropped=list(self.dropped), rename=dict(self.rename))


def layout_known(state: AlignState, ci: int, ri: int) -> bool:
    """Whether the layout comparing two records of equal element count is known: equal shapes, one
    shape the other with consecutive axes merged (a reshape), or a permutation the values confirm.
    Values that are wrong cannot say which axes a permuted layout swapped: such a pair would compare
    elements that do not correspond."""
    c, r = tuple(state.cand[ci].shape), tuple(state.ref[ri].shape)
    if c == r or _refines(c, r) or _refines(r, c):
        return True
    return permuted(state.layout(ci, ri))


def _value_err(state: AlignState, c: Record, r: Record) -> float | None:
    got = state.best(c.index, r.index)
    return None if got is None else got.rel_err
