"""Command line: ``diffkit diff REF CAND`` and ``diffkit capture MODEL.py``.

This module parses arguments into `Options`, runs the diff in child processes (see _isolated), and writes
what the pipeline returns; the diff itself is pipeline.run.
Exit codes: 0 match, 1 diverged, 2 a problem in the user's files or flags (a file that does not
load or build, a crash, a bad flag), 3 an internal error of diffkit (its traceback is printed).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time

import click

from .compare import error_result
from .errors import EXIT, INTERNAL, DiffkitError
from .flags import DIFF_OPTIONS
from .options import Options, Tolerance
from .processes import python_command, stop as _stop
from .result import ErrorInfo, Result
from .suite import suite
INSURED_ENV = "DIFFKIT_INSURED"  # how an isolated diff tells its candidate child what its capture file keeps
AFTER_ENV = "DIFFKIT_AFTER"  # the file an isolated diff's candidate child waits for (its reference's capture)
HANDOVER_ENV = "DIFFKIT_HANDOVER"  # set for an isolated diff's reference child: on a GPU, keep the values and hand
# them over (diffkit.handoff); it then writes HELD and stays alive until released
HELD = "ref-held"
# set for an isolated diff's one child that runs both sides (see _isolated): the folder for its "done" marker.
# It answers only when its diff ran clean; anything else is left to the two-process diff that follows
BOTH_ENV = "DIFFKIT_BOTH_SIDES"
EARLIER_ENV = "DIFFKIT_EARLIER"  # that child's failure (a JSON file), for the candidate child that runs after it
BOTH_TTY_ENV = "DIFFKIT_BOTH_TTY"  # "1": the diff's own standard output is a terminal (the child's is a file)
# the phases of an error that comes before either model's forward has run (diffkit.errors): that child answers it
BEFORE_ANY_FORWARD = ("read", "parse", "import", "build", "init", "inputs")
BOTH_LIMIT_S = 600.0  # the most that child gets (its --timeout, if shorter): a longer diff runs again, a child per side
AGAIN_CODE = 4  # how that child says "not clean: run the diff again, a child per side" (never a diff's exit code)
# where a CLI diff ran its models (the JSON's meta.processes)
PROCESSES = {"both": "one child process, both sides", "per side": "a child process per side",
             "none": "diffkit's own process"}
ANSWER_POLL_S = 0.01  # how often an isolated diff looks for a child's marker (its answer, its complete capture)
RELEASE_WAIT_S = 30.0  # how long a released reference process gets to exit before it is stopped
CAUGHT_UP = "was stopped once it had got as far as the first"
HUNG = "did not finish within"  # how a child stopped at its time limit is described (`why`)
AGAIN_MARGIN = 30.0  # seconds a hung candidate's second run gets beyond twice the first run's progress


class Terminated(BaseException):
    """SIGTERM/SIGINT arrived: unwind (children stopped, temporary directories removed), then exit.
    A BaseException, so neither the user's model nor the capture takes it for an error of the model."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    raise Terminated(signum)


def _install_signal_handlers() -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread (e.g. called from a test runner's worker)
            pass


def _is_users_fault(e: BaseException) -> bool:
    """An exception escaping the pipeline is diffkit's bug, except a device error that the
    candidate's kernel left behind (the context is poisoned after its forward)."""
    text = f"{type(e).__name__}: {e}"
    return type(e).__name__ == "AcceleratorError" or "CUDA error" in text or "device-side assert" in text


def _internal_error(e: BaseException) -> None:
    import traceback

    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    click.echo(f"diffkit: INTERNAL ERROR: {type(e).__name__}: {str(e).strip()[:300]} — this is a bug in diffkit, "
               f"not in your files; please report it with the traceback above", err=True)


def _options(atol, rtol, tolerance, **rest) -> Options:
    from .stream import parse_size

    try:
        max_bytes = parse_size(rest.pop("max_memory"))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-memory")
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


class _Main(click.Group):
    """The command group, keeping the arguments it was run with: an isolated diff passes them on to its children,
    also when it was called from Python (`main.main(args=[...])`, whose arguments are not `sys.argv`)."""

    argv: list[str] | None = None

    def main(self, args=None, *rest, **kwargs):
        self.argv = [str(a) for a in args] if args is not None else sys.argv[1:]
        return super().main(args, *rest, **kwargs)


@click.group(cls=_Main)
@click.version_option(package_name="diffkit")
def main() -> None:
    """diffkit: find the first stage where a hand-written kernel stops matching its PyTorch reference."""


# (the hidden flags: how an isolated diff tells its children their part; see _isolated)
_CHILD_FLAGS = [click.Option(["--stream-dir"], type=click.Path(file_okay=False), default=None, hidden=True),
                click.Option(["--side-only"], type=click.Choice(["ref"]), default=None, hidden=True),
                click.Option(["--ref-capture"], type=click.Path(file_okay=False), default=None, hidden=True)]


@main.command(params=[*DIFF_OPTIONS, *_CHILD_FLAGS])
@click.argument("ref_path", metavar="REF")
@click.argument("cand_path", metavar="CAND")
def diff(ref_path, cand_path, atol, rtol, seed, device, json_path, csv_path, strict, full, tolerance,
         reinit_zero, report_dir, no_report, html_path, md_path, junit_path, no_isolate, timeout, max_memory, stream,
         only, stop_at_first, sanitize, stream_dir, side_only, ref_capture, trials=5, eval_mode=False,
         sync_weights=False, explain=None, explain_budget=1000, explain_seconds=60.0, stat="elementwise", fold=True):
    """Compare candidate CAND (a ModelNew file) with reference REF (a Model file), stage by stage.

    Either side may instead be a capture directory written by `diffkit capture -o`: a candidate file
    against a captured reference runs on the capture's inputs and weights."""
    _install_signal_handlers()
    try:
        _diff(ref_path, cand_path, atol, rtol, seed, device, json_path, csv_path, strict, full, tolerance,
              reinit_zero, report_dir, no_report, html_path, md_path, junit_path, no_isolate, timeout, max_memory,
              stream, only, stop_at_first, sanitize, stream_dir, side_only, ref_capture,
              protocol={"trials": trials, "eval": eval_mode, "sync_weights": sync_weights, "explain": explain,
                        "explain_budget": explain_budget, "explain_seconds": explain_seconds, "stat": stat,
                        "fold": fold})
    except Terminated as t:
        sys.exit(128 + t.signum)


def _diff(ref_path, cand_path, atol, rtol, seed, device, json_path, csv_path, strict, full, tolerance,
          reinit_zero, report_dir, no_report, html_path, md_path, junit_path, no_isolate, timeout, max_memory, stream,
          only, stop_at_first, sanitize, stream_dir, side_only, ref_capture, protocol=None):
    from .compare import capture_reference, diff_files, is_capture

    options = _options(atol, rtol, tolerance, max_memory=max_memory, stream=stream, seed=seed, device=device,
                       strict=strict, reinit_zero=reinit_zero, only=only, stop_at_first=stop_at_first,
                       stream_dir=stream_dir, **(protocol or {}))
    # an isolated diff's candidate child (see _isolated): "0" keeps names and shapes only as crash insurance,
    # "again" is the second run after a crash or hang, which keeps every value and leaves the answer to the parent
    insured = os.environ.get(INSURED_ENV) if ref_capture else None
    if insured == "0":
        options = options.replace(insured=False)
    # an isolated diff's one child running both sides (see _isolated): it answers only for a clean diff.  (Its
    # variables are taken out of the environment: nothing the models start -- a nested diffkit -- inherits them)
    both = os.environ.pop(BOTH_ENV, None) if no_isolate and not (side_only or ref_capture or stream_dir) else None
    tty = bool(os.environ.pop(BOTH_TTY_ENV, None)) if both else sys.stdout.isatty()
    earlier = os.environ.pop(EARLIER_ENV, None) if ref_capture and stream_dir else None
    torch_before = _torch_globals() if both else None
    processes = PROCESSES["both" if both else "per side" if ref_capture and stream_dir else "none"]  # (meta.processes)
    if both:  # a crash prints its Python stack into the log: which model's file it was in (see _what_failed)
        import faulthandler

        faulthandler.enable(file=sys.stderr)
    out = _Outputs(json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path, tty,
                   full, silent=insured == "again")
    after = os.environ.get(AFTER_ENV) if ref_capture else None
    if after:  # started beside the reference's process: run the candidate's file now, then wait for its capture
        from .load import prepare_candidate

        prepare_candidate(cand_path)
        # with no GPU in play, the candidate is built as soon as the reference's process says what it builds
        # its model from (on a GPU its constructor could take device memory that process needs)
        init_file = os.path.join(stream_dir, INIT_FILE) if stream_dir and _host_only(options.device) else None
        parent = os.getppid()
        while not os.path.exists(after):
            if init_file and os.path.exists(init_file):
                _build_ahead(cand_path, init_file)
                init_file = None
            if os.getppid() != parent:  # the diff that started this process is gone
                sys.exit(2)
            time.sleep(0.01)
    if sanitize and no_isolate:
        raise click.UsageError("--sanitize runs the candidate in a child process under compute-sanitizer; "
                               "drop --no-isolate")
    if options.tolerance.mode == "auto" and not (side_only or ref_capture):
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
    if not no_isolate and not is_capture(cand_path):
        given = main.argv if main.argv is not None else sys.argv[1:]
        argv = list(given) if given[:1] == ["diff"] else ["diff", *given]
        if sanitize:
            argv = [a for i, a in enumerate(argv) if a != "--sanitize" and not (i and argv[i - 1] == "--sanitize")
                    and not a.startswith("--sanitize=")]
        sys.exit(_isolated(argv, ref_path, cand_path, options, timeout, out, sanitize))
    # in this process (--no-isolate, a captured candidate): --timeout bounds the whole diff here (a child of an
    # isolated diff is timed by its parent)
    with _deadline(0 if stream_dir or both else timeout, ref_path, cand_path, options, out):
        if side_only == "ref":  # an isolated diff's reference process: capture, then leave the rest to the other
            from .handoff import Holder
            from .trials import TRIAL_DIR

            parent = os.getppid()
            holder = Holder(os.path.join(stream_dir, "ref.dkt"), keep=TRIAL_DIR) if os.environ.get(HANDOVER_ENV) \
                else None
            try:
                capture_reference(ref_path, os.path.join(stream_dir, "ref.dkt"), options,
                                  on_init=lambda init: _publish_init(stream_dir, init),
                                  hand_over=holder.hand_over if holder is not None else None,
                                  outputs_only_trials=True)  # (the candidate's process reruns a failing trial)
            except DiffkitError as e:
                out.write(error_result(e, ref_path, cand_path, options), error=e)
                _done(stream_dir, 2)  # a load error is a finished answer, not a crash
                sys.exit(2)
            with open(os.path.join(stream_dir, "ref-done"), "w") as fh:
                fh.write("ok")
            if holder is not None and holder.holding:  # its values stay on the GPU until the candidate is done
                with open(os.path.join(stream_dir, HELD), "w") as fh:
                    fh.write(str(os.getpid()))
                holder.serve(parent)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)  # (no teardown: the driver takes the device memory back; the handles' users are gone)
            sys.exit(0)
        try:
            if ref_capture:  # the capture this diff's own reference child wrote
                options = options.replace(trusted_capture=True)
            result = diff_files(ref_capture or ref_path, cand_path, options=options, evidence=_sanitizer_evidence())
            result.ref_path = ref_path
        except DiffkitError as e:
            if both and e.phase not in BEFORE_ANY_FORWARD:  # (a file that does not load is answered as it is)
                _again(both, ErrorInfo.from_dict(e.to_dict()))
            failed = error_result(e, ref_path, cand_path, options)
            failed.meta["processes"] = processes
            out.write(failed, error=e)
            _done(both or stream_dir, 2)
            sys.exit(2)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            if both:  # the diff runs again, a child per side
                import traceback

                text = traceback.format_exc()
                sys.stderr.write(text)
                _again(both, ErrorInfo("candidate", "forward", f"{type(e).__name__}: {first}", "", text[-6000:])
                       if _is_users_fault(e) else None)
            if not _is_users_fault(e):
                _internal_exit(e, stream_dir)
            if stream_dir:  # a CUDA error that poisoned the context after the forward: the parent diffs the captures
                raise
            err = DiffkitError("candidate", "forward", f"{type(e).__name__}: {first}")
            out.write(error_result(err, ref_path, cand_path, options), error=err)
            sys.exit(2)
        if both and (result.error is not None or result.verdict not in ("match", "diverged")):
            _again(both, result.error)  # a side failed: a child per side says which, and diffs what it captured
        if both and _torch_changed(torch_before):
            # a model changed torch itself (a function swapped, the default dtype, a precision flag): in one process
            # that reaches the other model too; a child per side keeps the reference away from it
            _again(both, None)
        if earlier and result.error is None:
            _failed_before(result, earlier)
        result.meta["processes"] = processes
        try:
            written = out.write(result)
        except Exception as e:  # writing diffkit's own answer failed: never the candidate's fault
            _internal_exit(e, stream_dir)
        code = EXIT[result.verdict] if written else 2
        _done(both or stream_dir, code)
        sys.exit(code)


def _torch_globals() -> dict:
    """What a model could change in torch itself for every model in its process: the functions of torch,
    torch.nn.functional and torch.Tensor and the forward of every torch.nn module class (by identity), the default
    dtype and the precision flags (see _torch_changed)."""
    import torch
    import torch.nn.functional as F

    seen = {}
    for label, space in (("torch", torch), ("F", F), ("Tensor", torch.Tensor)):
        for k, v in list(vars(space).items()):
            if not k.startswith("__"):
                seen[(label, k)] = id(v)
    for k, v in list(vars(torch.nn).items()):
        if isinstance(v, type):
            seen[("nn", k)] = id(getattr(v, "forward", None))
    seen["flags"] = (torch.get_default_dtype(), torch.get_float32_matmul_precision(),
                     torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
                     torch.backends.cudnn.allow_tf32, torch.backends.cudnn.enabled, torch.is_grad_enabled())
    return seen


def _torch_changed(before: dict) -> list[str]:
    """The names in `before` (_torch_globals) that are something else now (a name added since -- importing a
    submodule adds some -- is not a change)."""
    now = _torch_globals()
    return [k if isinstance(k, str) else ".".join(k) for k, v in before.items() if k in now and now[k] != v]


def _again(both: str, error: ErrorInfo | None) -> None:
    """An isolated diff's one child running both sides (see _isolated) whose diff did not run clean: what failed
    noted for its parent (`error`; None: diffkit's own fault, or nothing to say), no answer written, and the exit
    code that asks for the diff again with a child per side."""
    if error is not None:
        import json

        with open(os.path.join(both, "failed"), "w", encoding="utf-8") as fh:
            json.dump(error.to_dict(), fh)
    sys.stdout.flush()
    sys.exit(AGAIN_CODE)


def _what_failed(both: str, code: int, why: str | None, err_text: str, ref_path: str, cand_path: str,
                 limit: float) -> dict | None:
    """What the one child running both sides hit, for the diff that runs again with a child per side to report
    if it does not hit it (an ErrorInfo's fields; "warning": said as a warning, not an error); None when there is
    nothing a clean second diff should be told (diffkit itself failed: exit 3, its traceback in the log)."""
    import json

    if code == AGAIN_CODE:
        try:
            with open(os.path.join(both, "failed"), encoding="utf-8") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None
    if code == INTERNAL:
        return None
    if why and why.startswith(HUNG):  # (its limit was both sides' together: the sides' own come next)
        return {"warning": True, "message": f"run in one child process, both sides together did not finish within "
                                            f"{limit:g} s (its limit: --timeout, at most {BOTH_LIMIT_S:g} s); with a "
                                            f"child process per side each did: a diff that long, or a hang that "
                                            f"does not repeat"}
    try:
        crumb = open(os.path.join(both, "breadcrumb"), encoding="utf-8").read().strip()
    except OSError:
        crumb = ""
    # the kernel call it died in names the side whose file made it; else the innermost line of either model's
    # file in the stack faulthandler printed (most recent call first); one file for both models names neither
    side = ""
    files = {os.path.realpath(cand_path): "candidate"}
    files[os.path.realpath(ref_path)] = "reference" if os.path.realpath(ref_path) not in files else ""
    for path, name in files.items():
        if crumb and path in crumb:
            side = name
            break
    for m in ([] if side else re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', err_text)):
        path = os.path.realpath(m.group(1))
        if path in files:  # (a kernel call's breadcrumb, when there is one, stays the place named)
            side, crumb = files[path], crumb or f"{os.path.basename(m.group(1))}:{m.group(2)} in {m.group(3)}"
            break
    who = f"the {side}" if side else "one of the models"
    how = why or f"exited with status {code}"
    return {"side": side, "phase": "forward", "stage": crumb,
            "message": f"the process running both models {how} ({who})", "traceback": err_text[-6000:]}


def _failed_before(result: Result, path: str) -> None:
    """The diff with a child per side ran clean after the one child running both sides failed (see _isolated):
    the failure happened all the same, so the answer is an error naming it, with every stage of this diff."""
    import json

    from .pipeline import judge

    try:
        with open(path, encoding="utf-8") as fh:
            said = json.load(fh)
    except (OSError, ValueError):
        return
    if said.get("warning"):
        result.warnings.append(said.get("message", ""))
        return
    first = ErrorInfo.from_dict(said)
    first.message = (f"{first.message}; the diff was run again, a child process per side, and it did not fail: "
                     f"the failure does not repeat (a race, an uninitialised read, or the two models in one "
                     f"process, as KernelBench runs them?)")
    result.error = first
    result.verdict = judge(result)


def _internal_exit(e: BaseException, stream_dir: str | None) -> None:
    """A bug of diffkit's: its traceback printed and exit 3; an isolated diff's child also tells the
    isolating parent (an "internal" file) that it was diffkit's fault, not a crash of the kernel."""
    _internal_error(e)
    if stream_dir:
        with open(os.path.join(stream_dir, "internal"), "w") as fh:
            fh.write(f"{type(e).__name__}: {e}")
    sys.exit(INTERNAL)


INIT_FILE = "init.json"  # an isolated diff's reference process: the init inputs it builds its model from


def _publish_init(stream_dir: str, init: list) -> None:
    """Tell the candidate's process the init inputs the reference is built from (`INIT_FILE`, written
    whole or not at all), so it can build its model while the reference is captured."""
    import json

    from .load import encode_values

    path = os.path.join(stream_dir, INIT_FILE)
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump({"init_inputs": encode_values(init)}, fh)
        os.replace(path + ".tmp", path)
    except (OSError, TypeError, ValueError):  # the candidate's process builds its model later, as ever
        pass


def _build_ahead(cand_path: str, init_file: str) -> None:
    """The candidate's process: build the candidate from the init inputs the reference's process published."""
    import json

    from .load import build_candidate_ahead

    try:
        with open(init_file, encoding="utf-8") as fh:
            enc = json.load(fh).get("init_inputs")
    except (OSError, ValueError, AttributeError):
        return
    build_candidate_ahead(cand_path, enc)


# a --no-isolate diff past its --timeout whose Python cannot run (code holding the interpreter's lock) is ended by
# the kernel (SIGALRM) this many seconds later
DEADLINE_GRACE_S = 10.0


def _hung_at(frame, ref_path: str, cand_path: str) -> tuple[str, str, str]:
    """The side whose file the innermost frame of `frame`'s stack belongs to, the phase (its constructor, its
    inputs, else its forward) and where: ("candidate", "forward", "cand.py:12 in forward"); ("", "forward", "") when
    neither model's file is on the stack."""
    files = {}
    for side, path in (("candidate", cand_path), ("reference", ref_path)):
        try:
            files[os.path.realpath(path)] = side
        except (OSError, TypeError, ValueError):
            continue
    while frame is not None:
        code = frame.f_code
        side = files.get(os.path.realpath(code.co_filename)) if code.co_filename else None
        if side:
            phase = {"__init__": "init", "get_init_inputs": "init", "get_inputs": "inputs"}.get(code.co_name, "forward")
            return side, phase, f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return "", "forward", ""


# past this, a --timeout is "never" (and where it is not a number at all)
_LONGEST_TIMEOUT = 1e8


@contextlib.contextmanager
def _deadline(limit: float, ref_path: str, cand_path: str, options: Options, out: "_Outputs"):
    """A diff in this process (--no-isolate) past `limit` seconds (0, inf, nan: none): its answer is an error
    naming the side and the line its main thread was at, written as every answer is, and the process exits 2
    (nothing else can stop a forward that does not return); whichever of the diff and this deadline starts writing
    the answer first writes it alone (`_Outputs.claim`).  Where its Python cannot run, SIGALRM ends the process
    DEADLINE_GRACE_S later, unless SIGALRM or the real-time timer is already someone else's (a host process's)."""
    import math
    import signal

    if not limit or not math.isfinite(limit) or limit > _LONGEST_TIMEOUT:
        yield
        return
    main_thread = threading.current_thread()
    done = threading.Event()

    def expire() -> None:
        if done.wait(limit) or not out.claim():
            return
        side, phase, where = _hung_at(sys._current_frames().get(main_thread.ident), ref_path, cand_path)
        whose = f"the {side}" if side else "the diff (in neither model's file: diffkit's own work or a library's)"
        err = DiffkitError(side, phase, f"{whose} did not finish within {limit:g} s and was stopped (--no-isolate: "
                           f"both models ran in diffkit's process, so what they computed is lost; without "
                           f"--no-isolate only the side that hangs is stopped and what it captured is diffed)", where)
        try:
            out.write(error_result(err, ref_path, cand_path, options), error=err, claimed=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)

    threading.Thread(target=expire, name="diffkit-deadline", daemon=True).start()
    alarm = (hasattr(signal, "setitimer") and main_thread is threading.main_thread()
             and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
             and signal.getitimer(signal.ITIMER_REAL)[0] == 0)

    def disarm() -> None:  # (the answer is being written here: its writing is not cut short)
        if alarm and threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)

    if alarm:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, limit + DEADLINE_GRACE_S)
    out.on_claim = disarm
    try:
        yield
    finally:
        done.set()
        out.on_claim = None
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)


class _Outputs:
    """Where a diff's answer goes: the terminal, --json/--csv, the report directory and single files."""

    def __init__(self, json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path, color, full,
                 silent=False):
        # against the directory the command ran in (a model's constructor or forward may change it)
        here = lambda p: os.path.abspath(p) if p else p  # noqa: E731
        self.json_path, self.csv_path, self.report_dir, self.no_report = here(json_path), here(csv_path), \
            here(report_dir), no_report
        self.html_path, self.md_path, self.junit_path = here(html_path), here(md_path), here(junit_path)
        self.cwd = os.getcwd()
        self.color, self.full = color, full
        self.silent = silent  # an isolated diff's second candidate run: the parent writes the answer
        self.answering = False  # someone is writing the answer (`claim`)
        self._claim_lock = threading.Lock()
        self._claimed_by: int | None = None
        self.on_claim = None  # called when the answer is claimed (a --no-isolate deadline disarms its alarm)

    def claim(self) -> bool:
        """Whether the caller is the one to write the answer (the first to ask): a --no-isolate diff's deadline and
        the diff itself never both write it."""
        with self._claim_lock:
            if self.answering:
                return self._claimed_by == threading.get_ident()  # (the same thread writing again: as before)
            self.answering, self._claimed_by = True, threading.get_ident()
        if self.on_claim is not None:
            self.on_claim()
        return True

    def write(self, result: Result, error: DiffkitError | None = None, claimed: bool = False) -> bool:
        """Print the answer and write every artifact asked for; False when one could not be written.  An answer
        already being written by another thread (a deadline's) is left to it: this thread then waits for the
        process to end."""
        if not claimed and not self.claim():
            threading.Event().wait()  # (the deadline's answer ends the process)
        from . import report
        from .render import text_report

        if self.silent:
            return True
        # the files first: a reader of the printed answer that stops early (`| head`) costs none of them
        written, notes = True, []
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
                paths = report.write_report(result, self.report_dir or os.path.join(
                    self.cwd, report.default_report_dir(result)))
                notes.append(f"report: {paths['html']}")
            if self.html_path:
                report.write_html(result, self.html_path)
            if self.md_path:
                report.write_markdown(result, self.md_path)
            if self.junit_path:
                report.write_junit(result, self.junit_path)
        except OSError as e:
            notes.append(f"diffkit: ERROR: could not write {e.filename or 'the report'}: {e.strerror or e}")
            written = False
        try:
            # (color: kept when this process prints into a file for a parent whose output is a terminal)
            click.echo(f"diffkit: ERROR: {error}" if error is not None else text_report(result, color=self.color,
                                                                                      full=self.full),
                       color=True if self.color else None)
        except BrokenPipeError:  # the reader has gone: nothing more goes to it (the exit code still tells)
            _stdout_gone()
        for note in notes:
            click.echo(note, err=True)
        return written


def _stdout_gone() -> None:
    """Standard output's reader has closed it: point it at the null device, so that no later write or flush
    (this process's own at exit included) fails again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


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
        from .sanitize import attach, built_sources, candidate_sources, failure_words, internal_failure, parse

        text = open(log, encoding="utf-8", errors="replace").read() if os.path.exists(log) else ""
        cand = os.environ.get("DIFFKIT_SANITIZER_CANDIDATE", "")
        sources = built_sources() + ([t for _, t in candidate_sources(cand)] if os.path.isfile(cand) else [])
        attach(result, parse(text, tool), sources=sources)
        failed = internal_failure(text)
        if failed and result.error is not None and result.error.side == "candidate":  # the error followed it
            result.error.message = f"{result.error.message}, {failure_words(tool, failed)}"
        elif failed:  # it went on: what it reported stands, what it did not may be missing
            result.warnings.insert(0, failure_words(tool, failed, crashed=False))
    return attach_logged


def _done(stream_dir, code: int) -> None:
    """Tell the isolating parent that this child finished, wrote its own result (flushed first: the parent may
    return before this process has exited) and exits with `code`."""
    if stream_dir:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _stdout_gone()
        sys.stderr.flush()
        path = os.path.join(stream_dir, "done")
        with open(path + ".part", "w") as fh:
            fh.write(str(code))
        os.replace(path + ".part", path)  # (the parent never reads half of it)


def _finished_code(tmp: str) -> int | None:
    """The exit code an isolated diff's child wrote with its "done" marker (see _done); None without one."""
    try:
        with open(os.path.join(tmp, "done"), encoding="utf-8") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.lstrip("-").isdigit() else None


_REAPING: list = []  # the threads reaping answered children (see _let_answered_go), joined at this process's exit
REAP_AT_EXIT_S = 30.0  # at most this long in all (a killed process ends once the kernel has taken its memory back)


def _let_answered_go(proc) -> None:
    """A child that has given its answer (printed, its files written and closed, its exit code in its done
    marker): stopped at once, with whatever it started (SIGKILL to its process group: nothing of it is
    needed any more, and what is left of its exit cannot hang or outlive the diff), and reaped on a thread
    of its own, so that the diff returns without waiting for the memory it gives back.  This process waits
    for it only when it exits itself (`_reap_at_exit`): no child is left a zombie for another to reap."""
    import atexit
    import signal
    import threading

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

    def reap():
        try:
            proc.wait()
        except Exception:
            pass

    thread = threading.Thread(target=reap, name="diffkit-reap", daemon=True)
    thread.start()
    if not _REAPING:
        atexit.register(_reap_at_exit)
    _REAPING[:] = [t for t in _REAPING if t.is_alive()] + [thread]


def _reap_at_exit() -> None:
    end = time.monotonic() + REAP_AT_EXIT_S
    for thread in _REAPING:
        thread.join(max(0.0, end - time.monotonic()))


class _Forked:
    """A child process forked from this one (torch and diffkit already imported: no interpreter start,
    no imports), running `diffkit ARGS` in its own session with `env` and its stderr to `err`.  The
    subset of subprocess.Popen the isolation uses: pid, wait(timeout), poll()."""

    def __init__(self, args: list[str], env: dict, err, quiet: bool = False, out=None):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                import signal

                try:
                    os.setsid()  # its own session and process group, as start_new_session gives a subprocess
                except OSError:  # the parent made it a group leader first: its own group all the same
                    pass
                os.dup2(err.fileno(), 2)
                if quiet or out is not None:  # its standard output goes nowhere, or into `out`
                    fd = os.open(os.devnull, os.O_WRONLY) if out is None else os.dup(out.fileno())
                    os.dup2(fd, 1)
                    os.close(fd)
                    if _no_fd(sys.stdout):
                        # this process's standard output was a stand-in (a StringIO): print into fd 1 all the same
                        import io

                        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False),
                                                      encoding=getattr(sys.stdout, "encoding", None) or "utf-8")
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                os.environ.clear()
                os.environ.update(env)
                from . import capture as _capture

                _capture._BREADCRUMB = env.get("DIFFKIT_BREADCRUMB", "")  # read at import in a fresh process
                sys.argv = ["diffkit", *args]
                main.main(args=list(args), prog_name="diffkit", standalone_mode=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        try:
            os.setpgid(pid, pid)  # as the child does: a stop right after the fork reaches its group too
        except OSError:
            pass
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess
        import time

        import select

        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        fd = None
        try:  # woken the moment the child exits (Linux), not at the next poll
            fd = os.pidfd_open(self.pid) if self.poll() is None else None
        except (AttributeError, OSError):
            fd = None
        try:
            while self.poll() is None:
                if end is not None and time.monotonic() >= end:
                    raise subprocess.TimeoutExpired(["diffkit"], timeout)
                if fd is not None:
                    select.select([fd], [], [], None if end is None else max(0.0, end - time.monotonic()))
                else:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
        finally:
            if fd is not None:
                os.close(fd)
        return self.returncode


def _no_fd(stream) -> bool:
    """Whether `stream` writes to no file descriptor (a StringIO standing in for standard output)."""
    try:
        stream.fileno()
        return False
    except (AttributeError, OSError, ValueError):
        return True


def _preload() -> None:
    """Import what the children run (a forked child inherits it), and load the CPU metric kernel.  No torch
    computation: a parent that has run one before forking could leave its children's thread pool unusable."""
    from . import compare, host_kernel, pipeline, report, store, trials, whatif  # noqa: F401
    from .capture import _install_extension_import_hook

    _install_extension_import_hook()  # (cpp_extension wrapped when a model imports it: inherited by the children)
    host_kernel.library()  # the CPU metric kernel built (first run on this machine) or loaded once, here


def _can_fork(device: str | None = None) -> bool:
    """Children are forked from this process (saving an interpreter start and torch's import each)
    on POSIX with a CPU-only torch, or with `--device cpu`; DIFFKIT_NO_FORK=1 asks for fresh
    interpreters."""
    if not hasattr(os, "fork") or os.environ.get("DIFFKIT_NO_FORK"):
        return False
    # a CUDA build: even asking whether a GPU is there can leave a forked child unable to use it, so the
    # children get fresh interpreters (CPU-only builds, and --device cpu, fork)
    return _host_only(device)


def _host_only(device: str | None) -> bool:
    """No GPU can be in play: `--device cpu`, or a torch built without CUDA or ROCm (asked without
    touching the driver, which could leave forked children unable to use it)."""
    import torch

    return device == "cpu" or (torch.version.cuda is None and getattr(torch.version, "hip", None) is None)


# the reference child hands its values over through shared memory (tmpfs) when there is room for them
SHM = "/dev/shm"
SHM_MIN_FREE = 4 << 30


def _run_again(tmp: str, cand_cmd: list[str], cand_env: dict, run_step, timeout: float, took: float,
               hung: bool) -> str:
    """The candidate child crashed or hung, and its capture file holds names and shapes only: run it
    again keeping every value (and writing no answer), so the parent can diff what was captured before
    the failure.  A hang's second run gets twice the time the first took to make its last record (plus
    a margin), not the whole timeout again.  Returns a line for the error's details saying how the
    second run ended; nothing when there was nothing to recapture."""
    import shutil

    journal = os.path.join(tmp, "cand.dkt", "records.jsonl")

    def lines() -> int:
        try:
            with open(journal, "rb") as fh:
                return fh.read().count(b"\n")
        except OSError:
            return 0

    made = lines()
    if not made:
        return ""  # it failed before its first record: a second run would find nothing more
    try:
        last = os.path.getmtime(journal) - (time.time() - took)  # seconds into the first run
    except OSError:
        last = took
    limit = timeout or None
    if hung:
        limit = min(timeout, 2 * max(last, 0.0) + AGAIN_MARGIN) if timeout else 2 * max(last, 0.0) + AGAIN_MARGIN
    crumb = os.path.join(tmp, "breadcrumb")
    first_crumb = open(crumb, encoding="utf-8").read() if os.path.exists(crumb) else None
    shutil.rmtree(os.path.join(tmp, "cand.dkt"), ignore_errors=True)
    for marker in ("done", "internal"):
        if os.path.exists(os.path.join(tmp, marker)):
            os.remove(os.path.join(tmp, marker))
    # a hang: stop the second run once its journal is as long as the first's (it has every value the first
    # one had captured); a crash is left to happen again by itself
    code, why, _ = run_step(cand_cmd, dict(cand_env, **{INSURED_ENV: "again"}), limit,
                            enough=(lambda: lines() >= made) if hung else None)
    if first_crumb is not None:  # where the first run was when it failed is the answer's "where"
        with open(crumb, "w", encoding="utf-8") as fh:
            fh.write(first_crumb)
    if code in (0, 1, 2) and os.path.exists(os.path.join(tmp, "done")):
        how = "finished without failing (the failure does not repeat: a race or an uninitialised read?)"
    elif why == CAUGHT_UP:
        how = why
    else:
        how = f"{why or f'exited with status {code}'} as well"
    return (f"\ndiffkit: the candidate was run a second time to capture the values its first run computed "
            f"before failing; the second run {how}.")


def _trials_before_the_failure(result, judged: list[dict], running, what: str) -> None:
    """An isolated diff whose candidate process crashed or hung: the trials it judged before, and the one it
    was running (its seed), in place of the trial-1 row the capture alone would give."""
    from .trials import Trial

    rows = [dict(t) for t in judged]
    if running is not None:
        k, seed = running
        rows = [t for t in rows if t.get("trial") != k]
        rows.append(Trial(k, seed, error=what[:500], error_side="candidate").to_dict())
    if not rows:
        return
    result.trials = rows
    result.meta["trials"] = {**(result.meta.get("trials") or {}), "run": len(rows),
                             "reported": rows[-1].get("trial", 1),
                             "failed": sum(1 for t in rows if not t.get("allclose"))}


def _handoff_dir(options: Options) -> str | None:
    """Where the reference child writes its capture for the candidate child: the shared-memory
    filesystem (the values never touch a disk) when it is there, writable and has room (at least
    SHM_MIN_FREE, and the streaming budget when one is set); else the default temporary directory."""
    try:
        if not (os.path.isdir(SHM) and os.access(SHM, os.W_OK)):
            return None
        st = os.statvfs(SHM)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return None
    need = max(SHM_MIN_FREE, options.max_memory or 0) if options.max_memory != float("inf") else SHM_MIN_FREE
    return SHM if free >= need else None


def _own_notes(log: str) -> str:
    """diffkit's own notes in a child's stderr ("diffkit: …" lines: a hand-over that fell back to files),
    which a finished diff passes on; the rest of that child's output stays in its log."""
    try:
        with open(log, encoding="utf-8", errors="replace") as fh:
            return "".join(ln for ln in fh if ln.startswith("diffkit: "))
    except OSError:
        return ""


def _let_go(holder, capture_dir: str, dump: bool, limit: float | None) -> None:
    """An isolated diff's reference process that holds its values on the GPU (see diffkit.handoff): release it,
    or (`dump`: the candidate's process failed, and what follows reads the capture's files) have it write its
    values into its capture first; stopped if it does not exit in time."""
    from .handoff import DUMP, HANDOFF_FILE, RELEASE, ask

    ask(capture_dir, DUMP if dump else RELEASE)
    try:
        holder.wait(timeout=(limit or 600.0) if dump else RELEASE_WAIT_S)
    except Exception:
        _stop(holder)
    try:  # whatever happened, no later reader may take the handles of a process that is gone
        os.unlink(os.path.join(capture_dir, HANDOFF_FILE))
    except OSError:
        pass


def _isolated(argv, ref_path, cand_path, options: Options, timeout, out: _Outputs, sanitize=None) -> int:
    """Run each side in its own child process (the reference captured to a file, then the candidate
    diffed against that capture); if a child crashes or hangs, diff what was captured before it."""
    import json
    import signal
    import subprocess
    import tempfile

    from .compare import is_capture
    from .pipeline import CaptureSource, TraceSource, run
    from .capture import Trace

    # (errors ignored at its removal: a child stopped once it answered may still have had files open in it)
    with tempfile.TemporaryDirectory(prefix="diffkit-", dir=_handoff_dir(options), ignore_cleanup_errors=True) as tmp:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", DIFFKIT_BREADCRUMB=os.path.join(tmp, "breadcrumb"))
        base = [*python_command(), *argv, "--no-isolate", "--stream-dir", tmp]
        given = is_capture(ref_path)
        ref_dkt = ref_path if given else os.path.join(tmp, "ref.dkt")
        # on a GPU the reference's process keeps its values on the device and hands them over (diffkit.handoff)
        # while it stays alive; written to files only if the candidate's process fails.  Not when a budget
        # bounds memory (streaming), nor under a sanitizer; DIFFKIT_NO_HANDOVER=1 hands them over in files
        hand = (not given and not sanitize and not options.is_streaming and not _host_only(options.device)
                and not os.environ.get("DIFFKIT_NO_HANDOVER"))
        ref_env = dict(env, **{HANDOVER_ENV: "1"}) if hand else env
        steps = [] if given else [(base + ["--side-only", "ref"], ref_env, "ref-done")]
        cand_cmd = base + ["--ref-capture", ref_dkt]
        san_log = os.path.join(tmp, "sanitizer.log")
        cand_env = dict(env)
        if sanitize:  # the candidate's process only, and only the candidate's own kernels in it
            from .sanitize import candidate_kernels, wrap_command

            try:
                cand_cmd = wrap_command(sanitize, san_log, cand_cmd, kernels=candidate_kernels(cand_path))
            except (FileNotFoundError, ValueError) as e:
                click.echo(f"diffkit: ERROR: --sanitize: {e}")
                return 2
            # line numbers in the reports when the extension is (re)built in this run (nvcc reads the variable)
            flags = (os.environ.get("NVCC_APPEND_FLAGS", "") + " -lineinfo").strip()
            cand_env.update(DIFFKIT_SANITIZER_LOG=san_log, DIFFKIT_SANITIZER_TOOL=sanitize, NVCC_APPEND_FLAGS=flags,
                            DIFFKIT_SANITIZER_CANDIDATE=os.path.abspath(cand_path))
        # the candidate's capture file is crash insurance only: without a sanitizer it keeps names and shapes,
        # and the values are captured by a second run only if this one crashes or hangs (_run_again)
        insure = not sanitize and not options.is_streaming  # (a streaming child keeps its stats in a journal)
        if insure:
            cand_env[INSURED_ENV] = "0"
        steps.append((cand_cmd, cand_env, "done"))
        errlog = os.path.join(tmp, "stderr")
        code, why, err_text = 0, None, ""
        fork = _can_fork(options.device)
        if fork:
            _preload()  # imported once here, not once in each child

        def launch(cmd, cenv, log, out_path=None):
            """Start one child, its stderr to `log`, in its own process group (so stopping it also stops
            what it started: compute-sanitizer, ninja).  A second run after a failure prints nothing; a child
            whose answer may not be the one given prints into `out_path`."""
            quiet = cenv.get(INSURED_ENV) == "again"
            with open(log, "w") as err_fh, (open(out_path, "w") if out_path else contextlib.nullcontext()) as out:
                if fork and cmd[:3] == base[:3]:  # diffkit itself (not wrapped in compute-sanitizer)
                    try:
                        return _Forked(cmd[3:], cenv, err_fh, quiet=quiet, out=out)
                    except OSError:  # no fork here (memory, limits): a fresh interpreter instead
                        pass
                return subprocess.Popen(cmd, env=cenv, stderr=err_fh, start_new_session=True,
                                        stdout=subprocess.DEVNULL if quiet else out)

        def finish(proc, cmd, log, limit, enough=None, stop=True, answered=None):
            """Wait for a child to end (or `limit` seconds, or until `enough()` says it has done what it was
            run for, then stopped unless `stop` is False): its exit code, why it failed (None when it ended by
            itself or was left running), its stderr.  `answered()`: the exit code a child has given with its
            marker once it has done its part (a candidate's answer, its "done"; a reference's complete capture,
            its "ref-done"), else None: it is then stopped, not waited for (see _let_answered_go)."""
            try:
                if answered is not None:
                    end = time.monotonic() + limit if limit else None
                    while True:
                        try:
                            code = proc.wait(timeout=ANSWER_POLL_S)
                        except subprocess.TimeoutExpired:
                            code = None
                        got = answered()
                        if got is not None:  # its answer is given: how its process ends is not the diff's
                            if code is None:
                                detached.append(proc)
                                _let_answered_go(proc)
                            return got, None, open(log, encoding="utf-8", errors="replace").read()
                        if code is not None:
                            break
                        if end is not None and time.monotonic() >= end:
                            raise subprocess.TimeoutExpired(cmd, limit)
                elif enough is None:
                    code = proc.wait(timeout=limit or None)
                else:
                    end = time.monotonic() + limit if limit else None
                    while proc.poll() is None and not enough():
                        if end is not None and time.monotonic() >= end:
                            raise subprocess.TimeoutExpired(cmd, limit)
                        time.sleep(0.05)
                    if proc.poll() is None:
                        if not stop:
                            return 0, None, ""
                        _stop(proc)
                        return -9, CAUGHT_UP, ""
                    code = proc.returncode
                why = None if code >= 0 else f"was killed by {signal.Signals(-code).name}"
            except subprocess.TimeoutExpired:
                _stop(proc)
                code, why = -9, f"{HUNG} {limit:g} s and was stopped"
            except BaseException:  # Terminated (SIGTERM/SIGINT) or anything else: leave no child behind
                _stop(proc)
                raise
            return code, why, open(log, encoding="utf-8", errors="replace").read()

        def run_step(cmd, cenv, limit, enough=None):
            return finish(launch(cmd, cenv, errlog), cmd, errlog, limit, enough)

        # with no GPU in play, the candidate's process is not waited for once it has given its answer: it is
        # stopped, and its end (hundreds of MB given back, the reference's capture unmapped: removing that
        # capture here is then cheap, its pages go back with that process's) goes on while this one returns
        detach = _host_only(options.device) and not sanitize
        detached: list = []

        # what says a child has done its part (see finish's `answered`), by the marker its step waits for: the
        # candidate's answer with its exit code; the reference's complete capture (its process may hang at exit)
        answered_by = {"done": lambda: _finished_code(tmp),
                       "ref-done": lambda: 0 if os.path.exists(os.path.join(tmp, "ref-done")) else None} if detach else {}

        if detach and not (given or options.is_streaming or os.environ.get("DIFFKIT_TWO_PROCESSES", "0") != "0"):
            # with no GPU in play, one child runs both sides first, as --no-isolate does in this process: no
            # hand-over of the reference's values, one fork.  It answers only when that diff ran clean (a match
            # or a divergence, no side failing, torch itself unchanged: _torch_changed) or a file did not load (a
            # model not built, no inputs: nothing ran yet); else (a forward's error, a crash, a hang, a diffkit
            # bug) the diff runs again below, a child per side, which says which side failed and diffs what each
            # captured before -- and if that one runs clean, its answer still names the failure (_failed_before).
            # DIFFKIT_TWO_PROCESSES=1: straight to a child per side.  (On a GPU the children are fresh
            # interpreters, and a child per side starts the candidate's beside the reference's: one child for both
            # was no faster there -- 12.4 s against 12.4 s, bench/gpu_round21.sh -- and a CUDA crash cost it 4x.)
            both = os.path.join(tmp, "both")
            os.mkdir(both)
            both_cmd = [*base[:3], *argv, "--no-isolate"]
            log = errlog + "-both"
            # (what it prints, the candidate's own output included, is kept until it is known to be the answer)
            printed = os.path.join(both, "stdout")
            both_env = dict(env, **{BOTH_ENV: both, BOTH_TTY_ENV: "1" if sys.stdout.isatty() else "",
                                    "DIFFKIT_BREADCRUMB": os.path.join(both, "breadcrumb")})
            proc = launch(both_cmd, both_env, log, out_path=printed)
            # it gets --timeout for the whole diff, at most BOTH_LIMIT_S: a side that hangs is found that much
            # later than a child per side alone finds it, and a longer diff runs again, a child per side
            limit = min(timeout, BOTH_LIMIT_S) if timeout else BOTH_LIMIT_S
            code, why, err_text = finish(proc, both_cmd, log, limit, answered=lambda: _finished_code(both))
            if code in (0, 1, 2) and _finished_code(both) == code:
                with open(printed, "rb") as fh:  # (as written: in the encoding the child printed in)
                    try:
                        sys.stdout.flush()
                        if hasattr(sys.stdout, "buffer"):
                            sys.stdout.buffer.write(fh.read())
                        else:  # (a stand-in for standard output that takes text only)
                            sys.stdout.write(fh.read().decode(sys.stdout.encoding or "utf-8", "replace"))
                        sys.stdout.flush()
                    except BrokenPipeError:
                        _stdout_gone()
                sys.stderr.write(err_text)
                return code
            earlier = _what_failed(both, code, why, err_text, ref_path, cand_path, limit)
            if earlier is not None:  # the candidate's process of the diff that follows says so if it runs clean
                with open(os.path.join(tmp, "earlier.json"), "w", encoding="utf-8") as fh:
                    json.dump(earlier, fh)
                cand_env[EARLIER_ENV] = os.path.join(tmp, "earlier.json")
            code, why, err_text = 0, None, ""

        # the candidate's process starts with the reference's: it runs its file (its extensions built or
        # loaded, its imports done) while the reference is captured, then waits for that capture
        ahead = holder = None
        started = time.monotonic()
        if steps[:-1] and not sanitize:
            # on a GPU the candidate waits for the reference's process to exit (its device memory free) or to
            # hold its values for the hand-over; with no GPU in play, for the reference's capture to be complete
            wait_for = "ref-done" if _host_only(options.device) else "ref-exited"
            ahead = launch(cand_cmd, dict(cand_env, **{AFTER_ENV: os.path.join(tmp, wait_for)}), errlog)
        try:
            for cmd, cenv, marker in steps:
                if marker == "done" and ahead is not None:
                    code, why, err_text = finish(ahead, cmd, errlog, timeout, answered=answered_by.get(marker))
                else:
                    if ahead is None:
                        started = time.monotonic()
                    log = errlog if marker == "done" else errlog + "-ref"
                    proc = launch(cmd, cenv, log)
                    held = os.path.join(tmp, HELD)
                    code, why, err_text = finish(proc, cmd, log, timeout, stop=False,
                                                 enough=(lambda: os.path.exists(held)) if hand and marker == "ref-done"
                                                 else None, answered=answered_by.get(marker))
                    if proc not in detached and proc.poll() is None:  # it holds the values the candidate reads
                        holder = proc
                if marker == "ref-done" and os.path.exists(os.path.join(tmp, marker)):
                    # its capture is complete and closed (a failure after that, at exit, is not the diff's) and
                    # its process has exited (its device memory is free) or holds its values on it: go on
                    code, why = 0, None
                    with open(os.path.join(tmp, "ref-exited"), "w") as fh:
                        fh.write("ok")
                elif not (code in (0, 1, 2) and os.path.exists(os.path.join(tmp, marker))):
                    break
            if holder is not None:  # done with its values: let it go, or have it write them out for what follows
                _let_go(holder, ref_dkt, dump=not (code in (0, 1, 2) and os.path.exists(os.path.join(tmp, "done"))),
                        limit=timeout)
        finally:
            if ahead is not None and ahead not in detached and ahead.poll() is None:
                # the reference failed: its partner is not needed
                _stop(ahead)
            if holder is not None and holder.poll() is None:
                _stop(holder)
        if sanitize and os.environ.get("DIFFKIT_SANITIZER_COPY") and os.path.exists(san_log):
            import shutil

            shutil.copy(san_log, os.environ["DIFFKIT_SANITIZER_COPY"])  # keep the raw log (debugging the parser)
        if code in (0, 1, 2) and os.path.exists(os.path.join(tmp, "done")):
            sys.stderr.write(_own_notes(errlog + "-ref") + err_text)
            return code
        if os.path.exists(os.path.join(tmp, "internal")):  # the child hit a bug of diffkit's, not a crash
            sys.stderr.write(err_text)
            return INTERNAL
        from .trials import read_trials_journal

        judged, running = read_trials_journal(tmp)  # (before a second run adds to it)
        again = ""
        if insure and os.path.exists(os.path.join(tmp, "ref-done") if not given else ref_dkt) and is_capture(ref_dkt):
            again = _run_again(tmp, cand_cmd, cand_env, run_step, timeout, time.monotonic() - started,
                               hung=bool(why and why.startswith(HUNG)))
        # a child crashed or hung: diff what both capture files hold, with the failure as the error
        lines = [ln.strip() for ln in err_text.splitlines() if ln.strip() and not ln.startswith(" ")]
        last_err = next((ln for ln in reversed(lines) if re.match(r"^[\w.]*(Error|Exception)\b.*:", ln)),
                        lines[-1] if lines else "")
        why = why or f"exited with status {code}" + (f" ({last_err[:300]})" if last_err else "")
        sources = {}
        for side, path in (("ref", ref_dkt), ("cand", os.path.join(tmp, "cand.dkt"))):
            sources[side] = CaptureSource(path) if is_capture(path) else TraceSource(Trace())
        ref_src, cand_src = sources["ref"], sources["cand"]
        # the reference's process failed if it never said its capture was done (a later trial it runs after
        # trial 1's capture is complete can crash it too); else the candidate's did
        ref_done = given or os.path.exists(os.path.join(tmp, "ref-done"))
        # (its own reference's process said its capture was complete: whatever became of that capture since, the
        # reference did not fail)
        complete = isinstance(ref_src, CaptureSource) and ref_src.file.complete
        side = "candidate" if ref_done and (complete or not given) else "reference"
        crumb = ""
        if os.path.exists(os.path.join(tmp, "breadcrumb")):
            crumb = open(os.path.join(tmp, "breadcrumb"), encoding="utf-8").read().strip()
        last = (cand_src if side == "candidate" else ref_src).trace(values=False).records
        stages = [r for r in last if r.kind != "input"]
        where = crumb or (f"after {stages[-1].name}" + (f" ({stages[-1].where})" if stages[-1].where else "")
                          if stages else "its forward, before its first captured stage" if last
                          else "before any stage was captured")
        from .stream import read_journal

        later = side == "candidate" and running is not None and running[0] > 1
        if later:  # trial 1's captured forward is behind it: its capture's stages are all there, as judged
            where = (f"trial {running[0]}'s forward (the trials after the first run uncaptured, as KernelBench runs "
                     f"them)")
        what = f"the {side} process {why}"
        san_text = open(san_log, encoding="utf-8", errors="replace").read() if sanitize and os.path.exists(san_log) \
            else None
        if san_text is not None and side == "candidate":
            from .sanitize import failure_words, internal_failure

            failed = internal_failure(san_text)
            if failed:  # the sanitizer broke first: the crash that followed is its doing, not the candidate's
                what = f"{what}, {failure_words(sanitize, failed)}"
        error = ErrorInfo(side, "forward", (f"on trial {running[0]} (seed {running[1]}) " if later else "") + what,
                          where, err_text[-6000:] + again)
        evidence = None
        if san_text is not None:
            def evidence(result):
                from .sanitize import attach, parse

                attach(result, parse(san_text, sanitize))
        result = run(ref_src, cand_src, options.replace(stream_dir=None, health=False, rerun=False, explain=False),
                     known=read_journal(os.path.join(tmp, "stats.jsonl")), error=error, evidence=evidence)
        result.ref_path, result.cand_path = ref_path, cand_path
        result.meta["processes"] = PROCESSES["per side"]
        if side == "candidate" and (judged or running):
            _trials_before_the_failure(result, judged, running, what)
        out.write(result)
        return 2


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
    from .compare import capture_reference
    from .load import load_reference
    from .pipeline import clone_inputs, run_captured
    from .trials import seed_all, trial_seeds

    options = Options(seed=seed, trials=trials, device=device, eval=eval_mode)
    class_name = {"cand": "ModelNew", "ref": "Model", None: None}[side]
    which = "candidate" if side == "cand" else "reference"
    _install_signal_handlers()
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
        _internal_error(e)
        sys.exit(INTERNAL)
    click.echo(trace.format(limit=limit))
    if output:
        click.echo(f"saved {len(trace)} records to {output}")
    sys.exit(2 if trace.error else 0)


main.add_command(suite)

if __name__ == "__main__":
    main()
