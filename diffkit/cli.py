"""Command line: ``diffkit diff REF CAND`` and ``diffkit capture MODEL.py``.

This module parses arguments into `Options`, isolates each side in a child process, and writes
what the pipeline returns; the diff itself is pipeline.run.
Exit codes: 0 match, 1 diverged, 2 error (bad file, build failure, crash).
"""
from __future__ import annotations

import os
import re
import sys

import click

from .errors import DiffkitError
from .options import Options, Tolerance
from .result import ErrorInfo, Result

EXIT = {"match": 0, "diverged": 1, "error": 2}


def error_result(e: DiffkitError, ref_path: str, cand_path: str, options: Options) -> Result:
    """The result of a diff that could not run (a file that does not load, build or construct)."""
    from .pipeline import judge

    result = Result(verdict="", stages=[], first_divergence=None,
                    error=ErrorInfo(e.side, e.phase, e.message, e.where, e.detail), output=None,
                    atol=options.tolerance.atol, rtol=options.tolerance.rtol, ref_path=ref_path, cand_path=cand_path)
    result.verdict = judge(result)
    return result


def _options(atol, rtol, tolerance, **rest) -> Options:
    from .stream import parse_size

    try:
        max_bytes = parse_size(rest.pop("max_memory"))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-memory")
    stream = rest.pop("stream")
    try:
        tol = Tolerance(atol, rtol, tolerance)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--atol/--rtol")
    streaming = True if (stream or max_bytes is not None or rest.get("only") or rest.get("stop_at_first")) else None
    try:
        return Options(tolerance=tol, max_memory=max_bytes, streaming=streaming, **rest)
    except ValueError as e:
        raise click.UsageError(str(e))


@click.group()
@click.version_option(package_name="diffkit")
def main() -> None:
    """diffkit: find the first stage where a hand-written kernel stops matching its PyTorch reference."""


@main.command()
@click.argument("ref_path", metavar="REF")
@click.argument("cand_path", metavar="CAND")
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
              help="run in this process (default: a child process per side, so a crashing kernel cannot take the "
                   "answer with it)")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="stop a side that runs longer than this (seconds)")
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
              help="run the candidate's process under compute-sanitizer and attach its reports (kernel, thread, "
                   "address) to the stage that launched the kernel")
@click.option("--stream-dir", type=click.Path(file_okay=False), default=None, hidden=True)
@click.option("--side-only", type=click.Choice(["ref"]), default=None, hidden=True)
@click.option("--ref-capture", type=click.Path(file_okay=False), default=None, hidden=True)
def diff(ref_path, cand_path, atol, rtol, seed, device, json_path, csv_path, strict, train, full, tolerance,
         reinit_zero, report_dir, no_report, html_path, md_path, junit_path, no_isolate, timeout, max_memory, stream,
         only, stop_at_first, sanitize, stream_dir, side_only, ref_capture):
    """Compare candidate CAND (a ModelNew file) with reference REF (a Model file), stage by stage.

    Either side may instead be a capture directory written by `diffkit capture -o`: a candidate file
    against a captured reference runs on the capture's inputs and weights."""
    from .compare import capture_reference, diff_files, is_capture

    options = _options(atol, rtol, tolerance, max_memory=max_memory, stream=stream, seed=seed, device=device,
                       strict=strict, train=train, reinit_zero=reinit_zero, only=only, stop_at_first=stop_at_first,
                       stream_dir=stream_dir)
    out = _Outputs(json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path, sys.stdout.isatty(),
                   full)
    if sanitize and no_isolate:
        raise click.UsageError("--sanitize runs the candidate in a child process under compute-sanitizer; "
                               "drop --no-isolate")
    if not no_isolate and not is_capture(cand_path):
        argv = sys.argv[1:] if sys.argv[1:2] == ["diff"] else ["diff", *sys.argv[1:]]
        if sanitize:
            argv = [a for i, a in enumerate(argv) if a != "--sanitize" and not (i and argv[i - 1] == "--sanitize")
                    and not a.startswith("--sanitize=")]
        sys.exit(_isolated(argv, ref_path, cand_path, options, timeout, out, sanitize))
    if side_only == "ref":  # an isolated diff's reference process: capture, then leave the rest to the other
        try:
            capture_reference(ref_path, os.path.join(stream_dir, "ref.dkt"), options)
        except DiffkitError as e:
            out.write(error_result(e, ref_path, cand_path, options), error=e)
            _done(stream_dir)  # a load error is a finished answer, not a crash
            sys.exit(2)
        with open(os.path.join(stream_dir, "ref-done"), "w") as fh:
            fh.write("ok")
        sys.exit(0)
    try:
        result = diff_files(ref_capture or ref_path, cand_path, options=options, evidence=_sanitizer_evidence())
        result.ref_path = ref_path
    except DiffkitError as e:
        out.write(error_result(e, ref_path, cand_path, options), error=e)
        _done(stream_dir)
        sys.exit(2)
    except Exception as e:  # e.g. a CUDA error that poisoned the context after the forward
        if stream_dir:  # isolated: let the parent compare what was streamed before it
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        err = DiffkitError("", "compare", f"{type(e).__name__}: {first}")
        out.write(error_result(err, ref_path, cand_path, options), error=err)
        sys.exit(2)
    out.write(result)
    _done(stream_dir)
    sys.exit(EXIT[result.verdict])


class _Outputs:
    """Where a diff's answer goes: the terminal, --json/--csv, the report directory and single files."""

    def __init__(self, json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path, color, full):
        self.json_path, self.csv_path, self.report_dir, self.no_report = json_path, csv_path, report_dir, no_report
        self.html_path, self.md_path, self.junit_path = html_path, md_path, junit_path
        self.color, self.full = color, full

    def write(self, result: Result, error: DiffkitError | None = None) -> None:
        from . import report
        from .render import text_report

        click.echo(f"diffkit: ERROR: {error}" if error is not None else text_report(result, color=self.color,
                                                                                  full=self.full))
        try:
            for path in (self.json_path, self.csv_path):
                if path and os.path.dirname(path):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
            if self.json_path:
                with open(self.json_path, "w", encoding="utf-8") as fh:
                    fh.write(result.to_json())
            if self.csv_path:
                result.to_csv(self.csv_path)
            if not self.no_report:
                paths = report.write_report(result, self.report_dir)
                click.echo(f"report: {paths['html']}", err=True)
            if self.html_path:
                report.write_html(result, self.html_path)
            if self.md_path:
                report.write_markdown(result, self.md_path)
            if self.junit_path:
                report.write_junit(result, self.junit_path)
        except OSError as e:
            click.echo(f"diffkit: could not write the report: {e}", err=True)


def _sanitizer_evidence():
    """In a child run under compute-sanitizer: attach what it has logged to the stages before judging."""
    log, tool = os.environ.get("DIFFKIT_SANITIZER_LOG"), os.environ.get("DIFFKIT_SANITIZER_TOOL", "")
    if not log:
        return None

    def attach_logged(result) -> None:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception:
            pass
        from .sanitize import attach, parse

        text = open(log, encoding="utf-8", errors="replace").read() if os.path.exists(log) else ""
        attach(result, parse(text, tool))
    return attach_logged


def _done(stream_dir) -> None:
    """Tell the isolating parent that this child finished and wrote its own result."""
    if stream_dir:
        with open(os.path.join(stream_dir, "done"), "w") as fh:
            fh.write("ok")


def _isolated(argv, ref_path, cand_path, options: Options, timeout, out: _Outputs, sanitize=None) -> int:
    """Run each side in its own child process (the reference captured to a file, then the candidate
    diffed against that capture); if a child crashes or hangs, diff what was captured before it."""
    import signal
    import subprocess
    import tempfile

    from .compare import is_capture
    from .pipeline import CaptureSource, TraceSource, run
    from .capture import Trace

    with tempfile.TemporaryDirectory(prefix="diffkit-") as tmp:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", DIFFKIT_BREADCRUMB=os.path.join(tmp, "breadcrumb"))
        base = [sys.executable, "-m", "diffkit.cli", *argv, "--no-isolate", "--stream-dir", tmp]
        given = is_capture(ref_path)
        ref_dkt = ref_path if given else os.path.join(tmp, "ref.dkt")
        steps = [] if given else [(base + ["--side-only", "ref"], env, "ref-done")]
        cand_cmd = base + ["--ref-capture", ref_dkt]
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
        steps.append((cand_cmd, cand_env, "done"))
        errlog = os.path.join(tmp, "stderr")
        code, why, err_text = 0, None, ""
        for cmd, cenv, marker in steps:
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
        # a child crashed or hung: diff what both capture files hold, with the failure as the error
        lines = [ln.strip() for ln in err_text.splitlines() if ln.strip() and not ln.startswith(" ")]
        last_err = next((ln for ln in reversed(lines) if re.match(r"^[\w.]*(Error|Exception)\b.*:", ln)),
                        lines[-1] if lines else "")
        why = why or f"exited with status {code}" + (f" ({last_err[:300]})" if last_err else "")
        sources = {}
        for side, path in (("ref", ref_dkt), ("cand", os.path.join(tmp, "cand.dkt"))):
            sources[side] = CaptureSource(path) if is_capture(path) else TraceSource(Trace())
        ref_src, cand_src = sources["ref"], sources["cand"]
        side = "candidate" if isinstance(ref_src, CaptureSource) and ref_src.file.complete else "reference"
        crumb = ""
        if os.path.exists(os.path.join(tmp, "breadcrumb")):
            crumb = open(os.path.join(tmp, "breadcrumb"), encoding="utf-8").read().strip()
        last = (cand_src if side == "candidate" else ref_src).trace(values=False).records
        where = crumb or (f"after {last[-1].name} ({last[-1].where})" if last else "before any stage was captured")
        from .stream import read_journal

        error = ErrorInfo(side, "forward", f"the {side} process {why}", where, err_text[-6000:])
        evidence = None
        if sanitize and os.path.exists(san_log):
            def evidence(result):
                from .sanitize import attach, parse

                attach(result, parse(open(san_log, encoding="utf-8", errors="replace").read(), sanitize))
        result = run(ref_src, cand_src, options.replace(stream_dir=None, health=False, rerun=False),
                     known=read_journal(os.path.join(tmp, "stats.jsonl")), error=error, evidence=evidence)
        result.ref_path, result.cand_path = ref_path, cand_path
        out.write(result)
        return 2


@main.command(name="capture")
@click.argument("model_path", metavar="MODEL.py")
@click.option("--side", type=click.Choice(["ref", "cand"]), default=None,
              help="which class to build: Model (ref) or ModelNew (cand); default: whichever the file defines")
@click.option("--seed", type=int, default=42, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="run the model here")
@click.option("--train", is_flag=True, help="keep training mode (default: eval)")
@click.option("--inputs-from", "inputs_from", type=click.Path(exists=True, dir_okay=False), default=None,
              help="take get_inputs()/get_init_inputs() from this reference file (for a candidate file)")
@click.option("--limit", type=int, default=None, help="print at most this many records")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="save the records (values and metadata), the model's parameters and its inputs as a capture "
                   "directory for `diffkit diff`")
def capture_cmd(model_path, side, seed, device, train, inputs_from, limit, output):
    """Run one forward of MODEL.py under capture and print its records."""
    from .load import load_reference
    from .pipeline import capture_writer, clone_inputs, rerun_differences, run_captured

    try:
        built = load_reference(model_path, seed=seed, device=device, train=train, inputs_from=inputs_from,
                               class_name={"cand": "ModelNew", "ref": "Model", None: None}[side],
                               side="candidate" if side == "cand" else "reference")
    except DiffkitError as e:
        click.echo(f"diffkit: ERROR: {e}")
        sys.exit(2)
    info = built.info()
    writer = capture_writer(output, built.model, info) if output else None
    trace = run_captured(built.model, clone_inputs(built.inputs), sink=writer)
    if writer is not None and trace.error is None:
        # a second forward on the same inputs: records that change between runs (a race, an
        # uninitialised read) are kept with the capture, as a live diff's re-run would find them
        again = run_captured(built.model, clone_inputs(built.inputs))
        writer.set_info({**info, "rerun_differs": rerun_differences(trace, again)})
    click.echo(trace.format(limit=limit))
    if output:
        click.echo(f"saved {len(trace)} records to {output}")
    sys.exit(2 if trace.error else 0)


if __name__ == "__main__":
    main()
