"""Renderings of a Result: terminal text, HTML (report page and notebook), Markdown, JUnit and CSV.

The sentences come from `describe`; this module only lays them out for each surface, escaping
for that surface: HTML through Jinja2 templates with autoescape on (diffkit/templates/), JUnit
through ElementTree, Markdown with its own escaper, CSV with cells a spreadsheet cannot take for
a formula.  Every renderer copes with a partial Result: stages without metrics (shapes that
differ), without a reference or candidate record, without a re-run, NaN/Inf numbers, no stages.
"""
from __future__ import annotations

import csv
import io
import os
import re
import xml.etree.ElementTree as ET

import jinja2
from markupsafe import Markup, escape

from . import describe
from .describe import fmt, shape_text

STATUS_COLOUR = {"ok": "#e8f6ec", "diverged": "#f9d6d5", "after-divergence": "#fcefd9", "unmatched": "#eeeeee"}
VERDICT_COLOUR = {"match": "#1e8449", "diverged": "#c0392b", "error": "#7d3c98"}
TERMINAL_COLOUR = {"ok": "green", "diverged": "red", "after-divergence": "yellow", "unmatched": None}
DASH = "–"  # an empty HTML cell
TABLE_PAGE = 100  # rows per collapsible page of the HTML stage table


# ----------------------------------------------------------------------------- terminal text
def fold_rows(result, around: int = 6, head: int = 4, tail: int = 3, limit: int = 40) -> list[int | None]:
    """Row indices to print: everything for short models, else head, the first divergence's
    neighbourhood and the tail, with `None` marking a fold."""
    n = len(result.stages)
    if n <= limit:
        return list(range(n))
    keep = set(range(min(head, n))) | set(range(max(0, n - tail), n))
    fd = result.first_divergence
    if fd is not None:
        keep |= set(range(max(0, fd.index - around), min(n, fd.index + around + 1)))
    rows: list[int | None] = []
    last = -1
    for i in sorted(keep):
        if i != last + 1:
            rows.append(None)
        rows.append(i)
        last = i
    return rows


NAME_WIDTH, SHAPE_WIDTH, BY_WIDTH = 56, 16, 8  # the terminal stage table's text columns


def format_table(result, color: bool = False, full: bool = False) -> str:
    """The stage table for a terminal (folded around the first divergence unless `full`)."""
    def style(text, **kw):
        if not color:
            return text
        import click

        return click.style(text, **kw)

    lines = [f"{'#':>4}  {'stage (reference | candidate)':<{NAME_WIDTH}} {'shape':<{SHAPE_WIDTH}} "
             f"{'by':<{BY_WIDTH}} {'max_abs':>9} {'mean_abs':>9}  status"]
    rows = list(range(len(result.stages))) if full else fold_rows(result)
    fd = result.first_divergence
    label = describe.divergence_label(result, short=True)
    for i in rows:
        if i is None:
            lines.append(style(f"{'…':>4}  (rows folded; --full shows all)", dim=True))
            continue
        s = result.stages[i]
        if s.ref_name and s.cand_name and s.ref_name != s.cand_name:
            name = f"{s.ref_name} | {s.cand_name}"
        else:
            name = s.ref_name or f"- | {s.cand_name}"
        # (cut to its column with "…" where it is longer, so the columns stay aligned and the cut shows)
        name = describe.clip(name, NAME_WIDTH)
        shape = describe.clip(shape_text(s.ref_shape if s.ref_shape is not None else s.cand_shape), SHAPE_WIDTH)
        st = s.stats
        by = describe.clip(s.paired_by or "-", BY_WIDTH)
        line = (f"{s.index:>4}  {name:<{NAME_WIDTH}} {shape:<{SHAPE_WIDTH}} {by:<{BY_WIDTH}} "
                f"{fmt(st.max_abs if st else None):>9} {fmt(st.mean_abs if st else None):>9}  {s.status}")
        if fd is not None and s is fd:
            line = style(line + f"   <-- {label}", fg="red", bold=True)
        elif TERMINAL_COLOUR.get(s.status):
            line = style(line, fg=TERMINAL_COLOUR[s.status])
        lines.append(line)
    return "\n".join(lines)


def text_report(result, color: bool = False, full: bool = False) -> str:
    """What `diffkit diff` prints: weights, the stage table, the divergence details, warnings,
    reference health and, last, the headline."""
    out = []
    if result.weights is not None:
        out.append("weights: " + result.weights.summary())
    out.append(format_table(result, color=color, full=full))
    out += describe.divergence_lines(result)
    out += [f"finding: {f}" for f in describe.run_findings(result)]
    out += [f"warning: {w}" for w in result.warnings]
    out += [f"reference health: {h}" for h in result.health]
    out += [f"note: {n}" for n in describe.notes(result)]
    out += ["", describe.headline(result)]
    return "\n".join(out)


# ----------------------------------------------------------------------------- HTML
def _stage_shapes(stage) -> str:
    text = shape_text(stage.ref_shape) if stage.ref_shape is not None else DASH
    if stage.cand_shape is not None and stage.cand_shape != stage.ref_shape:
        text += f" / {shape_text(stage.cand_shape)}"
    return text


def _paired(stage) -> str:
    transform = describe.transform_text(stage)
    return (stage.paired_by or "") + (f" ({transform})" if transform else "")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")),
        autoescape=True, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
    env.filters.update(
        num=lambda x: fmt(x, ".3g", DASH), fmt=lambda x, spec: fmt(x, spec, DASH),
        pct=lambda x: describe.pct(x, DASH), shapes=_stage_shapes, paired=_paired,
        where=describe.where, op=describe.op, transform=describe.transform_text, codespans=codespans)
    env.globals.update(status_colour=STATUS_COLOUR, stats_summary=describe.stats_summary,
                       not_compared_reason=describe.not_compared_reason)
    return env


_ENV: jinja2.Environment | None = None
_CODE_SPAN = re.compile(r"`([^`]+)`")


def codespans(text) -> Markup:
    """Text for HTML with its `backticked` names in <code>: escaped first, so only the <code> tags are markup."""
    return Markup(_CODE_SPAN.sub(r"<code>\1</code>", str(escape("" if text is None else text))))


def template(name: str) -> jinja2.Template:
    """One of diffkit/templates/, from an environment built once."""
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    return _ENV.get_template(name)


def banner(result) -> dict:
    """What the HTML banner shows: verdict, first divergence, root cause, error, headline."""
    fd, rc = result.first_divergence, result.root_cause
    tol = result.tolerance()
    all_within = ""
    if fd is None and result.error is None and result.verdict == "match":
        all_within = (f"{len(result.compared)} stages compared, all within "
                      f"{describe.tolerance_text(tol['atol'], tol['rtol'], tol.get('stat'))}")
    rc = rc if rc is not None and rc is not fd else None
    said: set = set()
    fd_finding = next(iter(describe.unsaid(fd.diagnosis[:1], said)), None) if fd is not None else None
    rc_finding = next(iter(describe.unsaid(rc.diagnosis[:1], said)), None) if rc is not None else None
    return {"verdict": result.verdict, "colour": VERDICT_COLOUR.get(result.verdict, "#555"), "fd": fd,
            "rc": rc, "error": result.error, "fd_finding": fd_finding, "rc_finding": rc_finding,
            "all_within": all_within, "headline": describe.headline(result),
            "fd_label": describe.divergence_label(result)}


def stage_table(result, page: int = TABLE_PAGE) -> dict:
    """The stage table's pages: paired stages `page` rows at a time (the page holding the first
    divergence open, else the first), unmatched stages apart."""
    paired = [s for s in result.stages if s.status != "unmatched"]
    fd = result.first_divergence
    called = describe.divergence_label(result)
    pages = []
    for start in range(0, len(paired), page):
        chunk = paired[start:start + page]
        has_fd = fd is not None and any(s is fd for s in chunk)
        label = f"stages {chunk[0].index}–{chunk[-1].index}" + (f" ({called})" if has_fd else "")
        pages.append({"open": has_fd or (start == 0 and fd is None), "label": label,
                      "rows": [(s, f"  ◀ {called}" if s is fd else "") for s in chunk]})
    return {"pages": pages, "unmatched": [s for s in result.stages if s.status == "unmatched"]}


def stage_rows(stage) -> list[tuple[str, str]]:
    """A stage's facts as (label, text) rows, for the notebook view."""
    st = stage.stats

    def side(name, shape, record):
        return f"{name or '-'} {shape_text(shape)} {describe.op(record)} {describe.where(record)}".rstrip()

    rows = [("reference", side(stage.ref_name, stage.ref_shape, stage.ref)),
            ("candidate", side(stage.cand_name, stage.cand_shape, stage.cand)),
            ("paired by", _paired(stage) or "-"), ("status", stage.status)]
    if st is not None:
        rows += [("max |error|", fmt(st.max_abs, ".6g")), ("mean |error|", fmt(st.mean_abs, ".6g")),
                 ("max relative", fmt(st.max_rel, ".6g")), ("out of tolerance", f"{st.mismatches}/{st.numel}"),
                 ("cosine", fmt(st.cosine, ".6f")), ("tolerance", describe.tolerance_text(st.atol, st.rtol, st.stat)),
                 ("judged", describe.judged_text(st))]
        if st.worst:
            rows.append(("worst element", describe.worst_summary(st.worst)))
    else:
        rows.append(("not compared", describe.not_compared_reason(stage)))
    if stage.local is not None:
        rows.append(("re-run on reference inputs", f"max |error| {fmt(stage.local.max_abs, '.4g')}"))
    if stage.replay_note:
        rows.append(("replay", stage.replay_note))
    return rows


def stage_html(stage) -> str:
    """A stage in a notebook: its metrics and findings."""
    return template("stage.html").render(stage=stage, rows=stage_rows(stage))


def notices(result) -> list[str]:
    """What an HTML page lists under its banner: warnings, the reference's health, notes."""
    return describe.run_findings(result) + list(result.warnings) + list(result.health) + describe.notes(result)


def result_html(result) -> str:
    """The result in a notebook: banner, warnings and the stage table (no images)."""
    return template("result.html").render(banner=banner(result), warnings=notices(result), table=stage_table(result),
                                          harden=harden_view(result))


# ----------------------------------------------------------------------------- --harden
# a setting's row in the HTML matrix, by its verdict
HARDEN_COLOUR = {"match": STATUS_COLOUR["ok"], "diverged": STATUS_COLOUR["diverged"], "error": "#ead7f1",
                 "skipped": STATUS_COLOUR["unmatched"]}
HARDEN_VERDICT_COLOUR = {"robust": VERDICT_COLOUR["match"], "breaks": VERDICT_COLOUR["diverged"]}
JUDGED_BY = {"fixed": "KernelBench's tolerance", "auto": "the reference's float64 noise floor"}


def harden_stage_text(d) -> str:
    """A setting's stage (a `Stage.divergence_dict()`) in words: "stage 7 group_norm", the candidate's name
    added when it differs; "" when there is none."""
    if not d:
        return ""
    ref, cand = d.get("ref_name"), d.get("cand_name")
    names = ref or cand or "?"
    if ref and cand and ref != cand:
        names = f"{ref} (candidate: {cand})"
    return f"stage {d.get('index', '?')} {names}"


def harden_where(setting) -> str:
    """Where a setting breaks the candidate: its first wrong stage, the root cause when it is another stage,
    and the first diagnosis ("" when the setting names no stage)."""
    fd, rc = setting.first_divergence or None, setting.root_cause or None
    text = harden_stage_text(fd)
    if rc and (not fd or rc.get("index") != fd.get("index")):
        text += ("; " if text else "") + "root cause " + harden_stage_text(rc)
    diagnosis = (rc or {}).get("diagnosis") or (fd or {}).get("diagnosis") or []
    if diagnosis and isinstance(diagnosis[0], dict) and diagnosis[0].get("kind"):
        text += f" ({diagnosis[0]['kind']})"
    return text


def harden_setting_line(setting) -> str:
    """One setting in a sentence: "init: GroupNorm affine drawn at random: diverged, max |error| 0.31 (judged
    by KernelBench's tolerance); first wrong stage 7 group_norm"."""
    text = f"{setting.kind}: {setting.name}: {setting.verdict}"
    if setting.max_abs is not None:
        judged = JUDGED_BY.get(setting.judged_by, setting.judged_by)
        text += f", max |error| {fmt(setting.max_abs, '.3g')} (judged by {judged})"
    where_ = harden_where(setting)
    if where_:
        text += f"; first wrong {where_}"
    if setting.error:
        text += f"; {setting.error}"
    if setting.note:
        text += f" ({setting.note})"
    return text


def harden_kinds(harden) -> list[str]:
    """The kinds of the settings that break the candidate, each once, in the matrix's order."""
    return list(dict.fromkeys(s.kind for s in harden.breaking))


def harden_cell(harden) -> str | None:
    """The suite's column: "robust", "breaks: init, shape"; None when --harden was not asked."""
    if harden is None:
        return None
    kinds = harden_kinds(harden)
    return f"breaks: {', '.join(kinds)}" if kinds or harden.verdict == "breaks" else harden.verdict


def harden_counts(harden) -> str:
    """The matrix in numbers: "14 settings, 2 break, 1 skipped, 3.1 s"."""
    skipped = sum(1 for s in harden.settings if s.verdict == "skipped")
    text = f"{len(harden.settings)} settings"
    if harden.breaking:
        text += f", {len(harden.breaking)} break"
    if skipped:
        text += f", {skipped} skipped"
    return text + f", {fmt(harden.seconds, '.2g')} s"


def harden_view(result) -> dict | None:
    """What the HTML report's --harden section shows (None when --harden was not asked): the verdict, the
    findings about the problem, one row per setting."""
    h = getattr(result, "harden", None)
    if h is None:
        return None
    rows = [{"s": s, "colour": HARDEN_COLOUR.get(s.verdict, "#fff"), "where": harden_where(s),
             "judged": JUDGED_BY.get(s.judged_by, s.judged_by) if s.verdict in ("match", "diverged") else "",
             "said": "; ".join(x for x in (s.error, s.note) if x)} for s in h.settings]
    return {"verdict": h.verdict, "colour": HARDEN_VERDICT_COLOUR.get(h.verdict, "#555"), "counts": harden_counts(h),
            "kinds": ", ".join(harden_kinds(h)), "findings": list(h.findings), "rows": rows,
            "finding_kinds": ", ".join(dict.fromkeys(f.kind for f in h.findings)),
            "seconds": h.seconds}


# ----------------------------------------------------------------------------- Markdown
_MD_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_MD_BACKSLASHED = set("\\`*[]|")


def md_escape(text) -> str:
    """Text safe in Markdown prose, list items and table cells: HTML's `& < >` become entities;
    backslash, backtick, `*`, brackets and `|` are backslash-escaped (a GFM table splits on a bare
    `|`, even inside a code span); line breaks become spaces so a cell stays one row."""
    out = []
    for ch in "" if text is None else str(text):
        if ch in _MD_ENTITIES:
            out.append(_MD_ENTITIES[ch])
        elif ch in _MD_BACKSLASHED:
            out.append("\\" + ch)
        elif ch in "\r\n":
            out.append(" ")
        else:
            out.append(ch)
    return "".join(out)


def md_code(text) -> str:
    """A name or path in code type.  An HTML ``<code>`` element holding escaped text, not a
    backtick code span: a span can be broken by a backtick in the name, and entities (the only
    way to write `<` safely) are shown literally inside one."""
    return f"<code>{md_escape(text if text is not None else '-')}</code>"


def summary_markdown(result, limit: int = 15) -> str:
    """summary.md: verdict, headline, paths, first divergence, root cause, error, the stages out
    of tolerance (at most `limit`) and warnings, for a CI job summary or a pull-request comment."""
    icon = {"match": "✅", "diverged": "❌", "error": "💥"}.get(result.verdict, "")
    lines = [f"## diffkit: {icon} {md_escape(result.verdict)}", "", md_code(describe.headline(result)), ""]
    if result.ref_path or result.cand_path:
        lines += [f"- reference: {md_code(result.ref_path)}", f"- candidate: {md_code(result.cand_path)}", ""]

    said: set = set()  # each finding once, whichever stage carries it

    def findings(stage):
        return [f"- **{md_escape(f.kind)}** ({fmt(f.confidence, '.2f')}): {md_escape(f.detail)}"
                for f in describe.unsaid(stage.diagnosis, said)]

    fd = result.first_divergence
    if fd is not None:
        numbers = describe.stats_summary(fd.stats) if fd.stats is not None else describe.not_compared_reason(fd)
        lines += [f"### {describe.divergence_label(result).capitalize()}", "",
                  f"- stage {fd.index}: reference {md_code(fd.ref_name)} ({md_escape(describe.where(fd.ref))}), "
                  f"candidate {md_code(fd.cand_name)} ({md_escape(describe.where(fd.cand))})",
                  f"- {md_escape(numbers)}"]
        lines += findings(fd)
        lines.append("")
    wi = [x.strip() for x in describe.what_if_lines(result) if x.strip()]
    if wi:
        lines += ["### What-if runs of the reference", ""] + [f"- {md_escape(x)}" for x in wi] + [""]
    rc = result.root_cause
    if rc is not None and rc is not fd:
        lines += ["### Root cause", "",
                  f"- stage {rc.index} {md_code(rc.ref_name or rc.cand_name)} introduces the error"
                  + (f" (re-run on the reference's inputs: max abs error {md_escape(fmt(rc.local.max_abs))})"
                     if rc.local is not None else "")]
        lines += findings(rc)
        lines.append("")
    e = result.error
    if e is not None:
        lines += ["### Error", "", f"{md_escape(e.side)} failed ({md_escape(e.phase)}) at {md_code(e.stage or '?')}: "
                  f"{md_escape(e.message)}", ""]
    failed = result.diverged_stages
    if failed:
        lines += ["| # | reference | candidate | max abs | mean abs | status |", "|---|---|---|---|---|---|"]
        for s in failed[:limit]:
            st = s.stats
            lines.append(f"| {s.index} | {md_code(s.ref_name)} | {md_code(s.cand_name)} | "
                         f"{md_escape(fmt(st.max_abs if st else None))} | "
                         f"{md_escape(fmt(st.mean_abs if st else None))} | "
                         f"{md_escape(s.status)} |")
        if len(failed) > limit:
            lines.append(f"\n… and {len(failed) - limit} more stages out of tolerance")
        lines.append("")
    lines += _harden_markdown(result)
    found = describe.run_findings(result)
    if found:
        lines += ["### Findings", ""] + [f"- {md_escape(f)}" for f in found] + [""]
    lines += [f"> ⚠️ {md_escape(w)}" for w in list(result.warnings) + list(result.health)]
    lines += [f"> ℹ️ {md_escape(n)}" for n in describe.notes(result)]
    return "\n".join(lines).rstrip() + "\n"


def _harden_markdown(result) -> list[str]:
    """summary.md's --harden block: the verdict and counts, each setting that breaks the candidate, the findings
    about the problem ([] when --harden was not asked)."""
    h = getattr(result, "harden", None)
    if h is None:
        return []
    icon = {"robust": "✅", "breaks": "❌"}.get(h.verdict, "")
    lines = [f"### Hardening (--harden): {icon} {md_escape(h.verdict)}", "", f"- {md_escape(harden_counts(h))}"]
    lines += [f"- {md_escape(harden_setting_line(s))}" for s in h.breaking]
    lines += [f"- finding **{md_escape(f.kind)}** ({fmt(f.confidence, '.2f')}): {md_escape(f.detail)}"
              for f in h.findings]
    return lines + [""]


# ----------------------------------------------------------------------------- JUnit
# characters XML 1.0 cannot hold at all (C0 controls but tab/LF/CR, lone surrogates, U+FFFE/U+FFFF)
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(value) -> str:
    """`value` as text XML 1.0 can hold: the characters it cannot are dropped."""
    return _NOT_XML.sub("", "" if value is None else str(value))


def _element(parent, tag: str, text: str | None = None, **attrs) -> ET.Element:
    el = ET.SubElement(parent, tag, {k: xml_text(v) for k, v in attrs.items()})
    if text is not None:
        el.text = xml_text(text)
    return el


def junit_xml(result, suite: str = "diffkit") -> str:
    """junit.xml: one test case per compared stage (and per stage that failed without metrics,
    e.g. shapes that differ); failures carry the numbers; a side's error is an <error> case."""
    root = ET.Element("testsuites")
    ts = _element(root, "testsuite", name=suite)
    tests = failures = errors = 0
    for s in result.stages:
        if s.stats is None and not s.failed:
            continue
        tests += 1
        name = f"{s.index:04d} {s.ref_name or '-'}" + (f" <- {s.cand_name}" if s.cand_name != s.ref_name else "")
        case = _element(ts, "testcase", classname=suite, name=name)
        if not s.failed:
            continue
        failures += 1
        st = s.stats
        if st is not None:
            msg = (f"{s.status}: max_abs={fmt(st.max_abs, '.4g')} mean_abs={fmt(st.mean_abs, '.4g')} "
                   f"mismatch={describe.pct(st.mismatch_fraction)} {describe.tolerance_text(st.atol, st.rtol, st.stat)}")
            detail = msg + (f"\nworst {describe.worst_summary(st.worst)}" if st.worst else "")
        else:
            msg = f"{s.status}: {describe.not_compared_reason(s)}"
            detail = msg
        detail += "".join(f"\n{f.kind}: {f.detail}" for f in s.diagnosis)
        _element(case, "failure", detail, message=msg, type=s.status)
    e = result.error
    if e is not None:
        tests += 1
        errors = 1
        case = _element(ts, "testcase", classname=suite, name=f"{e.side} {e.phase}")
        _element(case, "error", f"{e.stage}\n{(e.traceback or '')[-4000:]}", message=e.message, type=e.phase)
    if result.verdict == "diverged" and not failures and not errors:
        # diverged on what no stage row carries (the output's structure, shape or dtype, a later trial, a
        # second run): CI must still see a failure
        tests += 1
        failures = 1
        case = _element(ts, "testcase", classname=suite, name="verdict")
        why = "\n".join([*(f"{f.kind}: {f.detail}" for f in result.findings), *result.warnings])
        _element(case, "failure", f"{result.summary_line()}\n{why}".strip(), message=result.summary_line()[:500],
                 type="diverged")
    skipped = 0
    if getattr(result, "harden", None) is not None:
        more, broke, skipped = _harden_cases(ts, suite, result.harden)
        tests, failures = tests + more, failures + broke
    ts.set("tests", str(tests))
    ts.set("failures", str(failures))
    ts.set("errors", str(errors))
    ts.set("skipped", str(skipped))
    return ET.tostring(root, encoding="UTF-8", xml_declaration=True).decode("utf-8") + "\n"


def _harden_cases(ts, suite: str, harden) -> tuple[int, int, int]:
    """A test case per --harden setting (class `<suite>.harden`): a failure where it breaks the candidate,
    skipped where the setting was skipped; returns (tests, failures, skipped)."""
    failures = skipped = 0
    for s in harden.settings:
        case = _element(ts, "testcase", classname=f"{suite}.harden", name=f"harden {s.kind}: {s.name}",
                        time=f"{s.seconds or 0:.3f}")
        if s.breaks:
            failures += 1
            line = harden_setting_line(s)
            diagnosis = [f"{f.get('kind')}: {f.get('detail')}" for d in (s.first_divergence, s.root_cause) if d
                         for f in d.get("diagnosis") or [] if isinstance(f, dict)]
            _element(case, "failure", "\n".join([line, *dict.fromkeys(diagnosis)]), message=line[:500],
                     type=s.verdict)
        elif s.verdict == "skipped":
            skipped += 1
            _element(case, "skipped", message=s.note or "skipped")
    return len(harden.settings), failures, skipped


# ----------------------------------------------------------------------------- CSV
# a text cell starting with one of these is read as a formula by spreadsheets (OWASP "CSV injection")
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
CSV_COLUMNS = ["index", "ref_name", "cand_name", "paired_by", "ref_shape", "cand_shape", "dtype", "max_abs",
               "mean_abs", "max_rel", "mismatch_fraction", "cosine", "status", "local_max_abs", "transform", "note",
               "stat", "stat_error", "stat_bound"]


def csv_safe(value):
    """A CSV cell: text that a spreadsheet would take for a formula gets a leading `'`; numbers
    (and None, written empty) pass unchanged, so the numeric columns stay numeric."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def _shape_cell(shape) -> str | None:
    return None if shape is None else str(list(shape))  # "[4, 16]": text, but never formula-like


def _stage_cells(s) -> list:
    st = s.stats
    return [s.index, s.ref_name, s.cand_name, s.paired_by, _shape_cell(s.ref_shape), _shape_cell(s.cand_shape), s.dtype,
            st.max_abs if st else None, st.mean_abs if st else None, st.max_rel if st else None,
            st.mismatch_fraction if st else None, st.cosine if st else None, s.status,
            s.local.max_abs if s.local is not None else None, describe.transform_text(s), s.note,
            st.stat if st else None, st.stat_error if st else None, st.stat_bound if st else None]


def stages_csv(result) -> str:
    """stages.csv: one row per stage; text cells made safe for spreadsheets (see `csv_safe`)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for s in result.stages:
        writer.writerow([csv_safe(v) for v in _stage_cells(s)])
    return buf.getvalue()
