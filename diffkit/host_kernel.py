"""The CPU metric kernel: `host_metrics.c`, built once per machine with the system C compiler and
called through ctypes.

One pass over both tensors gives every sufficient statistic of a range (the slots of
`metric_slots.Part`), where the torch path makes about ten passes.  The library is built the first time
a process asks for it (about a second) into a cache directory keyed by the source, the compiler and
the CPU (on Linux it is built for the CPU it runs on), checked on a pair with known answers, and
loaded from there afterwards.  Without a C compiler, or when the build or the check fails,
`library()` is None (`why()` says why) and diffkit measures with torch ops instead; DIFFKIT_NATIVE=0
asks for that always.  `$CC` (a command, arguments allowed: "ccache gcc") picks the compiler.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading

import torch

from .metric_slots import Part

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_metrics.c")
FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
SLOTS = len(Part)
# the dtypes the kernel reads (as the `is_double` flag it is given)
DTYPES = {torch.float32: 0, torch.float64: 1}

_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> str:
    return os.environ.get("DIFFKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "diffkit")


def _cpu_flags() -> str | None:
    """The CPU's instruction-set flags (Linux), None where they cannot be read: then the library is
    built for the architecture in general, not for this CPU (a cache shared between machines is safe)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return None


def _compiler() -> list[str] | None:
    """The compiler command: `$CC` split as a shell would (its first word looked up on PATH), else cc,
    gcc or clang."""
    words = shlex.split(os.environ.get("CC", "")) if os.environ.get("CC", "").strip() else []
    if words:
        exe = shutil.which(words[0])
        return [exe, *words[1:]] if exe else None
    for name in ("cc", "gcc", "clang"):
        exe = shutil.which(name)
        if exe:
            return [exe]
    return None


def _private_dir(path: str) -> bool:
    """Create `path` (mode 0700) if needed; whether it is a real directory owned by this user that no one
    else can write into (a library found there is loaded and run: it must be this user's)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return False
    return os.access(path, os.W_OK | os.X_OK)


def _self_test(lib: ctypes.CDLL) -> str | None:
    """Run the kernel on a small pair with known answers (a fast block, a block holding a NaN and an
    infinity, a tail): None when it gives them, else what went wrong."""
    try:
        fn = lib.dk_partials
    except AttributeError:
        return "the library has no dk_partials"
    _signature(fn)
    # plain ctypes arrays, no torch: this runs before `diffkit diff` forks its children (a parent that ran
    # torch computations could leave their thread pools unusable)
    n = 1100
    r = [i / 64 - 4 for i in range(n)]
    c = list(r)
    c[7] += 0.5  # the largest error, in the first (fast) block
    c[600] = math.nan  # the second block by the full rules
    r[601] = c[601] = math.inf
    c[1099] += 0.25  # the tail
    rr, cc = (ctypes.c_double * n)(*r), (ctypes.c_float * n)(*c)
    out = (ctypes.c_double * SLOTS)()
    fn(ctypes.addressof(rr), 1, ctypes.addressof(cc), 0, 0, n, 1e-3, 1e-3, out)
    got = list(out)
    want = {0: 3.0, 1: 0.5, 2: 7.0, 3: 0.75, 8: 0.0, 9: 1.0, 10: 1.0, 11: 1.0, 13: 7.0, 14: 600.0}
    bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    # a float32 pair (its blocks in float32 lanes): the largest error in the second block, a tail
    r32 = (ctypes.c_float * n)(*[i / 64 - 4 for i in range(n)])
    c32 = (ctypes.c_float * n)(*r32)
    c32[700] += 0.5
    c32[1099] += 0.25
    fn(ctypes.addressof(r32), 0, ctypes.addressof(c32), 0, 0, n, 1e-3, 1e-3, out)
    got = list(out)
    want = {0: 2.0, 1: 0.5, 2: 700.0, 3: 0.75, 8: 0.0, 10: 0.0, 13: 700.0}
    bad.update({f"float32 {k}": (got[k], v) for k, v in want.items() if got[k] != v})
    return f"wrong answers on the self-test (slot: got, want): {bad}" if bad else None


def _signature(fn) -> None:
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_double, ctypes.c_double, ctypes.POINTER(ctypes.c_double)]


def _build(cc: list[str], target: str, native: bool) -> str | None:
    """Compile SOURCE into `target`: as C++ (vector selects become blends), else as C; for this CPU first
    (`native`), else for any.  A variant is kept only when it loads and passes `_self_test`; it is moved
    into place atomically (a concurrent build elsewhere is harmless).  Returns why no variant did, or None."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    why = []
    try:
        variants = [(["-x", "c++"], ["-march=native"]), ([], ["-march=native"])] if native else []
        variants += [(["-x", "c++"], []), ([], [])]
        for lang, arch in variants:
            try:
                p = subprocess.run([*cc, *lang, *FLAGS, *arch, SOURCE, "-o", tmp], capture_output=True, text=True,
                                   timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                return f"{' '.join(cc)}: {e}"
            if p.returncode != 0:
                why.append(((p.stderr or p.stdout).strip().splitlines() or [f"exit {p.returncode}"])[-1])
                continue
            try:
                failed = _self_test(ctypes.CDLL(tmp))
            except OSError as e:
                failed = str(e)
            if failed is None:
                os.replace(tmp, target)
                return None
            why.append(failed)
        return f"{' '.join(cc)}: " + "; ".join(why[-2:])
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load() -> ctypes.CDLL | None:
    if os.environ.get("DIFFKIT_NATIVE", "1") == "0":
        _state["why"] = "DIFFKIT_NATIVE=0"
        return None
    cc = _compiler()
    if cc is None:
        _state["why"] = f"no C compiler ({'$CC=' + os.environ['CC'] if os.environ.get('CC') else 'cc, gcc or clang'} " \
                        f"not found on PATH)"
        return None
    try:
        with open(SOURCE, "rb") as fh:
            src = fh.read()
        mtime = os.stat(cc[0]).st_mtime_ns
    except OSError as e:
        _state["why"] = str(e)
        return None
    flags = _cpu_flags()
    key = hashlib.sha256(b"|".join([src, " ".join(cc).encode(), str(mtime).encode(), " ".join(FLAGS).encode(),
                                    platform.machine().encode(), (flags or "").encode(), sys.platform.encode()]))
    name = f"host_metrics-{key.hexdigest()[:16]}.so"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    for base in (_cache_dir(), os.path.join(tempfile.gettempdir(), f"diffkit-{uid}")):
        if not _private_dir(base):
            _state["why"] = f"{base} is not a private, writable directory"
            continue
        target = os.path.join(base, name)
        try:
            if os.path.exists(target):
                try:
                    lib = ctypes.CDLL(target)
                    if _self_test(lib) is None:
                        return _ready(lib, target)
                except OSError:
                    pass
                os.remove(target)  # a broken library (a build cut short, a full disk): built again
            why = _build(cc, target, native=flags is not None)
            if why is not None:
                _state["why"] = f"building {SOURCE} failed: {why}"
                return None
            return _ready(ctypes.CDLL(target), target)
        except (OSError, AttributeError) as e:
            _state["why"] = f"{target}: {e}"
    return None


def _ready(lib: ctypes.CDLL, path: str) -> ctypes.CDLL:
    _signature(lib.dk_partials)
    _state["path"] = path
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None when it cannot be had (`why()` says why)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                try:
                    lib = _load()
                except Exception as e:  # never let the fast path break a measurement
                    _state["why"] = f"{type(e).__name__}: {e}"
                    lib = None
                _state["lib"] = lib
    return _state["lib"]


def available() -> bool:
    return library() is not None


def why() -> str | None:
    """Why the kernel is not available (None when it is, or has not been asked for)."""
    return None if _state.get("lib") is not None else _state.get("why")


def supports(t: torch.Tensor) -> bool:
    """Whether the kernel can read `t`'s memory: a plain float32 or float64 CPU tensor with storage of its
    own (not a wrapper subclass, a zero tensor or a negated view).  It reads memory in row-major order: a
    tensor laid out otherwise is gathered into one first (see `measure._Flat`)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype in DTYPES
            and t.layout == torch.strided and not t.is_neg() and not t._is_zerotensor() and t.data_ptr() != 0)


def partials(r: torch.Tensor, c: torch.Tensor, lo: int, hi: int, atol: float, rtol: float) -> list[float]:
    """The `Part` slots of elements lo..hi-1 of `r` and `c` (both `supports`-ed and contiguous, same element
    count; flat indices into the whole tensors).  Runs without the GIL."""
    assert r.is_contiguous() and c.is_contiguous() and 0 <= lo <= hi <= min(r.numel(), c.numel())
    out = (ctypes.c_double * SLOTS)()
    library().dk_partials(r.data_ptr(), DTYPES[r.dtype], c.data_ptr(), DTYPES[c.dtype], lo, hi, atol, rtol, out)
    return list(out)
