"""What the report adds to the demo's diff (issue 46): the diff without a report, then `write_report` alone.

    python bench/report_time.py [--repeat 5] [--ref references/axial_attention.py]
                                [--cand kernels/axial_attention_missing_bias.py]

One process: `diffkit.diff_files` once (its time printed for scale), then the whole report (index.html,
stages.csv, result.json, summary.md, junit.xml) written `--repeat` times into a fresh temporary folder;
the median write is "what the report adds".  The first write pays the imports the report needs (Jinja2,
Pillow, the templates), as the CLI's single write does, so it is printed apart.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import diffkit  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default=os.path.join(ROOT, "references", "axial_attention.py"))
    ap.add_argument("--cand", default=os.path.join(ROOT, "kernels", "axial_attention_missing_bias.py"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = diffkit.diff_files(args.ref, args.cand)
    t1 = time.perf_counter()
    print(f"diff without report: {t1 - t0:.2f} s (verdict {result.verdict}, {len(result.stages)} stages)")
    from diffkit.report import write_report

    times, size = [], 0
    with tempfile.TemporaryDirectory() as d:
        for i in range(max(1, args.repeat)):
            out = os.path.join(d, f"r{i}")
            t = time.perf_counter()
            paths = write_report(result, out)
            times.append(time.perf_counter() - t)
            size = os.path.getsize(paths["html"])
    print("report writes: " + ", ".join(f"{t:.3f}" for t in times) + " s (the first pays the report's imports)")
    print(f"matplotlib imported: {'matplotlib' in sys.modules}")
    print(f"report adds {statistics.median(times):.3f} s (median of {len(times)}; first write {times[0]:.3f} s); "
          f"index.html {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
