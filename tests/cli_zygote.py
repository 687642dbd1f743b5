"""A process that has imported torch and diffkit's CLI once and forks a fresh `python cli.py ARGS` from itself
for each request (conftest.run_cli): the 1.5-2 s a new interpreter spends importing them is paid once per test
worker, not once per CLI run.  It computes nothing itself, so each fork starts as a new interpreter would (no
thread pool, no CUDA context, no capture state), in the directory and environment the request names.

Protocol, one JSON line per request on stdin: {"args", "cwd", "env", "out", "err"}; the answer, on the file
descriptor given as argv[1]: "pid <n>" when the run starts, then "status <wait status>" when it ends."""
import json
import os
import runpy
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(ROOT, "cli.py")
sys.path[0] = ROOT  # as for `python cli.py` (the script's folder first)

import torch  # noqa: E402,F401  (what each run would import: imported once, here)
import diffkit.cli  # noqa: E402,F401
from diffkit.warm import run_as_interpreter  # noqa: E402


def _run(req: dict, reply_fd: int) -> int:
    os.close(reply_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # (re-read from the request's TMPDIR)
    sys.argv = [CLI, *req["args"]]
    return run_as_interpreter(lambda: runpy.run_path(CLI, run_name="__main__"))


def main() -> None:
    reply = int(sys.argv[1])
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run(req, reply)
            finally:
                os._exit(code)
        os.write(reply, f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(reply, f"status {status}\n".encode())


if __name__ == "__main__":
    main()
