"""Progress at a terminal (issue 45): while a diff runs, one line on standard error says the step and its seconds,
and is gone before the answer; nothing of it when standard error is not a terminal or DIFFKIT_NO_PROGRESS=1."""
import os
import pty
import re
import select
import subprocess
import sys

import pytest

from conftest import REFS, ROOT

GELU = open(os.path.join(REFS, "gelu.py"), encoding="utf-8").read()
SLOW = '''import time
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        time.sleep(0.6)
        return torch.nn.functional.gelu(x)
'''
STEP = re.compile(r"diffkit: ([a-z][^…\r\n]*?) … \d+ s")


def _run(tmp_path, *extra, terminal=True, env_extra=None):
    (tmp_path / "ref.py").write_text(GELU)
    (tmp_path / "cand.py").write_text(SLOW)
    cmd = [sys.executable, os.path.join(ROOT, "cli.py"), "diff", "ref.py", "cand.py", "--no-report", "--trials", "2",
           *extra]
    env = {**os.environ, "TERM": "xterm", **(env_extra or {})}
    env.pop("DIFFKIT_NO_PROGRESS", None) if "DIFFKIT_NO_PROGRESS" not in (env_extra or {}) else None
    if not terminal:
        p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # (the terminal's other end closed: the process has exited)
                break
            if not chunk:
                break
            seen += chunk
        elif p.poll() is not None:
            break
    out = p.stdout.read().decode()
    p.wait(timeout=60)
    os.close(master)
    return p.returncode, out, seen.decode(errors="replace")


@pytest.mark.parametrize("isolate", [[], ["--no-isolate"]])
def test_a_terminal_sees_the_steps_and_a_clean_answer(tmp_path, isolate):
    code, out, err = _run(tmp_path, *isolate)
    assert code == 0 and "diffkit: MATCH" in out, (out[-1500:], err[-1500:])
    assert "diffkit: trial 1 of 2: capturing and comparing every stage" in err, err[-2000:]
    assert STEP.search(err)  # (the step's seconds beside it)
    assert not STEP.search(out) and "…" not in out.splitlines()[-1]  # the line never reaches the answer


def test_no_terminal_no_progress(tmp_path):
    code, out, err = _run(tmp_path, terminal=False)
    assert code == 0 and "diffkit: MATCH" in out
    assert not STEP.search(err) and not STEP.search(out)


def test_progress_can_be_turned_off(tmp_path):
    code, out, err = _run(tmp_path, env_extra={"DIFFKIT_NO_PROGRESS": "1"})
    assert code == 0 and "diffkit: MATCH" in out
    assert not STEP.search(err)
