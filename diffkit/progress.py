"""What a diff is doing, for a person waiting at a terminal (issue 45): one line on standard error, rewritten in
place, saying the step and the seconds it has taken ("running the candidate's file (its extensions are built or
loaded) … 12 s"), gone before the answer is printed.  Nothing at all when standard error is not a terminal (a log,
CI, a pipe), with TERM=dumb, or with DIFFKIT_NO_PROGRESS=1.

Library code says where it is with `say(text)`.  Who shows it is set once per process (`show_here`, `send_to`):
the process the user started shows the line (rich's status display); an isolated diff's child sends each step to
that process instead (the child's `say` becomes a message over its link), and stops the line before it prints its
answer itself (`before_answer`).

(The lowest layer: it imports nothing of diffkit's.)
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

__all__ = ["say", "wanted", "Status", "show_here", "showing", "send_to", "before_answer", "stop"]

_sink: Callable[[str | None], None] | None = None
_lock = threading.Lock()


def wanted(stream=None) -> bool:
    """Whether a person is watching `stream` (default: standard error): a terminal, not TERM=dumb, not turned off."""
    stream = stream if stream is not None else sys.stderr
    if os.environ.get("DIFFKIT_NO_PROGRESS", "0") not in ("", "0") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return bool(stream is not None and stream.isatty())
    except (ValueError, OSError):
        return False


def say(text: str | None) -> None:
    """The step the diff is at now (None: it is about to print its answer)."""
    sink = _sink
    if sink is not None:
        try:
            sink(text)
        except Exception:  # (showing progress never stops a diff)
            pass


class Status:
    """The line on standard error: the step and the seconds it has taken, refreshed a few times a second."""

    def __init__(self):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.text = "starting"
        self.since = time.monotonic()
        self.live = self.console.status(self._words(), spinner="dots")
        self.live.start()
        self.stopped = False
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="diffkit-progress")
        self._ticker.start()

    def _words(self) -> str:
        return f"diffkit: {self.text} … {time.monotonic() - self.since:.0f} s"

    def _tick(self) -> None:
        while not self.stopped:
            time.sleep(0.25)
            with _lock:
                if not self.stopped:
                    self.live.update(self._words())

    def update(self, text: str | None) -> None:
        if text is None:
            self.stop()
            return
        with _lock:
            if self.stopped:
                return
            if text != self.text:
                self.text, self.since = text, time.monotonic()
            self.live.update(self._words())

    def stop(self) -> None:
        with _lock:
            if self.stopped:
                return
            self.stopped = True
            self.live.stop()


_status: Status | None = None


def show_here() -> Status | None:
    """This process shows the line (when a person is watching standard error): the process the user started."""
    global _sink, _status
    if _status is None and wanted():
        try:
            _status = Status()
        except Exception:  # (no rich, a terminal it cannot drive: no line)
            return None
        _sink = _status.update
    return _status


def showing() -> bool:
    """Whether this process shows the line (its children are then asked to send their steps)."""
    return _status is not None and not _status.stopped


def send_to(send: Callable[[str | None], None]) -> None:
    """This process (an isolated diff's child) sends each step to the process that shows the line."""
    global _sink
    _sink = send


def before_answer() -> None:
    """About to print the answer: the line is taken away first (in this process, or by the one showing it)."""
    say(None)
    if _status is None and _sink is not None:
        time.sleep(0.05)  # (the showing process clears its line within its 10 ms poll; the answer then follows)


def stop() -> None:
    """No more steps: the line is taken away (this process's, if it shows one)."""
    global _sink
    if _status is not None:
        _status.stop()
    _sink = None
