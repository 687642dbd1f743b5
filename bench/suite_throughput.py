"""Pairs per minute of `diffkit suite` over a suite of small problems: the local suite (a pool of child
processes) against `--ray` on the same machine, and Ray's overhead per pair.

    python bench/suite_throughput.py [--pairs 24] [--workers N] [--device cpu|cuda] [--isolate]

Writes PAIRS small problems (a few reference models; candidates in several styles, a third of them wrong)
to a temporary folder, then runs, each as its own `python -m diffkit.cli suite` process with `--trials 1`:
  1. the local suite with --workers N (on CUDA: one worker per visible GPU unless --workers);
  2. the same suite with --ray ADDRESS, on a Ray cluster started beforehand on this machine (N CPUs, or its
     GPUs with --device cuda), so that the cluster's start (timed apart) is not counted per pair.
With --device cuda every pair is a CUDA pair (its candidate allocates on device "cuda" and the diff runs with
--device cuda): each Ray task takes one GPU.

Figures: wall seconds and pairs per minute of each; the slot time per pair spent outside the pair's diff child
((workers x wall - sum of the pairs' own seconds) / pairs), whose difference between Ray and local is Ray's
overhead per pair; the verdicts of both must agree.  The last line is the same as one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REFS = {
    "softmax": ("torch.softmax(x, dim=1)", "[torch.randn(8, 32)]", "[]"),
    "mlp": ("torch.relu(self.lin(x))", "[torch.randn(8, 16)]", "[16, 24]"),
    "norm": ("torch.nn.functional.layer_norm(x, x.shape[-1:])", "[torch.randn(6, 20)]", "[]"),
}
REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, *dims):
        super().__init__()
        self.lin = nn.Linear(*dims) if dims else None

    def forward(self, x):
        return {body}


def get_inputs():
    return {inputs}


def get_init_inputs():
    return {init}
'''
# candidates, per reference: (style name, forward body); {alloc} places a scratch tensor (CUDA pairs: on "cuda")
CANDS = {
    "softmax": [("numpy", "np.exp(a - a.max(1, keepdims=True)) / np.exp(a - a.max(1, keepdims=True)).sum(1, "
                          "keepdims=True)"),
                ("loop", None), ("scaled", "1.1 * torch.softmax(x, dim=1).numpy()")],
    "mlp": [("torch", "np.maximum(a @ w.T + b, 0)"),
            ("no_bias", "np.maximum(a @ w.T, 0)")],
    "norm": [("numpy", "(a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5)"),
             ("no_eps", "(a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True, ddof=1))")],
}
CAND = '''import numpy as np
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, *dims):
        super().__init__()
        self.lin = nn.Linear(*dims) if dims else None

    def forward(self, inp):
        scratch = torch.zeros(1{alloc})
        x = inp.detach().cpu()
        a = x.numpy()
        if self.lin is not None:
            w, b = (p.detach().cpu().numpy() for p in (self.lin.weight, self.lin.bias))
        out = {body}
        return torch.as_tensor(np.asarray(out), dtype=inp.dtype).to(inp.device) + scratch.to(inp.device)
'''
LOOP = '''        rows = []
        for r in range(a.shape[0]):
            e = np.exp(a[r] - a[r].max())
            rows.append(e / e.sum())
        out = np.stack(rows)'''


def write_problems(root: str, n: int, cuda: bool) -> list[str]:
    styles = [(ref, style, body) for ref, items in CANDS.items() for style, body in items]
    names = []
    for i in range(n):
        ref, style, body = styles[i % len(styles)]
        d = os.path.join(root, f"p{i:03d}_{ref}_{style}")
        os.makedirs(d)
        r_body, inputs, init = REFS[ref]
        with open(os.path.join(d, "ref.py"), "w") as fh:
            fh.write(REF.format(body=r_body, inputs=inputs, init=init))
        cand = CAND.format(alloc=', device="cuda"' if cuda else "", body=body or "None")
        if body is None:
            cand = cand.replace("        out = None", LOOP)
        with open(os.path.join(d, "cand.py"), "w") as fh:
            fh.write(cand)
        names.append(os.path.basename(d))
    return names


def run_suite(src: str, out: str, extra: list[str]) -> tuple[float, list[dict], int]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "diffkit.cli", "suite", src, "--report-dir", out, "--trials", "1",
                           *extra], cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        rows = json.load(fh)
    if proc.returncode not in (0, 1):
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    return wall, rows, proc.returncode


def figures(label: str, wall: float, rows: list[dict], workers: int) -> dict:
    busy = sum(r["seconds"] or 0 for r in rows)
    return {f"{label}_wall_s": round(wall, 2), f"{label}_pairs_per_min": round(60 * len(rows) / wall, 1),
            f"{label}_outside_child_s_per_pair": round((workers * wall - busy) / len(rows), 3),
            f"{label}_child_s_per_pair": round(busy / len(rows), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--workers", type=int, default=None, help="default: the GPUs with --device cuda, else the CPUs")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--isolate", action="store_true", help="run each side in its own process (default --no-isolate)")
    args = ap.parse_args()
    import torch
    from ray.cluster_utils import Cluster

    cuda = args.device == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    if cuda and not gpus:
        sys.exit("--device cuda: no GPU visible")
    workers = args.workers or (gpus if cuda else (os.cpu_count() or 1))
    extra = ["--device", args.device] + ([] if args.isolate else ["--no-isolate"])
    with tempfile.TemporaryDirectory(prefix="diffkit-suite-bench-") as tmp:
        src = os.path.join(tmp, "problems")
        write_problems(src, args.pairs, cuda)
        local_wall, local_rows, local_code = run_suite(src, os.path.join(tmp, "local"), [*extra, "--workers",
                                                                                          str(workers)])
        t0 = time.monotonic()
        head = {"num_cpus": workers, "num_gpus": gpus} if cuda else {"num_cpus": workers, "num_gpus": 0}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        cluster.wait_for_nodes()
        start_s = time.monotonic() - t0
        try:
            ray_wall, ray_rows, ray_code = run_suite(src, os.path.join(tmp, "ray"), [*extra, "--ray",
                                                                                      cluster.address])
        finally:
            cluster.shutdown()
    verdicts = {r["name"]: r["verdict"] for r in local_rows}
    same = verdicts == {r["name"]: r["verdict"] for r in ray_rows} and local_code == ray_code
    out = {"pairs": args.pairs, "workers": workers, "device": args.device, "gpus": gpus,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPU" + (f", {gpus}x {torch.cuda.get_device_name(0)}"
                                                                        if cuda else ""),
           "verdicts": {v: sum(1 for x in verdicts.values() if x == v) for v in sorted(set(verdicts.values()))},
           "same_verdicts": same, **figures("local", local_wall, local_rows, workers),
           **figures("ray", ray_wall, ray_rows, workers), "ray_cluster_start_s": round(start_s, 2)}
    out["ray_overhead_s_per_pair"] = round(out["ray_outside_child_s_per_pair"]
                                           - out["local_outside_child_s_per_pair"], 3)
    print(f"{args.pairs} pairs ({', '.join(f'{n} {v}' for v, n in out['verdicts'].items())}), {workers} worker(s), "
          f"{args.device}, {out['machine']}")
    print(f"local: {local_wall:.1f} s, {out['local_pairs_per_min']} pairs/min")
    print(f"ray:   {ray_wall:.1f} s, {out['ray_pairs_per_min']} pairs/min (cluster start {start_s:.1f} s apart)")
    print(f"ray overhead per pair: {out['ray_overhead_s_per_pair']:+.3f} s of a worker slot; verdicts "
          f"{'agree' if same else 'DIFFER'}")
    print(json.dumps(out))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
