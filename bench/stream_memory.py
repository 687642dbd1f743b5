"""Peak memory of one diff mode, in a fresh process (used by tests/test_stream.py and by hand).

    python bench/stream_memory.py MODE [--max-memory SIZE]      MODE: plain | memory | stream

Prints one JSON line: mode, peak RSS (bytes, VmHWM), peak RSS of the loaded models before
the diff, verdict, first divergence, the bytes all captured intermediates would take, largest one."""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss() -> int:
    """This process's peak RSS (VmHWM).  Not getrusage's ru_maxrss: Linux carries that across
    fork+exec, so a child started by a big parent (pytest) would report the parent's peak."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["plain", "memory", "stream"])
    ap.add_argument("--max-memory", default="32M")
    ap.add_argument("--ref", default=os.path.join(ROOT, "references", "deep_transformer.py"))
    ap.add_argument("--cand", default=os.path.join(ROOT, "kernels", "deep_transformer_fused.py"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    import diffkit
    from diffkit.stream import parse_size

    pair = diffkit.load_pair(args.ref, args.cand)
    with torch.no_grad():
        pair.ref(*pair.ref_inputs)
        pair.cand(*pair.cand_inputs)
    base = peak_rss()
    out = {"mode": args.mode, "base_rss": base}
    if args.mode == "plain":
        with torch.no_grad():
            pair.ref(*pair.ref_inputs)
            pair.cand(*pair.cand_inputs)
    else:
        kw = {"streaming": True, "max_memory": parse_size(args.max_memory)} if args.mode == "stream" else {}
        r = diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, health=False,
                            rerun=False, **kw)
        fd = r.first_divergence
        sizes = [s.ref.shape for s in r.stages if s.ref is not None]
        nbytes = [4 * int(torch.tensor(sh).prod()) if sh else 4 for sh in sizes]
        out.update(verdict=r.verdict, first=fd.ref_name if fd else None, first_cand=fd.cand_name if fd else None,
                   root=r.root_cause.ref_name if r.root_cause else None,
                   kind=fd.diagnosis[0].kind if fd and fd.diagnosis else None,
                   intermediates=sum(nbytes), largest=max(nbytes),
                   accounted_peak=r.meta.get("peak_device_bytes"), spilled=r.meta.get("spilled_bytes"))
    out["peak_rss"] = peak_rss()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
