"""`diffkit suite`: many reference/candidate pairs, each diffed in its own process, one summary.

Discovery (`discover`):
  - ``diffkit suite DIR``: every folder of DIR holding ``ref.py`` and ``cand.py`` is a pair named after
    the folder (DIR itself, when it holds them, is one pair; several DIRs may be given);
  - ``diffkit suite --refs REFS --cands CANDS``: a KernelBench candidate
    ``level_<L>_problem_<N>_sample_<S>_kernel.py`` pairs with the reference ``<N>_*.py`` in REFS (in
    ``REFS/level<L>/`` when REFS has level folders, as KernelBench's own tree does); several samples are
    several pairs.  Other candidate files (those defining ``ModelNew``) pair with the reference they
    declare (``DIFFKIT_EXPECT = {"reference": "x.py"}``, as the bundled ones do), else with the reference
    whose name is the longest ``_``-prefix of theirs (``row_softmax_fused.py`` -> ``row_softmax.py``).
  A candidate with no reference, or with several, is an errored pair that says so; nothing is dropped.

Each pair runs as ``python -m diffkit.cli diff REF CAND --report-dir OUT/<name> --json
OUT/<name>/result.json`` (started by `processes.python_command`: this diffkit, whatever the current folder
holds) plus the diff options given to the suite, in a pool of workers (one per visible GPU, each child
seeing only its GPU; ``--workers N`` on CPU).  The verdicts are read back with
`Result.from_json`; a child that fails without an answer (killed, internal error, past the suite's
deadline) is an ``error`` entry with the reason from its log.  After every finished pair the summary
files are rewritten atomically: index.html, summary.json, summary.csv, junit.xml, summary.md.  A small
marker per pair (suite.json: the two files' SHA-256, the diff options, the result's SHA-256) lets
``--resume`` skip pairs already answered for the same files and options.

A pair that needs CUDA or Triton on a machine without them is ``skipped``, not errored: its diff answered
an error that says CUDA (or Triton) is missing and this machine indeed lacks it (`unavailable_reason`; the
reason also names what in the files needs it, `needs_cuda`).  Skipped pairs are counted apart in every
summary and leave the exit code alone.  ``--ray [ADDRESS]`` runs the pairs as Ray tasks (suite_ray.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import click

from .errors import EXIT, INTERNAL
from .describe import clip, explaining_what_if, failure_summary, headline, stage_names, what_if_diagnosis
from .render import (VERDICT_COLOUR, _element as el, csv_safe, harden_cell, harden_setting_line, md_code, md_escape,
                     template)
from .result import Result, json_safe
from .safefiles import open_fresh, write_text
from .flags import DIFF_OPTIONS
from . import warm
from .processes import python_command, stop as _stop

KB_CANDIDATE = re.compile(r"^level_?(?P<level>\d+)_problem_(?P<problem>\d+)_sample_(?P<sample>\d+)_kernel\.py$")
KB_REFERENCE = re.compile(r"^(?P<problem>\d+)_.*\.py$")
MARKER = "suite.json"  # per pair: what its result.json was computed from
LOG = "diff.log"  # per pair: the child's stdout and stderr
SUMMARY_FILES = ("index.html", "summary.json", "summary.csv", "junit.xml", "summary.md")
VERDICT_ORDER = ("error", "diverged", "match", "skipped")
# options of `diffkit diff` a suite passes on to every pair when given (any that `diff` does not have are
# skipped, so an option added to `diff` later, e.g. --stat, needs only its name here)
PASS_THROUGH = ("atol", "rtol", "seed", "trials", "eval_mode", "sync_weights", "device", "timeout", "strict",
                "tolerance", "reinit_zero", "stat", "no_isolate", "max_memory", "device_memory", "stream", "only", "stop_at_first",
                "sanitize", "explain", "explain_budget", "explain_seconds", "harden")
HARDEN_KEYS = ("harden", "harden_detail")  # SuiteEntry's --harden fields, written only when set
LOCAL_RAY = "local"  # --ray with no address: start a local Ray cluster
# other ways to run a suite's pairs, by name: suite_ray.py registers "ray" (the command line imports it; it
# imports this module, so this one cannot import it back)
BACKENDS: dict[str, Any] = {}
GRACE_S = 120.0  # a child past both sides' --timeout plus this is stopped by the suite


# ----------------------------------------------------------------------------- the entries
@dataclass
class SuiteEntry:
    """One pair of a suite and, once run, its answer.

    name:             unique in the suite; the pair's report folder under the suite directory
    ref, cand:        the two files (None when discovery found no counterpart)
    verdict:          "match" | "diverged" | "error" | "skipped" (needs CUDA or Triton, which this machine
                      lacks); None while not run
    first_divergence: "stage 7 output" (the reference name, with the candidate's when it differs)
    root_cause:       the stage that introduces the error (rootcause.py), in the same form; it may be the first
                      divergence itself
    diagnosis:        the kind of the first finding (root cause's, else the first divergence's), e.g. "missing_bias"
    diagnosis_detail: that finding's sentence
    seconds:          wall time of the pair's diff
    report:           the pair's index.html, relative to the suite directory
    log:              the child's output (diff.log), relative to the suite directory
    error:            why the pair errored (the diff's error, a crash, a discovery problem)
    headline:         the diff's one-line answer (describe.headline)
    harden:           with --harden: "robust" or "breaks: <the kinds of the settings that break it>"; None when
                      --harden was not asked (or the pair has no answer)
    harden_detail:    with --harden, the first setting that breaks the candidate, in a sentence (else the first
                      finding about the problem, e.g. input_independent)
    skip_reason:      why a skipped pair was not judged: what it needs, what in its files needs it, the diff's error
    """

    name: str
    ref: str | None
    cand: str | None
    verdict: str | None = None
    first_divergence: str | None = None
    root_cause: str | None = None
    diagnosis: str | None = None
    diagnosis_detail: str | None = None
    seconds: float | None = None
    report: str | None = None
    log: str | None = None
    error: str | None = None
    headline: str = ""
    harden: str | None = None
    harden_detail: str | None = None
    skip_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.verdict is not None

    @property
    def breaks(self) -> bool:
        """A pair KernelBench's verdict passes that a --harden setting breaks: a failure, as a divergence is."""
        return self.verdict == "match" and (self.harden or "").startswith("breaks")

    @property
    def runnable(self) -> bool:
        return self.ref is not None and self.cand is not None and self.error is None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for key in (*HARDEN_KEYS, "skip_reason"):  # not asked / not skipped: no trace of them
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SuiteEntry":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _unpaired(name: str, ref: str | None, cand: str | None, message: str) -> SuiteEntry:
    """A pair discovery could not make (no reference, several, a missing file): an errored entry."""
    return SuiteEntry(name, ref, cand, verdict="error", error=message, headline=f"diffkit: ERROR: {message}")


def _natural(text: str) -> list:
    """Sort key: numbers by value (problem_2 before problem_10)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _safe_name(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_.-]+", "_", name).strip("._") or "pair"


def _defines_model_new(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "ModelNew" in fh.read()
    except OSError:
        return False


def _declared_reference(path: str) -> str | None:
    """The reference a candidate declares (``DIFFKIT_EXPECT = {"reference": "x.py", …}``, the bundled
    candidates' convention), read without running the file."""
    import ast

    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "DIFFKIT_EXPECT" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            ref = value.get("reference") if isinstance(value, dict) else None
            return os.path.basename(ref) if isinstance(ref, str) and ref else None
    return None


def _py_files(folder: str) -> list[str]:
    return sorted((f for f in os.listdir(folder) if f.endswith(".py") and not f.startswith(("_", "."))
                   and os.path.isfile(os.path.join(folder, f))), key=_natural)


def discover_folders(roots: Sequence[str]) -> list[SuiteEntry]:
    """Folder per problem: each folder of a root holding ref.py and/or cand.py (or the root itself)."""
    found: list[SuiteEntry] = []
    seen: set[str] = set()
    for root in roots:
        if not os.path.isdir(root):
            found.append(_unpaired(_safe_name(os.path.basename(os.path.normpath(root))), None, None,
                                   f"{root} is not a directory"))
            continue
        own = [os.path.exists(os.path.join(root, f)) for f in ("ref.py", "cand.py")]
        if any(own):
            folders = [root]
        else:
            folders = [os.path.join(root, d) for d in sorted(os.listdir(root), key=_natural)
                       if not d.startswith((".", "_")) and os.path.isdir(os.path.join(root, d))]
        for folder in folders:
            if os.path.realpath(folder) in seen:
                continue  # given twice (a DIR and its parent, a repeated argument)
            seen.add(os.path.realpath(folder))
            ref, cand = os.path.join(folder, "ref.py"), os.path.join(folder, "cand.py")
            has_ref, has_cand = os.path.isfile(ref), os.path.isfile(cand)
            if not (has_ref or has_cand):
                continue  # not a problem folder (reports/, a helper package …)
            name = _safe_name(os.path.basename(os.path.abspath(folder)))
            if not has_cand:
                found.append(_unpaired(name, ref, None, f"{folder} has ref.py but no cand.py"))
            elif not has_ref:
                found.append(_unpaired(name, None, cand, f"{folder} has cand.py but no ref.py"))
            else:
                found.append(SuiteEntry(name, ref, cand))
    return _unique(found)


def _reference_folder(refs: str, level: str) -> str:
    """REFS/level<L> (or level_<L>) when REFS is laid out by level, as KernelBench's tree is; else REFS."""
    for sub in (f"level{int(level)}", f"level_{int(level)}", f"level{level}", f"level_{level}"):
        if os.path.isdir(os.path.join(refs, sub)):
            return os.path.join(refs, sub)
    return refs


def discover_kernelbench(refs: str, cands: str) -> list[SuiteEntry]:
    """--refs/--cands: KernelBench candidate names pair by problem number, other names by prefix."""
    for label, folder in (("--refs", refs), ("--cands", cands)):
        if not os.path.isdir(folder):
            raise click.UsageError(f"{label} {folder} is not a directory")
    by_problem: dict[str, dict[int, list[str]]] = {}

    def numbered(folder: str) -> dict[int, list[str]]:
        if folder not in by_problem:
            table: dict[int, list[str]] = {}
            for f in _py_files(folder):
                m = KB_REFERENCE.match(f)
                if m:
                    table.setdefault(int(m["problem"]), []).append(f)
            by_problem[folder] = table
        return by_problem[folder]

    ref_stems = {os.path.splitext(f)[0]: f for f in _py_files(refs)}
    found: list[SuiteEntry] = []
    for f in _py_files(cands):
        path = os.path.join(cands, f)
        m = KB_CANDIDATE.match(f)
        if m:
            name = f[:-len("_kernel.py")]
            folder = _reference_folder(refs, m["level"])
            matches = numbered(folder).get(int(m["problem"]), [])
            if len(matches) == 1:
                found.append(SuiteEntry(name, os.path.join(folder, matches[0]), path))
            elif not matches:
                found.append(_unpaired(name, None, path,
                                       f"no reference for {f}: no {int(m['problem'])}_*.py in {folder}"))
            else:
                found.append(_unpaired(name, None, path, f"ambiguous reference for {f}: {', '.join(matches)} in "
                                                         f"{folder} all have problem number {int(m['problem'])}"))
            continue
        if not _defines_model_new(path):
            continue  # a helper module the candidates load, not a candidate
        stem = os.path.splitext(f)[0]
        declared = _declared_reference(path)
        if declared is not None:
            if os.path.isfile(os.path.join(refs, declared)):
                found.append(SuiteEntry(_safe_name(stem), os.path.join(refs, declared), path))
            else:
                found.append(_unpaired(_safe_name(stem), None, path, f"{f} declares its reference {declared}, "
                                                                      f"which is not in {refs}"))
            continue
        prefixes = [s for s in ref_stems if stem == s or stem.startswith(s + "_")]
        if prefixes:
            best = max(prefixes, key=len)
            found.append(SuiteEntry(_safe_name(stem), os.path.join(refs, ref_stems[best]), path))
        else:
            found.append(_unpaired(_safe_name(stem), None, path,
                                   f"no reference for {f}: its name is not level_<L>_problem_<N>_sample_<S>_kernel.py "
                                   f"and no file in {refs} is named after a prefix of it"))
    found.sort(key=lambda e: _natural(e.name))
    return _unique(found)


def _unique(entries: list[SuiteEntry]) -> list[SuiteEntry]:
    seen: dict[str, int] = {}
    for e in entries:
        base = e.name
        if base in seen:
            seen[base] += 1
            e.name = f"{base}-{seen[base]}"
        else:
            seen[base] = 1
    return entries


def discover(dirs: Sequence[str] = (), refs: str | None = None, cands: str | None = None) -> list[SuiteEntry]:
    if (refs is None) != (cands is None):
        raise click.UsageError("--refs and --cands go together")
    if refs is not None and dirs:
        raise click.UsageError("give either DIR (one folder per problem) or --refs/--cands, not both")
    if refs is not None:
        return discover_kernelbench(refs, cands)
    if not dirs:
        raise click.UsageError("give DIR (one folder per problem with ref.py and cand.py) or --refs DIR --cands DIR")
    return discover_folders(dirs)


# ----------------------------------------------------------------------------- reading an answer back
def _stage_text(stage) -> str | None:
    if stage is None:
        return None
    return f"stage {stage.index} {stage_names(stage)}"


def entry_from_result(entry: SuiteEntry, result) -> SuiteEntry:
    """Fill `entry` from a diff's Result."""
    entry.verdict = result.verdict
    entry.headline = headline(result)
    fd, rc = result.first_divergence, result.root_cause
    entry.first_divergence = _stage_text(fd)
    entry.root_cause = _stage_text(rc)
    findings = (list(rc.diagnosis) if rc is not None else []) or (list(fd.diagnosis) if fd is not None else []) \
        or (list(result.findings) if result.verdict != "match" else [])
    entry.diagnosis = findings[0].kind if findings else None
    entry.diagnosis_detail = findings[0].detail if findings else None
    best = explaining_what_if(result) if result.verdict != "match" else None
    if best is not None:  # a run of the reference with that mistake gives the candidate's values: as the headline says
        entry.diagnosis, entry.diagnosis_detail = what_if_diagnosis(best)
    entry.error = failure_summary(result.error) if result.error is not None else (
        entry.headline if result.verdict == "error" else None)
    h = getattr(result, "harden", None)
    if h is not None:
        entry.harden = harden_cell(h)
        entry.harden_detail = harden_setting_line(h.breaking[0]) if h.breaking else (
            f"{h.findings[0].kind}: {h.findings[0].detail}" if h.findings else None)
    return entry


def expected_exit(result) -> int | None:
    """The exit code of `diffkit diff` for `result`: its verdict's, and 1 for a match that a --harden setting
    breaks."""
    h = getattr(result, "harden", None)
    if result.verdict == "match" and h is not None and h.verdict == "breaks":
        return EXIT["diverged"]
    return EXIT.get(result.verdict)


def _reason(log_text: str) -> str:
    """The line of a child's log that says why it failed."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for pattern in (r"^diffkit: INTERNAL ERROR", r"^diffkit: ERROR", r"^[\w.]*(Error|Exception)\b.*:"):
        hit = next((ln for ln in reversed(lines) if re.match(pattern, ln)), None)
        if hit:
            return clip(hit, 500)
    return clip(lines[-1], 500) if lines else "no output"


# ----------------------------------------------------------------------------- skipped: CUDA or Triton missing
# what a diff says when the machine lacks CUDA (torch's own messages: no CUDA build, no driver, no device, no
# toolkit for load_inline) or Triton (the import fails, or Triton finds no GPU backend)
MISSING = {
    "CUDA": re.compile(r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|CUDA_HOME environment variable "
                       r"is not set|No CUDA GPUs are available|CUDA is not available|no CUDA-capable device|"
                       r"CUDA driver version is insufficient|nvcc(: not found| not found|\b.*No such file)|"
                       r"Cannot access accelerator device when none is available|NVIDIA driver on your system is too "
                       r"old|cuda.*is not available", re.IGNORECASE),
    "Triton": re.compile(r"No module named '?triton|0 active drivers|Triton.*(requires|needs) a GPU", re.IGNORECASE),
}
# how a file shows that it needs one of them (what the skip reason names; the verdict itself rests on the diff's
# own error and on this machine lacking the thing)
NEEDS = (
    ("Triton", "imports triton", re.compile(r"^\s*(import|from)\s+triton\b", re.MULTILINE)),
    ("CUDA", "builds a CUDA extension (load_inline with cuda_sources)", re.compile(r"\bcuda_sources\s*=")),
    ("CUDA", "compiles .cu sources", re.compile(r"[\"'][^\"'\n]+\.cu[\"']")),
    ("CUDA", "moves tensors with .cuda()", re.compile(r"\.cuda\(\s*\)")),
    ("CUDA", "puts tensors on device \"cuda\"", re.compile(r"device\s*=\s*(torch\.device\()?[\"']cuda")),
    ("CUDA", "declares DIFFKIT_EXPECT device cuda", re.compile(r"[\"']device[\"']\s*:\s*[\"']cuda")),
)


def needs_cuda(path: str | None) -> list[tuple[str, str]]:
    """What in a pair file needs CUDA or Triton: [(thing, how the file shows it)], read without running it."""
    if not path:
        return []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return []
    return [(thing, how) for thing, how, pattern in NEEDS if pattern.search(text)]


def machine_has(thing: str) -> bool:
    """Whether this machine has CUDA (a device torch can use) or Triton (importable, with a device to run on)."""
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except Exception:
        cuda = False
    if thing == "CUDA":
        return cuda
    import importlib.util

    return cuda and importlib.util.find_spec("triton") is not None


def unavailable_reason(entry: SuiteEntry, log_text: str) -> str | None:
    """Why an errored pair is to be skipped instead: its diff failed saying CUDA (or Triton) is missing and this
    machine has none; None for any other error (a candidate that says so on a CUDA machine is an error)."""
    said = "\n".join(x for x in (entry.error, log_text) if x)
    for thing, pattern in MISSING.items():
        hit = pattern.search(said)
        if hit is None or machine_has(thing):
            continue
        shown = [f"{side} {how}" for side, path in (("the reference", entry.ref), ("the candidate", entry.cand))
                 for t, how in needs_cuda(path) if t == thing or thing == "CUDA"]
        line = next((ln.strip() for ln in said.splitlines() if hit.group(0) in ln), hit.group(0))
        return (f"needs {thing}, which this machine lacks" + (f" ({'; '.join(shown)})" if shown else "")
                + f": {clip(line, 300)}")
    return _unbuildable(entry)


BUILDS = ("builds a CUDA extension (load_inline with cuda_sources)", "compiles .cu sources")


def _unbuildable(entry: SuiteEntry) -> str | None:
    """A side whose file builds CUDA sources failed to import (or build) on a machine without CUDA, in words of
    its own (torch's build of another pair's same extension failing beside it: "cannot open shared object
    file"): it cannot be judged here, whatever the build said."""
    m = re.search(r"\b(reference|candidate) failed \((import|build)\)", entry.error or "")
    if m is None or machine_has("CUDA"):
        return None
    path = entry.cand if m.group(1) == "candidate" else entry.ref
    shown = [how for thing, how in needs_cuda(path) if thing == "CUDA" and how in BUILDS]
    if not shown:
        return None
    return (f"needs CUDA, which this machine lacks (the {m.group(1)} {'; '.join(shown)}): its {m.group(2)} failed "
            f"here: {clip(entry.error or '', 300)}")


def _skip(entry: SuiteEntry, reason: str) -> SuiteEntry:
    entry.verdict, entry.error, entry.skip_reason = "skipped", None, reason
    entry.first_divergence = entry.root_cause = entry.diagnosis = entry.diagnosis_detail = None
    entry.headline = f"diffkit: SKIPPED: {reason}"
    return entry


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fingerprint(entry: SuiteEntry, diff_args: list[str]) -> dict:
    return {"ref": os.path.abspath(entry.ref), "cand": os.path.abspath(entry.cand), "ref_sha256": _sha256(entry.ref),
            "cand_sha256": _sha256(entry.cand), "diff_args": list(diff_args)}


def resumed(entry: SuiteEntry, pair_dir: str, diff_args: list[str]) -> SuiteEntry | None:
    """The entry as its marker recorded it, when the pair was finished for the same files and options
    and its result.json is still the one written then and still reads as a Result."""
    marker, rjson = os.path.join(pair_dir, MARKER), os.path.join(pair_dir, "result.json")
    try:
        with open(marker, encoding="utf-8") as fh:
            m = json.load(fh)
        if {k: m.get(k) for k in ("ref", "cand", "ref_sha256", "cand_sha256", "diff_args")} \
                != _fingerprint(entry, diff_args):
            return None
        if _sha256(rjson) != m.get("result_sha256"):
            return None
        with open(rjson, encoding="utf-8") as fh:
            Result.from_json(fh.read())
        done = SuiteEntry.from_dict(m["entry"])
    except Exception:
        return None
    done.name, done.ref, done.cand = entry.name, entry.ref, entry.cand
    return done if done.finished else None


# ----------------------------------------------------------------------------- files
def atomic_write(path: str, text: str) -> None:
    """Write `text` to `path` so a reader (or an interrupted suite) sees the old file or the new one."""
    write_text(path, text)  # (a fresh file renamed into place: never through a link planted in the folder)


def counts(entries: Sequence[SuiteEntry]) -> dict[str, int]:
    c = {v: 0 for v in ("match", "diverged", "error", "skipped", "pending")}
    for e in entries:
        c[e.verdict or "pending"] += 1
    return c


def hardened(entries: Sequence[SuiteEntry]) -> bool:
    """Whether the suite ran with --harden (some pair has its --harden answer): its files then show it."""
    return any(e.harden is not None for e in entries)


def harden_counts_text(entries: Sequence[SuiteEntry]) -> str:
    """", 2 break under --harden" when the suite ran with --harden, else ""."""
    if not hardened(entries):
        return ""
    return f", {sum(1 for e in entries if e.breaks)} break under --harden"


def summary_json(entries: Sequence[SuiteEntry]) -> str:
    """summary.json: one object per finished pair (name, verdict, first_divergence, root_cause, report, …)."""
    keys = ("name", "verdict", "first_divergence", "root_cause", "report", "diagnosis", "diagnosis_detail", "seconds",
            "error", "headline", "ref", "cand", "skip_reason") + (HARDEN_KEYS if hardened(entries) else ())
    rows = [{k: getattr(e, k) for k in keys} for e in entries if e.finished]
    return json.dumps(json_safe(rows), indent=2, allow_nan=False) + "\n"


CSV_COLUMNS = ["name", "verdict", "first_divergence", "root_cause", "diagnosis", "seconds", "report", "error",
               "headline", "ref", "cand", "skip_reason"]


def summary_csv(entries: Sequence[SuiteEntry]) -> str:
    """summary.csv: one row per finished pair; text cells a spreadsheet would take for a formula are escaped."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = CSV_COLUMNS + (["harden"] if hardened(entries) else [])
    writer.writerow(columns)
    for e in entries:
        if e.finished:
            writer.writerow([csv_safe(v) for v in (getattr(e, k) for k in columns)])
    return buf.getvalue()


def _message(e: SuiteEntry) -> str:
    return e.headline or e.error or e.verdict or ""


def junit_xml(entries: Sequence[SuiteEntry], suite: str = "diffkit.suite") -> str:
    """junit.xml: one testcase per pair; <failure> for diverged, <error> for errored, <skipped> for skipped (with
    the reason) and not run;
    the pair's report as the property diffkit_report."""
    root = ET.Element("testsuites")
    ts = el(root, "testsuite", name=suite)
    c = counts(entries)
    total = 0.0
    for e in entries:
        case = el(ts, "testcase", classname=suite, name=e.name, time=f"{e.seconds or 0:.3f}")
        total += e.seconds or 0
        if e.report:
            props = el(case, "properties")
            el(props, "property", name="diffkit_report", value=e.report)
        detail = "\n".join(x for x in (e.headline, f"reference: {e.ref}" if e.ref else "",
                                       f"candidate: {e.cand}" if e.cand else "",
                                       f"diagnosis: {e.diagnosis}: {e.diagnosis_detail}" if e.diagnosis else "",
                                       f"--harden: {e.harden}" if e.harden else "",
                                       f"--harden: {e.harden_detail}" if e.harden_detail else "",
                                       f"report: {e.report}" if e.report else "") if x)
        if e.verdict == "diverged":
            el(case, "failure", detail, message=_message(e), type="diverged")
        elif e.breaks:
            el(case, "failure", detail, message=f"--harden: {e.harden_detail or e.harden}"[:500], type="harden")
        elif e.verdict == "error":
            el(case, "error", detail or e.error, message=e.error or _message(e), type="error")
        elif e.verdict == "skipped":
            el(case, "skipped", e.headline, message=e.skip_reason or "skipped")
        elif e.verdict is None:
            el(case, "skipped", message="not run (the suite was interrupted or is still running)")
    for k, v in (("tests", len(entries)), ("failures", c["diverged"] + sum(1 for e in entries if e.breaks)),
                 ("errors", c["error"]),
                 ("skipped", c["pending"] + c["skipped"]), ("time", f"{total:.3f}")):
        ts.set(k, str(v))
    return ET.tostring(root, encoding="UTF-8", xml_declaration=True).decode("utf-8") + "\n"


def summary_markdown(entries: Sequence[SuiteEntry], title: str = "diffkit suite") -> str:
    """summary.md: counts and a table of pairs (errors and divergences first), for a CI job summary."""
    icon = {"match": "✅", "diverged": "❌", "error": "💥", "skipped": "⏭️", None: "⏳"}
    c = counts(entries)
    parts = [f"{c['match']} match", f"{c['diverged']} diverged", f"{c['error']} error"]
    if c["skipped"]:
        parts.append(f"{c['skipped']} skipped")
    if c["pending"]:
        parts.append(f"{c['pending']} not run")
    with_harden = hardened(entries)
    if with_harden:
        parts.append(f"{sum(1 for e in entries if e.breaks)} break under --harden")
    head, rule = "| | pair | verdict | first divergence | root cause | diagnosis | time |", "|---|---|---|---|---|---|---|"
    if with_harden:
        head, rule = head + " harden |", rule + "---|"
    lines = [f"## {md_escape(title)}: {', '.join(parts)} ({len(entries)} pairs)", "", head, rule]
    order = {v: i for i, v in enumerate(VERDICT_ORDER)}
    for e in sorted(entries, key=lambda x: order.get(x.verdict, len(order))):
        first = e.first_divergence or (e.error if e.verdict == "error" else None) or (
            e.skip_reason if e.verdict == "skipped" else None)
        lines.append(f"| {icon['diverged'] if e.breaks else icon.get(e.verdict, '')} | {md_code(e.name)} | {md_escape(e.verdict or 'not run')} | "
                     f"{md_escape(first or '–')} | {md_escape(e.root_cause or '–')} | "
                     f"{md_escape(e.diagnosis or '–')} | "
                     f"{'' if e.seconds is None else f'{e.seconds:.1f} s'} |"
                     + (f" {md_escape(e.harden or '–')} |" if with_harden else ""))
    return "\n".join(lines) + "\n"


def index_html(entries: Sequence[SuiteEntry], title: str = "diffkit suite", note: str = "") -> str:
    """index.html: a table of the pairs linking each pair's report (Jinja2, autoescaped)."""
    return template("suite.html").render(title=title, entries=list(entries), counts=counts(entries), note=note,
                                         harden=hardened(entries), breaks=sum(1 for e in entries if e.breaks),
                                         colours=dict(VERDICT_COLOUR, pending="#999999", skipped="#b9770e"),
                                         written=time.strftime("%Y-%m-%d %H:%M:%S"))


def write_summaries(entries: Sequence[SuiteEntry], out_dir: str, note: str = "") -> dict[str, str]:
    """Every summary file, each replaced atomically."""
    os.makedirs(out_dir, exist_ok=True)
    texts = {"index.html": index_html(entries, note=note), "summary.json": summary_json(entries),
             "summary.csv": summary_csv(entries), "junit.xml": junit_xml(entries),
             "summary.md": summary_markdown(entries)}
    paths = {}
    for name, text in texts.items():
        paths[name] = os.path.join(out_dir, name)
        atomic_write(paths[name], text)
    return paths


def exit_code(entries: Sequence[SuiteEntry]) -> int:
    """0 all match, 1 any diverged or broken under --harden (none errored), 2 any errored or not run; skipped
    pairs (CUDA or Triton missing) count for nothing."""
    verdicts = {e.verdict for e in entries}
    if "error" in verdicts or None in verdicts:
        return EXIT["error"]
    return EXIT["diverged"] if "diverged" in verdicts or any(e.breaks for e in entries) else EXIT["match"]


# ----------------------------------------------------------------------------- running
def visible_gpus() -> list[str]:
    """The ids to put in each child's CUDA_VISIBLE_DEVICES, one per visible GPU ([] without CUDA)."""
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:
        return []
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None and given.strip():
        ids = [x.strip() for x in given.split(",") if x.strip()]
        return ids[:n]
    return [str(i) for i in range(n)]


def worker_slots(workers: int | None, device: str | None) -> list[str | None]:
    """One entry per worker: the GPU it owns (None on CPU).  One worker per GPU unless --workers."""
    gpus = [] if device == "cpu" else visible_gpus()
    if gpus:
        n = workers or len(gpus)
        return [gpus[i % len(gpus)] for i in range(n)]
    return [None] * (workers or 1)


class Runner:
    """Runs pairs in child processes, a pool of workers each owning a slot (a GPU or a CPU share)."""

    def __init__(self, out_dir: str, diff_args: list[str], slots: list[str | None], deadline: float | None):
        self.out_dir, self.diff_args, self.deadline = out_dir, diff_args, deadline
        self.slots: queue.Queue = queue.Queue()
        for s in slots:
            self.slots.put(s)
        self.workers = len(slots)
        self.stop = threading.Event()
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.running: set[str] = set()  # names of the pairs whose child is running

    def pair_dir(self, entry: SuiteEntry) -> str:
        return os.path.join(self.out_dir, entry.name)

    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self.running)

    def command(self, entry: SuiteEntry) -> list[str]:
        """A pair's `diffkit` arguments."""
        d = self.pair_dir(entry)
        return ["diff", entry.ref, entry.cand, "--report-dir", d, "--json", os.path.join(d, "result.json"),
                *self.diff_args]

    def run(self, entry: SuiteEntry) -> SuiteEntry:
        """Diff one pair; an entry with verdict None when the suite was stopped before it finished."""
        if self.stop.is_set():
            return entry
        slot = self.slots.get()
        try:
            return self._run(entry, slot)
        finally:
            self.slots.put(slot)

    def _run(self, entry: SuiteEntry, slot: str | None) -> SuiteEntry:
        d = self.pair_dir(entry)
        os.makedirs(d, exist_ok=True)
        for stale in (MARKER, "result.json"):  # a half-run pair must never look finished
            try:
                os.remove(os.path.join(d, stale))
            except FileNotFoundError:
                pass
        env = dict(os.environ)
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot
        log_path = os.path.join(d, LOG)
        start = time.monotonic()
        why = None
        with open_fresh(log_path) as log:
            # (the command as a user would type it; the child itself is started by `python_command`, which runs
            # this diffkit whatever the current folder holds)
            log.write("$ " + " ".join([sys.executable, "-m", "diffkit.cli", *self.command(entry)])
                      + (f"  (CUDA_VISIBLE_DEVICES={slot})" if slot else "")
                      + "\n")
            log.flush()
            with self._lock:
                if self.stop.is_set():
                    return entry
                # its own process group: stopping it stops what it started (the per-side children, ninja …);
                # forked from a process that imported torch and diffkit once (diffkit.warm), else a fresh interpreter
                proc = warm.start(self.command(entry), env, os.getcwd(), log_path) or \
                    subprocess.Popen([*python_command(), *self.command(entry)], stdout=log, stderr=subprocess.STDOUT,
                                     env=env, stdin=subprocess.DEVNULL, start_new_session=True)
                self._procs.add(proc)
                self.running.add(entry.name)
            try:
                code = proc.wait(timeout=self.deadline)
            except subprocess.TimeoutExpired:
                _stop(proc)
                code, why = proc.returncode, f"did not finish within {self.deadline:g} s and was stopped by the suite"
            finally:
                with self._lock:
                    self._procs.discard(proc)
                    self.running.discard(entry.name)
        seconds = round(time.monotonic() - start, 3)
        if self.stop.is_set() and (why is not None or code not in (0, 1, 2)):
            return entry  # stopped by the suite: not an answer, run again on --resume
        entry = dataclasses.replace(entry, seconds=seconds)
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            log_text = fh.read()
        return self._answer(entry, code, why, log_text)

    def _answer(self, entry: SuiteEntry, code: int | None, why: str | None, log_text: str) -> SuiteEntry:
        d = self.pair_dir(entry)
        rjson = os.path.join(d, "result.json")
        if os.path.exists(os.path.join(d, "index.html")):
            entry.report = f"{entry.name}/index.html"
        entry.log = f"{entry.name}/{LOG}"
        result, unreadable = None, None
        if why is None and code in (0, 1, 2) and os.path.exists(rjson):
            try:
                with open(rjson, encoding="utf-8") as fh:
                    result = Result.from_json(fh.read())
            except Exception as e:
                unreadable = f"its result.json does not read back ({type(e).__name__}: {e})"
        if result is not None:
            entry_from_result(entry, result)
            expected = expected_exit(result)
            if code != expected:  # e.g. the report could not be written: the diff said so and exited 2
                entry.verdict, entry.error = "error", f"diff exited {code}: {_reason(log_text)}"
            else:
                skip = unavailable_reason(entry, log_text) if entry.verdict == "error" else None
                if skip is not None:
                    _skip(entry, skip)
                marker = {**_fingerprint(entry, self.diff_args), "result_sha256": _sha256(rjson),
                          "entry": entry.to_dict()}
                atomic_write(os.path.join(d, MARKER), json.dumps(marker, indent=2) + "\n")
            return entry
        if why is None:
            if code is not None and code < 0:
                why = f"killed by {signal.Signals(-code).name}"
            elif code == INTERNAL:
                why = "internal error of diffkit"
            else:
                why = f"exited with status {code}"
        entry.verdict = "error"
        entry.error = f"the diff {why}: {unreadable or _reason(log_text)}"
        entry.headline = f"diffkit: ERROR: {entry.error}"
        skip = unavailable_reason(entry, log_text) if code is not None and code >= 0 else None
        return _skip(entry, skip) if skip is not None else entry

    def stop_all(self) -> None:
        """Stop every running child (SIGTERM to its group, then SIGKILL)."""
        self.stop.set()
        with self._lock:
            procs = list(self._procs)
        threads = [threading.Thread(target=_stop, args=(p,), daemon=True) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class _Progress:
    """A rich progress bar on a terminal; plain lines otherwise (CI logs, pipes)."""

    def __init__(self, total: int, interactive: bool):
        self.total, self.done, self.interactive = total, 0, interactive
        self._bar = None
        if interactive:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn)

            self._bar = Progress(SpinnerColumn(), TextColumn("[bold]diffkit suite"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}"), transient=False)
            self._task = self._bar.add_task("", total=total)

    def __enter__(self):
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def advance(self, entry: SuiteEntry, skipped: bool = False) -> None:
        self.done += 1
        secs = "" if entry.seconds is None else f" ({entry.seconds:.1f} s)"
        what = "resumed: " if skipped else ""
        detail = entry.first_divergence if entry.verdict == "diverged" else (
            entry.error if entry.verdict == "error" else entry.skip_reason if entry.verdict == "skipped" else (
                f"--harden: {entry.harden}" if entry.breaks else ""))
        line = f"[{self.done}/{self.total}] {entry.name}: {what}{entry.verdict}{secs}"
        line += f" — {detail}" if detail else ""
        if self._bar is not None:
            from rich.markup import escape

            colour = {"match": "green", "diverged": "red", "error": "magenta", "skipped": "yellow"}.get(
                entry.verdict or "", "white")
            self._bar.console.print(f"[{colour}]{escape(line)}[/{colour}]", highlight=False)
            self._bar.update(self._task, advance=1)
        else:
            click.echo(line)

    def running(self, names) -> None:
        """Name the pairs in flight beside the bar (a terminal only)."""
        if self._bar is not None:
            from rich.markup import escape

            text = ", ".join(sorted(names, key=_natural))
            self._bar.update(self._task, description=escape(clip(text, self.room())))

    # what the bar's other columns take: the spinner, "diffkit suite", the bar, N/M, the time, the gaps between
    FIXED = 1 + 13 + 40 + 8 + 7 + 5

    def room(self) -> int:
        """How many characters of the terminal are left beside the bar for the pairs in flight (at most 60, at least
        12): rich would otherwise crop the line itself, or squeeze the bar, without showing what it dropped."""
        width = self._bar.console.width if self._bar is not None else 80
        return max(12, min(60, width - self.FIXED - 2 * len(str(self.total))))


def plan(entries: list[SuiteEntry], out_dir: str, diff_args: list[str], resume: bool,
         progress: _Progress) -> list[int]:
    """The indices of the pairs to run; pairs discovery could not make, and with `resume` those already
    answered (`entries` takes their recorded answer), are shown as done."""
    todo: list[int] = []
    for i, e in enumerate(entries):
        if not e.runnable:
            progress.advance(e)
            continue
        if resume:
            done = resumed(e, os.path.join(out_dir, e.name), diff_args)
            if done is not None:
                entries[i] = done
                progress.advance(done, skipped=True)
                continue
        todo.append(i)
    return todo


@contextlib.contextmanager
def interruptible(stop: threading.Event) -> Iterator[list[int]]:
    """SIGINT/SIGTERM set `stop` instead of raising; yields the list the signals received are appended to."""
    stopped: list[int] = []

    def handler(signum, frame):
        stopped.append(signum)
        stop.set()

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    try:
        yield stopped
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def interrupted_note(entries: Sequence[SuiteEntry], stopped: list[int]) -> str:
    return (f"interrupted by {signal.Signals(stopped[0]).name}: {counts(entries)['pending']} pairs not run; "
            f"--resume runs them") if stopped else ""


def run_suite(entries: list[SuiteEntry], out_dir: str, diff_args: list[str], *, slots: list[str | None] | None = None,
              timeout: float | None = None, resume: bool = False,
              interactive: bool = False) -> tuple[list[SuiteEntry], int | None]:
    """Run every runnable pair (`slots`: one per worker, see `worker_slots`); return the entries and the
    signal that stopped the suite (None when it ran to the end).  The summary files are rewritten after
    each finished pair, so an interrupted suite leaves valid ones."""
    os.makedirs(out_dir, exist_ok=True)
    slots = slots or [None]
    runner = Runner(out_dir, diff_args, slots, pair_deadline(timeout))
    entries = list(entries)
    stopped: list[int] = []
    with _Progress(len(entries), interactive) as progress:
        todo = plan(entries, out_dir, diff_args, resume, progress)
        write_summaries(entries, out_dir)
        try:
            with interruptible(runner.stop) as stopped, \
                    cf.ThreadPoolExecutor(max(1, runner.workers), thread_name_prefix="diffkit-suite") as pool:
                futures = {pool.submit(runner.run, entries[i]): i for i in todo}
                pending = set(futures)

                def collect(finished) -> None:
                    for f in finished:
                        i = futures[f]
                        if f.cancelled():
                            continue
                        try:
                            e = f.result()
                        except Exception as exc:  # the runner itself failed: this pair errors, the others go on
                            e = dataclasses.replace(entries[i], verdict="error", error=f"the suite could not run "
                                                    f"this pair: {type(exc).__name__}: {exc}")
                        if e.finished:
                            entries[i] = e
                            progress.advance(e)
                            write_summaries(entries, out_dir)

                while pending:
                    done_now, pending = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
                    collect(done_now)
                    progress.running(runner.in_flight())
                    if runner.stop.is_set():
                        for f in pending:
                            f.cancel()
                        runner.stop_all()
                        collect(cf.wait(pending).done)
                        break
        finally:
            write_summaries(entries, out_dir, note=interrupted_note(entries, stopped))
    return entries, (stopped[0] if stopped else None)


def pair_deadline(timeout: float | None) -> float | None:
    """How long the suite lets one pair's child run: past both sides' --timeout plus GRACE_S."""
    return (2 * timeout + GRACE_S) if timeout else None


# ----------------------------------------------------------------------------- the command
def _diff_options() -> list[click.Option]:
    """The options of `diffkit diff` a suite passes through (only those `diff` has)."""
    by_name = {p.name: p for p in DIFF_OPTIONS}
    return [by_name[n] for n in PASS_THROUGH if n in by_name]


def diff_argv(ctx: click.Context, values: dict[str, Any]) -> list[str]:
    """The pass-through options given on the command line, as `diffkit diff` arguments."""
    from click.core import ParameterSource

    argv: list[str] = []
    for opt in _diff_options():
        if ctx.get_parameter_source(opt.name) in (None, ParameterSource.DEFAULT):
            continue
        value = values.get(opt.name)
        if opt.is_flag:
            if opt.is_bool_flag:
                if value:
                    argv.append(opt.opts[0])
                elif opt.secondary_opts:
                    argv.append(opt.secondary_opts[0])
            elif value == opt.flag_value:
                argv.append(opt.opts[0])
        elif value is None:
            continue
        elif opt.multiple:
            for v in value:
                argv += [opt.opts[0], *(map(str, v) if opt.nargs > 1 else [str(v)])]
        elif opt.nargs > 1:
            argv += [opt.opts[0], *map(str, value)]
        else:
            argv += [opt.opts[0], str(value)]
    return argv


class SuiteCommand(click.Command):
    """`suite` with the pass-through options of `diff` added when the command line is parsed."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)
        own = {p.name for p in params}
        extra = [p for p in _diff_options() if p.name not in own]
        help_opt = self.get_help_option(ctx)
        if help_opt is not None and params and params[-1] is help_opt:
            return [*params[:-1], *extra, help_opt]
        return [*params, *extra]


@click.command(cls=SuiteCommand, name="suite")
@click.argument("dirs", metavar="[DIR]...", nargs=-1, type=click.Path(file_okay=False))
@click.option("--refs", type=click.Path(file_okay=False), default=None,
              help="folder of KernelBench references (<N>_*.py); pairs with --cands")
@click.option("--cands", type=click.Path(file_okay=False), default=None,
              help="folder of candidates (level_<L>_problem_<N>_sample_<S>_kernel.py, or named after a reference)")
@click.option("--report-dir", "report_dir", type=click.Path(file_okay=False), default=os.path.join("reports", "suite"),
              show_default=True, help="each pair's report in <name>/, and index.html, summary.json, summary.csv, "
                                      "junit.xml, summary.md")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="pairs at once (default: one per visible GPU, else 1)")
@click.option("--select", "select", multiple=True, metavar="GLOB",
              help="run only the pairs whose names match this glob (repeatable), e.g. 'level_2_*'")
@click.option("--resume", is_flag=True,
              help="skip pairs already answered for the same files and options (their report's suite.json)")
@click.option("--ray", "ray_address", is_flag=False, flag_value=LOCAL_RAY, default=None, metavar="[ADDRESS]",
              help="run each pair as a Ray task: 'auto' joins the running cluster, an address joins that one, no "
                   "value starts a local one (needs pip install -e '.[ray]'; put it after DIR or write --ray=ADDRESS)")
@click.pass_context
def suite(ctx, dirs, refs, cands, report_dir, workers, select, resume, ray_address, **passthrough):
    """Diff many pairs, each in its own process: DIR holds one folder per problem (ref.py, cand.py), or
    --refs/--cands pair KernelBench-named files.  Writes each pair's report and index.html, summary.json,
    summary.csv, junit.xml and summary.md under --report-dir.

    A pair that needs CUDA or Triton on a machine without them is skipped (counted apart, exit code unchanged).

    Exit code: 0 all match, 1 any diverged (or, with --harden, broken by a setting), 2 any errored (or a bad
    flag, or --ray without Ray installed), 130/143 interrupted."""
    if ray_address is not None and ray_address != LOCAL_RAY and os.path.isdir(ray_address):
        raise click.UsageError(f"--ray took the folder {ray_address} for a cluster address: put --ray after DIR, "
                               f"or write --ray=ADDRESS")
    entries = discover(dirs, refs, cands)
    if select:
        import fnmatch

        entries = [e for e in entries if any(fnmatch.fnmatchcase(e.name, g) for g in select)]
    if not entries:
        raise click.UsageError(f"no pairs found in {', '.join(dirs) if dirs else cands}"
                               + (f" matching {', '.join(select)}" if select else ""))
    argv = diff_argv(ctx, passthrough)
    interactive = sys.stdout.isatty()
    if ray_address is not None:
        if workers is not None:
            raise click.UsageError("--workers does not go with --ray: the cluster's CPUs and GPUs set how many "
                                   "pairs run at once")
        if "ray" not in BACKENDS:
            raise click.UsageError("--ray: the Ray backend is not loaded (import diffkit.suite_ray)")
        entries, stopped = BACKENDS["ray"](entries, report_dir, argv, address=ray_address,
                                         timeout=passthrough.get("timeout"), resume=resume, interactive=interactive)
    else:
        slots = worker_slots(workers, passthrough.get("device"))
        where = (f"{len(slots)} worker(s) on GPU {', '.join(sorted(set(s for s in slots if s), key=_natural))}"
                 if any(s is not None for s in slots) else f"{len(slots)} worker(s) on CPU")
        click.echo(f"diffkit suite: {len(entries)} pairs, {where} -> {report_dir}")
        entries, stopped = run_suite(entries, report_dir, argv, slots=slots, timeout=passthrough.get("timeout"),
                                     resume=resume, interactive=interactive)
    c = counts(entries)
    click.echo(f"diffkit suite: {c['match']} match, {c['diverged']} diverged, {c['error']} error"
               + (f", {c['skipped']} skipped" if c["skipped"] else "")
               + (f", {c['pending']} not run" if c["pending"] else "") + harden_counts_text(entries)
               + f"; {os.path.join(report_dir, 'index.html')}")
    if stopped is not None:
        sys.exit(128 + stopped)
    sys.exit(exit_code(entries))
