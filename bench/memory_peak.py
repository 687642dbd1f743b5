"""Where a diff's device memory peaks: `diffkit diff` run in this process under torch's allocator history, then
what was allocated at the peak, by the Python frame that allocated it.

    python bench/memory_peak.py REF CAND [DIFF OPTIONS ...]     # e.g. --stream --no-isolate --trials 1

Prints torch's peak allocated and reserved bytes, the moment of the peak (the events before it), and the blocks
alive at the peak grouped by their allocating frame (the innermost frame in diffkit/, the models' files or
bench/, else the innermost Python frame), largest first; and every out-of-memory with where it was asked for.  The
diff runs in this process (--no-isolate is added).  Recording the history slows the diff: the uncapped problem-19
diff (30 s alone on an H100) did not finish in 75 s; give it two minutes or more."""
import atexit
import collections
import os
import sys

import torch


def _where(frames: list[dict]) -> str:
    """The frame that says who allocated: the innermost in diffkit, a model file or bench; else the innermost."""
    keep = [f for f in frames if f.get("filename", "").endswith(".py")]
    for f in keep:
        name = f["filename"]
        if "/diffkit/" in name or "/bench/" in name or "/references/" in name or "/kernels/" in name:
            return f"{os.path.basename(name)}:{f['line']} {f['name']}"
    if not keep:
        return "(no Python frame)"
    return f"{os.path.basename(keep[0]['filename'])}:{keep[0]['line']} {keep[0]['name']}"


def _chain(frames: list[dict], depth: int = 4) -> str:
    ours = [f for f in frames if "/diffkit/" in f.get("filename", "")]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}" for f in ours[:depth])


def report() -> None:
    """The figures, from the allocator's history (run at exit: the diff may end the process itself)."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"torch peak allocated {torch.cuda.max_memory_allocated() / 1e9:.2f} GB, reserved "
          f"{torch.cuda.max_memory_reserved() / 1e9:.2f} GB", flush=True)
    events = snap["device_traces"][torch.cuda.current_device()]
    live: dict[int, dict] = {}
    now = peak = peak_i = 0
    at_peak: dict[int, dict] = {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            now += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])["size"]
        elif e["action"] == "oom":
            print(f"OUT OF MEMORY asking {e['size'] / 1e9:.3f} GB at {_where(e['frames'])}  [{_chain(e['frames'], 8)}]")
        if now > peak:
            peak, at_peak, peak_i = now, dict(live), i
    big = [e for e in events if e["action"] == "alloc" and e["size"] >= BIG]
    print(f"{len(big)} allocations of {BIG / 1e9:.1f} GB or more:")
    for where, n in collections.Counter(f"{e['size'] / 1e9:.2f} GB {_where(e['frames'])}  [{_chain(e['frames'], 6)}]"
                                        for e in big).most_common(20):
        print(f"  {n:3d}x {where}")
    print(f"peak of the traced allocations: {peak / 1e9:.2f} GB at event {peak_i} of {len(events)}")
    if not events:
        return
    e = events[peak_i]
    print(f"  the allocation that made it: {e['size'] / 1e9:.3f} GB at {_where(e['frames'])}  "
          f"[{_chain(e['frames'], 8)}]")
    groups: dict[str, list] = collections.defaultdict(lambda: [0, 0, ""])
    for blk in at_peak.values():
        g = groups[_where(blk["frames"])]
        g[0] += blk["size"]
        g[1] += 1
        g[2] = g[2] or _chain(blk["frames"], 6)
    print("alive at the peak, by allocating frame:")
    for where, (size, n, chain) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:25]:
        if size >= 1 << 20:
            print(f"  {size / 1e9:8.3f} GB  {n:4d} blocks  {where}   [{chain}]")
    sys.stdout.flush()


BIG = int(os.environ.get("MEMORY_PEAK_BIG", str(3 << 30)))


def main() -> int:
    args = sys.argv[1:]
    if "--no-isolate" not in args:
        args.append("--no-isolate")
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1_000_000)
    atexit.register(report)
    from diffkit.cli import main as cli

    cli(["diff", *args])
    return 0


if __name__ == "__main__":
    sys.exit(main())
