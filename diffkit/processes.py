"""diffkit's child processes: the isolated diff (`isolated`), and how a child is started and stopped.

An isolated diff runs its models in child processes, so that a kernel that crashes or hangs cannot take the answer
with it.  One child first runs the whole diff (role "both"; on a GPU streaming, its captured values on the device held
to what the models themselves take); it answers only when that diff ran clean.  Otherwise (and at once under a
sanitizer, or with DIFFKIT_TWO_PROCESSES=1) a child per side: the reference's process
captures into a folder of the diff's own, the candidate's process diffs against that capture; if a child crashes
or hangs, this process diffs what both captured before (the candidate run again, keeping its values, when its
capture kept names and shapes only).

The protocol between this process and a child (the types are in diffkit.roles):

  * the child gets a `Job` (a dataclass, pickled) over a connection (multiprocessing's, a socket pair) it
    inherits: a forked child is handed its end; a fresh interpreter gets its file descriptor as its argument;
  * the child answers with messages on the same connection: the reference's `InitInputs` (what its model is built
    from), `RefDone` (its capture is complete), `Held` (it holds its values on the GPU, diffkit.handoff),
    `Dumped` (it wrote them out); the candidate's `DumpAsk` (it cannot open the handed-over values); any child's
    `Answered(code)` (its answer is written and flushed), `Again(error)` (the one child for both sides did not
    run clean), `Internal` (a bug of diffkit's);
  * this process tells a child: `Go` (the candidate, started beside the reference: its capture is ready; it
    builds its model ahead on the `InitInputs` passed on to it), `Release` / `Dump` (the holder);
  * what stays in the diff's folder are data: the captures, their journals, the candidate's error log, the
    breadcrumb a kernel call leaves (read after a crash, so a file) and the sanitizer's log.

A fresh child runs the SAME diffkit package as this process, whatever the current folder holds: `python -m
diffkit.cli` would import a folder named ``diffkit`` in the current directory instead, so a child is started with
``python -c BOOT`` (`python_command`), which loads this very package from its own directory and only then runs
its entry point.  The current directory stays first on the child's ``sys.path``, as ``-m`` puts it there.  With
no GPU in play (a CPU-only torch, --device cpu) children are forked instead (no interpreter start, no imports).

Every child runs in a session of its own, so that stopping its process group (`stop`) also stops what it
started (compute-sanitizer, ninja, the per-side children of a suite's diff).
"""
from __future__ import annotations

import atexit
import contextlib
import io
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection, Pipe, wait

import click
import torch

from . import host_kernel, progress, report, store, whatif  # noqa: F401  (imported once here: a forked child inherits them)
from .capture import Trace, _install_extension_import_hook
from .compare import is_capture
from .errors import INTERNAL
from .handoff import HANDOFF_FILE
from .options import Options
from .outputs import STOP_SIGNALS, Outputs, stdout_gone
from .modelstate import Trial
from .pipeline import run
from .result import ErrorInfo
from .roles import (PROCESSES, Again, Answered, Dump, Dumped, DumpAsk, Go, Held, InitInputs, Internal, Job, Phase,
                    RefDone, Release, child_main)
from .sanitize import attach, candidate_kernels, failure_words, internal_failure, parse, wrap_command
from .stream import read_journal
from .sources import CaptureSource, TraceSource
from .trials import read_trials_journal

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# the program name the CLI's usage lines give in a child (as `python -m diffkit.cli` gave it)
CLI_PROG_NAME = "python -m diffkit.cli"

_BOOT = (
    "import importlib.util, os, sys\n"
    "sys.path[0] = os.getcwd()\n"  # (as -m puts it)
    "spec = importlib.util.spec_from_file_location('diffkit', {init!r}, submodule_search_locations=[{package!r}])\n"
    "package = importlib.util.module_from_spec(spec)\n"
    "sys.modules['diffkit'] = package\n"
    "spec.loader.exec_module(package)\n"
    "{entry}\n"
)

# the entry point of a child that runs the command line (`diffkit ARGS`: a suite's pair)
CLI_ENTRY = f"from diffkit.cli import main; main(prog_name={CLI_PROG_NAME!r})"
# the entry point of an isolated diff's child (its connection's file descriptor is its argument)
CHILD_ENTRY = "from diffkit.roles import child_main; child_main()"


def python_command(entry: str = CLI_ENTRY) -> list[str]:
    """The command line (before the child's own arguments) of a fresh interpreter that loads this diffkit
    package, wherever it is installed and whatever the current folder holds, then runs `entry`."""
    boot = _BOOT.format(init=os.path.join(PACKAGE_DIR, "__init__.py"), package=PACKAGE_DIR, entry=entry)
    return [sys.executable, "-c", boot]


def stop(proc) -> None:
    """Stop a child and everything it started: SIGTERM to its process group, SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:  # (a child forked a moment ago may not lead its own group yet)
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=wait)
            return
        except Exception:
            continue


# ----------------------------------------------------------------------------- the children
ANSWER_POLL_S = 0.01  # how often an isolated diff looks at its children (their messages, their exit)
RELEASE_WAIT_S = 30.0  # how long a released reference process gets to exit before it is stopped
CAUGHT_UP = "was stopped once it had got as far as the first"
HUNG = "did not finish within"  # how a child stopped at its time limit is described (`why`)
AGAIN_MARGIN = 30.0  # seconds a hung candidate's second run gets beyond twice the first run's progress
BOTH_LIMIT_S = 600.0  # the most the one child for both sides gets (its --timeout, if shorter)
REAP_AT_EXIT_S = 30.0  # at most this long in all (a killed process ends once the kernel has taken its memory back)
# the reference child hands its values over through shared memory (tmpfs) when there is room for them
SHM = "/dev/shm"
SHM_MIN_FREE = 4 << 30


class Child:
    """One child of an isolated diff: its process (a Popen or a `_Forked`), this process's end of its connection,
    the log its standard error goes to, and what it has said (its last message of each type)."""

    def __init__(self, job: Job, proc, conn: Connection, log: str):
        self.job, self.proc, self.conn, self.log = job, proc, conn, log
        self.said: dict[type, object] = {}
        self.go_sent = False

    def answered(self) -> int | None:
        """The exit code it gave with its answer; None before it has given one."""
        got = self.said.get(Answered)
        return got.code if got is not None else None

    def send(self, message) -> None:
        try:
            if self.conn is not None:
                self.conn.send(message)
        except (OSError, ValueError):  # (it has gone: its end is closed)
            pass

    def log_text(self) -> str:
        return open(self.log, encoding="utf-8", errors="replace").read()


class _Forked:
    """A child process forked from this one (torch and diffkit already imported: no interpreter start,
    no imports), running `job` in its own session with `env` and its stderr to `err`.  The
    subset of subprocess.Popen the isolation uses: pid, wait(timeout), poll()."""

    def __init__(self, job: Job, conn: Connection, ours: Connection, env: dict, err, quiet: bool = False,
                 out=None):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _forked_child(job, conn, ours, env, err, quiet, out)
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


def _forked_child(job: Job, conn: Connection, ours: Connection, env: dict, err, quiet: bool, out) -> None:
    """The forked child's side of `_Forked`: its session, its output, its environment; then its job."""
    code = 1
    try:
        ours.close()  # (the parent's end)
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
                sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False),
                                              encoding=getattr(sys.stdout, "encoding", None) or "utf-8")
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        child_main(job, conn)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _no_fd(stream) -> bool:
    """Whether `stream` writes to no file descriptor (a StringIO standing in for standard output)."""
    try:
        stream.fileno()
        return False
    except (AttributeError, OSError, ValueError):
        return True


def launch(job: Job, env: dict, log: str, fork: bool, wrap=None, quiet: bool = False,
           out_path: str | None = None) -> Child:
    """Start one child for `job`, its stderr to `log`, in its own process group (so stopping it also stops what
    it started: compute-sanitizer, ninja); forked when `fork` (and not wrapped: `wrap(cmd)`, compute-sanitizer's
    command around it).  `quiet`: it prints nothing; `out_path`: it prints into that file."""
    ours, theirs = Pipe()
    with open(log, "w") as err_fh, (open(out_path, "w") if out_path else contextlib.nullcontext()) as out:
        proc = None
        if fork and wrap is None:
            try:
                proc = _Forked(job, theirs, ours, dict(env), err_fh, quiet=quiet, out=out)
            except OSError:  # no fork here (memory, limits): a fresh interpreter instead
                proc = None
        if proc is None:
            cmd = [*python_command(CHILD_ENTRY), str(theirs.fileno())]
            proc = subprocess.Popen(wrap(cmd) if wrap is not None else cmd, env=env, stderr=err_fh,
                                    start_new_session=True, pass_fds=(theirs.fileno(),),
                                    stdout=subprocess.DEVNULL if quiet else out)
    theirs.close()
    child = Child(job, proc, ours, log)
    child.send(job)
    return child


_REAPING: list = []  # the threads reaping answered children (see let_answered_go), joined at this process's exit


def let_answered_go(proc) -> None:
    """A child that has given its answer (printed, its files written and closed, its exit code sent): stopped at
    once, with whatever it started (SIGKILL to its process group: nothing of it is needed any more, and what is
    left of its exit cannot hang or outlive the diff), and reaped on a thread of its own, so that the diff returns
    without waiting for the memory it gives back.  This process waits for it only when it exits itself
    (`_reap_at_exit`): no child is left a zombie for another to reap."""
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


def _preload() -> None:
    """Load what the children run (a forked child inherits it) and the CPU metric kernel.  No torch
    computation: a parent that has run one before forking could leave its children's thread pool unusable."""
    _install_extension_import_hook()  # (cpp_extension wrapped when a model imports it: inherited by the children)
    host_kernel.library()  # the CPU metric kernel built (first run on this machine) or loaded once, here


def _can_fork(device: str | None = None) -> bool:
    """Children are forked from this process (saving an interpreter start and torch's import each, ~3 s on a GPU
    host) on POSIX: with a CPU-only torch or `--device cpu`, and on a CUDA build as long as this process has not
    started CUDA (a child then starts its own; DIFFKIT_FORK_GPU=0 gives a CUDA build's children fresh
    interpreters).  DIFFKIT_NO_FORK=1 asks for fresh interpreters everywhere."""
    if not hasattr(os, "fork") or os.environ.get("DIFFKIT_NO_FORK"):
        return False
    if _host_only(device):
        return True
    # a CUDA build: a process that has started CUDA cannot hand it to a forked child, and even asking whether a GPU
    # is there (torch.cuda.is_available, device_count) leaves its forks unable to start CUDA; this process does
    # neither (the models, and every question about the device, are the children's)
    return os.environ.get("DIFFKIT_FORK_GPU", "1") != "0" and not torch.cuda.is_initialized()


def _host_only(device: str | None) -> bool:
    """No GPU can be in play: `--device cpu`, or a torch built without CUDA or ROCm (asked without
    touching the driver, which could leave forked children unable to use it)."""
    return device == "cpu" or (torch.version.cuda is None and getattr(torch.version, "hip", None) is None)


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


# ----------------------------------------------------------------------------- the isolated diff
def isolated(ref_path: str, cand_path: str, options: Options, timeout: float, out: Outputs,
             sanitize: str | None = None) -> int:
    """Run the diff in child processes: one child for the whole diff first (`_Isolated.one_child_first`); when
    that does not run clean, each side in its own child process (the reference captured to a file or held on
    the GPU, then the candidate diffed against that capture); if a child crashes or hangs, diff what was
    captured before it.  Returns the exit code."""
    # (errors ignored at its removal: a child stopped once it answered may still have had files open in it; the
    # name carries this process's id: whose folder it is, on a /dev/shm shared by every diff on the machine)
    with tempfile.TemporaryDirectory(prefix=f"diffkit-{os.getpid()}-", dir=_handoff_dir(options), ignore_cleanup_errors=True) as tmp:
        return _Isolated(tmp, ref_path, cand_path, options, timeout, out, sanitize).run()


class _Isolated:
    """One isolated diff: its folder, its children and the messages between them."""

    def __init__(self, tmp, ref_path, cand_path, options: Options, timeout, out: Outputs, sanitize):
        self.tmp, self.ref_path, self.cand_path, self.options = tmp, ref_path, cand_path, options
        self.timeout, self.out, self.sanitize = timeout, out, sanitize
        self.env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        self.breadcrumb = os.path.join(tmp, "breadcrumb")
        self.given = is_capture(ref_path)
        self.ref_dkt = ref_path if self.given else os.path.join(tmp, "ref.dkt")
        self.host_only = _host_only(options.device)
        # on a GPU the reference's process keeps its values on the device and hands them over (diffkit.handoff)
        # while it stays alive; written to files only if the candidate's process fails.  Not when a budget
        # bounds memory (streaming), nor under a sanitizer, nor when --device-memory caps the diff (the cap is per
        # process: values held by the reference's process would be beside the candidate's, not within its cap);
        # DIFFKIT_NO_HANDOVER=1 hands them over in files
        self.hand = (not self.given and not sanitize and not options.is_streaming and not self.host_only
                     and not options.device_memory and not os.environ.get("DIFFKIT_NO_HANDOVER"))
        self.san_log = os.path.join(tmp, "sanitizer.log")
        # the candidate's capture file is crash insurance only: without a sanitizer it keeps names and shapes,
        # and the values are captured by a second run only if this one crashes or hangs (_run_again)
        self.insure = not sanitize and not options.is_streaming  # (a streaming child keeps its stats in a journal)
        self.errlog = os.path.join(tmp, "stderr")
        self.fork = _can_fork(options.device)
        # with no GPU in play, the candidate's process is not waited for once it has given its answer: it is
        # stopped, and its end (hundreds of MB given back, the reference's capture unmapped: removing that
        # capture here is then cheap, its pages go back with that process's) goes on while this one returns
        self.detach = self.host_only and not sanitize
        # on a GPU the one child for both sides streams, the reference's forward in lockstep with the candidate's
        # and the captured values on the device held to what the models themselves take (tiers.models_budget):
        # the diff needs about twice its models' memory, not every value of both forwards (issue 46).  A child per
        # side (the reference's values handed over whole) when that child does not run clean, under a sanitizer,
        # or with DIFFKIT_TWO_PROCESSES=1
        self.gpu_one = (not self.host_only and not sanitize and not self.given and options.streaming is not False
                        and os.environ.get("DIFFKIT_GPU_PER_SIDE", "0") == "0")
        self.detached: list = []
        self.children: list[Child] = []
        self.ref = self.cand = self.holder = None
        self.earlier = None
        self.wrap = None
        self.cand_env = dict(self.env)

    def answered(self) -> bool:
        """Whether a child per side has written the answer (the candidate's; the reference's, a file that did not
        load)."""
        return any(c is not None and c.answered() is not None for c in (self.ref, self.cand))

    def job(self, role: str, **more) -> Job:
        side = role != "both"
        options = self.options.replace(stream_dir=self.tmp) if side else self.options
        if role == "both" and self.gpu_one:
            options = options.replace(gpu_streaming=True)  # (it streams if its models turn out to be on a GPU)
        if role == "candidate" and self.insure:
            options = options.replace(insured=False)
        more.setdefault("breadcrumb", self.breadcrumb)
        # (the steps come from the process that runs the candidate: one line, not two processes' taking turns)
        more.setdefault("progress", progress.showing() and role in ("both", "candidate"))
        return Job(role, self.ref_path, self.cand_path, options, self.out.settings,
                   ref_capture=self.ref_dkt if role == "candidate" else None, **more)

    def cand_job(self, **more) -> Job:
        sanitizer = (self.san_log, self.sanitize, os.path.abspath(self.cand_path)) if self.sanitize else None
        return self.job("candidate", earlier=self.earlier, sanitizer=sanitizer, **more)

    def start(self, job: Job, log: str, **how) -> Child:
        wrap = self.wrap if job.role == "candidate" else None
        child = launch(job, self.cand_env if job.role == "candidate" else self.env, log, self.fork, wrap=wrap,
                       **how)
        self.children.append(child)
        return child

    # -- the messages
    def pump(self, timeout: float) -> None:
        """Wait up to `timeout` for a message from any child; take in every one there is, passing on what is
        another child's (see the module's docstring)."""
        conns = {c.conn: c for c in self.children if c.conn is not None}
        if not conns:
            time.sleep(timeout)
            return
        for conn in wait(list(conns), timeout):
            self.take(conns[conn])

    def take(self, child: Child) -> None:
        """Every message `child` has sent so far (its end closed once it has gone)."""
        try:
            while child.conn is not None and child.conn.poll(0):
                message = child.conn.recv()
                child.said[type(message)] = message
                self.on_message(child, message)
        except (EOFError, OSError):
            child.conn.close()
            child.conn = None

    def on_message(self, child: Child, message) -> None:
        ahead = self.cand if self.cand is not None and self.cand.job.after else None
        if isinstance(message, InitInputs) and ahead is not None and self.host_only:
            ahead.send(message)
        elif isinstance(message, RefDone) and ahead is not None and self.host_only and not ahead.go_sent:
            ahead.send(Go())
            ahead.go_sent = True
        elif isinstance(message, DumpAsk):  # the candidate cannot open the handles: the holder writes them out
            holder = self.ref if self.ref is not None and Held in self.ref.said and self.ref.conn else None
            if holder is not None:
                holder.send(Dump())
            else:
                child.send(Dumped(None))
        elif isinstance(message, Dumped) and self.cand is not None:
            self.cand.send(message)
        elif isinstance(message, Phase):
            progress.say(message.text)

    def finish(self, child: Child, limit, enough=None, stop_it=True, answered=None):
        """Wait for a child to end (or `limit` seconds, or until `enough()` says it has done what it was run for,
        then stopped unless `stop_it` is False): its exit code, why it failed (None when it ended by itself or was
        left running), its stderr.  `answered()`: the exit code a child has given once it has done its part (a
        candidate's answer; a reference's complete capture), else None: it is then stopped, not waited for (see
        let_answered_go)."""
        proc = child.proc
        end = time.monotonic() + limit if limit else None
        try:
            while True:
                self.pump(ANSWER_POLL_S)
                code = proc.poll()
                if code is not None:
                    self.take(child)  # (all it said before it exited)
                got = answered() if answered is not None else None
                if got is not None:  # its answer is given: how its process ends is not the diff's
                    if code is None:
                        self.detached.append(child)
                        let_answered_go(proc)
                    return got, None, child.log_text()
                if code is not None:
                    break
                if enough is not None and enough():
                    if not stop_it:
                        return 0, None, ""
                    stop(proc)
                    return -9, CAUGHT_UP, ""
                if end is not None and time.monotonic() >= end:
                    raise subprocess.TimeoutExpired("diffkit", limit)
            why = None if code >= 0 else f"was killed by {signal.Signals(-code).name}"
        except subprocess.TimeoutExpired:
            stop(proc)
            code, why = -9, f"{HUNG} {limit:g} s and was stopped"
        except BaseException:  # Terminated (SIGTERM/SIGINT) or anything else: leave no child behind
            stop(proc)
            raise
        return code, why, child.log_text()

    # -- the diff
    def run(self) -> int:
        if self.sanitize:  # the candidate's process only, and only the candidate's own kernels in it
            try:
                prefix = wrap_command(self.sanitize, self.san_log, [], kernels=candidate_kernels(self.cand_path))
            except (FileNotFoundError, ValueError) as e:
                click.echo(f"diffkit: ERROR: --sanitize: {e}")
                return 2
            self.wrap = lambda cmd: [*prefix, *cmd]
            # line numbers in the reports when the extension is (re)built in this run (nvcc reads the variable)
            flags = (os.environ.get("NVCC_APPEND_FLAGS", "") + " -lineinfo").strip()
            self.cand_env.update(NVCC_APPEND_FLAGS=flags)
        if self.fork:
            _preload()  # loaded once here, not once in each child
        if os.environ.get("DIFFKIT_TWO_PROCESSES", "0") == "0" and (
                self.gpu_one or (self.detach and not (self.given or self.options.is_streaming))):
            code = self.one_child_first()
            if code is not None:
                return code
        code, why, err_text = self.per_side()
        if self.sanitize and os.environ.get("DIFFKIT_SANITIZER_COPY") and os.path.exists(self.san_log):
            shutil.copy(self.san_log, os.environ["DIFFKIT_SANITIZER_COPY"])  # keep the raw log (debugging the parser)
        if code in (0, 1, 2) and self.answered():
            sys.stderr.write(_own_notes(self.errlog + "-ref") + err_text)
            return code
        if any(Internal in c.said for c in (self.ref, self.cand) if c is not None):
            sys.stderr.write(err_text)  # the child hit a bug of diffkit's, not a crash
            return INTERNAL
        return self.crash_report(code, why, err_text)

    def one_child_first(self) -> int | None:
        """One child runs both sides first, as --no-isolate does in this process: no hand-over of the reference's
        values, one fork.  It answers only when that diff ran clean (a match or a divergence, no
        side failing, torch itself unchanged) or a file did not load (a model not built, no inputs: nothing ran
        yet); else (a forward's error, a crash, a hang, a diffkit bug) the diff runs again, a child per side, which
        says which side failed and diffs what each captured before -- and if that one runs clean, its answer still
        names the failure (roles.failed_before).  DIFFKIT_TWO_PROCESSES=1: straight to a child per side.  (On a
        GPU that child streams in lockstep: both models in one process is what bounds the diff's device memory to
        about twice the models' own without sending values through host memory; a CUDA crash costs the run
        per side after it.  DIFFKIT_GPU_PER_SIDE=1: a child per side at once, every value on the device, as
        before issue 46.)  Returns its exit code when it answered; else None."""
        both = os.path.join(self.tmp, "both")
        os.mkdir(both)
        # (what it prints, the candidate's own output included, is kept until it is known to be the answer)
        printed = os.path.join(both, "stdout")
        log = self.errlog + "-both"
        crumb = os.path.join(both, "breadcrumb")
        child = self.start(self.job("both", color=sys.stdout.isatty(), breadcrumb=crumb), log, out_path=printed)
        # it gets --timeout for the whole diff, at most BOTH_LIMIT_S with no GPU in play: a side that hangs is found
        # that much later than a child per side alone finds it, and a longer diff runs again, a child per side.  On
        # a GPU (where a diff's sides may well run longer, and a child per side holds every value on the device)
        # it gets --timeout itself
        limit = (self.timeout or None) if self.gpu_one else \
            min(self.timeout, BOTH_LIMIT_S) if self.timeout else BOTH_LIMIT_S
        code, why, err_text = self.finish(child, limit, answered=child.answered)
        if code in (0, 1, 2) and child.answered() == code:
            _pass_on(printed)
            sys.stderr.write(err_text)
            return code
        self.earlier = what_failed(child.said.get(Again), _read(crumb), code, why, err_text, self.ref_path,
                                   self.cand_path, limit)
        return None

    def per_side(self):
        """The reference's child captures, the candidate's diffs against that capture (started beside it, it runs
        its file -- its extensions built or loaded, its imports done -- while the reference is captured, then waits
        for that capture).  Returns the candidate's (or the failing reference's) exit code, why, its stderr."""
        code, why, err_text = 0, None, ""
        ahead = None
        self.started = time.monotonic()
        if not self.given and not self.sanitize:
            # on a GPU the candidate waits for the reference's process to exit (its device memory free) or to
            # hold its values for the hand-over; with no GPU in play, for the reference's capture to be complete
            ahead = self.cand = self.start(self.cand_job(after=True), self.errlog)
        try:
            if not self.given:
                code, why, err_text = self.reference()
                if RefDone not in self.ref.said:
                    return code, why, err_text
                if ahead is not None and not ahead.go_sent:
                    ahead.send(Go())
                    ahead.go_sent = True
            if ahead is None:
                self.started = time.monotonic()
                self.cand = self.start(self.cand_job(), self.errlog)
            answered = self.cand.answered if self.detach else None
            code, why, err_text = self.finish(self.cand, self.timeout, answered=answered)
            if self.holder is not None:  # done with its values: let it go, or have it write them out
                let_go(self.holder, self.ref_dkt, dump=not (code in (0, 1, 2) and self.cand.answered() is not None),
                       limit=self.timeout)
        finally:
            if ahead is not None and ahead not in self.detached and ahead.proc.poll() is None:
                stop(ahead.proc)  # the reference failed: its partner is not needed
            if self.holder is not None and self.holder.proc.poll() is None:
                stop(self.holder.proc)
        return code, why, err_text

    def reference(self):
        """The reference's child: until its capture is complete (with no GPU in play it is then stopped, if it
        has not exited) or, holding its values for the hand-over, it says so (it is then left running)."""
        ref = self.ref = self.start(self.job("reference", handover=self.hand), self.errlog + "-ref")
        answered = (lambda: 0 if RefDone in ref.said else None) if self.detach else None
        code, why, err_text = self.finish(ref, self.timeout, stop_it=False, answered=answered,
                                          enough=(lambda: Held in ref.said) if self.hand else None)
        if ref not in self.detached and ref.proc.poll() is None:  # it holds the values the candidate reads
            self.holder = ref
        if RefDone in ref.said:
            # its capture is complete and closed (a failure after that, at exit, is not the diff's) and its process
            # has exited (its device memory is free) or holds its values on it: go on
            return 0, None, err_text
        return code, why, err_text

    def crash_report(self, code: int, why: str | None, err_text: str) -> int:
        """A child crashed or hung: diff what both capture files hold, with the failure as the error."""
        judged, running = read_trials_journal(self.tmp)  # (before a second run adds to it)
        ref_done = self.given or (self.ref is not None and RefDone in self.ref.said)
        again = ""
        if self.insure and (ref_done if not self.given else os.path.exists(self.ref_dkt)) \
                and is_capture(self.ref_dkt):
            again = self.run_again(time.monotonic() - self.started, hung=bool(why and why.startswith(HUNG)))
        lines = [ln.strip() for ln in err_text.splitlines() if ln.strip() and not ln.startswith(" ")]
        last_err = next((ln for ln in reversed(lines) if re.match(r"^[\w.]*(Error|Exception)\b.*:", ln)),
                        lines[-1] if lines else "")
        why = why or f"exited with status {code}" + (f" ({last_err[:300]})" if last_err else "")
        sources = {}
        for side, path in (("ref", self.ref_dkt), ("cand", os.path.join(self.tmp, "cand.dkt"))):
            sources[side] = CaptureSource(path) if is_capture(path) else TraceSource(Trace())
        ref_src, cand_src = sources["ref"], sources["cand"]
        # the reference's process failed if it never said its capture was done (a later trial it runs after
        # trial 1's capture is complete can crash it too); else the candidate's did.  (Its own reference's process
        # said its capture was complete: whatever became of that capture since, the reference did not fail)
        complete = isinstance(ref_src, CaptureSource) and ref_src.file.complete
        side = "candidate" if ref_done and (complete or not self.given) else "reference"
        last = (cand_src if side == "candidate" else ref_src).trace(values=False).records
        stages = [r for r in last if r.kind != "input"]
        where = _read(self.breadcrumb).strip() or (
            f"after {stages[-1].name}" + (f" ({stages[-1].where})" if stages[-1].where else "") if stages
            else "its forward, before its first captured stage" if last else "before any stage was captured")
        later = side == "candidate" and running is not None and running[0] > 1
        if later:  # trial 1's captured forward is behind it: its capture's stages are all there, as judged
            where = (f"trial {running[0]}'s forward (the trials after the first run uncaptured, as KernelBench runs "
                     f"them)")
        what = f"the {side} process {why}"
        san_text = _read(self.san_log, None) if self.sanitize else None
        if san_text is not None and side == "candidate":
            failed = internal_failure(san_text)
            if failed:  # the sanitizer broke first: the crash that followed is its doing, not the candidate's
                what = f"{what}, {failure_words(self.sanitize, failed)}"
        error = ErrorInfo(side, "forward", (f"on trial {running[0]} (seed {running[1]}) " if later else "") + what,
                          where, err_text[-6000:] + again)
        evidence = None
        if san_text is not None:
            def evidence(result):
                attach(result, parse(san_text, self.sanitize))
        result = run(ref_src, cand_src, self.options.replace(stream_dir=None, health=False, rerun=False,
                                                             explain=False),
                     known=read_journal(os.path.join(self.tmp, "stats.jsonl")), error=error, evidence=evidence)
        result.ref_path, result.cand_path = self.ref_path, self.cand_path
        result.meta["processes"] = PROCESSES["candidate"]
        if side == "candidate" and (judged or running):
            trials_before_the_failure(result, judged, running, what)
        self.out.write(result)
        return 2

    def run_again(self, took: float, hung: bool) -> str:
        """The candidate child crashed or hung, and its capture file holds names and shapes only: run it again
        keeping every value (and writing no answer), so the parent can diff what was captured before the failure.
        A hang's second run gets twice the time the first took to make its last record (plus a margin), not the
        whole timeout again.  Returns a line for the error's details saying how the second run ended; nothing when
        there was nothing to recapture."""
        journal = os.path.join(self.tmp, "cand.dkt", "records.jsonl")

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
        limit = self.timeout or None
        if hung:
            limit = min(self.timeout, 2 * max(last, 0.0) + AGAIN_MARGIN) if self.timeout \
                else 2 * max(last, 0.0) + AGAIN_MARGIN
        first_crumb = _read(self.breadcrumb, None)
        shutil.rmtree(os.path.join(self.tmp, "cand.dkt"), ignore_errors=True)
        # a hang: stop the second run once its journal is as long as the first's (it has every value the first
        # one had captured); a crash is left to happen again by itself
        job = self.cand_job(silent=True)
        job.options = job.options.replace(insured=True)
        second = self.start(job, self.errlog, quiet=True)
        code, why, _ = self.finish(second, limit, enough=(lambda: lines() >= made) if hung else None)
        if first_crumb is not None:  # where the first run was when it failed is the answer's "where"
            with open(self.breadcrumb, "w", encoding="utf-8") as fh:
                fh.write(first_crumb)
        if code in (0, 1, 2) and second.answered() is not None:
            how = "finished without failing (the failure does not repeat: a race or an uninitialised read?)"
        elif why == CAUGHT_UP:
            how = why
        else:
            how = f"{why or f'exited with status {code}'} as well"
        return (f"\ndiffkit: the candidate was run a second time to capture the values its first run computed "
                f"before failing; the second run {how}.")


def _read(path: str, missing: str | None = "") -> str | None:
    """A text file's content; `missing` when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return missing


def _pass_on(printed: str) -> None:
    """What the one child for both sides printed (its answer), onto this process's standard output as written
    (in the encoding the child printed in)."""
    progress.before_answer()
    with open(printed, "rb") as fh:
        try:
            sys.stdout.flush()
            if hasattr(sys.stdout, "buffer"):
                sys.stdout.buffer.write(fh.read())
            else:  # (a stand-in for standard output that takes text only)
                sys.stdout.write(fh.read().decode(sys.stdout.encoding or "utf-8", "replace"))
            sys.stdout.flush()
        except BrokenPipeError:
            stdout_gone()


def let_go(holder: Child, capture_dir: str, dump: bool, limit: float | None) -> None:
    """An isolated diff's reference process that holds its values on the GPU (see diffkit.handoff): release it,
    or (`dump`: the candidate's process failed, and what follows reads the capture's files) have it write its
    values into its capture first; stopped if it does not exit in time."""
    holder.send(Dump() if dump else Release())
    try:
        holder.proc.wait(timeout=(limit or 600.0) if dump else RELEASE_WAIT_S)
    except Exception:
        stop(holder.proc)
    try:  # whatever happened, no later reader may take the handles of a process that is gone
        os.unlink(os.path.join(capture_dir, HANDOFF_FILE))
    except OSError:
        pass


def what_failed(again: Again | None, crumb: str, code: int, why: str | None, err_text: str, ref_path: str,
                cand_path: str, limit: float) -> dict | None:
    """What the one child running both sides hit (`again`: what it said; `crumb`: its breadcrumb), for the diff
    that runs again with a child per side to report if it does not hit it (an ErrorInfo's fields; "warning": said
    as a warning, not an error); None when there is nothing a clean second diff should be told (diffkit itself
    failed: exit 3, its traceback in the log)."""
    if again is not None:
        return again.error
    if code == INTERNAL:
        return None
    if why and why.startswith(HUNG):  # (its limit was both sides' together: the sides' own come next)
        return {"warning": True, "message": f"run in one child process, both sides together did not finish within "
                                            f"{limit:g} s (its limit: --timeout; at most {BOTH_LIMIT_S:g} s with no "
                                            f"GPU in play); with a "
                                            f"child process per side each did: a diff that long, or a hang that "
                                            f"does not repeat"}
    crumb = crumb.strip()
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


def trials_before_the_failure(result, judged: list[dict], running, what: str) -> None:
    """An isolated diff whose candidate process crashed or hung: the trials it judged before, and the one it
    was running (its seed), in place of the trial-1 row the capture alone would give."""
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
