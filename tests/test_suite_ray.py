"""`diffkit suite --ray`: on a local Ray cluster of two nodes (one CPU each, as on the 2-core CI machine), a
folder of mixed pairs (a match, a divergence, a crash, a hang past --timeout, a CUDA-only pair) gets the
verdicts, first divergences and summary files of the local suite; a pair whose Ray worker dies is run once
more, and one whose worker dies twice is an error naming the node; without Ray, --ray says how to install it."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from test_suite import TINY_REF  # noqa: E402

PY = [sys.executable, "-m", "diffkit.cli"]
# (the --timeout bounds a pair's whole diff, torch's import included: 3 s was too little on a loaded CI machine,
# where the crashing pair's diff ran past it and read as a hang)
OPTS = ["--trials", "1", "--timeout", "15"]

REF = TINY_REF  # (the suite's own test reference: a softmax over 4 x 16)
# a numpy softmax (invisible to capture), scaled by SCALE
NUMPY = '''import numpy as np
import torch
from torch import nn


def _rows(a):
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


class ModelNew(nn.Module):
    def forward(self, inp):
        return torch.from_numpy(SCALE * _rows(inp.detach().numpy()))
'''
CRASH = '''import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x[None].view(3, -1, 7)
'''
HANG = '''import time
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        while True:
            time.sleep(0.5)
'''
CUDA_ONLY = '''import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.softmax(x.to(device="cuda"), dim=1)
        return y.cpu()
'''
# kills the Ray worker that runs its pair (the first process above it titled "ray::…"): every time, or only
# the first time (a marker file says it already did)
KILLER = '''import os
import signal

import torch
import torch.nn as nn

MARKER = {marker!r}


def _ray_worker():
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{{pid}}/cmdline", "rb") as fh:
            if fh.read().startswith(b"ray::"):
                return pid
        with open(f"/proc/{{pid}}/stat") as fh:
            pid = int(fh.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("no Ray worker above this process")


if {always!r} or not os.path.exists(MARKER):
    with open(MARKER, "a") as fh:
        fh.write("killed\\n")
    os.kill(_ray_worker(), signal.SIGKILL)
    os._exit(1)


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=1)
'''


def _pair(root, name, cand):
    d = os.path.join(root, name)
    os.makedirs(d)
    with open(os.path.join(d, "ref.py"), "w") as fh:
        fh.write(REF)
    with open(os.path.join(d, "cand.py"), "w") as fh:
        fh.write(cand)


def _suite(*args):
    return subprocess.run([*PY, "suite", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each on this machine."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mixed"))
    for name, cand in (("match", NUMPY.replace("SCALE * ", "")), ("diverged", NUMPY.replace("SCALE", "1.25")),
                       ("crash", CRASH), ("hang", HANG), ("cuda_only", CUDA_ONLY)):
        _pair(root, name, cand)
    return root


def _read(path):
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _untimed(name, text):
    """A summary file without its timings (seconds, junit time=, the html's written-at and time cells)."""
    if name == "summary.json":
        return [{k: v for k, v in row.items() if k != "seconds"} for row in json.loads(text)]
    text = re.sub(r'time="[^"]*"', "", text)
    text = re.sub(r"written [0-9: -]+", "", text)
    return re.sub(r"\d+\.\d s", "", text)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CUDA-only pair runs where CUDA is")
def test_ray_suite_gives_the_local_suite_answers(cluster, mixed, tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "ray")
    a = _suite(mixed, "--report-dir", local, "--workers", "2", *OPTS)
    b = _suite(mixed, "--report-dir", remote, *OPTS, "--ray", cluster.address)
    assert a.returncode == b.returncode == 2, a.stdout + a.stderr + b.stdout + b.stderr
    assert "2 node(s), 2 CPU" in b.stdout
    rows = {r["name"]: r for r in json.loads(_read(os.path.join(remote, "summary.json")))}
    assert {n: r["verdict"] for n, r in rows.items()} == {"match": "match", "diverged": "diverged", "crash": "error",
                                                          "hang": "error", "cuda_only": "skipped"}
    assert rows["diverged"]["first_divergence"] == "stage 0 output"
    assert "did not finish within 15 s" in rows["hang"]["error"]
    assert "needs CUDA" in rows["cuda_only"]["skip_reason"]
    for name in ("summary.json", "index.html", "junit.xml", "summary.csv", "summary.md"):
        if name == "summary.csv":  # its seconds column
            strip = [re.sub(r",\d+\.\d+,", ",,", ln) for ln in _read(os.path.join(local, name)).splitlines()]
            assert strip == [re.sub(r",\d+\.\d+,", ",,", ln) for ln in _read(os.path.join(remote, name)).splitlines()]
            continue
        assert _untimed(name, _read(os.path.join(local, name))) == _untimed(name, _read(os.path.join(remote, name))), \
            name
    for name in rows:  # each pair's report came back from its worker
        for f in ("result.json", "diff.log", "suite.json"):
            assert os.path.isfile(os.path.join(remote, name, f)), (name, f)
    assert b.stdout.count("[") >= 5 and "[5/5]" in b.stdout  # progress lines as pairs finish

    again = _suite(mixed, "--report-dir", remote, *OPTS, "--ray", cluster.address, "--resume")
    assert again.returncode == 2 and again.stdout.count("resumed") == 5, again.stdout + again.stderr


def test_a_pair_whose_worker_dies_is_run_once_more(cluster, tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    once, always = str(tmp_path / "once.marker"), str(tmp_path / "always.marker")
    _pair(src, "dies_once", KILLER.format(marker=once, always=False))
    _pair(src, "dies_always", KILLER.format(marker=always, always=True))
    proc = _suite(src, "--report-dir", out, "--trials", "1", "--no-isolate", "--ray", cluster.address)
    rows = {r["name"]: r for r in json.loads(_read(os.path.join(out, "summary.json")))}
    assert rows["dies_once"]["verdict"] == "match", proc.stdout + proc.stderr
    assert _read(once) == "killed\n"  # its first worker was killed; the second one ran it clean
    assert rows["dies_always"]["verdict"] == "error"
    assert _read(always) == "killed\nkilled\n"  # run twice, no more
    error = rows["dies_always"]["error"]
    assert re.search(r"worker running this pair died \(last on node [0-9a-f]{20,} \(\d+\.\d+\.\d+\.\d+\)", error), error
    assert any(n.node_id in error for n in cluster.list_all_nodes()), error  # one of the cluster's two nodes
    assert proc.returncode == 2


# hangs in its forward, having written its process id beside itself (a pair's process is forked warm: its
# command line does not name the pair)
NOTED_HANG = '''import os
import time
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pid"), "w") as fh:
            fh.write(str(os.getpid()))
        while True:
            time.sleep(0.5)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_interrupted_ray_suite_stops_its_children_and_keeps_its_summaries(cluster, tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _pair(src, "a_fast", NUMPY.replace("SCALE * ", ""))
    _pair(src, "b_hangs", NOTED_HANG)  # no --timeout: only the interruption ends it
    proc = subprocess.Popen([*PY, "suite", src, "--report-dir", out, "--trials", "1", "--no-isolate", "--ray",
                             cluster.address], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    noted = os.path.join(src, "b_hangs", "pid")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(os.path.join(out, "a_fast", "suite.json"))
                                          and os.path.exists(noted) and open(noted).read()):
        time.sleep(0.2)
    assert os.path.exists(noted) and open(noted).read(), "the hanging pair's forward never started"
    hanging = int(open(noted).read())
    assert _alive(hanging)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGINT, output
    time.sleep(1)
    assert not _alive(hanging), "the cancelled task left its child running"
    rows = json.loads(_read(os.path.join(out, "summary.json")))
    assert [(r["name"], r["verdict"]) for r in rows] == [("a_fast", "match")]
    assert "interrupted by SIGINT" in _read(os.path.join(out, "index.html"))


def test_without_ray_the_flag_says_how_to_install_it(tmp_path):
    fake = tmp_path / "no_ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    _pair(str(tmp_path / "in"), "p", NUMPY.replace("SCALE * ", ""))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "no_ray"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([*PY, "suite", str(tmp_path / "in"), "--report-dir", str(tmp_path / "out"), "--ray"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert "pip install -e '.[ray]'" in proc.stderr
