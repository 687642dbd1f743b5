"""Command line: ``diffkit diff REF.py CAND.py`` and ``diffkit capture MODEL.py``.

Exit codes: 0 match, 1 diverged, 2 error (bad file, build failure, crash).
"""
from __future__ import annotations

import json
import os
import re
import sys

import click

from .errors import DiffkitError
from .result import ErrorInfo, Result

EXIT = {"match": 0, "diverged": 1, "error": 2}
STATUS_COLOUR = {"ok": "green", "diverged": "red", "after-divergence": "yellow", "unmatched": None}


def _shape(s) -> str:
    return "×".join(map(str, s)) if s else ("scalar" if s == [] else "-")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def fold_rows(result: Result, around: int = 6, head: int = 4, tail: int = 3, limit: int = 40) -> list:
    """Row indices to print: everything for short models, else head, the first divergence's
    neighbourhood and the tail, with `None` marking a fold."""
    n = len(result.stages)
    if n <= limit:
        return list(range(n))
    keep = set(range(min(head, n))) | set(range(max(0, n - tail), n))
    fd = result.first_divergence
    if fd is not None:
        keep |= set(range(max(0, fd.index - around), min(n, fd.index + around + 1)))
    rows, last = [], -1
    for i in sorted(keep):
        if i != last + 1:
            rows.append(None)
        rows.append(i)
        last = i
    return rows


def format_table(result: Result, color: bool = False, full: bool = False) -> str:
    def style(text, **kw):
        return click.style(text, **kw) if color else text

    lines = [f"{'#':>4}  {'stage (reference | candidate)':<56} {'shape':<16} {'by':<6} {'max_abs':>9} {'mean_abs':>9}  status"]
    rows = list(range(len(result.stages))) if full else fold_rows(result)
    fd = result.first_divergence
    for i in rows:
        if i is None:
            lines.append(style(f"{'…':>4}  {'(rows folded; --full shows all)':<56}", dim=True))
            continue
        s = result.stages[i]
        if s.ref_name and s.cand_name and s.ref_name != s.cand_name:
            name = f"{s.ref_name} | {s.cand_name}"
        else:
            name = s.ref_name or f"- | {s.cand_name}"
        name = name if len(name) <= 56 else name[:55] + "…"
        shape = _shape(s.ref_shape if s.ref_shape is not None else s.cand_shape)
        st = s.stats
        line = (f"{s.index:>4}  {name:<56} {shape:<16} {s.paired_by or '-':<6} {_fmt(st.max_abs if st else None):>9} "
                f"{_fmt(st.mean_abs if st else None):>9}  {s.status}")
        if fd is not None and s is fd:
            line = style(line + "   <-- first divergence", fg="red", bold=True)
        elif STATUS_COLOUR.get(s.status):
            line = style(line, fg=STATUS_COLOUR[s.status])
        lines.append(line)
    return "\n".join(lines)


def format_result(result: Result, color: bool = False, full: bool = False) -> str:
    out = []
    if result.weights is not None:
        out.append("weights: " + result.weights.summary())
    out.append(format_table(result, color=color, full=full))
    fd = result.first_divergence
    if fd is not None and fd.stats is not None:
        s = fd.stats
        out.append("")
        out.append(f"first divergence: stage {fd.index}")
        out.append(f"  reference: {fd.ref_name}  {_shape(fd.ref_shape)}  {fd.ref.op if fd.ref else ''}  {fd.ref.where if fd.ref else ''}")
        out.append(f"  candidate: {fd.cand_name}  {_shape(fd.cand_shape)}  {fd.cand.op if fd.cand else ''}  {fd.cand.where if fd.cand else ''}")
        if fd.transform:
            out.append(f"  layout: candidate compared after {fd.transform}")
        out.append(f"  max_abs {s.max_abs:.4g}  mean_abs {s.mean_abs:.4g}  max_rel {s.max_rel:.4g}  cosine {s.cosine:.6f}  "
                   f"{s.mismatches}/{s.numel} elements out of atol={s.atol:g} rtol={s.rtol:g}")
        if s.worst:
            out.append(f"  worst element {list(s.worst.index)}: reference {s.worst.ref:.6g}, candidate {s.worst.cand:.6g}")
        if s.cand_nan or s.cand_inf:
            out.append(f"  candidate has {s.cand_nan} NaN and {s.cand_inf} Inf (reference: {s.ref_nan} NaN, {s.ref_inf} Inf)")
        if fd.local is not None:
            verb = "introduces" if not fd.local.ok else "only inherits"
            out.append(f"  re-run alone on the reference's inputs: max_abs {fd.local.max_abs:.4g} — this stage {verb} "
                       f"the error (its inputs carried max_abs {fd.inherited_max_abs or 0:.3g})")
        elif fd.replay_note:
            out.append(f"  {fd.replay_note}")
        for f in fd.diagnosis:
            out.append(f"  diagnosis [{f.kind}, confidence {f.confidence:.2f}]: {f.detail}")
    rc = result.root_cause
    if rc is not None and rc is not fd:
        out.append("")
        out.append(f"root cause: stage {rc.index} {rc.ref_name} (candidate {rc.cand_name}) introduces the error: "
                   f"re-run on the reference's inputs it is off by max_abs {rc.local.max_abs:.4g}"
                   + (" (within tolerance there, out of it once propagated)" if rc.local.ok else ""))
        for f in rc.diagnosis:
            out.append(f"  diagnosis [{f.kind}, confidence {f.confidence:.2f}]: {f.detail}")
    if result.error is not None:
        out.append("")
        out.append(f"error: {result.error.side} {result.error.phase}: {result.error.message}")
        if result.error.stage:
            out.append(f"  at {result.error.stage}")
    for w in result.warnings:
        out.append(f"warning: {w}")
    for h in result.health:
        out.append(f"reference health: {h}")
    out.append("")
    out.append(result.summary_line())
    return "\n".join(out)


def error_result(e: DiffkitError, ref_path: str, cand_path: str, atol, rtol) -> Result:
    return Result(verdict="error", stages=[], first_divergence=None,
                  error=ErrorInfo(e.side, e.phase, e.message, e.where, e.detail), output=None,
                  atol=atol, rtol=rtol, ref_path=ref_path, cand_path=cand_path)


def write_outputs(result: Result, json_path: str | None, csv_path: str | None) -> None:
    for path in (json_path, csv_path):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            fh.write(result.to_json())
    if csv_path:
        result.to_csv(csv_path)


@click.group()
@click.version_option(package_name="diffkit")
def main() -> None:
    """diffkit: find the first stage where a hand-written kernel stops matching its PyTorch reference."""


@main.command()
@click.argument("ref_path", metavar="REF.py")
@click.argument("cand_path", metavar="CAND.py")
@click.option("--atol", type=float, default=None, help="absolute tolerance (default by dtype: 1e-4 fp32, 1e-2 fp16/bf16)")
@click.option("--rtol", type=float, default=None, help="relative tolerance (default as --atol)")
@click.option("--seed", type=int, default=42, show_default=True, help="seed for get_inputs()")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="run both models here")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write result.json here")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="write one CSV row per stage")
@click.option("--strict", is_flag=True, help="intermediate stages out of tolerance make the verdict diverged")
@click.option("--train", is_flag=True, help="keep training mode (default: eval)")
@click.option("--full", is_flag=True, help="print every stage (default: fold long models around the divergence)")
@click.option("--tolerance", type=click.Choice(["fixed", "auto"]), default="fixed", show_default=True,
              help="auto: judge each stage against a float64 run of the reference (TorchDynamo's same() rule)")
@click.option("--reinit-zero", is_flag=True, help="give all-zero weight matrices random values for the diff")
@click.option("--report-dir", type=click.Path(file_okay=False), default=None,
              help="write index.html, stages.csv, result.json, summary.md, junit.xml here "
                   "(default: reports/<candidate name>/)")
@click.option("--no-report", is_flag=True, help="write no report directory")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None, help="write the HTML report here")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), default=None, help="write summary.md here")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None, help="write junit.xml here")
@click.option("--no-isolate", is_flag=True,
              help="run in this process (default: a child process, so a crashing kernel cannot take the answer with it)")
@click.option("--timeout", type=float, default=None, help="stop a candidate that runs longer than this (seconds)")
@click.option("--max-memory", "max_memory", default=None, metavar="SIZE",
              help="streaming diff: hold at most SIZE (e.g. 512M, 4G) of captured values on the device (CPU: in "
                   "memory); the rest goes to pinned host memory, then disk. Default without the flag: in-memory diff")
@click.option("--stream", "stream", is_flag=True,
              help="streaming diff with the default budget (a quarter of the free device memory)")
@click.option("--only", "only", default=None, metavar="PATTERNS",
              help="capture only records whose names match these comma-separated globs (e.g. 'blocks.3.*'); "
                   "inputs and the output are always kept")
@click.option("--stop-at-first", is_flag=True, help="end the candidate's forward at its first divergent stage")
@click.option("--sanitize", type=click.Choice(["memcheck", "racecheck"]), default=None,
              help="run the diff's child process under compute-sanitizer and attach its reports (kernel, thread, "
                   "address) to the stage that launched the kernel")
@click.option("--stream-dir", type=click.Path(file_okay=False), default=None, hidden=True)
@click.option("--side-only", type=click.Choice(["ref"]), default=None, hidden=True)
@click.option("--ref-capture", type=click.Path(file_okay=False), default=None, hidden=True)
def diff(ref_path, cand_path, atol, rtol, seed, device, json_path, csv_path, strict, train, full, tolerance,
         reinit_zero, report_dir, no_report, html_path, md_path, junit_path, no_isolate, timeout, max_memory, stream,
         only, stop_at_first, sanitize, stream_dir, side_only, ref_capture):
    """Compare candidate CAND.py (ModelNew) with reference REF.py (Model), stage by stage.

    Either argument may instead be a capture directory written by `diffkit capture -o` (then both must be)."""
    from .compare import compare_traces, diff_files

    if atol is not None and rtol is None:
        rtol = atol
    if rtol is not None and atol is None:
        atol = rtol
    color = sys.stdout.isatty()
    from .stream import parse_size

    try:
        max_bytes = parse_size(max_memory)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-memory")
    streaming = True if (stream or max_bytes is not None or only or stop_at_first) else None
    arts = (json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path)
    if _is_capture(ref_path) or _is_capture(cand_path):
        from .store import load_trace

        try:
            if not (_is_capture(ref_path) and _is_capture(cand_path)):
                raise DiffkitError("", "read", "give both sides as capture directories, or both as model files")
            result = compare_traces(load_trace(ref_path), load_trace(cand_path), atol, rtol, strict=strict)
            result.ref_path, result.cand_path = ref_path, cand_path
        except DiffkitError as e:
            click.echo(f"diffkit: ERROR: {e}")
            _artifacts(error_result(e, ref_path, cand_path, atol, rtol), *arts)
            sys.exit(2)
        click.echo(format_result(result, color=color, full=full))
        _artifacts(result, *arts)
        sys.exit(EXIT[result.verdict])
    if sanitize and no_isolate:
        raise click.UsageError("--sanitize runs the diff in a child process under compute-sanitizer; drop --no-isolate")
    if not no_isolate:
        argv = sys.argv[1:] if sys.argv[1:2] == ["diff"] else ["diff", *sys.argv[1:]]
        if sanitize:
            argv = [a for i, a in enumerate(argv) if a != "--sanitize" and not (i and argv[i - 1] == "--sanitize")
                    and not a.startswith("--sanitize=")]
        sys.exit(_isolated(argv, ref_path, cand_path, atol, rtol, strict, timeout, color, full, arts, sanitize))
    if side_only == "ref":  # an isolated diff's reference process: capture, then leave the rest to the other
        import os

        from .compare import capture_reference

        try:
            capture_reference(ref_path, cand_path, os.path.join(stream_dir, "ref.dkt"), seed=seed, device=device,
                              train=train, reinit_zero=reinit_zero, only=only)
        except DiffkitError as e:
            result = error_result(e, ref_path, cand_path, atol, rtol)
            click.echo(f"diffkit: ERROR: {e}")
            _artifacts(result, json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path)
            _done(stream_dir)  # a load error is a finished answer, not a crash
            sys.exit(2)
        with open(os.path.join(stream_dir, "ref-done"), "w") as fh:
            fh.write("ok")
        sys.exit(0)
    try:
        result = diff_files(ref_path, cand_path, atol=atol, rtol=rtol, seed=seed, device=device, strict=strict,
                            train=train, tolerance=tolerance, reinit_zero=reinit_zero, stream_dir=stream_dir,
                            max_memory=max_bytes, only=only, stop_at_first=stop_at_first, streaming=streaming,
                            ref_capture=ref_capture)
    except DiffkitError as e:
        result = error_result(e, ref_path, cand_path, atol, rtol)
        click.echo(f"diffkit: ERROR: {e}", err=False)
        _artifacts(result, json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path)
        _done(stream_dir)
        sys.exit(2)
    except Exception as e:  # e.g. a CUDA error that poisoned the context after the forward
        if stream_dir:  # isolated: let the parent compare what was streamed before it
            raise
        err = DiffkitError("", "compare", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        click.echo(f"diffkit: ERROR: {err}")
        _artifacts(error_result(err, ref_path, cand_path, atol, rtol), json_path, csv_path, report_dir, no_report,
                   html_path, md_path, junit_path)
        sys.exit(2)
    _sanitizer_findings(result)
    click.echo(format_result(result, color=color, full=full))
    _artifacts(result, json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path)
    _done(stream_dir)
    sys.exit(EXIT[result.verdict])


def _sanitizer_findings(result) -> None:
    """In a child run under compute-sanitizer: attach what it has logged so far to the stages."""
    import os

    log, tool = os.environ.get("DIFFKIT_SANITIZER_LOG"), os.environ.get("DIFFKIT_SANITIZER_TOOL", "")
    if not log:
        return
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:
        pass
    from .sanitize import attach, parse

    text = open(log, encoding="utf-8", errors="replace").read() if os.path.exists(log) else ""
    attach(result, parse(text, tool))


def _done(stream_dir) -> None:
    """Tell the isolating parent that this child finished and wrote its own result."""
    if stream_dir:
        import os

        with open(os.path.join(stream_dir, "done"), "w") as fh:
            fh.write("ok")


def _is_capture(path: str) -> bool:
    import os

    return os.path.isdir(path) and os.path.exists(os.path.join(path, "index.json"))


def _isolated(argv, ref_path, cand_path, atol, rtol, strict, timeout, color, full, arts, sanitize=None) -> int:
    """Run each side in its own child process (reference, then candidate reading the reference's capture);
    if a child crashes or hangs, compare what was captured before it."""
    import os
    import signal
    import subprocess
    import tempfile

    from .compare import compare_traces
    from .result import ErrorInfo
    from .store import CaptureFile

    with tempfile.TemporaryDirectory(prefix="diffkit-") as tmp:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", DIFFKIT_BREADCRUMB=os.path.join(tmp, "breadcrumb"))
        base = [sys.executable, "-m", "diffkit.cli", *argv, "--no-isolate", "--stream-dir", tmp]
        # one process per side: the reference's forward streams to ref.dkt; the candidate's process
        # reads it back (lazily) and runs the candidate, the comparison and the root-cause replays
        ref_cmd = base + ["--side-only", "ref"]
        cand_cmd = base + ["--ref-capture", os.path.join(tmp, "ref.dkt")]
        san_log = os.path.join(tmp, "sanitizer.log")
        cand_env = dict(env)
        if sanitize:  # the candidate's process only
            from .sanitize import wrap_command

            try:
                cand_cmd = wrap_command(sanitize, san_log, cand_cmd)
            except (FileNotFoundError, ValueError) as e:
                click.echo(f"diffkit: ERROR: --sanitize: {e}")
                return 2
            cand_env.update(DIFFKIT_SANITIZER_LOG=san_log, DIFFKIT_SANITIZER_TOOL=sanitize)
        errlog = os.path.join(tmp, "stderr")
        code, why = 0, None
        for cmd, cenv, marker in ((ref_cmd, env, "ref-done"), (cand_cmd, cand_env, "done")):
            with open(errlog, "w") as err_fh:
                proc = subprocess.Popen(cmd, env=cenv, stderr=err_fh)
                try:
                    code = proc.wait(timeout=timeout)
                    why = None if code >= 0 else f"killed by {signal.Signals(-code).name}"
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    code, why = -9, f"did not finish within {timeout:g} s and was stopped"
            err_text = open(errlog, encoding="utf-8", errors="replace").read()
            if not (code in (0, 1, 2) and os.path.exists(os.path.join(tmp, marker))):
                break
        if sanitize and os.environ.get("DIFFKIT_SANITIZER_COPY") and os.path.exists(san_log):
            import shutil

            shutil.copy(san_log, os.environ["DIFFKIT_SANITIZER_COPY"])  # keep the raw log (debugging the parser)
        if code in (0, 1, 2) and os.path.exists(os.path.join(tmp, "done")):
            sys.stderr.write(err_text)
            return code
        lines = [ln.strip() for ln in err_text.splitlines() if ln.strip() and not ln.startswith(" ")]
        last_err = next((ln for ln in reversed(lines) if re.match(r"^[\w.]*(Error|Exception)\b.*:", ln)),
                        lines[-1] if lines else "")
        why = why or f"exited with status {code}" + (f" ({last_err[:300]})" if last_err else "")
        traces = {}
        for side in ("ref", "cand"):
            path = os.path.join(tmp, f"{side}.dkt")
            traces[side] = CaptureFile.open(path) if os.path.exists(os.path.join(path, "index.json")) else None
        crumb = ""
        if os.path.exists(os.path.join(tmp, "breadcrumb")):
            crumb = open(os.path.join(tmp, "breadcrumb"), encoding="utf-8").read().strip()
        side = "candidate" if traces["ref"] is not None and traces["ref"].complete else "reference"
        from .capture import Trace

        ref = traces["ref"].load() if traces["ref"] is not None else Trace()
        cand = traces["cand"].load() if traces["cand"] is not None else Trace()
        last = (cand if side == "candidate" else ref).records
        where = crumb or (f"after {last[-1].name} ({last[-1].where})" if last else "before any stage was captured")
        from .stream import read_journal

        result = compare_traces(ref, cand, atol, rtol, strict=strict,
                                known=read_journal(os.path.join(tmp, "stats.jsonl")))
        result.error = ErrorInfo(side, "forward", f"the {side} process {why}", where, err_text[-6000:])
        if sanitize and os.path.exists(san_log):
            from .sanitize import attach, parse

            attach(result, parse(open(san_log, encoding="utf-8", errors="replace").read(), sanitize))
        result.verdict = "error"
        result.ref_path, result.cand_path = ref_path, cand_path
        click.echo(format_result(result, color=color, full=full))
        _artifacts(result, *arts)
        return 2


def _artifacts(result, json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path) -> None:
    from . import report

    write_outputs(result, json_path, csv_path)
    try:
        if not no_report:
            paths = report.write_report(result, report_dir)
            click.echo(f"report: {paths['html']}", err=True)
        if html_path:
            report.write_html(result, html_path)
        if md_path:
            report.write_markdown(result, md_path)
        if junit_path:
            report.write_junit(result, junit_path)
    except OSError as e:
        click.echo(f"diffkit: could not write the report: {e}", err=True)


@main.command(name="capture")
@click.argument("model_path", metavar="MODEL.py")
@click.option("--side", type=click.Choice(["ref", "cand"]), default=None,
              help="which class to build: Model (ref) or ModelNew (cand); default: whichever the file defines")
@click.option("--seed", type=int, default=42, show_default=True)
@click.option("--inputs-from", "inputs_from", type=click.Path(exists=True, dir_okay=False), default=None,
              help="take get_inputs()/get_init_inputs() from this reference file (for a candidate file)")
@click.option("--limit", type=int, default=None, help="print at most this many records")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="save the records (values and metadata) as a capture directory for `diffkit diff`")
def capture_cmd(model_path, side, seed, inputs_from, limit, output):
    """Run one forward of MODEL.py under capture and print its records."""
    import torch

    from .compare import run_captured
    from .load import KERNELBENCH_SEED, exec_file

    try:
        mod = exec_file(model_path, "candidate" if side == "cand" else "reference")
        src = exec_file(inputs_from, "reference") if inputs_from else mod
        cls_name = {"ref": "Model", "cand": "ModelNew", None: "ModelNew" if hasattr(mod, "ModelNew") else "Model"}[side]
        cls = getattr(mod, cls_name, None)
        if cls is None:
            raise DiffkitError("", "import", f"{model_path} defines no `{cls_name}`", model_path)
        if not hasattr(src, "get_inputs"):
            raise DiffkitError("", "import", f"{model_path} defines no `get_inputs` (use --inputs-from REF.py)", model_path)
        torch.manual_seed(KERNELBENCH_SEED)
        init = src.get_init_inputs() if hasattr(src, "get_init_inputs") else []
        torch.manual_seed(KERNELBENCH_SEED)
        model = cls(*init).eval()
        torch.manual_seed(seed)
        inputs = src.get_inputs()
    except DiffkitError as e:
        click.echo(f"diffkit: ERROR: {e}")
        sys.exit(2)
    trace = run_captured(model, inputs, stream_to=output)
    click.echo(trace.format(limit=limit))
    if output:
        click.echo(f"saved {len(trace)} records to {output}")
    sys.exit(2 if trace.error else 0)


if __name__ == "__main__":
    main()
