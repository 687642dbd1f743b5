"""The CUDA metric kernel's programs compiled for a GPU architecture on this machine (no GPU needed: Triton and the
ptxas/nvdisasm it ships with), and what each program's main loop costs: machine instructions per element of a
step, registers per thread, and which loads read four elements at once.  The finite-first pass bounds the metric
passes (`diffkit.metrics_kernel`): this says how many instructions each way of reading a pair spends on an
element, before any device time is spent measuring it.

    python bench/kernel_instructions.py                 # sm_90 (H100, H200), float32 and float16 pairs
    python bench/kernel_instructions.py --arch 80 --dtype float32
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _tools():
    import triton

    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.join(here, "nvdisasm"), os.path.join(here, "cuobjdump")


def compiled(program, arch: int, warps: int, signature: dict, constants: dict):
    """`program` compiled for sm_`arch`: its cubin (bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{k: "constexpr" for k in constants})
    names = list(sig)
    src = ASTSource(fn=program, signature=sig, constexprs={(names.index(k),): v for k, v in constants.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if sig[k].startswith("*")})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps)).asm["cubin"]


def loops(sass: str) -> list[list[str]]:
    """The bodies of the backward branches' loops in disassembled code: each a list of opcodes."""
    labels, lines, out = {}, [], []
    for ln in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = len(lines)
            continue
        m = re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", ln)
        if not m:
            continue
        ins = re.sub(r"^@!?U?P[0-9T]\s+", "", m.group(1).strip())
        lines.append(ins)
        b = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ins)
        if b and b.group(1) in labels and labels[b.group(1)] < len(lines):
            out.append(lines[labels[b.group(1)]:])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="float32,float16")
    a = ap.parse_args()
    import torch
    import triton.language as tl

    from diffkit import metrics_kernel as K, metrics_triton as T

    nvdisasm, cuobjdump = _tools()
    signature = dict(ref_ptrs="*i64", cand_ptrs="*i64", numels="*i64", tile_first="*i64", layout="*i64", out="*fp64",
                     redo="*i32", atol="fp32", rtol="fp32", n_pairs="i32", n_direct="i32", row0="i32", search="i32")
    per = K.BLOCK // (32 * K.NUM_WARPS)  # elements of a step each thread holds
    print(f"sm_{a.arch}: BLOCK {K.BLOCK} lanes, {K.NUM_WARPS} warps: {per} elements of a step per thread; "
          "instructions of the main loop per element (the finite-first pass)")
    for name in a.dtype.split(","):
        dt = K._triton_dtype(getattr(torch, name))
        for label, read, aligned in (("contiguous, aligned", K.READ_FLAT, True),
                                     ("contiguous, unaligned", K.READ_FLAT, False),
                                     ("rows of lanes, aligned", K.READ_ROWS, True),
                                     ("rows of lanes, unaligned", K.READ_ROWS, False),
                                     ("element by element", K.READ_STRIDED, False)):
            const = dict(REF_T=dt, CAND_T=dt, WORK_T=tl.float32, BLOCK=K.BLOCK, TILE_BLOCKS=K.TILE_BLOCKS,
                         NPART=len(K.Part), DIRECT=False, SUM_T=tl.float32, FULL=False, RANGE=True,
                         LAYOUT=K.LAYOUT, ALIGNED=aligned, READ=read, GROUP=K.GROUP, REDO=False, MIXED=False)
            cubin = compiled(T.partials, a.arch, K.NUM_WARPS, signature, const)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
                res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
            regs = re.search(r"REG:(\d+)", res)
            body = max(loops(sass), key=len)
            ops = collections.Counter(op.split()[0] for op in body)
            wide = sum(n for op, n in ops.items() if op.startswith("LDG") and op.endswith(".128"))
            loads = sum(n for op, n in ops.items() if op.startswith("LDG"))
            print(f"  {name:8s} {label:26s} {len(body) / per:5.1f} per element ({len(body)} a step), "
                  f"{regs.group(1) if regs else '?'} registers, loads {loads} ({wide} of 16 bytes)")


if __name__ == "__main__":
    main()
