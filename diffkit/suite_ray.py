"""`diffkit suite --ray [ADDRESS]`: the suite's pairs as Ray tasks, for suites larger than one machine.

Each runnable pair is one Ray task (`run_pair`) that asks for one GPU when it needs one, else one CPU: a pair
needs a GPU when the cluster has GPUs and the suite was not given ``--device cpu`` (as the local suite gives
every child a GPU when there is one), or when its files need CUDA (`suite.needs_cuda`) and the cluster has a GPU;
on a cluster without GPUs every pair takes one CPU, and one that needs CUDA is then skipped by its own answer,
as locally.  The task runs the pair exactly as the local suite does: a `suite.Runner` of one slot in the
worker runs the same ``python -m diffkit.cli diff …`` child (`Runner.command`), with the same time limit, log,
answer reading, skip rule and resume marker.

Storage: the pair files (reference, candidate, what they load beside them) are read on the workers at the
paths the driver gives, so the nodes must see them at the same paths (a shared file system, or the same
checkout on every node).  The outputs need no shared storage: the worker writes the pair's folder into a
temporary folder of its own, sends every file of it back with the answer, and the driver writes them under
``--report-dir/<name>/`` and then writes the summaries with the same functions as a local suite, so
summary.json, index.html, junit.xml, summary.csv and summary.md are those of a local run of the same pairs
(up to timings).

A Ray worker (or node) that dies loses only the pair it held: Ray runs that task once more (max_retries=1;
exceptions raised by the task itself are not retried), and a second death makes the pair an ``error`` that
names the node it last ran on (its Ray node id and IP, which every task reports to a small `_Tracker` actor
when it starts).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace

import click

from .safefiles import write_bytes
from .suite import (BACKENDS, LOCAL_RAY, MARKER, Runner, SuiteEntry, _Progress, interrupted_note, interruptible,
                    needs_cuda, pair_deadline, plan, suite, write_summaries)

__all__ = ["run_suite_ray", "suite"]  # `suite`: the command, with this backend registered (cli.py takes it here)

INSTALL = "pip install -e '.[ray]'"
RETRIES = 1  # runs of a task whose worker died, after the first
CANCEL_WAIT_S = 30.0  # how long an interrupted suite waits for its cancelled tasks to stop their children


@dataclass
class PairAnswer:
    """What a task sends back: the answered entry, the node it ran on, and the pair folder's files."""

    entry: SuiteEntry
    node: str
    files: dict[str, bytes]


def import_ray():
    """The ray module, or exit 2 saying how to install it."""
    try:
        import ray
    except ImportError as e:
        click.echo(f"diffkit suite: --ray needs Ray, which is not installed ({e}); install it with {INSTALL}",
                   err=True)
        sys.exit(2)
    return ray


def connect(ray, address: str) -> bool:
    """Join the cluster at `address` ('auto': the running one) or start a local one; True when started here."""
    quiet = {"log_to_driver": False, "logging_level": "ERROR", "configure_logging": True}
    if ray.is_initialized():
        return False
    if address == LOCAL_RAY:
        ray.init(address="local", **quiet)  # a new one, even where a cluster runs already
        return True
    ray.init(address=address, **quiet)
    return False


def node_name() -> str:
    import ray

    ctx = ray.get_runtime_context()
    return f"node {ctx.get_node_id()} ({ray.util.get_node_ip_address()})"


def _pair_files(folder: str) -> dict[str, bytes]:
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                files[os.path.relpath(path, folder)] = fh.read()
    return files


def run_pair(entry: SuiteEntry, diff_args: list[str], deadline: float | None, tracker) -> PairAnswer:
    """A Ray task: diff one pair in a child process, as the local suite does, in a folder of this worker's
    own; return the answer and the folder's files.  Interrupted (ray.cancel), it stops its child."""
    import ray

    node = node_name()
    try:  # ray.cancel interrupts with SIGINT, which a worker started from a background job ignores
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread
        pass
    tracker.started.remote(entry.name, node)
    gpus = ray.get_gpu_ids()
    slot = ",".join(str(g) for g in gpus) if gpus else None
    try:
        with tempfile.TemporaryDirectory(prefix="diffkit-suite-ray-") as out:
            runner = Runner(out, diff_args, [slot], deadline)
            with cf.ThreadPoolExecutor(max_workers=1) as pool:
                future = pool.submit(runner.run, entry)
                try:
                    while not future.done():  # in short waits: a cancel is raised between them
                        time.sleep(0.2)
                    done = future.result()
                except KeyboardInterrupt:  # cancelled: stop the child (its own process group) before going
                    runner.stop_all()
                    raise
            return PairAnswer(done, node, _pair_files(runner.pair_dir(entry)))
    finally:
        ray.get(tracker.ended.remote(entry.name))  # an interrupted suite waits for this before it leaves


class _Tracker:
    """Where each pair's task last started (a Ray actor): names the node of a pair whose worker died."""

    def __init__(self):
        self.nodes: dict[str, str] = {}
        self.running: set[str] = set()

    def started(self, name: str, node: str) -> None:
        self.nodes[name] = node
        self.running.add(name)

    def ended(self, name: str) -> None:
        self.running.discard(name)

    def busy(self) -> int:
        return len(self.running)

    def node(self, name: str) -> str | None:
        return self.nodes.get(name)


def write_pair(out_dir: str, answer: PairAnswer) -> None:
    """The pair folder sent back, written under out_dir/<name>/ (its resume marker last, so a pair half
    written never looks answered)."""
    d = os.path.join(out_dir, answer.entry.name)
    os.makedirs(d, exist_ok=True)
    for stale in (MARKER, "result.json"):
        try:
            os.remove(os.path.join(d, stale))
        except FileNotFoundError:
            pass
    for rel, data in sorted(answer.files.items(), key=lambda kv: kv[0] == MARKER):
        path = os.path.abspath(os.path.join(d, rel))
        if os.path.commonpath([path, os.path.abspath(d)]) != os.path.abspath(d):
            continue  # never outside the pair's folder
        write_bytes(path, data)  # a fresh file renamed into place (never through a link planted there)


def wants_gpu(entry: SuiteEntry, diff_args: list[str], cluster_gpus: float) -> bool:
    """Whether the pair's task asks for a GPU: only where the cluster has one; then for every pair unless
    the suite runs on --device cpu, and always for a pair whose files need CUDA."""
    if cluster_gpus < 1:
        return False
    on_cpu = any(a == "--device" and b == "cpu" for a, b in zip(diff_args, diff_args[1:]))
    return not on_cpu or any(needs_cuda(p) for p in (entry.ref, entry.cand))


def _lost(entry: SuiteEntry, exc: Exception, node: str | None) -> SuiteEntry:
    """A pair whose task failed: its worker died twice (retried once), or the task itself raised."""
    import ray

    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    where = node or "an unknown node"
    if isinstance(exc, ray.exceptions.RayTaskError):
        why = f"the suite could not run this pair on {where}: {first}"
    else:
        why = (f"the Ray worker running this pair died (last on {where}; run {RETRIES + 1} times): "
               f"{type(exc).__name__}: {first}")
    return replace(entry, verdict="error", error=why, headline=f"diffkit: ERROR: {why}")


def run_suite_ray(entries: list[SuiteEntry], out_dir: str, diff_args: list[str], *, address: str,
                  timeout: float | None = None, resume: bool = False,
                  interactive: bool = False) -> tuple[list[SuiteEntry], int | None]:
    """`suite.run_suite` on a Ray cluster: the same entries, summaries and interruption, each pair a task."""
    ray = import_ray()
    try:
        started = connect(ray, address)
    except (ConnectionError, RuntimeError, ValueError) as e:
        click.echo(f"diffkit suite: --ray {address}: cannot reach the Ray cluster: {type(e).__name__}: {e}", err=True)
        sys.exit(2)
    try:
        gpus = float(ray.cluster_resources().get("GPU", 0))
        click.echo(f"diffkit suite: {len(entries)} pairs on Ray ({_cluster_text(ray)}) -> {out_dir}")
        return _run(ray, list(entries), out_dir, diff_args, gpus, pair_deadline(timeout), resume, interactive)
    finally:
        if started:
            ray.shutdown()


def _cluster_text(ray) -> str:
    res = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return f"{nodes} node(s), {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU"


def _run(ray, entries, out_dir, diff_args, gpus, deadline, resume, interactive):
    os.makedirs(out_dir, exist_ok=True)
    stop = threading.Event()
    stopped: list[int] = []
    task = ray.remote(run_pair)
    tracker = ray.remote(num_cpus=0)(_Tracker).remote()
    ray.get(tracker.busy.remote())  # up before the tasks take every worker slot
    with _Progress(len(entries), interactive) as progress:
        todo = plan(entries, out_dir, diff_args, resume, progress)
        write_summaries(entries, out_dir)
        try:
            with interruptible(stop) as stopped:
                refs = {}
                for i in todo:
                    gpu = wants_gpu(entries[i], diff_args, gpus)
                    opts = {"num_cpus": 1, "num_gpus": 1 if gpu else 0, "max_retries": RETRIES,
                            "retry_exceptions": False, "name": f"diffkit-suite:{entries[i].name}"}
                    refs[task.options(**opts).remote(entries[i], diff_args, deadline, tracker)] = i
                pending = list(refs)
                while pending and not stop.is_set():
                    ready, pending = ray.wait(pending, num_returns=1, timeout=0.25)
                    for ref in ready:
                        i = refs[ref]
                        entries[i] = _collect(ray, ref, entries[i], out_dir, tracker)
                        if entries[i].finished:
                            progress.advance(entries[i])
                            write_summaries(entries, out_dir)
                    progress.running(entries[refs[r]].name for r in pending)
                if stop.is_set() and pending:
                    _cancel(ray, pending, tracker)
        finally:
            write_summaries(entries, out_dir, note=interrupted_note(entries, stopped))
    return entries, (stopped[0] if stopped else None)


def _collect(ray, ref, entry: SuiteEntry, out_dir: str, tracker) -> SuiteEntry:
    try:
        answer = ray.get(ref)
    except ray.exceptions.TaskCancelledError:
        return entry
    except ray.exceptions.RayError as exc:
        try:
            node = ray.get(tracker.node.remote(entry.name), timeout=10)
        except Exception:
            node = None
        return _lost(entry, exc, node)
    write_pair(out_dir, answer)
    return answer.entry


def _cancel(ray, pending, tracker) -> None:
    """Interrupted: cancel the tasks (a running one stops its child) and wait until none is running (at most
    CANCEL_WAIT_S): a cancelled task's answer is ready at once, before its child is stopped."""
    for ref in pending:
        ray.cancel(ref)
    end = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < end and ray.get(tracker.busy.remote(), timeout=CANCEL_WAIT_S):
        time.sleep(0.2)


BACKENDS["ray"] = run_suite_ray
