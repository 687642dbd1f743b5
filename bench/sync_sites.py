"""Where an in-process `diffkit.compare` on a GPU makes the host wait for the device (bench only).

Each synchronising call (a tensor's value read on the host: `.item()`, `.tolist()`, `float(t)`, `nonzero`, an
event waited on ...) ends the host's run-ahead: until the device has caught up, the host does nothing, and after it
the device waits for the host's next launch. torch's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`)
warns at each one; this counts them by the diffkit function that made them (the innermost frame in diffkit/) and
prints when, in the diff's wall time, the first ones came.

    python bench/sync_sites.py --model gpu_mid             # the 12-block transformer, B4 S1024 D1024
    python bench/sync_sites.py --model tiny12 --device cpu # (on a CPU: no synchronisations, a dry run)
"""
import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speed import load_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpu_mid")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--first", type=int, default=12, help="how many of the first synchronisations to list")
    a = ap.parse_args()
    import torch

    diffkit, ref, cand, ri, ci = load_model(a.model, a.device)
    cuda = a.device.startswith("cuda")

    def diff():
        diffkit.compare(ref, cand, ri, cand_inputs=ci, health=False, rerun=False)

    for _ in range(2):
        diff()
    if cuda:
        torch.cuda.synchronize()
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        diff()
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    print(f"compare {statistics.median(walls) * 1e3:.1f} ms (median of 3, no debug mode)")
    _phases(diffkit, diff, sync=torch.cuda.synchronize if cuda else (lambda: None))

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pkg = os.path.join(here, "diffkit") + os.sep
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # (any other warning goes where it went)
            old(message, category, filename, lineno, file, line)
            return
        stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(os.sep + "warnings.py")]
        mine = [f for f in stack if f.filename.startswith(pkg)]
        inner = mine[-1] if mine else None
        where = f"{os.path.relpath(inner.filename, here)}:{inner.lineno} {inner.name}" if inner else "(not diffkit)"
        if stack and stack[-1] is not inner:  # the call itself was made elsewhere: the model's code, torch's
            last = stack[-1]
            where += f" <- {os.path.basename(last.filename)}:{last.lineno} {last.name}"
        phase = next((f.name for f in mine if f.name in PHASES), mine[0].name if mine else "?")
        seen.append((time.perf_counter(), where, phase))

    old = warnings.showwarning
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # (puts `showwarning` back as it found it)
            warnings.simplefilter("always")
            warnings.showwarning = show
            t0 = time.perf_counter()
            diff()
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    print(f"under the debug mode: {wall * 1e3:.1f} ms, {len(seen)} synchronising calls")
    by_site = collections.Counter(w for _, w, _ in seen)
    by_phase = collections.Counter(p for _, _, p in seen)
    print("by phase:", ", ".join(f"{p} {n}" for p, n in by_phase.most_common()))
    for w, n in by_site.most_common(20):
        print(f"  {n:5d}  {w}")
    print(f"the first {min(a.first, len(seen))} (ms since the diff began):")
    for t, w, p in seen[:a.first]:
        print(f"  {1e3 * (t - t0):8.1f}  {p:<22s} {w}")


def step_names() -> list[str]:
    """The names `steps_wrapped` knows a diff's steps by: "capture" (one side's captured run), each alignment pass
    by its function's name, "explain" (everything after the alignment)."""
    from diffkit import align

    return ["capture", *(p.__name__ for p in align.PASSES), "explain"]


@contextlib.contextmanager
def steps_wrapped(wrap):
    """Each step of an in-process diff replaced by `wrap(fn, name)` (`step_names`; return `fn` to leave it as it is),
    put back on leaving."""
    from diffkit import align, pipeline, traces

    saved = (traces._run_side, pipeline.explain, list(align.PASSES))
    traces._run_side = wrap(saved[0], "capture")
    pipeline.explain = wrap(saved[1], "explain")
    align.PASSES[:] = [wrap(p, p.__name__) for p in saved[2]]
    try:
        yield
    finally:
        traces._run_side, pipeline.explain = saved[:2]
        align.PASSES[:] = saved[2]


def _phases(diffkit, diff, sync, repeat: int = 5) -> None:
    """The host's time in each step of the diff (its mean a diff over `repeat` diffs; a step's time includes its
    waits for the device), the device synchronised only before and after each diff."""
    acc = collections.defaultdict(list)
    labels = {"capture": "capture (both sides)", "explain": "explain (after the alignment)"}

    def timed(fn, name):
        label = labels.get(name, "align: " + name)

        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label].append(time.perf_counter() - t)
        return run

    walls = []
    with steps_wrapped(timed):
        for _ in range(repeat):
            sync()
            t = time.perf_counter()
            diff()
            sync()
            walls.append(time.perf_counter() - t)
    print(f"the diff's steps on the host (mean a diff over {repeat} diffs; the diffs' median "
          f"{statistics.median(walls) * 1e3:.1f} ms):")
    for name, ts in acc.items():
        calls = len(ts) / repeat
        print(f"  {sum(ts) / repeat * 1e3:8.2f} ms  {name}" + (f" ({calls:g} calls)" if calls != 1 else ""))


# the diff's steps, named by the function that runs each (the outermost one a synchronisation came from is its phase)
PHASES = ("_run_side", "pass_name", "pass_outputs", "pass_dataflow", "pass_proposed", "pass_order", "pass_value",
          "pass_read_inputs", "pass_reader_layout", "pass_deferred", "pass_consistency", "measure_stages",
          "locate_divergence", "compare_outputs", "find_cause", "diagnose_stages", "check_health", "check_second_run")


if __name__ == "__main__":
    main()
