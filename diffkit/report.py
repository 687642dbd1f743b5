"""Write a report directory: index.html, stages.csv, result.json, summary.md, junit.xml.

The HTML is self-contained (images inlined): it can be downloaded from CI and opened anywhere.
Heatmaps are drawn for the first divergence, the root cause and then the other diverged stages,
at most `max_stages` of them (the page says how many were left out).
"""
from __future__ import annotations

import os
import re
import time

from . import plots
from .render import CSS, banner_html, esc, findings_html, img_tag, junit_xml, stage_table_html, summary_markdown
from .result import Result, Stage

MAX_STAGES = 6


def default_report_dir(result: Result, root: str = "reports") -> str:
    name = os.path.splitext(os.path.basename(result.cand_path or "candidate"))[0] or "candidate"
    return os.path.join(root, re.sub(r"[^0-9A-Za-z_.-]", "_", name))


def _stage_section(stage: Stage, heading: str) -> str:
    parts = [f"<h2>{esc(heading)}: stage {stage.index} <code>{esc(stage.ref_name)}</code></h2>"]
    st = stage.stats
    parts.append(f"<div>reference <code>{esc(stage.ref_name)}</code> {esc(stage.ref.op)} at {esc(stage.ref.where)}<br>"
                 f"candidate <code>{esc(stage.cand_name)}</code> {esc(stage.cand.op)} at {esc(stage.cand.where)}"
                 + (f"<br>compared after {esc(stage.transform)} of the candidate" if stage.transform else "") + "</div>")
    if st is not None:
        parts.append(f"<div>max |error| {st.max_abs:.4g} · mean {st.mean_abs:.4g} · {st.mismatches}/{st.numel} out of "
                     f"tolerance · cosine {st.cosine:.5f}"
                     + (f" · re-run on reference inputs: {stage.local.max_abs:.3g}" if stage.local else "")
                     + (f" · {esc(stage.replay_note)}" if stage.replay_note else "") + "</div>")
    parts.append(findings_html(stage))
    try:
        parts.append(img_tag(plots.to_png(plots.heatmap(stage)), f"heatmaps of {stage.ref_name}"))
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3))
        plots.error_histogram(stage, axes[0])
        plots.error_vs_magnitude(stage, axes[1])
        fig.tight_layout()
        parts.append(img_tag(plots.to_png(fig), f"error distribution of {stage.ref_name}"))
        rows = "".join(f"<tr><td class='mono'>{esc(r['index'])}</td><td class='num'>{r['ref']:.6g}</td>"
                       f"<td class='num'>{r['cand']:.6g}</td><td class='num'>{r['abs_err']:.4g}</td></tr>"
                       for r in plots.worst_elements(stage))
        parts.append(f"<details open><summary>worst elements</summary><table><tr><th>index</th><th>reference</th>"
                     f"<th>candidate</th><th>|error|</th></tr>{rows}</table></details>")
    except Exception as e:  # one stage that cannot be drawn must not lose the report
        parts.append(f'<div class="warn">could not draw this stage: {esc(type(e).__name__)}: {esc(e)}</div>')
    return "".join(parts)


def html_report(result: Result, max_stages: int = MAX_STAGES) -> str:
    title = f"diffkit: {os.path.basename(result.cand_path or 'candidate')} vs {os.path.basename(result.ref_path or 'reference')}"
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{esc(title)}</h1>"]
    parts.append(f"<div class='muted'>reference <code>{esc(result.ref_path)}</code> · candidate "
                 f"<code>{esc(result.cand_path)}</code> · {esc(time.strftime('%Y-%m-%d %H:%M:%S'))}</div>")
    parts.append(banner_html(result))
    for w in result.warnings + result.health:
        parts.append(f'<div class="warn">{esc(w)}</div>')
    if result.weights is not None:
        parts.append(f"<div class='muted'>weights: {esc(result.weights.summary())}</div>")
    if result.compared:
        parts.append("<h2>Error through the network</h2>")
        parts.append(img_tag(plots.to_png(plots.error_profile(result)), "error per stage"))
    chosen: list[tuple[Stage, str]] = []
    if result.first_divergence is not None:
        chosen.append((result.first_divergence, "First divergence"))
    if result.root_cause is not None and result.root_cause is not result.first_divergence:
        chosen.append((result.root_cause, "Root cause"))
    rest = [s for s in result.diverged_stages if all(s is not c for c, _ in chosen)]
    room = max(0, max_stages - len(chosen))
    chosen += [(s, "Diverged stage") for s in rest[:room]]
    for stage, heading in chosen:
        if stage.ref is not None and stage.cand is not None and stage.ref.value is not None and stage.stats:
            parts.append(_stage_section(stage, heading))
    if len(rest) > room:
        parts.append(f"<div class='muted'>{len(rest) - room} more diverged stages are not drawn "
                     f"(see the table).</div>")
    parts.append("<h2>Stages</h2>")
    parts.append(stage_table_html(result))
    if result.error is not None and result.error.traceback:
        parts.append(f"<h2>Traceback ({esc(result.error.side)})</h2><pre class='mono'>"
                     f"{esc(result.error.traceback[-6000:])}</pre>")
    parts.append("</body></html>")
    return "".join(parts)


def _write(path: str, text: str) -> str:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def write_report(result: Result, directory: str | None = None) -> dict[str, str]:
    """Write every artifact into `directory` (default reports/<candidate name>/); return their paths."""
    directory = directory or default_report_dir(result)
    os.makedirs(directory, exist_ok=True)
    paths = {
        "html": _write(os.path.join(directory, "index.html"), html_report(result)),
        "csv": os.path.join(directory, "stages.csv"),
        "json": _write(os.path.join(directory, "result.json"), result.to_json()),
        "markdown": _write(os.path.join(directory, "summary.md"), summary_markdown(result)),
        "junit": _write(os.path.join(directory, "junit.xml"), junit_xml(result, _suite(result))),
    }
    result.to_csv(paths["csv"])
    return paths


def _suite(result: Result) -> str:
    return "diffkit." + os.path.splitext(os.path.basename(result.cand_path or "candidate"))[0]


def write_html(result: Result, path: str) -> str:
    return _write(path, html_report(result))


def write_markdown(result: Result, path: str) -> str:
    return _write(path, summary_markdown(result))


def write_junit(result: Result, path: str) -> str:
    return _write(path, junit_xml(result, _suite(result)))
