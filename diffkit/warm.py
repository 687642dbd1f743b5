"""A suite's pairs started warm (issue 46): each `diffkit diff` of a pair is forked from a server process that has
imported torch and diffkit's command line once (multiprocessing's forkserver, preloading `diffkit.cli`), instead
of a fresh interpreter importing them again for every pair (1.5-2 s each on a 2-core machine, more on a GPU
host).  The server computes nothing, so each fork starts as a new interpreter would: no thread pool, no CUDA
context (a pair's `CUDA_VISIBLE_DEVICES` still takes effect), no capture state; in its own session (stopping it
stops what it started), with its own environment, folder, arguments and log.

`start` answers an object with the `subprocess.Popen` surface the suite uses (pid, wait(timeout), returncode);
None when forking is not possible here (no forkserver on this platform, DIFFKIT_SUITE_FRESH=1): the suite then
starts a fresh interpreter, as before.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings

from .outputs import exit_code_of, flush_standard_streams
from .processes import CLI_ENTRY, CLI_PROG_NAME

__all__ = ["start", "WarmRun", "run_as_interpreter"]

PRELOAD = ["torch", "diffkit.cli"]
# multiprocessing runs the parent's main module again in each forked child (as __mp_main__); for
# `python -m diffkit.cli` that is diffkit.cli, already loaded here, and runpy warns about it in every pair's log
warnings.filterwarnings("ignore", message=r"'diffkit\.cli' found in sys\.modules", category=RuntimeWarning)
_context = None
_lock = threading.Lock()


def _server():
    """The forkserver context, started once per process (None where there is none)."""
    global _context
    with _lock:
        if _context is None:
            if os.environ.get("DIFFKIT_SUITE_FRESH") or "forkserver" not in multiprocessing.get_all_start_methods():
                _context = False
            else:
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(PRELOAD)
                _context = ctx
        return _context or None


def _run(argv: list[str], env: dict, cwd: str, log_path: str) -> None:
    """In the forked child: become the `diffkit ARGV` run a fresh interpreter would have been, then exit with its
    code (non-daemon threads joined and exit functions run, as at an interpreter's exit)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # (re-read from this run's TMPDIR)
    sys.argv = [CLI_PROG_NAME, *argv]
    sys.exit(run_as_interpreter(lambda: exec(CLI_ENTRY, {"__name__": "__diffkit_pair__"})))


def run_as_interpreter(entry) -> int:
    """Run `entry()` as a fresh interpreter would run its program, in a process forked for it: the exit code it
    would end with (SystemExit's, 1 with the traceback printed for an uncaught exception), after joining
    non-daemon threads, running exit functions and flushing the standard streams, as an interpreter does when it
    exits.  (Also how the test suite's CLI zygote runs each `python cli.py` it forks.)"""
    try:
        entry()
        code = 0
    except SystemExit as e:
        code = exit_code_of(e)
    except BaseException:  # noqa: BLE001 - an uncaught exception ends an interpreter with 1 and its traceback
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        flush_standard_streams()
    return code


class WarmRun:
    """A pair's run forked from the server: the part of `subprocess.Popen` the suite uses."""

    def __init__(self, process):
        self.process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode  # (negative: killed by that signal, as Popen says it)

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"diffkit (pid {self.pid})", timeout)
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode


def start(argv: list[str], env: dict, cwd: str, log_path: str) -> WarmRun | None:
    """Fork `diffkit ARGV` from the warm server, its output appended to `log_path`; None when it cannot be."""
    ctx = _server()
    if ctx is None:
        return None
    try:
        process = ctx.Process(target=_run, args=(list(argv), dict(env), cwd, log_path), daemon=False)
        process.start()
    except (OSError, RuntimeError, EOFError):  # no server could be started here: a fresh interpreter instead
        return None
    return WarmRun(process)
