"""The words that describe a Result: one place, read by every surface.

The terminal report, the HTML banner, summary.md, junit.xml, the notebook view and the pytest
assertion all take their sentences from here, so a divergence reads the same wherever it is seen
and a change of wording is made once.

Nothing here may raise on a partial Result: a stage without metrics (the shapes differ), without
a reference or candidate record, without a re-run on the reference's inputs, NaN or Inf numbers,
no stages at all, or an error with no details all get words.
"""
from __future__ import annotations

import math

import os

MISSING = "-"


# ----------------------------------------------------------------------------- small pieces
def clip(text, width: int) -> str:
    """`text` cut to `width` characters for a terminal, ending in "…" when anything was dropped (so the reader
    knows it was); unchanged when it fits."""
    text = "" if text is None else str(text)
    if width < 1:
        return ""
    return text if len(text) <= width else text[:width - 1] + "…"


def fmt(x, spec: str = ".3g", missing: str = MISSING) -> str:
    """`x` formatted with `spec`; `missing` for None; NaN and Inf as Python writes them."""
    if x is None:
        return missing
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def pct(fraction, missing: str = MISSING) -> str:
    """A fraction in [0, 1] as a percentage with one decimal ("12.5%"); a share above zero that would
    show as 0.0% (one element in thousands) keeps two significant digits ("0.024%")."""
    if fraction is None:
        return missing
    if 0 < 100 * fraction < 0.05:
        return f"{fmt(100 * fraction, '.2g')}%"
    return f"{fmt(100 * fraction, '.1f')}%"


def shape_text(shape) -> str:
    """A shape as ``4×16×32``; "scalar" for a 0-d tensor; "-" when there is no shape."""
    if shape is None:
        return MISSING
    shape = list(shape)
    return "×".join(map(str, shape)) if shape else "scalar"


def where(record) -> str:
    """The source location of a record ("file.py:12"), or "" when there is no record."""
    return (getattr(record, "where", "") or "") if record is not None else ""


def op(record) -> str:
    return (getattr(record, "op", "") or "") if record is not None else ""


def stage_names(stage) -> str:
    """The stage's reference name, with the candidate's added when the two differ."""
    r, c = stage.ref_name, stage.cand_name
    if r is None or c is None or r == c:
        return r or c or "?"
    return f"{r} (candidate: {c})"


def transform_text(stage) -> str:
    """How the candidate was brought into the reference's layout before the comparison; "" when
    it was not (a stage with no metrics was never compared, whatever its pairing noted)."""
    return (stage.transform or "") if stage.stats is not None else ""


def tolerance_text(atol, rtol, stat: str = "elementwise") -> str:
    text = f"atol={fmt(atol, 'g')} rtol={fmt(rtol, 'g')}"
    return text if stat in ("elementwise", None) else f"{text} on the {stat} error (--stat {stat})"


def judged_text(stats) -> str:
    """How a pair fares against its tolerance: the share of elements out of it (the elementwise rule),
    or, with --stat max/mean/median, that statistic of |error| against its bound."""
    share = f"{pct(stats.mismatch_fraction)} of {stats.numel} elements out of {tolerance_text(stats.atol, stats.rtol)}"
    if getattr(stats, "stat", "elementwise") == "elementwise" or stats.stat_error is None:
        return share
    verdict = "within" if stats.ok else "over"
    return (f"{stats.stat} |error| {fmt(stats.stat_error, '.4g')} {verdict} its bound {fmt(stats.stat_bound, '.4g')} "
            f"(atol + rtol x {stats.stat} |reference|, --stat {stats.stat}); elementwise {share}")


def output_shape_words(mismatch) -> str:
    """An output shape mismatch in KernelBench's own words."""
    ref, cand = mismatch
    return f"Output shape mismatch: Expected {list(ref)}, got {list(cand)}"


def output_structure_words(structure) -> str:
    """Outputs whose nesting or number of tensors differs (the shape message's sibling)."""
    ref, cand = structure
    return f"Output structure mismatch: Expected {ref}, got {cand}"


def not_compared_reason(stage) -> str:
    """Why a stage has no metrics: its note (e.g. the two shapes), else the shapes themselves."""
    if stage.note:
        return stage.note
    if stage.ref is None or stage.cand is None:
        return f"no {'reference' if stage.ref is None else 'candidate'} counterpart"
    if stage.ref_shape != stage.cand_shape:
        return f"shape mismatch: reference {stage.ref_shape}, candidate {stage.cand_shape}"
    return "not compared"


def stats_summary(stats) -> str:
    """One sentence of a pair's numbers: largest and mean error and the share out of tolerance."""
    return f"max |error| {fmt(stats.max_abs, '.4g')}, mean {fmt(stats.mean_abs, '.4g')}, {judged_text(stats)}"


def worst_summary(worst) -> str:
    """The worst element: its index and both values."""
    return f"{list(worst.index)}: reference {fmt(worst.ref, '.6g')}, candidate {fmt(worst.cand, '.6g')}"


def introduces(stage) -> bool | None:
    """Whether a stage introduces error of its own: re-run alone on the reference's inputs (`stage.local`,
    rootcause.py) it is still out of tolerance (True), or there it is within tolerance and only inherits the
    error of its inputs (False); None when it was not re-run.  The words every surface uses ("this stage
    introduces the error" / "only inherits")."""
    local = getattr(stage, "local", None)
    return None if local is None else not local.ok


def rerun_summary(stage) -> str:
    """What re-running the stage alone on the reference's inputs showed ("" when it was not re-run)."""
    if stage.local is None:
        return stage.replay_note or ""
    verb = "introduces" if introduces(stage) else "only inherits"
    return (f"re-run alone on the reference's inputs: max_abs {fmt(stage.local.max_abs, '.4g')} — this stage {verb} "
            f"the error (its inputs carried max_abs {fmt(stage.inherited_max_abs or 0, '.3g')})")


def root_cause_summary(stage) -> str:
    """The root-cause stage in one sentence (names, what the re-run showed)."""
    text = f"stage {stage.index} {stage.ref_name or stage.cand_name or '?'} introduces the error"
    if stage.local is not None:
        text += f" (re-run on the reference's inputs: max |error| {fmt(stage.local.max_abs, '.3g')})"
    return text


def failure_summary(error) -> str:
    """A side's failure in one sentence."""
    return (f"{error.side} failed ({error.phase})" + (f" at {error.stage}" if error.stage else "")
            + f": {error.message}")


def _tolerance(result) -> dict:
    try:
        return result.tolerance()
    except Exception:  # a hand-built Result without tolerances still gets a headline
        return {"atol": result.atol, "rtol": result.rtol, "by_dtype": False}


def _earlier_matches(result, stage) -> int:
    return sum(1 for x in result.stages if x.index < stage.index and x.status == "ok")


def _is_output(stage) -> bool:
    return bool(getattr(stage.cand, "is_output", False)) if stage.cand is not None else False


# ----------------------------------------------------------------------------- trials
def _trials(result) -> list[dict]:
    return [t for t in (getattr(result, "trials", None) or []) if isinstance(t, dict)]


def reported_trial(result) -> dict | None:
    """The trial whose stages the result shows: the first failing one (else trial 1)."""
    trials = _trials(result)
    return next((t for t in trials if not t.get("allclose", True)), trials[0] if trials else None)


def kernelbench_passes(t: dict) -> bool:
    """Whether KernelBench's torch.allclose passes a trial (its own answer where the rule in force, --stat or
    --tolerance auto, said otherwise)."""
    kb = t.get("kernelbench")
    return bool(t.get("allclose", False) if kb is None else kb)


def trial_outcome(t: dict) -> str:
    """One trial in words: "pass (max_abs 3.1e-07)", "FAIL: output max_abs 0.42 in the candidate's second run" …"""
    if t.get("error"):
        side = t.get('error_side') or 'candidate'
        if str(t["error"]).startswith(f"the {side} "):  # a process that crashed, hung or exited: said whole
            return f"ERROR: {t['error']}"
        return f"ERROR: the {side} raised {t['error']}"
    if t.get("shape_mismatch"):
        ref, cand = t["shape_mismatch"]
        return f"FAIL: {output_shape_words((ref, cand))}"
    if t.get("dtype_mismatch"):
        ref, cand = t["dtype_mismatch"]
        return (f"FAIL: the output is {cand}, the reference's {ref} (torch.allclose refuses mixed dtypes, so "
                f"KernelBench fails it)")
    numbers = f"max_abs {fmt(t.get('max_abs'))}, mean_abs {fmt(t.get('mean_abs'))}"
    if kernelbench_passes(t) != bool(t.get("allclose", False)):  # the rule in force is not KernelBench's
        text = (f"pass by the rule in force, but KernelBench's torch.allclose FAILS it ({numbers})"
                if t.get("allclose", False) else
                f"FAIL by the rule in force, though KernelBench's torch.allclose passes it (output {numbers})")
    elif t.get("allclose", False):
        text = f"pass ({numbers})"
    else:
        text = f"FAIL: output {numbers}" + (" in the candidate's second run on the same inputs (its first passed)"
                                           if t.get("failed_run") == 2 else "")
    nd = t.get("nondeterministic")
    if nd:
        text += (f"; the candidate's two runs differ bitwise in {nd.get('where', 'the output')} "
                 f"({nd.get('elements')} of {nd.get('numel')} elements)")
    return text


def trials_summary(result) -> str:
    """The trials in one clause: "passes 5 of 5 KernelBench trials", "diverges on trial 3 of 5
    (seed 123…), fails 2 of 5 trials"; "" for a single trial."""
    trials = _trials(result)
    if len(trials) < 2 and not (trials and trials[0].get("failed_run") == 2):
        return ""
    asked = (getattr(result, "meta", None) or {}).get("trials", {}).get("asked", len(trials))
    failed = [t for t in trials if not t.get("allclose", True)]
    denied = [t for t in trials if not kernelbench_passes(t)]
    if not failed and denied:  # the rule in force passes what KernelBench's torch.allclose fails
        return (f"within tolerance in {len(trials)} of {asked} trials by the rule in force, but KernelBench's "
                f"torch.allclose fails {len(denied)} of them (trial {denied[0].get('trial')} first)")
    if not failed:
        form = (getattr(result, "meta", None) or {}).get("reference_returns")
        if form:  # compared tensor by tensor: KernelBench's own evaluator fails any candidate of this reference
            return (f"passes {len(trials)} of {asked} trials tensor by tensor (KernelBench's evaluator fails every "
                    f"candidate of a reference returning a {form})")
        return f"passes {len(trials)} of {asked} KernelBench trials"
    first = failed[0]
    return (f"diverges on trial {first.get('trial')} of {asked} (seed {first.get('seed')}), fails {len(failed)} of "
            f"{len(trials)} trials run")


def _trial_headline(result) -> str:
    """The headline of a divergence that only the trials show (the diffed run itself passed)."""
    t = reported_trial(result)
    if t is None or t.get("allclose", True):
        return ""
    asked = (getattr(result, "meta", None) or {}).get("trials", {}).get("asked", len(_trials(result)))
    where = f"on trial {t.get('trial')} of {asked} (seed {t.get('seed')})" if asked > 1 else f"(seed {t.get('seed')})"
    text = f"diffkit: DIVERGED {where}: {trial_outcome(t).removeprefix('FAIL: ')}"
    if (t.get("nondeterministic") or {}).get("stateful"):
        text += "; the candidate's forward changes its own state (see the findings)"
    elif t.get("failed_run") == 2 or t.get("nondeterministic"):
        text += "; the candidate is nondeterministic (a race, an uninitialised read or randomness)"
    summary = trials_summary(result)
    return text + (f"; {summary.split(', ', 1)[1]}" if ", " in summary else "")


# ----------------------------------------------------------------------------- the headline
# a diagnosis kind in the one-line answer where its identifier alone would not say what it means
KIND_WORDS = {"other_weights": "other weights (the models were built with other parameter values)",
              "mask_value": "a mask written as a large number on one side, as infinity on the other",
              "integer_values": "other integer values (indices, counts or flags compare exactly)"}


def headline(result) -> str:
    """The one-line answer: verdict, where it first went wrong, by how much and what it looks like."""
    tol = _tolerance(result)
    tol_s = tolerance_text(tol["atol"], tol["rtol"], tol.get("stat", "elementwise"))
    n = len(result.compared)
    fd = result.first_divergence
    if result.verdict == "error":
        e = result.error
        head = (f"diffkit: ERROR {'in ' + e.side + ' ' if e.side else ''}({e.phase}) at {e.stage or '?'}: {e.message}"
                if e is not None else "diffkit: ERROR (no details recorded)")
        if fd is not None:
            return head + f"; earlier, first divergence at stage {fd.index} {fd.ref_name or fd.cand_name or '?'}"
        if not n:
            return head
        # (the output compared: the diff ran to its end -- a later trial failed, or a failure that did not repeat
        # when the diff was run again)
        reached = any(s.stats is not None for s in result.output_stages)
        return head + (f"; {n} stages compared, the output among them, all within tolerance" if reached
                       else f"; {n} stages compared before it, all within tolerance")
    if result.verdict == "diverged":
        structure = getattr(result, "output_structure", None)
        if structure and (fd is None or _is_output(fd)):
            return f"diffkit: DIVERGED: {output_structure_words(structure)}"
        mismatch = result.output_shape_mismatch
        if mismatch and (fd is None or _is_output(fd)):
            return f"diffkit: DIVERGED: {output_shape_words(mismatch)}"
        trial_head = _trial_headline(result)
        outs = getattr(result, "output_stages", [])
        output_failed = bool(mismatch) or any(s.failed or s.stats is None for s in outs)
        if trial_head and not output_failed and not getattr(result, "strict", False):  # only a trial shows it
            return trial_head
        if fd is not None:
            head = _diverged_headline(result, fd)
            summary = trials_summary(result)
            return head + (f"; {summary}" if summary else "")
        failed = len(result.diverged_stages)
        out = result.output
        return (f"diffkit: DIVERGED: {failed} stages out of tolerance"
                + (f"; output max_abs={fmt(out.max_abs)}" if out is not None else ""))
    warn = (f" ({len(result.diverged_stages)} intermediate stages out of tolerance: see warnings)"
            if result.diverged_stages else "")
    out = result.output
    o = f" output max_abs={fmt(out.max_abs)}" if out is not None else ""
    summary = trials_summary(result)
    return f"diffkit: MATCH: {n} stages compared within {tol_s};{o}{warn}" + (f"; {summary}" if summary else "")


def nonfinite_words(s) -> str:
    """Where the two sides' NaNs or infinities disagree, in words for beside max_abs (which is taken over
    the elements finite on both sides): "" when they agree."""
    if s is None:
        return ""
    w = s.worst
    odd = w is not None and (math.isnan(w.ref) or math.isnan(w.cand) or math.isinf(w.ref) or math.isinf(w.cand))
    if not (s.ref_nan or s.cand_nan or s.ref_inf != s.cand_inf or odd):
        return ""
    parts = [f"{n} {what}" for n, what in ((s.cand_nan, "NaN in the candidate"), (s.ref_nan, "NaN in the reference"),
                                           (s.cand_inf, "inf in the candidate"), (s.ref_inf, "inf in the reference"))
             if n]
    return f" (over finite elements; {', '.join(parts) or 'non-finite values'}: |difference| there is inf or NaN)"


def explaining_what_if(result) -> dict | None:
    """The best what-if run (diffkit.whatif) when it reproduces the candidate within tolerance (`explains`) and says
    what it planted, else None: a run of the reference with that mistake gives the candidate's values, which the
    headline and the suite's diagnosis column put before a pattern's diagnosis."""
    best = next((w for w in (getattr(result, "what_if", None) or []) if isinstance(w, dict)), None)
    return best if best is not None and best.get("explains") and best.get("detail") else None


def what_if_diagnosis(best: dict) -> tuple[str, str]:
    """An explaining what-if as a diagnosis: (kind, sentence), e.g. ("what-if: drop_bias", "the reference gives the
    candidate's values with `fc1` computed without its bias (what-if)")."""
    return (f"what-if: {best.get('kind') or '?'}",
            f"the reference gives the candidate's values with {best['detail']} (what-if)")


def _diverged_headline(result, fd) -> str:
    s = fd.stats
    if s is not None:
        numbers = f"max_abs={fmt(s.max_abs)}{nonfinite_words(s)} mean_abs={fmt(s.mean_abs)} ({judged_text(s)});"
        if s.worst:
            numbers += (f" worst at {list(s.worst.index)}: ref {fmt(s.worst.ref, '.6g')} vs "
                        f"cand {fmt(s.worst.cand, '.6g')};")
    else:
        numbers = f"{not_compared_reason(fd)};"
    kind = f"; looks like {KIND_WORDS.get(fd.diagnosis[0].kind, fd.diagnosis[0].kind)}" if fd.diagnosis else ""
    best = explaining_what_if(result)
    if best is not None:
        # a run of the reference with that mistake planted gives the candidate's values: stronger than a pattern
        kind = f"; the reference gives the candidate's values with {best['detail']} (what-if)"
    rc = result.root_cause
    if rc is not None and rc is not fd:
        kind += (f"; root cause: stage {rc.index} {rc.ref_name or rc.cand_name or '?'} introduces the error"
                 + (f" (local max_abs={fmt(rc.local.max_abs)})" if rc.local is not None else "")
                 + (f", {rc.diagnosis[0].kind}" if rc.diagnosis else ""))
    elif rc is fd and fd.local is not None:
        kind += "; this stage introduces the error (wrong on the reference's own inputs)"
    if result.output_shape_mismatch:
        kind += f"; {output_shape_words(result.output_shape_mismatch)}"
    return (f"diffkit: DIVERGED at stage {fd.index} {stage_names(fd)}: {numbers} "
            f"{_earlier_matches(result, fd)} earlier stages match{kind}")


# ----------------------------------------------------------------------------- the detail block
def _finding_line(f) -> str:
    return f"  diagnosis [{f.kind}, confidence {fmt(f.confidence, '.2f')}]: {f.detail}"


def _finding_lines(stage, said: set) -> list[str]:
    """The stage's diagnosis lines, less any finding already said (`said`: their (kind, detail), updated)."""
    return [_finding_line(f) for f in unsaid(stage.diagnosis, said)]


def unsaid(findings, said: set) -> list:
    """`findings` less those whose (kind, detail) is in `said`, and less repeats among themselves; `said` takes the
    rest (one diagnosis line per finding, however many stages or surfaces carry it)."""
    out = []
    for f in findings or ():
        key = (getattr(f, "kind", ""), getattr(f, "detail", ""))
        if key not in said:
            said.add(key)
            out.append(f)
    return out


def run_findings(result) -> list[str]:
    """The findings about the whole run (the candidate's second run differing, its forward changing its own state),
    in words, less any a stage's diagnosis or a warning already says word for word."""
    shown = {f.detail for s in getattr(result, "stages", ()) for f in s.diagnosis}
    warned = list(getattr(result, "warnings", ()))
    return [f"{f.kind} (confidence {fmt(f.confidence, '.2f')}): {f.detail}" for f in getattr(result, "findings", ())
            if f.detail not in shown and not any(f.detail in w for w in warned)]


def notes(result) -> list[str]:
    """What the reader should know of how the diff ran that is no warning: loop results folded."""
    fold = result.meta.get("cand_folded")
    if not fold:
        return []
    sites = fold.get("sites") or {}
    top = ", ".join(f"{os.path.basename(site)} ({n})" for site, n in list(sites.items())[:3])
    return [f"{fold['results']} candidate loop results were folded, not recorded (their dataflow is kept): "
            f"results of sizes no reference record has, past the first {fold.get('recorded_per_site', '?')} of "
            f"their call site; views a call site made the step before as well; stores into part of a buffer, "
            f"which is recorded once filled, when next read or when the forward returns "
            f"({top}{' …' if len(sites) > 3 else ''}; --no-fold records them all)"]


def what_if_lines(result, limit: int = 3) -> list[str]:
    """The what-if block (diffkit.whatif): which planted mistake makes the reference reproduce the
    candidate, or, honestly, that none does and which came nearest."""
    found = [w for w in (result.what_if or []) if isinstance(w, dict)]
    info = (result.meta or {}).get("what_if") or {}
    if not found:
        return ["", f"what-if: {info['skipped']}"] if info.get("skipped") else []
    runs = f" ({info.get('forwards')} what-if runs of the reference, {fmt(info.get('seconds'), '.2g')} s" \
        + (f"; stopped at its {fmt(info.get('seconds_budget'), '.3g')} s budget with {info.get('variants_left')} "
           f"variants untried: --explain-seconds" if info.get("out_of_time") else "") + ")" \
        if info.get("forwards") else ""
    best = found[0]
    if best.get("explains"):
        out = ["", f"what-if{runs}: the candidate matches the reference with {best.get('detail')}: "
                   f"max error {fmt(best.get('max_abs_after'))}, was {fmt(best.get('max_abs_before'))}"]
        rest = [w for w in found[1:limit] if w.get("explains")]
        out += [f"  also within tolerance: {w.get('detail')} (max error {fmt(w.get('max_abs_after'))})" for w in rest]
        return out
    # only what comes closer to the candidate than the reference itself does may be said to partly explain it
    closer = [w for w in found if _closer(w)]
    if not closer:
        return ["", f"what-if{runs}: no mistake in the catalogue (alone or two together) reproduces the candidate, "
                    f"nor brings the reference closer to it than its error as it stands"]
    out = ["", f"what-if{runs}: no mistake in the catalogue (alone or two together) reproduces the candidate within "
               f"tolerance; the nearest partly explain it:"]
    out += [f"  {w.get('detail')}: partly explains it, max error {fmt(w.get('max_abs_after'))} remains (was "
            f"{fmt(w.get('max_abs_before'))}; relative error {fmt(w.get('rel_l2_after'), '.2g')}, "
            f"{w.get('mismatches_after')} elements still out of tolerance)" for w in closer[:limit]]
    return out


def _closer(w: dict) -> bool:
    after, before = w.get("max_abs_after"), w.get("max_abs_before")
    return isinstance(after, (int, float)) and isinstance(before, (int, float)) and after < before


def divergence_label(result, short: bool = False) -> str:
    """What the first stage out of tolerance is called: the first divergence, unless the output matches (an
    intermediate the candidate computes another way, or an error that never reaches the output).  `short`: as the
    stage table marks its row."""
    if getattr(result, "verdict", "") != "match":
        return "first divergence"
    return f"first {'' if short else 'stage '}out of tolerance (the output matches)"


def divergence_lines(result) -> list[str]:
    """The terminal's detail block under the stage table: the first divergence (records, layout,
    numbers, worst element, NaN/Inf, re-run, diagnosis), the root cause and the error.  Each block
    starts with an empty line; the list is empty when there is nothing to say."""
    out: list[str] = []
    fd = result.first_divergence
    if fd is not None:
        out += ["", f"{divergence_label(result)}: stage {fd.index}",
                f"  reference: {fd.ref_name}  {shape_text(fd.ref_shape)}  {op(fd.ref)}  {where(fd.ref)}",
                f"  candidate: {fd.cand_name}  {shape_text(fd.cand_shape)}  {op(fd.cand)}  {where(fd.cand)}"]
        if transform_text(fd):
            out.append(f"  layout: candidate compared after {transform_text(fd)}")
        s = fd.stats
        if s is None:
            out.append(f"  not compared: {not_compared_reason(fd)}")
        else:
            out.append(f"  max_abs {fmt(s.max_abs, '.4g')}{nonfinite_words(s)}  mean_abs {fmt(s.mean_abs, '.4g')}  "
                       f"max_rel {fmt(s.max_rel, '.4g')}  cosine {fmt(s.cosine, '.6f')}  "
                       f"{s.mismatches}/{s.numel} elements out of {tolerance_text(s.atol, s.rtol)}")
            if getattr(s, "stat", "elementwise") != "elementwise" and s.stat_error is not None:
                out.append(f"  judged by --stat {s.stat}: {judged_text(s)}")
            if s.worst:
                out.append(f"  worst element {worst_summary(s.worst)}")
            if s.cand_nan or s.cand_inf:
                out.append(f"  candidate has {s.cand_nan} NaN and {s.cand_inf} Inf "
                           f"(reference: {s.ref_nan} NaN, {s.ref_inf} Inf)")
        rerun = rerun_summary(fd)
        if rerun:
            out.append(f"  {rerun}")
    said: set = set()  # each finding once, whichever stage carries it
    if fd is not None:
        out += _finding_lines(fd, said)
    out += what_if_lines(result)
    rc = result.root_cause
    if rc is not None and rc is not fd:
        line = f"root cause: stage {rc.index} {rc.ref_name} (candidate {rc.cand_name}) introduces the error"
        if rc.local is not None:
            line += (f": re-run on the reference's inputs it is off by max_abs {fmt(rc.local.max_abs, '.4g')}"
                     + (" (within tolerance there, out of it once propagated)" if rc.local.ok else ""))
        out += ["", line]
        out += _finding_lines(rc, said)
    e = result.error
    if e is not None:
        out += ["", f"error: {e.side} {e.phase}: {e.message}"]
        if e.stage:
            out.append(f"  at {e.stage}")
    trials = _trials(result)
    if len(trials) > 1 or any(not t.get("allclose", True) or t.get("nondeterministic") for t in trials):
        shown = reported_trial(result)
        out += ["", "trials (KernelBench's protocol: seed 42 construction, no eval(), nothing copied):"]
        for t in trials:
            mark = "  <- the stages above" if t is shown and len(trials) > 1 else ""
            out.append(f"  trial {t.get('trial')} (seed {t.get('seed')}): {trial_outcome(t)}{mark}")
    return out


# ----------------------------------------------------------------------------- the pytest message
def _closeness_lines(stats) -> list[str]:
    """torch.testing.assert_close's wording for one pair's numbers."""
    lines = [f"Mismatched elements: {stats.mismatches} / {stats.numel} ({pct(stats.mismatch_fraction)})",
             f"Greatest absolute difference: {fmt(stats.max_abs, '.6g')} (up to {fmt(stats.atol, 'g')} allowed)",
             f"Greatest relative difference: {fmt(stats.max_rel, '.6g')} (up to {fmt(stats.rtol, 'g')} allowed)"]
    if stats.worst:
        w = stats.worst
        lines.append(f"Worst element at index {tuple(w.index)}: reference {fmt(w.ref, '.6g')}, "
                     f"candidate {fmt(w.cand, '.6g')}")
    if stats.cand_nan or stats.cand_inf:
        lines.append(f"Candidate has {stats.cand_nan} NaN and {stats.cand_inf} Inf "
                     f"(reference: {stats.ref_nan} NaN, {stats.ref_inf} Inf)")
    return lines


def assertion_message(result) -> str:
    """The AssertionError text of `diffkit.testing.assert_models_close`, in torch.testing's words:
    the headline, the first diverging stage, mismatched elements, greatest absolute and relative
    difference against the allowed tolerance, the worst element, diagnosis, root cause, error."""
    lines = [headline(result)]
    said: set = set()
    fd = result.first_divergence
    if fd is not None:
        lines.append(f"First diverging stage {fd.index}: reference {fd.ref_name!r} ({where(fd.ref)}), "
                     f"candidate {fd.cand_name!r} ({where(fd.cand)})")
        if fd.stats is not None:
            lines += _closeness_lines(fd.stats)
        else:
            lines.append(f"Not compared: {not_compared_reason(fd)}")
        lines += [f"Diagnosis ({f.kind}): {f.detail}" for f in unsaid(fd.diagnosis, said)]
        lines += [x.strip() for x in what_if_lines(result) if x.strip()]
    elif result.verdict == "diverged" and result.output is not None:
        lines.append("Output:")
        lines += _closeness_lines(result.output)
    rc = result.root_cause
    if rc is not None and rc is not fd:
        lines.append(f"Root cause: {root_cause_summary(rc)}")
        lines += [f"Diagnosis ({f.kind}): {f.detail}" for f in unsaid(rc.diagnosis, said)]
    e = result.error
    if e is not None:
        lines.append(f"The {e.side} raised: {e.message}" + (f" at {e.stage}" if e.stage else ""))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- --harden
def harden_setting_words(s) -> str:
    """One setting of the `--harden` matrix (a HardenSetting) in words: "ok (max_abs 3e-07)", "skipped: …",
    "first wrong stage `norm` (ignored_weight)", "the candidate raised …"."""
    verdict = getattr(s, "verdict", "")
    if verdict == "skipped":
        return f"skipped: {getattr(s, 'note', '') or 'not applicable'}"
    if verdict == "error":
        return getattr(s, "error", None) or "the candidate failed here"
    judged = " (judged against the reference's float64 noise floor)" if getattr(s, "judged_by", "") == "auto" else ""
    if verdict == "match":
        return f"ok (max_abs {fmt(getattr(s, 'max_abs', None))}){judged}"
    fd = getattr(s, "first_divergence", None) or {}
    if not fd.get("ref_name") and not fd.get("cand_name"):
        return f"diverges (max_abs {fmt(getattr(s, 'max_abs', None))}){judged}"
    kinds = [d.get("kind") for d in fd.get("diagnosis") or [] if isinstance(d, dict) and d.get("kind")]
    return f"first wrong stage `{fd.get('ref_name') or fd.get('cand_name')}`" + (f" ({kinds[0]})" if kinds else "")


def harden_summary(result) -> str | None:
    """The one line `--harden` adds after the usual output: "passes KernelBench (5/5); robust under 14 settings
    (2.1 s)" or "…; breaks with <setting>: first wrong stage `<name>` (<diagnosis>) and 2 more"; a reference
    that ignores an input is said after it.  None when the matrix was not run."""
    h = getattr(result, "harden", None)
    if h is None:
        return None
    trials = _trials(result)
    passed = sum(1 for t in trials if kernelbench_passes(t))
    verdict = getattr(result, "verdict", "")
    head = (f"{'passes' if verdict == 'match' else 'fails'} KernelBench ({passed}/{len(trials)})" if trials
            else f"KernelBench's verdict: {verdict}")
    settings = list(getattr(h, "settings", []) or [])
    breaking = [s for s in settings if getattr(s, "breaks", False)]
    tried = [s for s in settings if getattr(s, "verdict", "") != "skipped"]
    seconds = float(getattr(h, "seconds", 0.0) or 0.0)
    took = f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.0f} s"
    if breaking:
        first = breaking[0]
        text = (f"{head}; breaks with {first.name}: {harden_setting_words(first)}"
                + (f" and {len(breaking) - 1} more" if len(breaking) > 1 else "") + f" ({took})")
    elif not settings:
        text = f"{head}; no setting was run ({took})"
    else:
        text = f"{head}; robust under {len(tried)} settings ({took})"
    for f in getattr(h, "findings", []) or []:
        if getattr(f, "kind", "") == "input_independent":
            text += f"; warning: {f.detail}"
        elif not settings:
            text += f"; {f.detail}"
    return f"diffkit --harden: {text}"
