"""A suite's pairs forked warm (diffkit.warm): each pair is `diffkit diff` as a fresh interpreter would run it, in
its own folder, environment and session, with its output in its log, its exit code its own; stopping it stops
what it started."""
import json
import os
import subprocess
import time

import pytest

from conftest import ROOT
from diffkit import warm
from diffkit.processes import stop

REF = os.path.join(ROOT, "references", "gelu.py")
# a matching candidate that notes where and how its process runs
NOTING = '''import os
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    def forward(self, x):
        with open({note!r}, "w") as fh:
            fh.write(repr((os.environ.get("WARM_MARK"), os.getcwd(), os.getsid(0), os.getppid(),
                           os.getsid(os.getppid()))))
        return F.gelu(x)
'''
SLEEPING = '''import time
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        with open({note!r}, "w") as fh:
            fh.write(str(__import__("os").getpid()))
        time.sleep(120)
        return x
'''


@pytest.fixture
def fresh_server(monkeypatch):
    monkeypatch.delenv("DIFFKIT_SUITE_FRESH", raising=False)
    return warm


def _cand(tmp_path, text):
    note = str(tmp_path / "note")
    path = tmp_path / "cand.py"
    path.write_text(text.format(note=note))
    return str(path), note


def test_a_warm_pair_runs_in_its_own_folder_environment_and_session(tmp_path, fresh_server):
    cand, note = _cand(tmp_path, NOTING)
    log, result = str(tmp_path / "diff.log"), str(tmp_path / "r.json")
    open(log, "w").close()
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "WARM_MARK": "pair-7"}
    run = warm.start(["diff", REF, cand, "--json", result, "--no-report", "--trials", "1"], env, str(work), log)
    assert run is not None  # a forkserver exists on this platform
    assert run.wait(timeout=300) == 0, open(log).read()
    assert json.load(open(result))["verdict"] == "match"
    mark, cwd, sid, ppid, parent_sid = eval(open(note).read())
    assert mark == "pair-7" and cwd == str(work)
    # the pair leads its own session: the forward ran in it, or in a child of the pair's (an isolated diff's child,
    # which makes a session of its own unless its parent made it a group leader first: either may come first)
    assert sid == run.pid or (ppid == run.pid and parent_sid == run.pid), (sid, ppid, parent_sid, run.pid)
    assert "diffkit: MATCH" in open(log).read()


def test_a_warm_pairs_exit_code_is_its_diffs(tmp_path, fresh_server):
    log = str(tmp_path / "diff.log")
    open(log, "w").close()
    run = warm.start(["diff", REF, str(tmp_path / "missing.py"), "--no-report"], dict(os.environ), ROOT, log)
    assert run.wait(timeout=300) == 2 and "missing.py" in open(log).read()


def test_stopping_a_warm_pair_stops_what_it_started(tmp_path, fresh_server):
    cand, note = _cand(tmp_path, SLEEPING)
    log = str(tmp_path / "diff.log")
    open(log, "w").close()
    run = warm.start(["diff", REF, cand, "--no-report", "--trials", "1"], dict(os.environ), ROOT, log)
    deadline = time.monotonic() + 120
    while not os.path.exists(note) or not open(note).read():
        assert time.monotonic() < deadline and run.poll() is None, open(log).read()
        time.sleep(0.1)
    forward_pid = int(open(note).read())  # the isolated diff's child running the candidate's forward
    with pytest.raises(subprocess.TimeoutExpired):
        run.wait(timeout=0.5)
    stop(run)
    assert run.returncode is not None and run.returncode != 0
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{forward_pid}") and open(f"/proc/{forward_pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the candidate's process outlived its stopped pair"
        time.sleep(0.1)


def test_without_a_fork_server_the_suite_starts_fresh_interpreters(monkeypatch):
    monkeypatch.setattr(warm, "_context", False)
    assert warm.start(["--help"], dict(os.environ), ROOT, os.devnull) is None
