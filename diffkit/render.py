"""HTML, Markdown and JUnit renderings of a Result (the report, notebooks and CI read these).

Every name, path and message is HTML/XML-escaped.  Images are PNGs inlined as data URIs, so an
HTML file is self-contained: no network, no scripts.
"""
from __future__ import annotations

import base64
import html
from xml.sax.saxutils import quoteattr

from .result import Result, Stage

STATUS_COLOUR = {"ok": "#e8f6ec", "diverged": "#f9d6d5", "after-divergence": "#fcefd9", "unmatched": "#eeeeee"}
VERDICT_COLOUR = {"match": "#1e8449", "diverged": "#c0392b", "error": "#7d3c98"}

CSS = """
body{font:14px/1.45 -apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1250px}
h1{font-size:20px;margin:0 0 8px} h2{font-size:16px;margin:26px 0 8px;border-bottom:1px solid #ddd}
.banner{border-radius:6px;padding:14px 18px;color:#fff;margin-bottom:14px}
.banner .verdict{font-size:22px;font-weight:700;letter-spacing:.5px}
.banner code{background:rgba(255,255,255,.18);padding:1px 4px;border-radius:3px;color:#fff}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0} td,th{border:1px solid #ddd;padding:3px 7px;text-align:left}
th{background:#f4f4f4} td.num{text-align:right;font-family:ui-monospace,Menlo,monospace}
code,.mono{font-family:ui-monospace,Menlo,monospace;font-size:12px}
.finding{margin:4px 0;padding:6px 10px;background:#fff8e1;border-left:4px solid #f39c12}
.muted{color:#777} img{max-width:100%} details{margin:4px 0} summary{cursor:pointer;font-weight:600}
.warn{background:#fdf2e9;border-left:4px solid #e67e22;padding:6px 10px;margin:4px 0}
"""


def esc(x) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _num(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def _shape(s) -> str:
    return "×".join(map(str, s)) if s else "–"


def img_tag(png: bytes, alt: str) -> str:
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def findings_html(stage: Stage) -> str:
    return "".join(f'<div class="finding"><b>{esc(f.kind)}</b> <span class="muted">(confidence {f.confidence:.2f})'
                   f'</span><br>{esc(f.detail)}</div>' for f in stage.diagnosis)


def banner_html(result: Result) -> str:
    colour = VERDICT_COLOUR.get(result.verdict, "#555")
    tol = result.tolerance()
    parts = [f'<div class="banner" style="background:{colour}"><div class="verdict">{esc(result.verdict.upper())}</div>']
    fd = result.first_divergence
    if fd is not None and fd.stats is not None:
        s = fd.stats
        parts.append(
            f"<div>first divergence: stage {fd.index} — reference <code>{esc(fd.ref_name)}</code> "
            f"({esc(fd.ref.where if fd.ref else '')}), candidate <code>{esc(fd.cand_name)}</code> "
            f"({esc(fd.cand.where if fd.cand else '')})</div>"
            f"<div>max |error| {s.max_abs:.4g}, mean {s.mean_abs:.4g}, {100 * s.mismatch_fraction:.1f}% of "
            f"{s.numel} elements out of atol={s.atol:g} rtol={s.rtol:g}</div>")
        if fd.diagnosis:
            parts.append(f"<div>diagnosis: <b>{esc(fd.diagnosis[0].kind)}</b> — {esc(fd.diagnosis[0].detail)}</div>")
    rc = result.root_cause
    if rc is not None and rc is not fd:
        parts.append(f"<div>root cause: stage {rc.index} <code>{esc(rc.ref_name)}</code> introduces the error "
                     f"(re-run on the reference's inputs: max |error| {rc.local.max_abs:.3g})"
                     + (f" — {esc(rc.diagnosis[0].kind)}: {esc(rc.diagnosis[0].detail)}" if rc.diagnosis else "")
                     + "</div>")
    if result.error is not None:
        e = result.error
        parts.append(f"<div>{esc(e.side)} failed ({esc(e.phase)}) at <code>{esc(e.stage)}</code>: {esc(e.message)}</div>")
    if fd is None and result.error is None:
        parts.append(f"<div>{len(result.compared)} stages compared, all within atol={tol['atol']:g} "
                     f"rtol={tol['rtol']:g}</div>")
    parts.append(f'<div class="mono" style="opacity:.85;margin-top:6px">{esc(result.summary_line())}</div></div>')
    return "".join(parts)


STAGE_HEAD = ("<tr><th>#</th><th>reference</th><th>candidate</th><th>shape (ref / cand)</th><th>paired by</th>"
              "<th>max |err|</th><th>mean |err|</th><th>max rel</th><th>out of tol</th><th>cosine</th>"
              "<th>local</th><th>status</th></tr>")


def stage_row(s: Stage, mark: str = "") -> str:
    st = s.stats
    shape = _shape(s.ref_shape)
    if s.cand_shape is not None and s.cand_shape != s.ref_shape:
        shape += f" / {_shape(s.cand_shape)}"
    by = s.paired_by + (f" ({s.transform})" if s.transform else "")
    return (f'<tr style="background:{STATUS_COLOUR.get(s.status, "#fff")}"><td class="num">{s.index}</td>'
            f'<td class="mono">{esc(s.ref_name or "–")}</td><td class="mono">{esc(s.cand_name or "–")}</td>'
            f"<td>{esc(shape)}</td><td>{esc(by or '–')}</td>"
            f'<td class="num">{_num(st.max_abs if st else None)}</td><td class="num">{_num(st.mean_abs if st else None)}</td>'
            f'<td class="num">{_num(st.max_rel if st else None)}</td>'
            f'<td class="num">{"–" if not st else f"{100 * st.mismatch_fraction:.1f}%"}</td>'
            f'<td class="num">{"–" if not st else f"{st.cosine:.5f}"}</td>'
            f'<td class="num">{_num(s.local.max_abs if s.local else None)}</td>'
            f"<td>{esc(s.status)}{esc(mark)}</td></tr>")


def stage_table_html(result: Result, page: int = 100) -> str:
    """Paired stages in pages of `page` rows (the page holding the first divergence open);
    unmatched stages in their own collapsed section."""
    paired = [s for s in result.stages if s.status != "unmatched"]
    unmatched = [s for s in result.stages if s.status == "unmatched"]
    fd = result.first_divergence
    out = []
    for start in range(0, len(paired), page):
        chunk = paired[start:start + page]
        has_fd = fd is not None and any(s is fd for s in chunk)
        open_ = " open" if has_fd or (start == 0 and fd is None) else ""
        label = f"stages {chunk[0].index}–{chunk[-1].index}" + (" (first divergence)" if has_fd else "")
        rows = "".join(stage_row(s, "  ◀ first divergence" if s is fd else "") for s in chunk)
        out.append(f"<details{open_}><summary>{esc(label)}</summary><table>{STAGE_HEAD}{rows}</table></details>")
    if unmatched:
        rows = "".join(stage_row(s) for s in unmatched)
        out.append(f"<details><summary>{len(unmatched)} unmatched stages (fused away or with no counterpart; "
                   f"not failures)</summary><table>{STAGE_HEAD}{rows}</table></details>")
    return "".join(out)


def stage_html(stage: Stage) -> str:
    """A stage in a notebook: its metrics and findings."""
    st = stage.stats
    rows = [("reference", f"{stage.ref_name} {_shape(stage.ref_shape)} {stage.ref.op if stage.ref else ''} "
                          f"{stage.ref.where if stage.ref else ''}"),
            ("candidate", f"{stage.cand_name} {_shape(stage.cand_shape)} {stage.cand.op if stage.cand else ''} "
                          f"{stage.cand.where if stage.cand else ''}"),
            ("paired by", stage.paired_by + (f" ({stage.transform})" if stage.transform else "")),
            ("status", stage.status)]
    if st is not None:
        rows += [("max |error|", f"{st.max_abs:.6g}"), ("mean |error|", f"{st.mean_abs:.6g}"),
                 ("max relative", f"{st.max_rel:.6g}"), ("out of tolerance", f"{st.mismatches}/{st.numel}"),
                 ("cosine", f"{st.cosine:.6f}"), ("tolerance", f"atol={st.atol:g} rtol={st.rtol:g}")]
        if st.worst:
            rows.append(("worst element", f"{list(st.worst.index)}: ref {st.worst.ref:.6g}, cand {st.worst.cand:.6g}"))
    if stage.local is not None:
        rows.append(("re-run on reference inputs", f"max |error| {stage.local.max_abs:.4g}"))
    if stage.replay_note:
        rows.append(("replay", stage.replay_note))
    body = "".join(f"<tr><th>{esc(k)}</th><td class='mono'>{esc(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>{findings_html(stage)}"


def result_html(result: Result) -> str:
    """The result in a notebook: banner, warnings and the stage table (no images)."""
    warn = "".join(f'<div class="warn">{esc(w)}</div>' for w in result.warnings + result.health)
    return f"<style>{CSS}</style>{banner_html(result)}{warn}{stage_table_html(result)}"


# ----------------------------------------------------------------------------- markdown
def summary_markdown(result: Result, limit: int = 15) -> str:
    icon = {"match": "✅", "diverged": "❌", "error": "💥"}.get(result.verdict, "")
    lines = [f"## diffkit: {icon} {result.verdict}", "", f"`{result.summary_line()}`", ""]
    if result.ref_path or result.cand_path:
        lines += [f"- reference: `{result.ref_path}`", f"- candidate: `{result.cand_path}`", ""]
    fd = result.first_divergence
    if fd is not None and fd.stats is not None:
        s = fd.stats
        lines += ["### First divergence", "",
                  f"- stage {fd.index}: reference `{fd.ref_name}` ({fd.ref.where if fd.ref else ''}), "
                  f"candidate `{fd.cand_name}` ({fd.cand.where if fd.cand else ''})",
                  f"- max abs error {s.max_abs:.4g}, mean {s.mean_abs:.4g}, {100 * s.mismatch_fraction:.1f}% of "
                  f"{s.numel} elements out of atol={s.atol:g} rtol={s.rtol:g}"]
        lines += [f"- **{f.kind}** ({f.confidence:.2f}): {f.detail}" for f in fd.diagnosis]
        lines.append("")
    rc = result.root_cause
    if rc is not None and rc is not fd:
        lines += ["### Root cause", "", f"- stage {rc.index} `{rc.ref_name}` introduces the error "
                  f"(re-run on the reference's inputs: max abs error {rc.local.max_abs:.3g})"]
        lines += [f"- **{f.kind}** ({f.confidence:.2f}): {f.detail}" for f in rc.diagnosis]
        lines.append("")
    if result.error is not None:
        e = result.error
        lines += ["### Error", "", f"{e.side} failed ({e.phase}) at `{e.stage}`: {e.message}", ""]
    failed = result.diverged_stages
    if failed:
        lines += ["| # | reference | candidate | max abs | mean abs | status |", "|---|---|---|---|---|---|"]
        for s in failed[:limit]:
            lines.append(f"| {s.index} | `{s.ref_name}` | `{s.cand_name}` | {s.stats.max_abs:.3g} | "
                         f"{s.stats.mean_abs:.3g} | {s.status} |")
        if len(failed) > limit:
            lines.append(f"\n… and {len(failed) - limit} more stages out of tolerance")
        lines.append("")
    for w in result.warnings + result.health:
        lines.append(f"> ⚠️ {w}")
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------- junit
def junit_xml(result: Result, suite: str = "diffkit") -> str:
    """One test case per compared stage; failures carry the numbers; an error is an <error>."""
    cases = []
    compared = result.compared
    failures = 0
    for s in compared:
        name = f"{s.index:04d} {s.ref_name}" + (f" <- {s.cand_name}" if s.cand_name != s.ref_name else "")
        body = ""
        if s.failed:
            failures += 1
            st = s.stats
            msg = (f"{s.status}: max_abs={st.max_abs:.4g} mean_abs={st.mean_abs:.4g} "
                   f"mismatch={100 * st.mismatch_fraction:.1f}% atol={st.atol:g} rtol={st.rtol:g}")
            detail = msg + (f"\nworst {list(st.worst.index)}: ref {st.worst.ref:.6g} cand {st.worst.cand:.6g}"
                            if st.worst else "")
            detail += "".join(f"\n{f.kind}: {f.detail}" for f in s.diagnosis)
            body = f"<failure message={quoteattr(msg)} type={quoteattr(s.status)}>{esc(detail)}</failure>"
        cases.append(f"<testcase classname={quoteattr(suite)} name={quoteattr(name)}>{body}</testcase>")
    errors = 0
    if result.error is not None:
        errors = 1
        e = result.error
        cases.append(f"<testcase classname={quoteattr(suite)} name={quoteattr(f'{e.side} {e.phase}')}>"
                     f"<error message={quoteattr(e.message)} type={quoteattr(e.phase)}>{esc(e.stage)}\n"
                     f"{esc(e.traceback[-4000:])}</error></testcase>")
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<testsuites><testsuite name={quoteattr(suite)} tests=\"{len(cases)}\" failures=\"{failures}\" "
            f"errors=\"{errors}\" skipped=\"0\">" + "".join(cases) + "</testsuite></testsuites>\n")
