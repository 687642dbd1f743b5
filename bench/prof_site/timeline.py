"""The main threads of every process sampled into one folder (`DIFFKIT_SAMPLE_DIR`, see sitecustomize.py), on one
clock: `python bench/prof_site/timeline.py DIR [MIN_S]` prints each span of MIN_S (default 0.1) seconds and more as
seconds from the first process's start, its process, its length and what it was."""
import glob
import os
import sys


def main(folder: str, least: float = 0.1) -> None:
    rows, starts = [], []
    for path in glob.glob(os.path.join(folder, "*.samples.txt")):
        pid = os.path.basename(path).split(".")[0]
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        starts.append(float(lines[1].split()[1]))
        for ln in lines:
            if ln.startswith("T "):
                _, at, took, what = ln.split(None, 3)
                if float(took) >= least:
                    rows.append((float(at), pid, float(took), what))
    if not rows:
        print(f"no timeline in {folder}")
        return
    t0 = min(starts)
    for at, pid, took, what in sorted(rows):
        print(f"{at - t0:7.2f} s  {pid:>7}  {took:6.2f} s  {what}")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.1)
