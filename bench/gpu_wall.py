"""Issue 46's GPU targets: `diffkit diff` against a KernelBench-style baseline, as a user runs both.

    python bench/gpu_wall.py [--models mid,l2_19] [--repeat 2] [--modes diff,diff_per_side] [--json FILE]
    python bench/gpu_wall.py --models l2_19 --side-by-side 3      # three diffs at once on the one card
    python bench/gpu_wall.py --models l2_19 --device-memory 24G   # the diff capped to 24 GB, against uncapped

Every run is a fresh process (interpreter start, torch's import and CUDA's start included, as KernelBench's own
evaluation pays them); the candidate's extension is built once beforehand, so builds are warm in both.  Wall time
is measured from here; peak device memory is what `nvidia-smi` reports in use on the card (sampled every 20 ms)
above what it reported before the run, for both, so CUDA contexts count alike.  The baseline is
bench/kb_baseline.py (load, seed, construct, five trials of two forwards + torch.allclose).
Modes (`--modes`): `diff` (the default five trials: on a GPU one child for both sides, forked from the parent,
streaming with the captured values on the device held to what the models themselves take), `diff_trials1`
(--trials 1), `diff_fresh` (the default, its child a fresh interpreter: DIFFKIT_FORK_GPU=0), `diff_per_side`
(DIFFKIT_GPU_PER_SIDE=1: a child per side, every captured value on the device, the reference's handed over: the
default before issue 46's memory work).
Targets (issue 46): the default `diffkit diff` ≤ 2× the baseline's wall time and ≤ 2× its peak device memory;
side by side and capped, every diff completes with the same answer as alone and uncapped."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "mid": dict(ref="references/deep_transformer.py", cand="kernels/deep_transformer_fused.py",
                env=dict(DIFFKIT_DEPTH="12", DIFFKIT_BATCH="4", DIFFKIT_SEQ="1024", DIFFKIT_DIM="1024",
                         DIFFKIT_HEADS="16")),
    "l2_19": dict(ref="bench/models/convtranspose2d_gelu_groupnorm_large.py",
                  cand="bench/models/convtranspose2d_gelu_groupnorm_large_cuda.py", env={}),
}


class DevicePeak:
    """The card's memory in use, sampled by nvidia-smi: the most seen above the level before start()."""

    def __init__(self):
        self.base = self._used()
        self.peak = self.base
        self.proc = None

    @staticmethod
    def _used() -> int:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True).stdout
        return int(out.split()[0]) << 20

    def __enter__(self):
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0", "-lms", "20"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.peak = max(self.peak, int(line.split()[0]) << 20)
            except (ValueError, IndexError):
                pass

    def __exit__(self, *exc):
        time.sleep(0.1)
        self.proc.terminate()
        self.proc.wait()
        self.thread.join(timeout=2)

    @property
    def above(self) -> int:
        return self.peak - self.base


def _env(model: str, extra: dict | None = None) -> dict:
    return {**os.environ, **MODELS[model]["env"], **(extra or {})}


def run(cmd: list[str], model: str, extra_env: dict | None = None, timeout: float = 560) -> dict:
    with DevicePeak() as peak:
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=_env(model, extra_env), capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
    return {"wall": wall, "peak": peak.above, "rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}


def baseline(model: str) -> dict:
    m = MODELS[model]
    r = run([sys.executable, "bench/kb_baseline.py", m["ref"], m["cand"], "--device", "cuda", "--json"], model)
    try:
        r["own"] = json.loads(r["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        r["own"] = {}
    return r


def diffkit(model: str, *args: str, json_path: str | None = None, env: dict | None = None) -> dict:
    m = MODELS[model]
    cmd = [sys.executable, "cli.py", "diff", m["ref"], m["cand"], "--device", "cuda", "--no-report", *args]
    if json_path:
        cmd += ["--json", json_path]
    return run(cmd, model, env)


def answer(path: str) -> dict:
    with open(path) as fh:
        d = json.load(fh)
    fd = d.get("first_divergence") or {}
    out = d.get("output") or {}
    got = {"verdict": d.get("verdict"), "first_divergence": fd.get("ref_name"), "output_max_abs": out.get("max_abs"),
           "mode": (d.get("meta") or {}).get("memory")}
    if d.get("verdict") == "error":
        err = d.get("error") or {}
        got["error"] = f"{err.get('side')}/{err.get('phase')}: {err.get('message')}"[:700]
    return got


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def compare_with_baseline(model: str, repeat: int, modes=("diff", "diff_trials1", "diff_fresh", "diff_per_side")
                          ) -> dict:
    _warm(model)
    runs = {"diff": lambda: diffkit(model), "diff_trials1": lambda: diffkit(model, "--trials", "1"),
            # the child a fresh interpreter (torch imported again in it), not forked from the parent
            "diff_fresh": lambda: diffkit(model, env={"DIFFKIT_FORK_GPU": "0"}),
            "diff_per_side": lambda: diffkit(model, env={"DIFFKIT_GPU_PER_SIDE": "1"})}
    modes = [m for m in modes if m in runs]
    rows = {"baseline": [], **{m: [] for m in modes}}
    for _ in range(repeat):  # in turns, so a drift of the box hits both alike
        rows["baseline"].append(baseline(model))
        for m in modes:
            rows[m].append(runs[m]())
    out = {}
    for name, rs in rows.items():
        out[name] = {"wall": statistics.median(r["wall"] for r in rs), "peak": max(r["peak"] for r in rs),
                     "rc": [r["rc"] for r in rs], "walls": [r["wall"] for r in rs]}
        tail = rs[-1]["stdout"].strip().splitlines()[-1:] or rs[-1]["stderr"].strip().splitlines()[-1:]
        print(f"[{model}] {name:>13}: {out[name]['wall']:6.2f} s (runs {', '.join(f'{w:.2f}' for w in out[name]['walls'])}), "
              f"device peak {gb(out[name]['peak'])} above idle, rc {out[name]['rc']}  {tail[0][:160] if tail else ''}",
              flush=True)
    own = rows["baseline"][-1].get("own") or {}
    if own:
        print(f"[{model}] baseline's own phases (s since start): "
              + ", ".join(f"{k} {v:.2f}" for k, v in own.get("phases", {}).items())
              + f"; torch's peak {gb(own.get('peak_device_bytes') or 0)}", flush=True)
    b = out["baseline"]
    for name in modes:
        print(f"[{model}] {name}: wall {out[name]['wall'] / b['wall']:.2f}x the baseline (target <= 2x), "
              f"device peak {out[name]['peak'] / max(b['peak'], 1):.2f}x (target <= 2x)", flush=True)
    return out


def _warm(model: str) -> None:
    """The candidate's extension built into ninja's cache before any diff is timed (a fresh machine builds it once)."""
    w = baseline(model)
    print(f"[{model}] warm-up baseline (builds the candidate's extension): rc {w['rc']}, {w['wall']:.2f} s "
          f"{w['stderr'].strip().splitlines()[-1:] if w['rc'] not in (0, 1) else ''}", flush=True)


def side_by_side(model: str, n: int, extra: list[str]) -> dict:
    _warm(model)
    tmp = tempfile.mkdtemp(prefix="gpu_wall_")
    alone = os.path.join(tmp, "alone.json")
    r = diffkit(model, *extra, json_path=alone)
    print(f"[{model}] alone: rc {r['rc']}, {r['wall']:.1f} s, device peak {gb(r['peak'])}; {answer(alone) if os.path.exists(alone) else r['stderr'][-300:]}",
          flush=True)
    m = MODELS[model]
    procs = []
    with DevicePeak() as peak:
        t0 = time.perf_counter()
        for i in range(n):
            path = os.path.join(tmp, f"side_{i}.json")
            cmd = [sys.executable, "cli.py", "diff", m["ref"], m["cand"], "--device", "cuda", "--no-report",
                   "--json", path, *extra]
            procs.append((path, subprocess.Popen(cmd, cwd=ROOT, env=_env(model), stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True)))
        results = []
        for path, p in procs:
            so, se = p.communicate(timeout=560)
            results.append((path, p.returncode, so, se))
        wall = time.perf_counter() - t0
    same = 0
    for path, rc, so, se in results:
        got = answer(path) if os.path.exists(path) else None
        ok = got is not None and os.path.exists(alone) and {k: v for k, v in got.items() if k != "mode"} == \
            {k: v for k, v in answer(alone).items() if k != "mode"}
        same += ok
        print(f"[{model}] side by side: rc {rc}, {got if got else (so + se)[-400:]}, same answer as alone: {ok}", flush=True)
    print(f"[{model}] {n} side by side: {wall:.1f} s, card peak {gb(peak.above)} above idle, {same}/{n} the same answer "
          f"as alone", flush=True)
    return {"n": n, "wall": wall, "peak": peak.above, "same": same}


def capped(model: str, size: str) -> dict:
    _warm(model)
    tmp = tempfile.mkdtemp(prefix="gpu_cap_")
    free, capped_path = os.path.join(tmp, "free.json"), os.path.join(tmp, "capped.json")
    a = diffkit(model, json_path=free)
    b = diffkit(model, "--device-memory", size, json_path=capped_path)
    ga = answer(free) if os.path.exists(free) else None
    gb_ = answer(capped_path) if os.path.exists(capped_path) else None
    for name, r, g in (("uncapped", a, ga), (f"capped {size}", b, gb_)):
        print(f"[{model}] {name}: rc {r['rc']}, {r['wall']:.1f} s, device peak {gb(r['peak'])}; "
              f"{g if g else (r['stdout'] + r['stderr'])[-400:]}", flush=True)
    same = ga is not None and gb_ is not None and {k: v for k, v in ga.items() if k != "mode"} == \
        {k: v for k, v in gb_.items() if k != "mode"}
    print(f"[{model}] capped to {size}: the same answer as uncapped: {same}", flush=True)
    return {"uncapped": a["wall"], "capped": b["wall"], "peak_capped": b["peak"], "same": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mid,l2_19")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--side-by-side", type=int, default=0, metavar="N")
    ap.add_argument("--device-memory", default=None, metavar="SIZE")
    ap.add_argument("--modes", default="diff,diff_trials1,diff_fresh,diff_per_side",
                    help="which diffs to time against the baseline (see the docstring)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {}
    for model in args.models.split(","):
        if args.side_by_side:
            out[model] = side_by_side(model, args.side_by_side, [])
        elif args.device_memory:
            out[model] = capped(model, args.device_memory)
        else:
            out[model] = compare_with_baseline(model, args.repeat, args.modes.split(","))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
