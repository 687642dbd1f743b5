"""Names a person recognises: the variable a tensor is assigned to, else the expression text.

Given the user frame that is executing a call, the column span of the running bytecode
instruction (``co_positions``) is mapped onto the AST of the file.  When that span is the
right-hand side of an assignment the target gives the name (``q, k, v = ...`` by position);
otherwise the source text of the expression is used.  Lookups are cached per
``(code object, f_lasti)`` so a repeated call costs a dictionary access.
"""
from __future__ import annotations

import ast
import linecache
import os
import re
import sys
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR: str | None = None


def _torch_dir() -> str:
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch

        _TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
    return _TORCH_DIR


@dataclass(frozen=True)
class Site:
    """Where in user source a tensor was made."""

    file: str
    line: int
    function: str
    labels: tuple[str, ...]  # one label per produced value when a tuple target names them
    text: str  # the expression text (short)
    args: tuple[str, ...] = ()  # source text of the positional arguments when the site is a call
    rebound: frozenset = frozenset()  # variables assigned more than once in this function

    def label(self, i: int = 0, n: int = 1) -> str:
        if len(self.labels) == n and n > 1:
            return self.labels[i]
        if len(self.labels) == 1:
            return self.labels[0] if n == 1 else f"{self.labels[0]}[{i}]"
        return self.text if n == 1 else f"{self.text}[{i}]"


UNKNOWN_SITE = Site("", 0, "?", (), "?")  # where no user frame was found


def store_label(site: Site) -> str:
    """The name a store `y[i] = v` is recorded under: the tensor written, `y`."""
    return site.labels[0] if site.labels else (re.match(r"[\w.]+", site.text) or [site.text])[0]


_skip_cache: dict[str, bool] = {}


def is_internal_file(filename: str) -> bool:
    hit = _skip_cache.get(filename)
    if hit is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        hit = (
            path.startswith(_torch_dir() + os.sep)
            or path.startswith(_PKG_DIR + os.sep)
            or filename.startswith("<frozen")
            or os.sep + "contextlib.py" in path
            or os.sep + "triton" + os.sep in path
        )
        _skip_cache[filename] = hit
    return hit


def user_frame(start: FrameType | None = None) -> FrameType | None:
    """The innermost frame that is neither torch's nor diffkit's own."""
    f = start if start is not None else sys._getframe(1)
    while f is not None and is_internal_file(f.f_code.co_filename):
        f = f.f_back
    return f


# ---------------------------------------------------------------- AST index
_SHORT = 48


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _SHORT else text[: _SHORT - 1] + "…"


_line_cache: dict[int, list[bytes]] = {}


def _segment(source: str, node: ast.AST) -> str | None:
    """Source text of `node` (ast.get_source_segment re-splits the file on every call: too slow)."""
    lines = _line_cache.get(id(source))
    if lines is None:
        lines = _line_cache[id(source)] = [ln.encode() for ln in source.splitlines(keepends=True)]
    try:
        l0, l1 = node.lineno - 1, node.end_lineno - 1
        c0, c1 = node.col_offset, node.end_col_offset
    except AttributeError:
        return None
    if l1 is None or c1 is None or l0 >= len(lines):
        return None
    if l0 == l1:
        return lines[l0][c0:c1].decode(errors="replace")
    parts = [lines[l0][c0:]] + lines[l0 + 1:l1] + [lines[l1][:c1]]
    return b"".join(parts).decode(errors="replace")


class _FileIndex:
    """Maps exact source spans of expressions to the names they are given."""

    def __init__(self, filename: str):
        self.spans: dict[tuple[int, int, int, int], tuple[tuple[str, ...], str]] = {}
        self.call_args: dict[tuple[int, int, int, int], tuple[str, ...]] = {}
        source = "".join(linecache.getlines(filename))
        if not source:
            return
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return
        self.source = source
        self.rebound: dict[tuple[str, int], frozenset] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                counts: dict[str, int] = {}
                for sub in ast.walk(node):
                    targets = []
                    if isinstance(sub, ast.Assign):
                        targets = sub.targets
                    elif isinstance(sub, (ast.AugAssign, ast.AnnAssign)):
                        targets = [sub.target]
                    for t in targets:
                        for n in ast.walk(t):
                            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                                counts[n.id] = counts.get(n.id, 0) + 1
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                self.rebound[(node.name, first)] = frozenset(k for k, v in counts.items() if v > 1)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self._bind(targets[-1], node.value, source)
            elif isinstance(node, ast.AugAssign):  # `x += y` runs as one instruction spanning the statement
                key = (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)
                text = _short(_segment(source, node) or "")
                self.spans[key] = ((_target_name(node.target, source),), text)
            if isinstance(node, ast.expr):
                key = (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)
                self.spans.setdefault(key, ((), _short(_segment(source, node) or "")))
                if isinstance(node, ast.Call):
                    self.call_args[key] = tuple(
                        _short(_segment(source, a) or "?") for a in node.args
                    )
        _line_cache.pop(id(source), None)

    def _bind(self, target: ast.AST, value: ast.AST, source: str) -> None:
        text = _short(_segment(source, value) or "")
        key = (value.lineno, value.col_offset, value.end_lineno, value.end_col_offset)
        if isinstance(target, (ast.Tuple, ast.List)):
            names = tuple(_target_name(t, source) for t in target.elts)
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(names):
                for t, v in zip(target.elts, value.elts):
                    self._bind(t, v, source)
            self.spans[key] = (names, text)
        else:
            self.spans[key] = ((_target_name(target, source),), text)

    def lookup(self, pos: tuple[int | None, int | None, int | None, int | None]):
        line, end_line, col, end_col = pos
        if line is None or col is None:
            return None, ()
        key = (line, col, end_line, end_col)
        return self.spans.get(key), self.call_args.get(key, ())


def _target_name(t: ast.AST, source: str) -> str:
    if isinstance(t, ast.Name):
        return t.id
    if isinstance(t, ast.Starred):
        return _target_name(t.value, source)
    if isinstance(t, ast.Subscript):  # out[:, :n] = ... names `out`
        return _target_name(t.value, source)
    if isinstance(t, ast.Attribute):
        return _short(_segment(source, t) or t.attr)
    return _short(_segment(source, t) or "?")


_files: dict[str, _FileIndex] = {}
_stamps: dict[str, int | None] = {}  # a checksum of a file's text when its index was made


def _stamp(filename: str) -> int | None:
    """A checksum of the file's bytes (not its time stamp: an edit within the file system's time resolution,
    or one that keeps the size, changes it too)."""
    import zlib

    try:
        with open(filename, "rb") as fh:
            return zlib.crc32(fh.read())
    except OSError:
        return None


def refresh() -> None:
    """Forget what was read of source files that changed on disk since (a notebook that edits a kernel
    file and diffs it again runs new code: its names must come from the new text, not the old lines)."""
    for filename in list(_files):
        if _stamps.get(filename) != _stamp(filename):
            _files.pop(filename, None)
            _stamps.pop(filename, None)
            linecache.checkcache(filename)
# (id of a code object, instruction offset) -> (a weak reference to the code object, its Site); an entry goes
# when its code object does.  Not keyed by the code object: its hash is computed from its whole body each
# time, and this runs for every recorded op
_sites: dict[tuple[int, int], tuple[Any, Site]] = {}


def _forget_code(key: tuple[int, int]) -> Callable[[Any], None]:
    return lambda _ref: _sites.pop(key, None)


def site_of(frame: FrameType) -> Site:
    """The naming site of the instruction `frame` is executing (cached)."""
    code = frame.f_code
    key = (id(code), frame.f_lasti)
    hit = _sites.get(key)
    if hit is not None and hit[0]() is code:
        return hit[1]
    filename = code.co_filename
    index = _files.get(filename)
    if index is None:
        _stamps[filename] = _stamp(filename)
        index = _files[filename] = _FileIndex(filename)
    pos = None
    try:
        positions = code.co_positions()  # Python >= 3.11
        for i, p in enumerate(positions):
            if i == frame.f_lasti // 2:
                pos = p
                break
    except AttributeError:
        pass
    found, args = index.lookup(pos) if pos is not None else (None, ())
    line = frame.f_lineno or 0
    rebound = getattr(index, "rebound", {}).get((code.co_name, code.co_firstlineno), frozenset())
    if found is None:
        text = _short(linecache.getline(filename, line).strip()) or code.co_name
        site = Site(filename, line, code.co_name, (), text, args, rebound)
    else:
        labels, text = found
        site = Site(filename, line, code.co_name, labels, text, args, rebound)
    try:
        _sites[key] = (weakref.ref(code, _forget_code(key)), site)
    except TypeError:  # (no weak reference to it here: not cached)
        pass
    return site
