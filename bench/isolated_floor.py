"""The least an isolated, fully captured diff can cost on this machine (bench only): a child forked from a warm
parent, as `diffkit diff` forks its child, that does only what such a diff cannot leave out, and nothing of
diffkit's own: build both models by KernelBench's seeded protocol (`diffkit.load_pair`), then run each forward
once keeping every torch function's tensor output (a bare `TorchFunctionMode` appending to a list: no names, no
dataflow, no metrics, no second run). Printed as a multiple of two plain forwards, beside the isolated diff
itself, each run forked the same way from the same parent.

    python bench/isolated_floor.py --model stack12 --repeat 5

Where the floor is above a target, the target cannot be met by a diff that keeps every value (the first touch
of the kept memory and the seeded construction are paid by the floor too); `kept` says how much it held.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speed import MODELS, ROOT, _forked, _plain_in_a_child  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stack12")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    for k, v in MODELS[a.model]["env"].items():
        os.environ[k] = str(v)
    import torch
    from torch.overrides import TorchFunctionMode

    import diffkit
    from diffkit.cli import main as cli_main

    spec = MODELS[a.model]
    ref_path, cand_path = os.path.join(ROOT, spec["ref"]), os.path.join(ROOT, spec["cand"])

    class Keep(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.kept = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.kept.append(out)
            elif isinstance(out, (tuple, list)):
                self.kept.extend(t for t in out if isinstance(t, torch.Tensor))
            return out

    def floor():
        def run():
            t0 = time.perf_counter()
            pair = diffkit.load_pair(ref_path, cand_path, device="cpu")
            t1 = time.perf_counter()
            kept = 0
            with torch.no_grad():
                for model, inputs in ((pair.ref, pair.ref_inputs), (pair.cand, pair.cand_inputs)):
                    with Keep() as mode:
                        model(*inputs)
                    # each piece of memory once (views and in-place results share their base's)
                    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in mode.kept
                            if t.layout == torch.strided and t.device.type != "meta"}
                    kept += sum(held.values())
            return f"{t1 - t0:.3f} {time.perf_counter() - t1:.3f} {kept}"
        return run

    argv = ["diff", ref_path, cand_path, "--trials", "1", "--no-report", "--device", "cpu"]  # (the floor's device)

    def diff():
        try:
            cli_main.main(args=argv, standalone_mode=False)
        except SystemExit:
            pass

    rows = {"plain": [], "floor": [], "diff": []}
    parts = []
    for _ in range(a.repeat):
        rows["plain"].append(_plain_in_a_child(ref_path, cand_path))
        secs, text = _forked(floor())
        rows["floor"].append(secs)
        parts.append([float(x) for x in text.split()])
        t0 = time.perf_counter()
        diff()  # (the CLI forks its own child, as a user's run does)
        rows["diff"].append(time.perf_counter() - t0)
    plain = statistics.median(rows["plain"])
    build = statistics.median(p[0] for p in parts)
    fwd = statistics.median(p[1] for p in parts)
    print(f"{a.model}: two plain forwards {plain:.3f} s (median of {a.repeat}, each in a forked child)")
    for name in ("floor", "diff"):
        s = statistics.median(rows[name])
        paired = statistics.median(x / p for x, p in zip(rows[name], rows["plain"]))
        print(f"  {name:<6s} {s:.3f} s = {s / plain:.2f}x ({paired:.2f}x paired)")
    print(f"  the floor's child: both models built {build:.3f} s, both forwards keeping every output {fwd:.3f} s "
          f"({parts[0][2] / 1e6:.0f} MB kept)")


if __name__ == "__main__":
    main()
