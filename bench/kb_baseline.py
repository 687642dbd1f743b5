"""What the user's evaluator costs: a KernelBench-style correctness check in this fresh process, with no diffkit.

    python bench/kb_baseline.py REF CAND [--device cuda] [--trials 5] [--json]

As KernelBench's evaluation script does it: both files executed as source (the candidate's extension build, warm
in ninja's cache after a first run, included), the seed 42 set before get_init_inputs(), again before Model(*init)
and before ModelNew(*init), both models moved to the device; then per trial a seed drawn from a generator seeded
42, inputs from get_inputs() under that seed, one forward of each model under no_grad, torch.allclose with
KernelBench's tolerance (1e-4 for float32, 1e-2 for half types).  Prints each phase's seconds since the
interpreter started (`since_start`: the process's own start time, from /proc) and the peak device memory
torch allocated; --json prints one JSON line instead (bench/gpu_wall.py reads it)."""
import argparse
import json
import os
import sys
import time


def process_age() -> float:
    """Seconds since this process started (its interpreter start and imports included)."""
    with open("/proc/self/stat") as fh:
        start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref")
    ap.add_argument("cand")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    phases = {"interpreter": process_age()}
    import torch
    phases["import_torch"] = process_age()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.init()
        torch.zeros(1, device=dev)
    phases["device_ready"] = process_age()

    def run_source(path: str) -> dict:
        ns = {"__name__": os.path.splitext(os.path.basename(path))[0], "__file__": os.path.abspath(path)}
        with open(path) as fh:
            exec(compile(fh.read(), path, "exec"), ns)
        return ns

    ref_ns, cand_ns = run_source(args.ref), run_source(args.cand)
    phases["load_and_build"] = process_age()
    torch.manual_seed(42)
    init = ref_ns["get_init_inputs"]()
    torch.manual_seed(42)
    ref = ref_ns["Model"](*init).to(dev)
    torch.manual_seed(42)
    cand = cand_ns["ModelNew"](*init).to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    phases["construct"] = process_age()
    gen = torch.Generator().manual_seed(42)
    seeds = [int(torch.randint(0, 2 ** 32 - 1, (1,), generator=gen).item()) for _ in range(args.trials)]
    passed = 0
    worst = 0.0
    with torch.no_grad():
        for seed in seeds:
            torch.manual_seed(seed)
            inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in ref_ns["get_inputs"]()]
            want = ref(*inputs)
            got = cand(*inputs)
            tol = 1e-4 if want.dtype == torch.float32 else 1e-2
            if got.shape == want.shape:
                ok = torch.allclose(got, want, atol=tol, rtol=tol)
                worst = max(worst, float((got.float() - want.float()).abs().max()))
            else:
                ok = False
            passed += bool(ok)
            del want, got, inputs
    if dev.type == "cuda":
        torch.cuda.synchronize()
    phases["trials"] = process_age()
    out = {"phases": phases, "seconds": phases["trials"], "passed": passed, "trials": args.trials,
           "max_difference": worst,
           "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
           "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in phases.items():
            print(f"{k:>15}: {v:7.2f} s since the process started")
        print(f"{passed}/{args.trials} trials pass, max difference {worst:.3g}; peak device memory "
              f"{(out['peak_device_bytes'] or 0) / 1e9:.2f} GB")
    return 0 if passed == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
