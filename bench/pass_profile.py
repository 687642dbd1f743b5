"""One step of an in-process `diffkit.compare` under cProfile, on its own (bench only): where that step's host
time goes, torch's calls included (on a GPU a step's host time is what the device cannot hide once the forwards
are done).

    python bench/pass_profile.py --model gpu_mid --step pass_dataflow      # an alignment pass, by name
    python bench/pass_profile.py --model tiny12 --device cpu --step explain
    python bench/pass_profile.py --model tiny12 --device cpu --value-first-bytes 0   # the dataflow pass as it runs
                                       # on a model of large activations (gpu_mid's 16 MB), at toy size on a CPU
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speed import load_model  # noqa: E402
from sync_sites import step_names, steps_wrapped  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpu_mid")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--step", default="pass_dataflow",
                    help="capture (one side's run), an alignment pass's name (align.PASSES), or explain")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--sort", default="tottime,cumulative")
    ap.add_argument("--value-first-bytes", type=int, default=None,
                    help="align_dataflow.DATAFLOW_VALUE_FIRST_BYTES for this run (0: every record is 'large')")
    ap.add_argument("--no-profile", action="store_true", help="the step's wall time only (mean over --repeat)")
    a = ap.parse_args()
    import torch
    from diffkit import align_dataflow

    if a.step not in step_names():
        sys.exit(f"--step: one of {', '.join(step_names())}")
    if a.value_first_bytes is not None:
        align_dataflow.DATAFLOW_VALUE_FIRST_BYTES = a.value_first_bytes

    diffkit, ref, cand, ri, ci = load_model(a.model, a.device)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    prof = cProfile.Profile()
    walls = []

    def profiled(fn):
        def run(*args, **kwargs):
            sync()
            t = time.perf_counter()
            if not a.no_profile:
                prof.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                prof.disable()
                sync()
                walls.append(time.perf_counter() - t)
        return run

    def diff():
        diffkit.compare(ref, cand, ri, cand_inputs=ci, health=False, rerun=False)

    for _ in range(2):
        diff()
    with steps_wrapped(lambda fn, name: profiled(fn) if name == a.step else fn):
        for _ in range(a.repeat):
            diff()
    calls = len(walls) / a.repeat
    each = f", {calls:g} calls each" if calls != 1 else ""
    print(f"{a.step}: {sum(walls) / a.repeat * 1e3:.2f} ms a diff{'' if a.no_profile else ' under cProfile'} "
          f"(mean over {a.repeat} diffs{each}), {a.model} on {a.device}")
    if a.no_profile:
        return
    stats = pstats.Stats(prof)
    for key in a.sort.split(","):
        print(f"-- by {key} (totals over {a.repeat} diffs)")
        stats.sort_stats(key).print_stats(a.lines)


if __name__ == "__main__":
    main()
