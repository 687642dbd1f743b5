"""The CPU metric kernel: `host_metrics.c`, built once per machine with the system C compiler and
called through ctypes.

One pass over both tensors gives every sufficient statistic of a range (the slots of
`measure._Part`), where the torch path makes about ten passes.  The library is built the first time
a process asks for it (about a second) into a cache directory keyed by the source, the compiler and
the CPU (it is built for the CPU it runs on), and loaded from there afterwards.  Without a C
compiler, or when the build fails, `library()` is None and diffkit measures with torch ops instead;
DIFFKIT_NATIVE=0 asks for that always.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_metrics.c")
FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
NATIVE_ARCH = ["-march=native"]  # dropped when the compiler does not know it
SLOTS = 16  # len(measure._Part)
# the dtypes the kernel reads (as the `is_double` flag it is given)
DTYPES = {torch.float32: 0, torch.float64: 1}

_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> str:
    base = os.environ.get("DIFFKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "diffkit")
    return base


def _cpu_key() -> str:
    """What the built code depends on beyond the source: the machine and its instruction-set flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()}|{flags}"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str, target: str) -> str | None:
    """Compile SOURCE into `target` (atomically: a concurrent build elsewhere is harmless).  Returns why
    it failed, or None."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        why = "?"
        # as C++ first (vector selects become blends), else as C; for this CPU first, else for any
        for lang, arch in ((["-x", "c++"], NATIVE_ARCH), ([], NATIVE_ARCH), ([], [])):
            try:
                p = subprocess.run([cc, *lang, *FLAGS, *arch, SOURCE, "-o", tmp], capture_output=True, text=True,
                                   timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                return f"{cc}: {e}"
            if p.returncode == 0:
                os.replace(tmp, target)
                return None
            why = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
            why = why[0]
        return f"{cc}: {why}"
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load() -> ctypes.CDLL | None:
    if os.environ.get("DIFFKIT_NATIVE", "1") == "0":
        _state["why"] = "DIFFKIT_NATIVE=0"
        return None
    cc = _compiler()
    if cc is None:
        _state["why"] = "no C compiler (cc, gcc or clang) on PATH"
        return None
    try:
        with open(SOURCE, "rb") as fh:
            src = fh.read()
        st = os.stat(cc)
    except OSError as e:
        _state["why"] = str(e)
        return None
    key = hashlib.sha256(b"|".join([src, cc.encode(), str(st.st_mtime_ns).encode(), " ".join(FLAGS).encode(),
                                    _cpu_key().encode(), sys.platform.encode()])).hexdigest()[:16]
    for base in (_cache_dir(), os.path.join(tempfile.gettempdir(), f"diffkit-{os.getuid()}" if hasattr(os, "getuid")
                                            else "diffkit")):
        target = os.path.join(base, f"host_metrics-{key}.so")
        try:
            if not os.path.exists(target):
                why = _build(cc, target)
                if why is not None:
                    _state["why"] = f"building {SOURCE} failed: {why}"
                    return None
            lib = ctypes.CDLL(target)
        except OSError as e:  # an unwritable cache directory: the next place
            _state["why"] = str(e)
            continue
        fn = lib.dk_partials
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_double, ctypes.c_double, ctypes.POINTER(ctypes.c_double)]
        _state["path"] = target
        return lib
    return None


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None when it cannot be had (`why()` says why)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]


def available() -> bool:
    return library() is not None


def why() -> str | None:
    """Why the kernel is not available (None when it is, or has not been asked for)."""
    return None if _state.get("lib") is not None else _state.get("why")


def supports(t: torch.Tensor) -> bool:
    """Whether the kernel reads `t`'s dtype (float32 or float64, on the CPU).  It reads memory in row-major
    order: a tensor laid out otherwise is gathered into one first (see `measure._Flat`)."""
    return t.device.type == "cpu" and t.dtype in DTYPES and not t.is_neg()


def partials(r: torch.Tensor, c: torch.Tensor, lo: int, hi: int, atol: float, rtol: float) -> list[float]:
    """The `_Part` slots of elements lo..hi-1 of `r` and `c` (both `supports`-ed and contiguous, same element
    count; flat indices into the whole tensors).  Runs without the GIL."""
    assert r.is_contiguous() and c.is_contiguous() and 0 <= lo <= hi <= min(r.numel(), c.numel())
    out = (ctypes.c_double * SLOTS)()
    library().dk_partials(r.data_ptr(), DTYPES[r.dtype], c.data_ptr(), DTYPES[c.dtype], lo, hi, atol, rtol, out)
    return list(out)
