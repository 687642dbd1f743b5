"""Everything GPU-side in one call (device time is scarce): environment, every CUDA candidate
through the diff, the GPU tests, and the wall time of a GPU diff against two plain forwards.

    python bench/gpu_run.py [--skip-tests]
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    import torch

    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {torch.cuda.get_device_name(0)}")
    for mod in ("pandas", "matplotlib", "click", "safetensors", "pytest", "triton"):
        try:
            __import__(mod)
            print(f"  {mod}: yes")
        except Exception as e:
            print(f"  {mod}: NO ({e.__class__.__name__})")
    import diffkit
    from conftest import candidates

    t0 = time.perf_counter()
    diffkit.load.exec_file(os.path.join(ROOT, "kernels", "axial_attention_cuda.py"), "candidate")
    print(f"CUDA extension built/loaded in {time.perf_counter() - t0:.1f} s")
    # the realistic size: B=4, 64x64 grid, dim 256
    ref_path = os.path.join(ROOT, "references", "axial_attention_large.py")
    cand_path = os.path.join(ROOT, "kernels", "axial_attention_cuda.py")
    pair = diffkit.load_pair(ref_path, cand_path, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            pair.ref(*pair.ref_inputs), pair.cand(*pair.cand_inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            pair.ref(*pair.ref_inputs)
            pair.cand(*pair.cand_inputs)
        torch.cuda.synchronize()
        plain = (time.perf_counter() - t0) / 5
    diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs)  # warm
    torch.cuda.synchronize()
    for label, kw in (("full (health + rerun)", {}), ("no health/rerun", {"health": False, "rerun": False})):
        t0 = time.perf_counter()
        r = diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        print(f"\nlarge axial (4×64×64×256) {label}: diff {t * 1e3:.1f} ms vs two plain forwards {plain * 1e3:.1f} ms "
              f"= {t / plain:.1f}×; {len(r.stages)} stages, verdict {r.verdict}, "
              f"peak GPU memory {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB")
    # each candidate through the CLI, in its isolated child: a kernel that kills the CUDA context
    # (an illegal address) must not take the other results with it
    for name, ref, cand, exp in candidates("cuda"):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", ref, cand, "--device", "cuda",
                              "--no-report", "--timeout", "300"], capture_output=True, text=True, cwd=ROOT)
        lines = out.stdout.strip().splitlines()
        print(f"\n== {name}: exit {out.returncode} ({time.perf_counter() - t0:.1f} s); expected {exp}")
        for ln in lines:
            if ln.lstrip().startswith(("diagnosis", "error:", "at ", "root cause", "re-run", "first divergence")) \
                    or ln.startswith("diffkit:"):
                print("  " + ln.strip())
        if out.returncode not in (0, 1, 2):
            print(out.stderr[-1500:])
    if not args.skip_tests:
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-m", "cuda", os.path.join(ROOT, "tests", "test_gpu.py")],
                       cwd=ROOT)


if __name__ == "__main__":
    main()
