"""Command line: ``diffkit diff REF CAND``, ``diffkit capture MODEL.py`` and ``diffkit suite``.

This module parses arguments into `Options`, calls the library and prints: a diff runs in child processes
(diffkit.processes.isolated) or, with --no-isolate, here (diffkit.roles.run_here); the diff itself is
pipeline.run.  Exit codes (diffkit.errors): 0 match, 1 diverged, 2 a problem in the user's files or flags (a file
that does not load or build, a crash, a bad flag), 3 an internal error of diffkit (its traceback is printed).
"""
from __future__ import annotations

import sys

import click

from . import progress
from .compare import capture_reference, is_capture
from .errors import INTERNAL, DiffkitError
from .flags import DIFF_OPTIONS
from .load import load_reference
from .options import Options, Tolerance
from .outputs import (Outputs, Terminated, exit_guard, install_signal_handlers, print_internal_error,
                      standard_streams_present)
from .modelstate import seed_all
from .runner import clone_inputs, run_captured
from .processes import isolated
from .roles import Job, run_here
from .stream import parse_size
from .suite_ray import suite  # `diffkit suite`, with its --ray backend registered
from .trials import trial_seeds


def _options(atol, rtol, tolerance, **rest) -> Options:
    try:
        max_bytes = parse_size(rest.pop("max_memory"))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-memory")
    try:
        rest["device_memory"] = parse_size(rest.pop("device_memory", None)) or None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--device-memory")
    stream = rest.pop("stream")
    stat = rest.pop("stat", "elementwise")
    try:
        tol = Tolerance(atol, rtol, tolerance, stat)
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
    standard_streams_present()


@main.command(params=list(DIFF_OPTIONS))  # (a copy: click.argument appends to it, and a fork server runs
#  this module again as the parent's __main__, see diffkit.warm)
@click.argument("ref_path", metavar="REF")
@click.argument("cand_path", metavar="CAND")
def diff(ref_path, cand_path, json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path, full,
         no_isolate, timeout, sanitize, atol, rtol, tolerance, eval_mode=False, **flags):
    """Compare candidate CAND (a ModelNew file) with reference REF (a Model file), stage by stage.

    Either side may instead be a capture directory written by `diffkit capture -o`: a candidate file
    against a captured reference runs on the capture's inputs and weights."""
    install_signal_handlers()
    progress.show_here()  # (a person at a terminal sees what the diff is doing while it runs)
    try:
        options = _options(atol, rtol, tolerance, eval=eval_mode, **flags)
        out = Outputs(json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path, sys.stdout.isatty(),
                      full)
        _check(ref_path, options, no_isolate, sanitize)
        if out.clash():
            raise click.UsageError(out.clash())
        if not no_isolate and not is_capture(cand_path):
            sys.exit(isolated(ref_path, cand_path, options, timeout, out, sanitize))
        # in this process (--no-isolate, a captured candidate): --timeout bounds the whole diff here
        run_here(Job("here", ref_path, cand_path, options, out.settings), out, timeout)
    except Terminated as t:
        sys.exit(128 + t.signum)
    finally:
        progress.stop()


def _check(ref_path: str, options: Options, no_isolate: bool, sanitize: str | None) -> None:
    """The flags that do not go together."""
    if sanitize and no_isolate:
        raise click.UsageError("--sanitize runs the candidate in a child process under compute-sanitizer; "
                               "drop --no-isolate")
    if options.tolerance.mode == "auto":
        # (the pipeline's own checks would surface as an internal error from an isolated child)
        if is_capture(ref_path):
            raise click.UsageError("--tolerance auto runs the reference model again in float64: give the reference "
                                   "as its .py file, not a capture")
        if options.is_streaming:
            raise click.UsageError("--tolerance auto needs every reference value twice (as run, and in float64): it "
                                   "does not combine with --stream or --max-memory")
        if not no_isolate:
            raise click.UsageError("--tolerance auto runs the reference again in float64 beside the candidate, in "
                                   "one process: add --no-isolate")


@main.command(name="capture")
@click.argument("model_path", metavar="MODEL.py")
@click.option("--side", type=click.Choice(["ref", "cand"]), default=None,
              help="which class to build: Model (ref) or ModelNew (cand); default: whichever the file defines")
@click.option("--seed", type=int, default=42, show_default=True,
              help="KernelBench's seed: each trial's input seed is drawn from it")
@click.option("--trials", type=click.IntRange(min=1), default=5, show_default=True,
              help="with -o: also store each later trial's inputs and output (trial-K.dkt inside the capture)")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="run the model here")
@click.option("--eval", "eval_mode", is_flag=True, help="put the model in eval() (default: as constructed, as "
              "KernelBench runs it)")
@click.option("--inputs-from", "inputs_from", type=click.Path(exists=True, dir_okay=False), default=None,
              help="take get_inputs()/get_init_inputs() from this reference file (for a candidate file)")
@click.option("--limit", type=int, default=None, help="print at most this many records")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="save the records (values and metadata), the model's parameters and its inputs as a capture "
                   "directory for `diffkit diff`")
def capture_cmd(model_path, side, seed, trials, device, eval_mode, inputs_from, limit, output):
    """Run one forward of MODEL.py (KernelBench's first trial) under capture and print its records."""
    options = Options(seed=seed, trials=trials, device=device, eval=eval_mode)
    class_name = {"cand": "ModelNew", "ref": "Model", None: None}[side]
    which = "candidate" if side == "cand" else "reference"
    install_signal_handlers()
    guard = exit_guard(what="the capture")  # (held: for the rest of this process, the model's code runs in it)
    guard.__enter__()
    try:
        if output:
            trace = capture_reference(model_path, output, options, class_name=class_name, inputs_from=inputs_from,
                                      side=which)
        else:
            first = trial_seeds(1, seed)[0]
            built = load_reference(model_path, seed=first, device=device, eval_mode=eval_mode,
                                   inputs_from=inputs_from, class_name=class_name, side=which)
            seed_all(first)
            trace = run_captured(built.model, clone_inputs(built.inputs))
    except DiffkitError as e:
        click.echo(f"diffkit: ERROR: {e}")
        sys.exit(2)
    except Terminated as t:
        sys.exit(128 + t.signum)
    except OSError as e:
        click.echo(f"diffkit: ERROR: cannot write the capture {output}: {e}")
        sys.exit(2)
    except Exception as e:
        print_internal_error(e)
        sys.exit(INTERNAL)
    click.echo(trace.format(limit=limit))
    if output:
        click.echo(f"saved {len(trace)} records to {output}")
    sys.exit(2 if trace.error else 0)


main.add_command(suite)

if __name__ == "__main__":
    main()
