"""The axial-attention GPU figures and the extension build, for bench/gpu.sh (parts `tests`, `axial`, `sanitizer`).

    python bench/gpu_run.py build      # build both CUDA extensions at once (two processes)
    python bench/gpu_run.py timing     # GPU diff wall time vs two plain forwards (axial, B4 64x64 dim256)
    python bench/gpu_run.py sanitizer  # the raw compute-sanitizer logs of the two sanitizer cases
The CUDA tests: `bash bench/gpu.sh tests`. Scale figures: bench/scale.py --preset h200 --dtype float32|bfloat16.
"""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def env_report():
    import torch

    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {torch.cuda.get_device_name(0)}")
    for mod in ("pandas", "matplotlib", "click", "safetensors", "pytest", "triton"):
        try:
            m = __import__(mod)
            print(f"  {mod}: {getattr(m, '__version__', 'yes')}")
        except Exception as e:
            print(f"  {mod}: NO ({e.__class__.__name__})")


def build():
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT) for code in (
        "import runpy; runpy.run_path('kernels/axial_attention_cuda.py')",  # builds at import
        "import runpy; runpy.run_path('kernels/cuda_ops.py')['load']()")]
    codes = [p.wait() for p in procs]
    print(f"extensions built in {time.perf_counter() - t0:.1f} s, exit codes {codes}")


def timing():
    import torch

    import diffkit

    pair = diffkit.load_pair(os.path.join(ROOT, "references", "axial_attention_large.py"),
                             os.path.join(ROOT, "kernels", "axial_attention_cuda.py"), device="cuda")
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
    runs = (("in memory, health + rerun", {}), ("in memory, no health/rerun", {"health": False, "rerun": False}),
            ("streaming, default budget", {"health": False, "rerun": False, "streaming": True}),
            ("streaming, --max-memory 256M", {"health": False, "rerun": False, "max_memory": 256 << 20}))
    diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, health=False)  # warm
    for label, kw in runs:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        r = diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        print(f"axial 4x64x64x256, {label}: diff {t * 1e3:.1f} ms vs two plain forwards {plain * 1e3:.1f} ms "
              f"= {t / plain:.1f}x; {len(r.stages)} stages, verdict {r.verdict}, peak GPU memory above the models "
              f"{(torch.cuda.max_memory_allocated() - base) / 2 ** 30:.2f} GiB"
              + (f", reference tiers {r.meta.get('reference_tiers')}" if "reference_tiers" in r.meta else ""))
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, health=False, rerun=False)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


def sanitizer():
    for tool, ref, cand in (("memcheck", "axial_attention_large.py", "axial_attention_cuda_smem.py"),
                            ("racecheck", "triangle_multiplicative_update.py", "triangle_multiplicative_update_cuda_race.py")):
        log = f"/tmp/sanitizer-{tool}.log"
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", os.path.join(ROOT, "references", ref),
                              os.path.join(ROOT, "kernels", cand), "--device", "cuda", "--no-report", "--sanitize", tool,
                              "--timeout", "400"], capture_output=True, text=True, cwd=ROOT,
                             env=dict(os.environ, DIFFKIT_SANITIZER_COPY=log))
        print(f"\n== {tool} {cand}: exit {out.returncode} in {time.perf_counter() - t0:.0f} s")
        print("\n".join(ln for ln in out.stdout.splitlines() if "sanitizer" in ln or ln.startswith(("diffkit", "error", "  at", "warning")))[-3000:])
        if os.path.exists(log):
            print("-- raw log head --\n" + open(log).read()[:2500])


if __name__ == "__main__":
    env_report()
    for phase in sys.argv[1:] or ["build", "timing"]:
        print(f"\n######## {phase}")
        sys.stdout.flush()
        globals()[phase]()
        sys.stdout.flush()
