"""diffkit's child processes: how one is started and how one is stopped.

A child is a fresh interpreter (or, where cli forks, a copy of this one).  A fresh one runs the SAME diffkit
package as the process that starts it, whatever the current folder holds: `python -m diffkit.cli` would import a
folder named ``diffkit`` in the current directory instead (the user's checkout, a stub), so the child is started
with ``python -c BOOT`` (`python_command`), which loads this very package from its own directory and only then
runs its entry point.  The current directory stays first on the child's ``sys.path``, as ``-m`` puts it there:
whatever the user's files import from it still imports.

Stopping (`stop`): every child runs in a session of its own (``start_new_session``, or ``setsid`` after a fork),
so that stopping its process group also stops what it started (compute-sanitizer, ninja, the per-side children of
a suite's diff).
"""
from __future__ import annotations

import os
import signal
import sys

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

# the entry point of a child that runs the command line (`diffkit ARGS`)
CLI_ENTRY = f"from diffkit.cli import main; main(prog_name={CLI_PROG_NAME!r})"


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
            pass
        try:
            proc.wait(timeout=wait)
            return
        except Exception:
            continue
