"""`--sanitize memcheck|racecheck`: run the diff's child under NVIDIA compute-sanitizer and attach
what it reports (kernel, thread, block, address) to the stage whose call launched the kernel.

A report names a CUDA kernel (``ln_linear_kernel``); stages name the call that launched it
(``ext:diffkit_axial_cuda.ln_linear``, ``triton:softmax_rows_kernel``).  The bridge is, in order:
the report's host backtrace (a frame inside the extension's ``.so`` names the host function), then
the extension's own CUDA source (which host function contains ``kernel<<<``), then equal names
(a Triton kernel is launched under its own name).

Only the candidate's own kernels are instrumented: their names are read from the candidate's
sources before the child starts (``__global__`` functions in its load_inline strings and in the
.cu files it loads, ``@triton.jit`` functions) and passed to compute-sanitizer as a kernel-name
filter, so cuDNN's or cuBLAS's kernels run at full speed.  A race report is completed with the
shared array it is about (read from the kernel's source: the array on the reported line, or the
kernel's only shared array).
"""
from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass, field

from .result import Finding, Result

TOOLS = ("memcheck", "racecheck")


@dataclass
class SanitizerReport:
    """One error compute-sanitizer printed."""

    tool: str
    message: str  # "Invalid __global__ write of size 4 bytes", "Race reported between Write access …"
    kernel: str = ""  # the CUDA kernel's name, without its argument list
    thread: str = ""
    block: str = ""
    address: str = ""
    source: str = ""  # file:line inside the kernel, when the kernel was built with line info
    other_source: str = ""  # a race's second access (file:line), when given
    host: list[str] = field(default_factory=list)  # host frames (function names) below the launch
    shared: str = ""  # a race's shared array, in words (filled in by `attach` from the kernel's source)

    def describe(self) -> str:
        where = ", ".join(x for x in (f"thread {self.thread}" if self.thread else "",
                                      f"block {self.block}" if self.block else "",
                                      f"address {self.address}" if self.address else "",
                                      f"at {self.source}" if self.source else "") if x)
        what = f" on {self.shared}" if self.shared else ""
        return f"compute-sanitizer {self.tool}: {self.message} in kernel {self.kernel or '?'}{what}" + \
            (f" ({where})" if where else "")


def find_tool() -> str | None:
    exe = shutil.which("compute-sanitizer")
    if exe:
        return exe
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        cand = os.path.join(root, "compute-sanitizer", "compute-sanitizer") if root else ""
        if cand and os.path.exists(cand):
            return cand
        cand = os.path.join(root, "bin", "compute-sanitizer") if root else ""
        if cand and os.path.exists(cand):
            return cand
    return None


def tool_version(exe: str) -> tuple[int, int]:
    """compute-sanitizer's release as (year, minor), e.g. (2024, 3); (0, 0) when it cannot be told."""
    import subprocess

    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return (0, 0)
    m = re.search(r"(20\d\d)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


# --kernel-name with a regex key arrived in compute-sanitizer 2023.3 (earlier: --kernel-regex, substring keys)
KERNEL_NAME_OPTION = (2023, 3)


def kernel_filter(kernels: list[str], version: tuple[int, int]) -> list[str]:
    """compute-sanitizer arguments that limit instrumentation to `kernels` (names as written in the
    source; a mangled or demangled name contains them); [] when there is nothing to filter by."""
    names = sorted({k for k in kernels if re.fullmatch(r"[A-Za-z_]\w*", k)})
    if not names:
        return []
    if version >= KERNEL_NAME_OPTION:
        return ["--kernel-name", "regex=.*(" + "|".join(names) + ").*"]
    if len(names) == 1:  # the older option takes one substring
        return ["--kernel-regex", f"kns={names[0]}"]
    return []


def wrap_command(tool: str, log_path: str, argv: list[str], kernels: list[str] | None = None) -> list[str]:
    """The compute-sanitizer command line around `argv`; with `kernels`, only those kernels (the
    candidate's own) are instrumented."""
    if tool not in TOOLS:
        raise ValueError(f"--sanitize takes one of {', '.join(TOOLS)}, not {tool!r}")
    exe = find_tool()
    if exe is None:
        raise FileNotFoundError("compute-sanitizer was not found (looked on PATH, $CUDA_HOME and /usr/local/cuda)")
    filt = kernel_filter(kernels or [], tool_version(exe)) if kernels else []
    return [exe, "--tool", tool, "--log-file", log_path, "--print-limit", "64", "--show-backtrace", "host", *filt,
            *argv]


# ----------------------------------------------------------------------------- the candidate's kernels
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\([^)]*\)")
_GLOBAL = re.compile(r"__global__\b([^;{(]*?)\b([A-Za-z_]\w*)\s*\(")
_TRITON = re.compile(r"@(?:triton\.)?jit\b(?:\([^)]*\))?\s*(?:@[^\n]*\s*)*def\s+([A-Za-z_]\w*)\s*\(")
_SOURCE_NAME = re.compile(r"""["']([\w./-]+\.(?:cu|cuh|py))["']""")
MAX_SOURCE_BYTES = 4 << 20  # a source file larger than this is not read
MAX_SOURCES = 32  # files followed from the candidate
MAX_WALK = 4000  # directory entries looked at when a source is named by its base name only


def cuda_kernels(text: str) -> list[str]:
    """The ``__global__`` function names in CUDA source text."""
    return list(dict.fromkeys(m.group(2) for m in _GLOBAL.finditer(_LAUNCH_BOUNDS.sub("", text))))


def triton_kernels(text: str) -> list[str]:
    """The ``@triton.jit`` function names in Python source text."""
    return list(dict.fromkeys(_TRITON.findall(text)))


def _find_named(name: str, base_dir: str) -> str | None:
    """A file named `name` (a path or a base name a string literal mentions) near `base_dir`."""
    for cand in (name, os.path.join(base_dir, name)):
        if os.path.isabs(cand) and os.path.isfile(cand) or not os.path.isabs(name) and os.path.isfile(cand):
            return os.path.abspath(cand)
    want, seen = os.path.basename(name), 0
    for root, dirs, files in os.walk(base_dir):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        seen += len(files) + len(dirs)
        if want in files:
            return os.path.join(root, want)
        if seen > MAX_WALK or root.count(os.sep) - base_dir.count(os.sep) >= 2:
            dirs[:] = []
    return None


def candidate_sources(path: str) -> list[tuple[str, str]]:
    """(path, text) of the candidate file and of the sources it names (.cu/.cuh files it loads,
    .py helpers it runs), followed a few files deep."""
    out: list[tuple[str, str]] = []
    todo, done = [os.path.abspath(path)], set()
    while todo and len(done) < MAX_SOURCES:
        p = todo.pop(0)
        if p in done:
            continue
        done.add(p)
        try:
            if os.path.getsize(p) > MAX_SOURCE_BYTES:
                continue
            text = open(p, encoding="utf-8", errors="replace").read()
        except OSError:
            continue
        out.append((p, text))
        for name in _SOURCE_NAME.findall(text):
            found = _find_named(name, os.path.dirname(p))
            if found and found not in done:
                todo.append(found)
    return out


def candidate_kernels(path: str) -> list[str]:
    """The names of the CUDA and Triton kernels the candidate file defines or loads."""
    names: list[str] = []
    for _, text in candidate_sources(path):
        names += cuda_kernels(text) + triton_kernels(text)
    return list(dict.fromkeys(names))


_SHARED = re.compile(r"__shared__\s+(?:[\w:<>,]+\s*\*?\s+)+?([A-Za-z_]\w*)\s*\[")


def shared_arrays(text: str, kernel: str) -> list[str]:
    """The shared arrays declared in `kernel`'s body (and at file scope) in CUDA source `text`."""
    clean = _LAUNCH_BOUNDS.sub("", text)
    m = re.search(rf"__global__\b[^;{{(]*?\b{re.escape(kernel)}\s*\(", clean)
    names: list[str] = []
    if m is not None:
        start = clean.find("{", m.end())
        depth, i = 0, start
        while 0 <= i < len(clean):
            depth += {"{": 1, "}": -1}.get(clean[i], 0)
            if depth == 0:
                break
            i += 1
        names = _SHARED.findall(clean[start:i + 1]) if start >= 0 else []
    top = [n for n in _SHARED.findall(clean) if n not in names]
    return names + top


def _source_line(spec: str) -> str:
    """The text of ``/path/file.cu:LINE`` (empty when it cannot be read)."""
    path, _, line = spec.rpartition(":")
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for i, text in enumerate(fh, 1):
                if i == int(line):
                    return text
    except (OSError, ValueError):
        pass
    return ""


def shared_array_of(rep: "SanitizerReport", sources: list[str]) -> str:
    """Words naming the shared array a race report is about: the arrays on its reported source
    lines, else the kernel's only shared array; "" when it cannot be told."""
    declared: list[str] = []
    for text in sources:
        if rep.kernel and re.search(rf"\b{re.escape(rep.kernel)}\s*\(", text):
            declared += [n for n in shared_arrays(text, rep.kernel) if n not in declared]
    on_lines = []
    for spec in (rep.source, rep.other_source):
        line = _source_line(spec) if spec else ""
        on_lines += [n for n in declared if re.search(rf"\b{re.escape(n)}\b", line) and n not in on_lines]
    if on_lines:
        return "shared array " + ", ".join(on_lines)
    if len(declared) == 1:
        return f"shared array {declared[0]} (the kernel's only one)"
    return ("shared arrays " + ", ".join(declared) + " (one of them)") if declared else ""


_PREFIX = re.compile(r"^=+\s?")
_THREAD = re.compile(r"by thread \(([^)]*)\) in block \(([^)]*)\)")
_HOST = re.compile(r"Host Frame:\s*(?:\[0x[0-9a-f]+\]\s*)?(?!in\s)([^\s(\[]+)")
_SOURCE = re.compile(r"(/[^\s:]+\.\w+:\d+)")
_KERNEL_FORMS = (re.compile(r"\bat 0x[0-9a-f]+ in (?:\S*?:\d+:)?([A-Za-z_]\w*)\s*[(<]"),  # at 0x.. in file:line:kernel(
                 re.compile(r"\bat ([A-Za-z_]\w*)\s*[(<]"),  # at kernel(args)+0x.. in file:line
                 re.compile(r"\bin (?:\S*?:\d+:)?([A-Za-z_]\w*)\s*[(<]"))


def _kernel_of(text: str) -> str:
    for rx in _KERNEL_FORMS:
        m = rx.search(text)
        if m:
            return m.group(1)
    return ""


_STARTS = ("Invalid", "Race reported", "Error: Race", "Program hit", "Misaligned", "Out-of-range", "Barrier error",
           "Malloc", "Free", "Cuda API", "Error:")


def parse(text: str, tool: str) -> list[SanitizerReport]:
    """The errors in a compute-sanitizer log (memcheck's or racecheck's text format)."""
    reports: list[SanitizerReport] = []
    cur: SanitizerReport | None = None
    for raw in text.splitlines():
        if not raw.startswith("="):
            continue
        line = _PREFIX.sub("", raw).rstrip()
        body = line.strip()
        if not body or "SUMMARY" in body or body.startswith("COMPUTE-SANITIZER"):
            continue
        if not line.startswith(" ") and body.startswith(_STARTS):
            cur = SanitizerReport(tool, body.split(" at ")[0] if body.startswith(("Error: Race", "Race")) else body)
            reports.append(cur)
            cur.kernel = _kernel_of(body) if " at " in body else ""
            m = _SOURCE.search(body)
            cur.source = m.group(1) if m else ""
            continue
        if cur is None:
            continue
        if "Host Frame" in body:
            m = _HOST.search(body)
            if m:
                cur.host.append(m.group(1))
        elif body.startswith("by thread"):
            m = _THREAD.search(body)
            if m:
                cur.thread, cur.block = m.group(1).replace(" ", ""), m.group(2).replace(" ", "")
        elif body.startswith("Address"):
            cur.address = body[len("Address"):].strip()
        elif body.startswith(("at ", "and ", "Write access", "Read access")):
            cur.kernel = cur.kernel or _kernel_of(body)
            m = _SOURCE.search(body)
            if body.startswith("and ") and cur.source and m:
                cur.other_source = cur.other_source or m.group(1)
            cur.source = cur.source or (m.group(1) if m else "")
    return reports


_INTERNAL = re.compile(r"^=+[ \t]*Internal Sanitizer Error:?[ \t]*(.*)$", re.M)


def internal_failure(text: str) -> str | None:
    """What compute-sanitizer said of its own failure ("The Sanitizer failed to handle a hardware exception."),
    or None when its log has no "Internal Sanitizer Error".  After one, the process it watches goes on in a
    state the sanitizer left: a CUDA error there is the sanitizer's, not evidence against the candidate."""
    m = _INTERNAL.search(text)
    if m is None:
        return None
    return m.group(1).strip().rstrip(".") or "an internal sanitizer error"


def failure_words(tool: str, failed: str, crashed: bool = True) -> str:
    """What a result says when compute-sanitizer failed on its own (see `internal_failure`): `crashed`, the words
    that follow the candidate's error ("… after compute-sanitizer racecheck failed on its own …"); else a warning
    for a run that went on to its answer."""
    if crashed:
        return (f"after compute-sanitizer {tool} failed on its own inside the candidate's process ({failed}): what "
                f"that process did after it is not evidence against the candidate; diff without --sanitize for the "
                f"candidate's own verdict")
    return (f"compute-sanitizer {tool} failed on its own inside the candidate's process ({failed}); its reports may "
            f"be incomplete, and what ran after it is suspect")


def kernel_launchers() -> dict[str, str]:
    """kernel name → host function that launches it, from the CUDA sources of the extensions built
    in this process (torch keeps load_inline's sources in the extension's build directory)."""
    out: dict[str, str] = {}
    try:
        from torch.utils.cpp_extension import _get_build_directory  # type: ignore[attr-defined]
        root = os.path.dirname(_get_build_directory("x", verbose=False))
    except Exception:
        return out
    for path in glob.glob(os.path.join(root, "*", "*.cu")):
        try:
            src = open(path, encoding="utf-8", errors="replace").read()
        except OSError:
            continue
        host = None
        for line in src.splitlines():
            m = re.match(r"^[A-Za-z_][\w:<>,\s\*&]*?\b([A-Za-z_]\w*)\s*\(", line)
            if m and not line.startswith(("__global__", "__device__", "#", "static __device__")) and "__global__" not in line:
                host = m.group(1)
            for k in re.findall(r"\b([A-Za-z_]\w*)\s*<<<", line):
                if host:
                    out.setdefault(k, host)
    return out


def _group(reports: list[SanitizerReport]) -> list[tuple[SanitizerReport, int, str]]:
    """One entry per distinct error (a bad access repeats once per thread): first report, count, extent."""
    groups: dict[tuple, list[SanitizerReport]] = {}
    for r in reports:
        groups.setdefault((r.tool, r.message, r.kernel, r.source), []).append(r)
    out = []
    for rs in groups.values():
        threads = sorted({r.thread for r in rs if r.thread})
        blocks = sorted({r.block for r in rs if r.block})
        extent = ""
        if len(rs) > 1:
            extent = f"{len(rs)} reports" + (f", {len(threads)} threads" if threads else "") + \
                (f" in {len(blocks)} block(s) ({', '.join(blocks[:3])}{' …' if len(blocks) > 3 else ''})" if blocks else "")
        out.append((rs[0], len(rs), extent))
    return out


def built_sources() -> list[str]:
    """The CUDA sources of the extensions built in this process (load_inline keeps them in the
    extension's build directory)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # type: ignore[attr-defined]
        root = os.path.dirname(_get_build_directory("x", verbose=False))
    except Exception:
        return []
    out = []
    for path in glob.glob(os.path.join(root, "*", "*.cu")):
        try:
            out.append(open(path, encoding="utf-8", errors="replace").read())
        except OSError:
            continue
    return out


def attach(result: Result, reports: list[SanitizerReport], launchers: dict[str, str] | None = None,
           sources: list[str] | None = None) -> int:
    """Add each distinct report as a Finding on the stage whose call launched its kernel; one whose
    call raised (no stage) is added to the error's description; others become warnings.  A race
    report names its shared array, read from `sources` (CUDA source texts; default: the extensions
    built in this process and the candidate's own files).  Returns the number attached to stages."""
    launchers = kernel_launchers() if launchers is None else launchers
    if any(r.tool == "racecheck" for r in reports):
        if sources is None:
            sources = built_sources() + ([t for _, t in candidate_sources(result.cand_path)] if result.cand_path
                                         and os.path.isfile(result.cand_path) else [])
        for r in reports:
            if r.tool == "racecheck" and not r.shared:
                r.shared = shared_array_of(r, sources)
    result.meta["sanitizer"] = [r.__dict__ for r in reports[:200]]
    result.meta["sanitizer_reports"] = len(reports)
    attached = 0
    for rep, count, extent in _group(reports):
        names = {rep.kernel}
        if rep.kernel in launchers:
            names.add(launchers[rep.kernel])
        names.update(h.split("(")[0].split("::")[-1] for h in rep.host)
        names.discard("")
        text = rep.describe() + (f"; {extent}" if extent else "")
        stage = next((s for s in result.stages if s.cand is not None and s.cand.op.startswith(("ext:", "triton:"))
                      and s.cand.op.rsplit(".", 1)[-1].split(":")[-1] in names), None)
        kind = "memory_error" if rep.tool == "memcheck" else "race"
        if stage is not None:
            if not any(f.kind == kind and f.detail.startswith(rep.describe()) for f in stage.diagnosis):
                stage.diagnosis.insert(0, Finding(kind, text + f"; launched by {stage.cand.op} at {stage.cand.where}",
                                                  0.95))
            attached += 1
        elif result.error is not None and any(re.search(rf"[.:]{re.escape(n)}\b", result.error.stage or "")
                                                for n in names):
            result.error.message += f"; {text} (in the call that failed)"
        else:
            result.warnings.append(text + " (its launching call was not captured)")
    if reports:
        result.meta["sanitizer_errors"] = len(reports)  # pipeline.judge: a match with sanitizer errors diverges
    return attached
