"""What one process of a diff does: a diff here (`run_here`: --no-isolate, a captured candidate), or one part
of an isolated diff in a child process (`child_main`).  The parent's side, and the protocol between the two, are
in diffkit.processes: a child gets a `Job` and answers with the messages defined here.  (Layer 11, split from the
CLI.)
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import click
import torch
import torch.nn.functional as F

from . import handoff, progress
from .capture import set_breadcrumb
from .compare import capture_reference, diff_files, error_result
from .describe import harden_summary
from .device_memory import CardFull, is_out_of_memory, users_error
from .errors import EXIT, INTERNAL, DiffkitError
from .handoff import Holder
from .load import build_candidate_ahead, encode_values, prepare_candidate
from .options import Options
from .outputs import (Outputs, Terminated, exit_code_of, exit_guard, flush_standard_streams, install_signal_handlers,
                      is_users_fault, print_internal_error, stdout_gone)
from .pipeline import settle
from .result import ErrorInfo, Result
from .sanitize import attach, built_sources, candidate_sources, failure_words, internal_failure, parse
from .trials import TRIAL_DIR

# the phases of an error that comes before either model's forward has run (diffkit.errors): that child answers it
BEFORE_ANY_FORWARD = ("read", "parse", "import", "build", "init", "inputs")
AGAIN_CODE = 4  # how the one child for both sides says "not clean: run the diff again, a child per side"
# where a CLI diff ran its models (the JSON's meta.processes)
PROCESSES = {"both": "one child process, both sides", "candidate": "a child process per side",
             "here": "diffkit's own process"}


# ----------------------------------------------------------------------------- the protocol's values
@dataclass
class Job:
    """What a child is to do.  role: "both" (the whole diff, both models in this one child), "reference" (capture
    the reference into `capture_dir`'s ref.dkt, then hold or exit), "candidate" (diff the candidate against the
    reference's capture `ref_capture`)."""

    role: str
    ref_path: str
    cand_path: str
    options: Options  # as the CLI built them (with the isolated diff's folder as stream_dir, per side)
    outputs: dict  # Outputs' settings (its paths absolute)
    ref_capture: str | None = None
    color: bool | None = None  # None: whether this child's own standard output is a terminal
    silent: bool = False  # the candidate's second run after a crash or hang: the parent writes the answer
    after: bool = False  # started beside the reference's process: wait for `Go` (building ahead on `InitInputs`)
    handover: bool = False  # the reference on a GPU: hold the values, hand them over (diffkit.handoff)
    earlier: dict | None = None  # what the one child for both sides hit (see processes.what_failed)
    breadcrumb: str = ""  # the file a kernel call notes itself in (diffkit.capture)
    progress: bool = False  # the parent shows a person at a terminal what the diff is doing: send it each step
    sanitizer: tuple | None = None  # (its log, its tool, the candidate's file): run under compute-sanitizer


@dataclass
class InitInputs:
    """reference -> parent -> candidate: what the reference's model is built from (load.encode_values)."""
    encoded: dict


@dataclass
class RefDone:
    """reference: its capture is complete and closed."""


@dataclass
class Held:
    """reference: it holds its values on the GPU for the candidate (diffkit.handoff) until `Release` or `Dump`."""
    pid: int


@dataclass
class Dumped:
    """reference -> parent -> candidate: the held values are in the capture's files ("ok", or why not)."""
    outcome: str | None


@dataclass
class DumpAsk:
    """candidate -> parent: it cannot open the handed-over values: have the holder write them out."""


@dataclass
class Answered:
    """a child wrote its answer (flushed) and exits with `code`."""
    code: int


@dataclass
class Again:
    """the one child for both sides did not run clean: `error` (an ErrorInfo's dict) or None; the diff runs again."""
    error: dict | None


@dataclass
class Internal:
    """a child hit a bug of diffkit's (its traceback is in its standard error)."""
    text: str


@dataclass
class Phase:
    """child -> parent: the step the diff is at (diffkit.progress; None: about to print its answer)."""
    text: str | None


@dataclass
class Go:
    """parent -> candidate: the reference's capture is ready."""


@dataclass
class Release:
    """parent -> holder: exit."""


@dataclass
class Dump:
    """parent -> holder: write the values into the capture, then exit."""


GONE = object()  # the other end of a connection closed


class Link:
    """A child's end of its connection to the diff that started it."""

    def __init__(self, conn: Connection):
        self.conn, self.parent = conn, os.getppid()

    def say(self, message) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # (the parent is gone: nothing to tell)
            pass

    def receive(self, timeout: float):
        """The next message within `timeout` seconds; None if none; GONE once the parent is."""
        try:
            if not self.conn.poll(timeout):
                return GONE if os.getppid() != self.parent else None
            return self.conn.recv()
        except (EOFError, OSError):
            return GONE

    def requests(self, timeout: float) -> str | None:
        """What a holder is asked (handoff.Holder.serve): "release", "dump", "orphaned" or None."""
        got = self.receive(timeout)
        return {Release: "release", Dump: "dump"}.get(type(got), "orphaned" if got is GONE else None)

    def ask_dump(self, wait_s: float) -> bool:
        """The candidate cannot open the handed-over values: the holder writes them out (through the parent)."""
        self.say(DumpAsk())
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            got = self.receive(min(0.05, max(0.0, end - time.monotonic())))
            if isinstance(got, Dumped):
                return got.outcome is not None
            if got is GONE:
                return False
        return False


# ----------------------------------------------------------------------------- a child
def child_main(job: Job | None = None, conn: Connection | None = None) -> None:
    """A child of an isolated diff: its job comes over `conn` (a fresh interpreter: the connection's file
    descriptor is its first argument), then it runs it and exits.  Its sys.argv names its part for the
    models' files: ["diffkit", "child", role]."""
    fresh = conn is None
    if fresh:
        fd = int(sys.argv[1])
        os.set_inheritable(fd, False)  # (nothing this process starts keeps the diff's connection open)
        conn = Connection(fd)
    if job is None:
        job = conn.recv()
    sys.argv = ["diffkit", "child", job.role]
    if fresh:  # where a kernel call notes itself, for a crash to be named (a forked child notes none, as ever)
        set_breadcrumb(job.breadcrumb)
    install_signal_handlers()
    link = Link(conn)
    if job.progress:
        progress.send_to(lambda text: link.say(Phase(text)))
    try:
        if job.role == "reference":
            _reference(job, link)
        else:
            _diff_child(job, link)
    except Terminated as t:
        sys.exit(128 + t.signum)


def _reference(job: Job, link: Link) -> None:
    """An isolated diff's reference process: capture, say so, then (holding its values on the GPU) serve them."""
    out = Outputs(**{**job.outputs, "color": sys.stdout.isatty()})
    capture_dir = os.path.join(job.options.stream_dir, "ref.dkt")
    holder = Holder(capture_dir, keep=TRIAL_DIR) if job.handover else None

    def publish(init) -> None:  # the candidate's process can build its model while the reference is captured
        try:
            link.say(InitInputs(encode_values(init)))
        except (TypeError, ValueError):  # it builds its model later, as ever
            pass

    try:
        with _card_ran_out(job.options):
            capture_reference(job.ref_path, capture_dir, job.options, on_init=publish,
                              hand_over=holder.hand_over if holder is not None else None,
                              outputs_only_trials=True)  # (the candidate's process reruns a failing trial)
    except DiffkitError as e:
        out.write(error_result(e, job.ref_path, job.cand_path, job.options), error=e)
        _done(link, 2)  # a load error is a finished answer, not a crash
        sys.exit(2)
    link.say(RefDone())
    if holder is not None and holder.holding:  # its values stay on the GPU until the candidate is done
        link.say(Held(os.getpid()))
        if holder.serve(link.requests) == "dumped":
            link.say(Dumped(holder.dumped))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # (no teardown: the driver takes the device memory back; the handles' users are gone)
    sys.exit(0)


def _diff_child(job: Job, link: Link) -> None:
    """The one child running both sides, or the candidate's process."""
    if job.role == "both":  # a crash prints its Python stack into the log: which model's file it was in
        faulthandler.enable(file=sys.stderr)
    if job.role == "candidate":
        handoff.on_dump_request(link.ask_dump)
    out = Outputs(**{**job.outputs, "color": sys.stdout.isatty() if job.color is None else job.color},
                  silent=job.silent)
    if job.after:  # started beside the reference's process: run the candidate's file now, then wait for its capture
        prepare_candidate(job.cand_path)
        _wait_for_go(job, link)
    diff(job, out, link)


def _wait_for_go(job: Job, link: Link) -> None:
    """The candidate's process waits for the reference's capture; it builds its model as soon as the reference's
    process says what it builds its own from (the parent passes that on only with no GPU in play: on a GPU its
    constructor could take device memory the reference's process needs)."""
    built = False
    progress.say("capturing the reference in its own process")
    while True:
        got = link.receive(0.01)
        if got is GONE:  # the diff that started this process is gone
            sys.exit(2)
        if isinstance(got, Go):
            return
        if isinstance(got, InitInputs) and not built:
            build_candidate_ahead(job.cand_path, got.encoded)
            built = True


def _done(link: Link | None, code: int) -> None:
    """Tell the isolating parent that this child finished, wrote its own result (flushed first: the parent may
    return before this process has exited) and exits with `code`."""
    if link is not None:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            stdout_gone()
        sys.stderr.flush()
        link.say(Answered(code))


def _again(link: Link, error: ErrorInfo | None) -> None:
    """The one child running both sides whose diff did not run clean: what failed told to its parent (`error`;
    None: diffkit's own fault, or nothing to say), no answer written, and the diff runs again, a child per side."""
    link.say(Again(error.to_dict() if error is not None else None))
    sys.stdout.flush()
    sys.exit(AGAIN_CODE)


def _internal_exit(e: BaseException, link: Link | None) -> None:
    """A bug of diffkit's: its traceback printed and exit 3; a child also tells its parent that it was
    diffkit's fault, not a crash of the kernel."""
    print_internal_error(e)
    if link is not None:
        link.say(Internal(f"{type(e).__name__}: {e}"))
    sys.exit(INTERNAL)


@contextlib.contextmanager
def _card_ran_out(options: Options):
    """A GPU that ran out of memory where the diff could not adapt (diffkit.device_memory.Ladder adapts the
    capture itself): the user's card, said as an error of theirs (exit 2), never diffkit's bug."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise users_error(e, options.device, options.device_memory) from None


# ----------------------------------------------------------------------------- the diff itself
def diff(job: Job, out: Outputs, link: Link | None = None) -> None:
    """Diff the pair, write the answer and exit with its code (the one child for both sides answers only a clean
    diff or a file that did not load: else `_again`)."""
    both = job.role == "both"
    # only the capture this diff's own reference process wrote is trusted; a capture the user gave is data
    own = bool(job.ref_capture) and os.path.abspath(job.ref_capture) != os.path.abspath(job.ref_path)
    options = job.options.replace(trusted_capture=True) if own else job.options
    torch_before = _torch_globals() if both else None
    processes = PROCESSES.get(job.role, PROCESSES["here"])
    try:
        with _card_ran_out(options):
            result = diff_files(job.ref_capture or job.ref_path, job.cand_path, options=options,
                                evidence=_sanitizer_evidence(job.sanitizer))
        result.ref_path = job.ref_path
    except DiffkitError as e:
        if both and e.phase not in BEFORE_ANY_FORWARD:  # (a file that does not load is answered as it is)
            # (a card that ran out: a child per side, in processes of its own, answers as if this never ran)
            _again(link, None if isinstance(e, CardFull) else ErrorInfo.from_dict(e.to_dict()))
        failed = error_result(e, job.ref_path, job.cand_path, options)
        failed.meta["processes"] = processes
        out.write(failed, error=e)
        _done(link, 2)
        sys.exit(2)
    except Exception as e:
        _failed(e, job, out, link, options)
    if both and (result.error is not None or result.verdict not in ("match", "diverged")):
        _again(link, result.error)  # a side failed: a child per side says which, and diffs what it captured
    if both and _torch_changed(torch_before):
        # a model changed torch itself (a function swapped, the default dtype, a precision flag): in one process
        # that reaches the other model too; a child per side keeps the reference away from it
        _again(link, None)
    if job.earlier and result.error is None:
        failed_before(result, job.earlier)
    result.meta["processes"] = processes
    try:
        written = out.write(result)
        _say_harden(result, out)
    except Exception as e:  # writing diffkit's own answer failed: never the candidate's fault
        _internal_exit(e, link)
    code = EXIT[result.verdict] if written else 2
    if code == 0 and result.harden is not None and result.harden.breaking:
        code = EXIT["diverged"]  # --harden: a setting breaks the candidate, whatever KernelBench's verdict
    _done(link, code)
    sys.exit(code)


def _say_harden(result: Result, out: Outputs) -> None:
    """--harden's one line, after the usual output."""
    line = harden_summary(result)
    if line is None or out.silent:
        return
    try:
        click.echo(line)
    except BrokenPipeError:
        stdout_gone()


def _failed(e: Exception, job: Job, out: Outputs, link: Link | None, options: Options) -> None:
    """An exception escaped the diff: diffkit's bug (exit 3), or a device error the candidate left behind."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if job.role == "both":  # the diff runs again, a child per side
        text = traceback.format_exc()
        sys.stderr.write(text)
        _again(link, ErrorInfo("candidate", "forward", f"{type(e).__name__}: {first}", "", text[-6000:])
               if is_users_fault(e) else None)
    if not is_users_fault(e):
        _internal_exit(e, link if job.role == "candidate" else None)
    if job.role == "candidate":  # a CUDA error that poisoned the context after the forward: the parent diffs
        raise e
    err = DiffkitError("candidate", "forward", f"{type(e).__name__}: {first}")
    out.write(error_result(err, job.ref_path, job.cand_path, options), error=err)
    sys.exit(2)


def _torch_globals() -> dict:
    """What a model could change in torch itself for every model in its process: the functions of torch,
    torch.nn.functional and torch.Tensor and the forward of every torch.nn module class (by identity), the default
    dtype and the precision flags (see _torch_changed)."""
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


def failed_before(result: Result, said: dict) -> None:
    """The diff with a child per side ran clean after the one child running both sides failed (`said`, see
    processes.what_failed): the failure happened all the same, so the answer is an error naming it, with every
    stage of this diff."""
    if said.get("warning"):
        result.warnings.append(said.get("message", ""))
        return
    first = ErrorInfo.from_dict(said)
    first.message = (f"{first.message}; the diff was run again, a child process per side, and it did not fail: "
                     f"the failure does not repeat (a race, an uninitialised read, or the two models in one "
                     f"process, as KernelBench runs them?)")
    result.error = first
    settle(result)


def _sanitizer_evidence(sanitizer: tuple | None):
    """In a child run under compute-sanitizer: attach what it has logged to the stages before judging."""
    if not sanitizer:
        return None
    log, tool, cand = sanitizer

    def attach_logged(result) -> None:
        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception:
            pass
        text = open(log, encoding="utf-8", errors="replace").read() if os.path.exists(log) else ""
        sources = built_sources() + ([t for _, t in candidate_sources(cand)] if os.path.isfile(cand) else [])
        attach(result, parse(text, tool), sources=sources)
        failed = internal_failure(text)
        if failed and result.error is not None and result.error.side == "candidate":  # the error followed it
            result.error.message = f"{result.error.message}, {failure_words(tool, failed)}"
        elif failed:  # it went on: what it reported stands, what it did not may be missing
            result.warnings.insert(0, failure_words(tool, failed, crashed=False))
    return attach_logged


# ----------------------------------------------------------------------------- a diff in this process
def run_here(job: Job, out: Outputs, timeout: float) -> None:
    """A diff in this process (--no-isolate, a captured candidate): --timeout bounds the whole diff; exits with
    the diff's code."""
    before = set(threading.enumerate())
    try:
        with deadline(timeout, job.ref_path, job.cand_path, job.options, out), exit_guard(out):
            diff(job, out)
    except SystemExit as e:
        _leave_models_threads(before, e)
        raise


def _leave_models_threads(before: set, e: SystemExit) -> None:
    """The answer is written: threads a model started and left running (not daemons) would keep this process from
    ever exiting (the interpreter waits for them).  Said on stderr, then the process ends with the diff's code
    without waiting for them, after its own exit functions have run."""
    left = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    if not left:
        return
    names = ", ".join(repr(t.name) for t in left[:3]) + (" …" if len(left) > 3 else "")
    code = exit_code_of(e)
    try:
        sys.stderr.write(f"diffkit: warning: a model left {len(left)} thread(s) running ({names}); exiting without "
                         f"waiting for them\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    atexit._run_exitfuncs()
    flush_standard_streams()
    os._exit(code)


# a --no-isolate diff past its --timeout whose Python cannot run (code holding the interpreter's lock) is ended by
# the kernel (SIGALRM) this many seconds later
DEADLINE_GRACE_S = 10.0
# past this, a --timeout is "never" (and where it is not a number at all)
_LONGEST_TIMEOUT = 1e8


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


def _expire_after(limit: float, main_thread, done: threading.Event, ref_path: str, cand_path: str,
                  options: Options, out: Outputs) -> None:
    """The deadline's thread: past `limit`, the answer (unless the diff claimed it first) and the process's end."""
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


@contextlib.contextmanager
def deadline(limit: float, ref_path: str, cand_path: str, options: Options, out: Outputs):
    """A diff in this process (--no-isolate) past `limit` seconds (0, inf, nan: none): its answer is an error
    naming the side and the line its main thread was at, written as every answer is, and the process exits 2
    (nothing else can stop a forward that does not return); whichever of the diff and this deadline starts writing
    the answer first writes it alone (`Outputs.claim`).  Where its Python cannot run, SIGALRM ends the process
    DEADLINE_GRACE_S later, unless SIGALRM or the real-time timer is already someone else's (a host process's)."""
    if not limit or not math.isfinite(limit) or limit > _LONGEST_TIMEOUT:
        yield
        return
    main_thread = threading.current_thread()
    done = threading.Event()
    threading.Thread(target=_expire_after, args=(limit, main_thread, done, ref_path, cand_path, options, out),
                     name="diffkit-deadline", daemon=True).start()
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
