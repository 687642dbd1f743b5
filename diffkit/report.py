"""Write a report directory: index.html, stages.csv, result.json, summary.md, junit.xml.

The HTML is self-contained (pictures inlined, no URL): it can be downloaded from CI and opened
anywhere.  Maps and charts are drawn by `figures` (Pillow PNGs and inline SVG; matplotlib is not
imported, `plots` keeps the matplotlib Figures for notebooks).  They are drawn for the first
divergence, the root cause and then the other diverged stages that introduce error of their own,
at most `max_stages` of them (the page says how many were left out); the diverged stages that only
inherit their error are listed in one line linking to their rows of the stage table.  The banner
and the stage table link to each drawn stage's section.  Values are read only through
`Stage.ref_value` / `Stage.cand_value`; a stage whose values were not kept gets its numbers and
findings but no pictures.
"""
from __future__ import annotations

import os
import re
import time

from . import figures, plots
from .describe import introduces, unsaid
from .render import banner, harden_view, junit_xml, notices, stage_table, stages_csv, summary_markdown, template
from .result import Result, Stage
from .safefiles import write_text

MAX_STAGES = 6
TRACEBACK_CHARS = 6000  # the end of a traceback is where the failing line is


def default_report_dir(result: Result, root: str = "reports") -> str:
    name = os.path.splitext(os.path.basename(result.cand_path or "candidate"))[0] or "candidate"
    return os.path.join(root, re.sub(r"[^0-9A-Za-z_.-]", "_", name))


png_src = figures.data_uri  # a PNG as a data URI for an <img src>


def _problem(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def section_id(stage: Stage) -> str:
    """The id of a drawn stage's section (the banner and the stage table link to it)."""
    return f"stage-{stage.index}"


def _section(stage: Stage, heading: str) -> dict:
    """One drawn stage: maps, error distribution and worst elements when both values were kept.
    Each part is drawn on its own: one that fails is named in `problem`, the others stay."""
    sec = {"stage": stage, "heading": heading, "id": section_id(stage), "maps": None, "charts": [], "worst": [],
           "note": "", "problem": ""}
    if stage.stats is None:
        return sec  # nothing to draw for a pair that could not be compared; the template says why
    if stage.ref_value is None or stage.cand_value is None:
        sec["note"] = "values not kept: no heatmaps for this stage"
        return sec
    if plots.values(stage) is None:
        sec["note"] = "the two values cannot be put side by side: no heatmaps for this stage"
        return sec
    problems = []
    for key, draw in (("maps", figures.stage_maps), ("charts", figures.stage_charts),
                      ("worst", plots.worst_elements)):
        try:  # one stage that cannot be drawn must not lose the report
            sec[key] = draw(stage)
        except Exception as e:
            problems.append(_problem(e))
    sec["problem"] = "; ".join(problems)
    return sec


def _profile(result: Result) -> dict:
    if not result.compared:
        return {"svg": None, "problem": ""}
    try:
        return {"svg": figures.error_profile(result), "problem": ""}
    except Exception as e:
        return {"svg": None, "problem": _problem(e)}


INTRODUCES = "Introduces error of its own"
DIVERGED = "Diverged stage"


def _chosen(result: Result, max_stages: int) -> tuple[list[tuple[Stage, str]], int, list[Stage]]:
    """The stages to draw, with their headings, chosen for what they teach: the first divergence, the root cause,
    then the other diverged stages that introduce error of their own (`describe.introduces`: wrong even on the
    reference's inputs), then those not re-run, at most `max_stages` in all.  The diverged stages that only inherit
    their error (right on the reference's inputs) are not drawn: the page lists them in one line (the third item
    returned).  The second is how many stages that could have been drawn were left out."""
    chosen: list[tuple[Stage, str]] = []
    if result.first_divergence is not None:
        chosen.append((result.first_divergence, "First divergence"))
    if result.root_cause is not None and result.root_cause is not result.first_divergence:
        chosen.append((result.root_cause, "Root cause"))
    rest = [s for s in result.diverged_stages if all(s is not c for c, _ in chosen)]
    inherit = [s for s in rest if introduces(s) is False]
    ranked = [(s, INTRODUCES) for s in rest if introduces(s)] + [(s, DIVERGED) for s in rest if introduces(s) is None]
    room = max(0, max_stages - len(chosen))
    drawn = sorted(ranked[:room], key=lambda x: x[0].index)  # (in the order of the network)
    return chosen + drawn, max(0, len(ranked) - room), inherit


INHERITED_LISTED = 40  # the inherited stages named in the folded line (the rest counted)


def _inherited(stages: list[Stage]) -> dict | None:
    """The folded line of the diverged stages that only inherit their error: each one's index, name and max
    |error|, linking to its row of the stage table (None when there are none)."""
    if not stages:
        return None
    rows = [{"index": s.index, "name": s.ref_name or s.cand_name or "?", "row": row_id(s),
             "max_abs": s.stats.max_abs if s.stats is not None else None} for s in stages[:INHERITED_LISTED]]
    return {"rows": rows, "more": max(0, len(stages) - INHERITED_LISTED), "count": len(stages)}


def row_id(stage: Stage) -> str:
    """The id of a stage's row in the report's stage table."""
    return f"row-{stage.index}"


def html_report(result: Result, max_stages: int = MAX_STAGES) -> str:
    """index.html: banner, warnings, weights, the error profile, a section per drawn stage, the
    paged stage table and the traceback of a side that failed."""
    title = (f"diffkit: {os.path.basename(result.cand_path or 'candidate')} vs "
             f"{os.path.basename(result.ref_path or 'reference')}")
    chosen, left_out, inherit = _chosen(result, max_stages)
    weights = None
    if result.weights is not None:
        try:
            weights = result.weights.summary()
        except Exception as e:
            weights = f"(could not summarise: {_problem(e)})"
    error = result.error
    sections = [_section(s, heading) for s, heading in chosen]
    # each finding said once on the page: the banner's (the first divergence's and the root cause's first) are not
    # repeated in their stage's section, which names their kind and points up
    b = banner(result)
    in_banner = {(f.kind, f.detail) for f in (b["fd_finding"], b["rc_finding"]) if f is not None}
    said = set(in_banner)
    for sec in sections:
        diagnosis = sec["stage"].diagnosis
        sec["in_banner"] = list(dict.fromkeys(f.kind for f in diagnosis if (f.kind, f.detail) in in_banner))
        sec["findings"] = unsaid(diagnosis, said)
    return template("report.html").render(
        title=title, result=result, written=time.strftime("%Y-%m-%d %H:%M:%S"), banner=b, inherited=_inherited(inherit),
        warnings=notices(result), weights=weights, colour_bars=figures.colour_bar_css(), profile=_profile(result),
        sections=sections,
        drawn={sec["stage"].index: sec["id"] for sec in sections}, left_out=left_out, table=stage_table(result),
        what_if=[w for w in (result.what_if or []) if isinstance(w, dict)],
        what_if_info=(result.meta or {}).get("what_if") or {}, harden=harden_view(result),
        traceback=(error.traceback or "")[-TRACEBACK_CHARS:] if error is not None else "")


def _write(path: str, text: str) -> str:
    return write_text(path, text)  # (never through a link planted in the report folder)


def write_report(result: Result, directory: str | None = None) -> dict[str, str]:
    """Write every artifact into `directory` (default reports/<candidate name>/); return their paths."""
    directory = directory or default_report_dir(result)
    os.makedirs(directory, exist_ok=True)
    return {
        "html": _write(os.path.join(directory, "index.html"), html_report(result)),
        "csv": _write(os.path.join(directory, "stages.csv"), stages_csv(result)),
        "json": _write(os.path.join(directory, "result.json"), result.to_json()),
        "markdown": _write(os.path.join(directory, "summary.md"), summary_markdown(result)),
        "junit": _write(os.path.join(directory, "junit.xml"), junit_xml(result, _suite(result))),
    }


def _suite(result: Result) -> str:
    return "diffkit." + os.path.splitext(os.path.basename(result.cand_path or "candidate"))[0]


def write_html(result: Result, path: str) -> str:
    return _write(path, html_report(result))


def write_markdown(result: Result, path: str) -> str:
    return _write(path, summary_markdown(result))


def write_junit(result: Result, path: str) -> str:
    return _write(path, junit_xml(result, _suite(result)))
