"""What every diffkit process that gives an answer shares: where the answer goes (`Outputs`: the terminal,
--json/--csv, the report directory and single files), how an internal error is printed, and how SIGTERM/SIGINT
unwind it (`Terminated`).  (Layer 11, split from the CLI: the children of an isolated diff write answers too.)"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback

import click

from . import progress
from . import report
from .errors import DiffkitError
from .render import text_report
from .result import Result
from .safefiles import write_text


class Terminated(BaseException):
    """SIGTERM/SIGINT/SIGHUP arrived: unwind (children stopped, temporary directories removed), then exit.
    A BaseException, so neither the user's model nor the capture takes it for an error of the model."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    raise Terminated(signum)


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n))


def install_signal_handlers() -> None:
    """SIGTERM, SIGINT and SIGHUP (a closed terminal) unwind the diff: exit 128+N, children and folders gone."""
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread (e.g. called from a test runner's worker)
            pass


@contextlib.contextmanager
def exit_guard(out: "Outputs | None" = None, what: str = "the diff"):
    """While a model's code runs in this process (--no-isolate, `diffkit capture`): an os._exit it calls ends the
    process with exit 2 and a sentence, not silently with the code it chose (0 would read as a match).  A forked
    child's exit, and diffkit's own once the answer is being written (`out.answering`), pass through."""
    real, pid = os._exit, os.getpid()

    def guarded(code: int) -> None:
        if os.getpid() != pid or (out is not None and out.answering):
            real(code)
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        try:
            os.write(1, f"diffkit: ERROR: a model's code ended the process with os._exit({code}) before {what} "
                        f"answered\n".encode())
        except OSError:
            pass
        real(2)

    os._exit = guarded
    try:
        yield
    finally:
        os._exit = real


def is_users_fault(e: BaseException) -> bool:
    """An exception escaping the pipeline is diffkit's bug, except a device error that the
    candidate's kernel left behind (the context is poisoned after its forward)."""
    text = f"{type(e).__name__}: {e}"
    return type(e).__name__ == "AcceleratorError" or "CUDA error" in text or "device-side assert" in text


def print_internal_error(e: BaseException) -> None:
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    click.echo(f"diffkit: INTERNAL ERROR: {type(e).__name__}: {str(e).strip()[:300]} — this is a bug in diffkit, "
               f"not in your files; please report it with the traceback above", err=True)


class Outputs:
    """Where a diff's answer goes: the terminal, --json/--csv, the report directory and single files."""

    def __init__(self, json_path, csv_path, report_dir, no_report, html_path, md_path, junit_path, color, full,
                 silent=False):
        # against the directory the command ran in (a model's constructor or forward may change it)
        here = lambda p: os.path.abspath(p) if p else p  # noqa: E731
        self.json_path, self.csv_path, self.report_dir, self.no_report = here(json_path), here(csv_path), \
            here(report_dir), no_report
        self.html_path, self.md_path, self.junit_path = here(html_path), here(md_path), here(junit_path)
        self.cwd = os.getcwd()
        # (what a child of an isolated diff builds its own from: these paths are already absolute)
        self.settings = dict(json_path=self.json_path, csv_path=self.csv_path, report_dir=self.report_dir,
                             no_report=no_report, html_path=self.html_path, md_path=self.md_path,
                             junit_path=self.junit_path, color=color, full=full)
        self.color, self.full = color, full
        self.silent = silent  # an isolated diff's second candidate run: the parent writes the answer
        self.answering = False  # someone is writing the answer (`claim`)
        self._claim_lock = threading.Lock()
        self._claimed_by: int | None = None
        self.on_claim = None  # called when the answer is claimed (a --no-isolate deadline disarms its alarm)

    def clash(self) -> str | None:
        """Two single-file flags naming one file (the second would overwrite the first): a sentence, else None."""
        named = [(f, p) for f, p in (("--json", self.json_path), ("--csv", self.csv_path), ("--html", self.html_path),
                                     ("--markdown", self.md_path), ("--junit", self.junit_path)) if p]
        for i, (f, p) in enumerate(named):
            for g, q in named[i + 1:]:
                if os.path.realpath(p) == os.path.realpath(q):
                    return f"{f} and {g} both name {p}: the second would overwrite the first; give each its own file"
        return None

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
        if self.silent:
            return True
        # the files first: a reader of the printed answer that stops early (`| head`) costs none of them
        written, notes = True, []
        try:
            for path in (self.json_path, self.csv_path):
                if path and os.path.dirname(path):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
            if self.json_path:
                write_text(self.json_path, result.to_json())
            if self.csv_path:
                result.to_csv(self.csv_path)
            if not self.no_report and not _nothing_ran(result):
                progress.say("writing the report")
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
        progress.before_answer()
        try:
            # (color: kept when this process prints into a file for a parent whose output is a terminal)
            click.echo(f"diffkit: ERROR: {error}" if error is not None else text_report(result, color=self.color,
                                                                                      full=self.full),
                       color=True if self.color else None)
        except BrokenPipeError:  # the reader has gone: nothing more goes to it (the exit code still tells)
            stdout_gone()
        except OSError:  # closed (a model's code closed file descriptor 1): the files and the exit code still tell
            stdout_gone()
            notes.append("diffkit: warning: standard output was closed (by the models' code?): the answer was not "
                         "printed; the exit code and any files written still give it")
        for note in notes:
            try:
                click.echo(note, err=True)
            except OSError:
                _to_null(2, "stderr")
        return written


def _nothing_ran(result: Result) -> bool:
    """A diff that stopped at a path that is not there (a typo): no report folder is made for it."""
    e = result.error
    return e is not None and e.phase == "read" and bool(e.stage) and not os.path.exists(e.stage)  # (stage: the path)


def exit_code_of(e: SystemExit) -> int:
    """The status a process ends with for `e`, as the interpreter makes it (a code that is no number: printed,
    and 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def flush_standard_streams() -> None:
    """Standard output and error flushed, whatever state they are in (closed, gone), before a process ends."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def stdout_gone() -> None:
    """Standard output's reader has closed it, or it was closed (by the caller, or by a model's code closing file
    descriptor 1): point it at the null device, so that no later write or flush (this process's own at exit
    included) fails again."""
    _to_null(1, "stdout")


def _to_null(fd: int, name: str) -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != fd:  # (a closed descriptor is the lowest free one: the null device may have taken it)
            os.dup2(devnull, fd)
            os.close(devnull)
        if getattr(sys, name) is None:  # (the interpreter started with the descriptor closed)
            setattr(sys, name, open(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=False))
    except (OSError, ValueError, AttributeError):
        pass


def standard_streams_present() -> None:
    """A caller that started diffkit with standard output or error closed (`diffkit diff … >&-`) still gets the
    files it asked for and the exit code: what would have been printed goes to the null device."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            closed = getattr(sys, name) is None
        except OSError:
            closed = True
        if closed:
            _to_null(fd, name)
