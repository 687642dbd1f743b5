"""Capture files: a forward's records on disk, safe to open from strangers.

A capture is a directory (conventionally ``*.dkt``) holding safetensors shards and one
``index.json`` with every record's metadata, the shard and key of its value, and the error if
the forward raised.  It is written incrementally: a shard whenever the buffer passes
`shard_bytes`, each flushed record's metadata appended as one line to ``records.jsonl``, and
``index.json`` rewritten atomically at most once a second and at the end.  A process that dies
mid-forward thus leaves every record flushed before it, at a cost linear in the records.  Reading is lazy: one tensor at a time.
Nothing in it is executable: no pickle anywhere.

Version 2 adds ``info`` (JSON metadata about how the capture was made: source, class, seed,
init inputs, device, dtype, options), ``parameters`` (the name of ``params.safetensors``, the
model's parameters and buffers by qualified name, or null) and a per-record ``params`` list (the
qualified names of the parameters/buffers the producing call read).  Version 1 files still load.
An optional ``inputs_left`` names ``inputs-left.safetensors``: the input tensors the forward changed in
place, by input record name, as it left them (the inputs KernelBench's candidate then runs on), and
``rng_after`` names ``rng-after.safetensors``: the random generators' states the forward left (where
KernelBench's candidate goes on drawing).

Safety (a capture may come from a stranger): every member is opened relative to the capture
directory with ``O_NOFOLLOW`` and must be a regular file directly inside it (member names are
plain file names, never paths); a link, a FIFO, a directory or a name with a separator is
refused.  Writes never go through an existing file: each one creates a fresh file
(``O_CREAT|O_EXCL``) after unlinking whatever stood at the name (a planted link is removed, its
target untouched), and whole files are written to a temporary name and renamed into place.
Safetensors shards are parsed by `diffkit.store_io` (header, then one tensor's bytes with ``pread``), so no
library opens a path by name.  ``index.json`` and ``records.jsonl`` are size-limited, parsed
with the recursion guard turned into an error, and every field is checked for type and range:
every problem is a `DiffkitError` naming the file, the record and the field.
"""
from __future__ import annotations

import collections
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Any, Iterator

import torch

from .errors import DiffkitError
from .inputs import build_from_spec, input_names, read_spec
from .records import CaptureError, Record, Ref, Trace
from .store_io import (MAX_DIM, MAX_DIMS, _DTYPES, _ST_CODES, _Root, _is_int, _parse_json, _plain_name, _read_limited,
                       _show, _st_header, _st_tensor, _st_write)

FORMAT = "diffkit-capture"
VERSION = 2
READABLE_VERSIONS = (1, 2)
PARAMS_FILE = "params.safetensors"
INPUTS_LEFT_FILE = "inputs-left.safetensors"
RNG_AFTER_FILE = "rng-after.safetensors"

_FIELDS = ("index", "name", "kind", "scope", "label", "function", "file", "line", "op", "aliases", "is_output",
           "rebound")
_ERROR_FIELDS = ("type", "message", "scope", "function", "file", "line", "traceback", "call")

# limits on what a capture may hold (a stranger's file must not exhaust memory or the stack)
MAX_INDEX_BYTES = 256 << 20
MAX_JOURNAL_BYTES = 1 << 30
MAX_RECORDS = 4_000_000
MAX_STR = 64 << 10  # names, labels, file paths …
MAX_TEXT = 4 << 20  # an error's message and traceback
MAX_LIST = 1 << 20  # aliases, inputs, params of one record
MAX_LINE = 1 << 31
MAX_DEPTH = 64  # nesting of `info`
MAX_PARAMS = 1 << 20
# (a tensor's dimensions and a safetensors header: limits of diffkit.store_io)


def _depth_ok(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON-like `obj` nests at most `limit` deep (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, tuple)):
            if d > limit:
                return False
            stack.extend((x, d + 1) for x in o)
        elif isinstance(o, dict):
            if d > limit:
                return False
            stack.extend((x, d + 1) for x in o.values())
    return True


# ---------------------------------------------------------------- writing


def _text(v: Any) -> str:
    return "" if v is None else str(v)


def _meta(rec: Record) -> dict:
    d = {k: getattr(rec, k) for k in _FIELDS}
    for k in ("name", "kind", "scope", "label", "function", "file", "op"):
        d[k] = _text(d[k])
    d["aliases"] = [_text(a) for a in d["aliases"]]
    d["shape"] = list(rec.shape)
    d["dtype"] = str(rec.dtype).replace("torch.", "")
    d["device"] = _text(rec.device)
    d["inputs"] = [r.index for r in rec.inputs]
    d["params"] = [_text(p) for p in (getattr(rec, "params", None) or ())]
    return d


def _named_items(named: Any, what: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a dict of tensors to be saved (parameters, inputs), checked: raises
    ValueError naming the one that cannot be saved."""
    if not hasattr(named, "items"):
        raise ValueError(f"{what}s must be a dict of name to tensor, not {type(named).__name__}")
    items = list(named.items())
    if len(items) > MAX_PARAMS:
        raise ValueError(f"{len(items)} {what}s; at most {MAX_PARAMS} can be saved")
    for k, t in items:
        if not isinstance(k, str) or not k or len(k) > MAX_STR or k == "__metadata__":
            raise ValueError(f"{what} name {_show(k)} is not a usable name")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what} {k!r} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta" or t.dtype not in _ST_CODES:
            raise ValueError(f"{what} {k!r} ({t.dtype}, {t.layout}, on {t.device}) cannot be saved")
    return items


class CaptureWriter:
    """Append records; `flush()` writes a shard; `close()` marks the capture complete."""

    def __init__(self, path: str, side: str = "", source: str = "", shard_bytes: int = 64 << 20,
                 values: bool = True, write_through: bool = False):
        self.path = path
        self.values = values  # False: metadata only (a streaming diff's crash insurance)
        # write_through (with values, shard_bytes=0): the capture hands each value over as it is recorded and
        # keeps none itself (`owns_values`, as a streaming sink): it is written at once, the forward's memory
        # is free to be reused, and the values are read back from the files where they are needed
        self.owns_values = bool(write_through and values and shard_bytes == 0)
        self._scratch: list = [None]  # the buffer non-contiguous values are written through (see _st_write)
        self.side, self.source = side, source
        self.shard_bytes = shard_bytes
        os.makedirs(path, exist_ok=True)
        self._root = _Root(path)
        self.entries: list[dict] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_meta: list[dict] = []
        self.pending_bytes = 0
        self.shards = 0
        self.error: dict | None = None
        self.output_form = ""  # what the forward returned at the top (Trace.output_form)
        self.output_others: dict | None = None  # its leaves that are not tensors (Trace.output_others)
        self.info: dict = {}
        self.params_file: str | None = None
        self.inputs_left_file: str | None = None
        self.rng_after_file: str | None = None
        self.complete = False
        self._last_index = 0.0
        self._journal = os.fdopen(self._root.create("records.jsonl"), "w", encoding="utf-8")
        self._write_index()

    def set_info(self, info: dict) -> None:
        """JSON metadata saved under ``info`` in index.json (how the capture was made).
        Raises ValueError if it is not a dict of JSON-able values, nested at most MAX_DEPTH deep."""
        if not isinstance(info, dict):
            raise ValueError(f"capture info must be a dict, not {type(info).__name__}")
        if not all(isinstance(k, str) for k in info):
            raise ValueError("capture info's keys must be strings")
        if not _depth_ok(info):
            raise ValueError(f"capture info nests deeper than {MAX_DEPTH} levels")
        try:
            text = json.dumps(info)
        except (TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"capture info is not JSON-serialisable: {e}") from None
        self.info = json.loads(text)  # a copy, as it will read back (tuples become lists)
        self._write_index()

    def add_parameters(self, named: dict[str, torch.Tensor]) -> None:
        """The model's parameters and buffers by qualified name, written now (atomically, as
        contiguous CPU copies) to params.safetensors.  Calling it again replaces them."""
        self._add_named("params_file", PARAMS_FILE, named, "parameter")

    def add_inputs_left(self, named: dict[str, torch.Tensor]) -> None:
        """The input tensors the forward changed in place, by input record name, as it left them
        (inputs-left.safetensors); written even by a writer that keeps no values, so that a reader can
        give the candidate the inputs KernelBench gives it."""
        self._add_named("inputs_left_file", INPUTS_LEFT_FILE, named, "input")

    def add_rng_after(self, named: dict[str, torch.Tensor]) -> None:
        """The random generators' states the forward left, by generator name (rng-after.safetensors)."""
        self._add_named("rng_after_file", RNG_AFTER_FILE, named, "generator")

    def _add_named(self, attr: str, name: str, named: dict[str, torch.Tensor], what: str) -> None:
        """Write a dict of tensors by name to the file `name` (atomically, checked by `_named_items`), keep
        its name in `attr` and rewrite the index, which names it under that field."""
        items = _named_items(named, what)
        self._root.write_atomic(name, lambda fh: _st_write(fh, items))
        setattr(self, attr, name)
        self._write_index()

    def add(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        """Add a record (its value: `tensor` for a write-through writer, else `rec.value`)."""
        meta = _meta(rec)
        value = tensor if self.owns_values else rec.value
        if value is not None and self.values:
            key = f"r{rec.index:06d}"
            v = value.detach()
            if self.shard_bytes > 0:
                host = v.to("cpu").contiguous()
                if host.data_ptr() == v.data_ptr():
                    # the record may hold live memory (capture copies on write) and the shard is written later
                    host = host.clone()
            else:  # written before add returns: no copy (one laid out otherwise, or on a device, goes through
                # _st_write's buffers)
                host = v
            self.pending[key] = host
            meta["key"] = key
            self.pending_bytes += v.numel() * v.element_size()
        self.pending_meta.append(meta)
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def update(self, rec: Record, tensor: torch.Tensor | None = None) -> None:
        """A record already written got another name (aliases, renames): keep the index in step (its value,
        written already, stays as it was)."""
        for m in reversed(self.pending_meta):
            if m["index"] == rec.index:
                m.update(self._renamed(rec))
                return
        if 0 <= rec.index < len(self.entries) and self.entries[rec.index]["index"] == rec.index:
            m = self.entries[rec.index]
            m.update(self._renamed(rec))
            self._journal.write(json.dumps(m) + "\n")  # a later line for an index replaces the earlier
            self._journal.flush()

    @staticmethod
    def _renamed(rec: Record) -> dict:
        return {"name": _text(rec.name), "kind": _text(rec.kind), "aliases": [_text(a) for a in rec.aliases],
                "is_output": bool(rec.is_output), "rebound": bool(rec.rebound)}

    def flush(self) -> None:
        if not self.pending_meta:
            return
        shard = f"shard-{self.shards:05d}.safetensors"
        if self.pending:
            pending = list(self.pending.items())
            self._root.write_atomic(shard, lambda fh: _st_write(fh, pending, self._scratch))
            self.shards += 1
        for m in self.pending_meta:
            if "key" in m:
                m["shard"] = shard
        self.entries += self.pending_meta
        self._journal.write("".join(json.dumps(m) + "\n" for m in self.pending_meta))
        self._journal.flush()
        self.pending, self.pending_meta, self.pending_bytes = {}, [], 0
        if time.monotonic() - self._last_index > 1.0:
            self._write_index()

    def set_error(self, err: CaptureError | None) -> None:
        if err is None:
            self.error = None
            return
        self.error = {k: _text(getattr(err, k, "")) for k in _ERROR_FIELDS if k != "line"}
        self.error["line"] = err.line if _is_int(err.line) and err.line >= 0 else 0

    def close(self) -> None:
        self.flush()
        self.complete = True
        self._write_index()
        self._journal.close()
        self._root.close()

    def __del__(self):
        root = getattr(self, "_root", None)
        if root is not None:
            try:
                root.close()
            except OSError:
                pass

    def _write_index(self) -> None:
        self._last_index = time.monotonic()
        data = {"format": FORMAT, "version": VERSION, "side": self.side, "source": self.source,
                "complete": self.complete, "error": self.error, "output_form": self.output_form,
                "output_others": self.output_others, "info": self.info,
                "parameters": self.params_file, "inputs_left": self.inputs_left_file,
                "rng_after": self.rng_after_file,
                "records": self.entries}
        text = json.dumps(data).encode("utf-8")
        self._root.write_atomic("index.json", lambda fh: fh.write(text))


def write_after_forward(writer: "CaptureWriter", inputs_left: dict, rng_after: dict) -> None:
    """What a forward left besides its records: the inputs it changed and the generators' states."""
    if inputs_left:
        writer.add_inputs_left(inputs_left)
    if rng_after:
        writer.add_rng_after(rng_after)


def save_trace(trace: Trace, path: str, side: str = "", source: str = "", shard_bytes: int = 64 << 20) -> str:
    w = CaptureWriter(path, side, source, shard_bytes)
    for rec in trace.records:
        w.add(rec)
    write_after_forward(w, trace.inputs_left, trace.rng_after)
    w.set_error(trace.error)
    w.output_form = trace.output_form
    w.output_others = trace.output_others
    w.close()
    return path


# ---------------------------------------------------------------- validating what was read


class _Bad(Exception):
    """A field failed its check: (field, what is wrong)."""

    def __init__(self, fld: str, why: str):
        super().__init__(fld, why)
        self.field, self.why = fld, why


def _check_output_others(v) -> dict | None:
    """Trace.output_others as stored: absent (a capture written before it was kept), or short texts by path."""
    if v is None:
        return None
    if not isinstance(v, dict) or len(v) > 64 or not all(
            isinstance(k, str) and isinstance(x, str) and len(k) <= 200 and len(x) <= 200 for k, x in v.items()):
        raise _Bad("output_others", f"must map at most 64 output paths to short texts, not {_show(v)}")
    return dict(v)


def _str_field(m: dict, k: str, required: bool = True, nullable: bool = True, limit: int = MAX_STR) -> str:
    if k not in m:
        if required:
            raise _Bad(k, "is missing")
        return ""
    v = m[k]
    if v is None and nullable:
        return ""
    if not isinstance(v, str):
        raise _Bad(k, f"must be a string, not {_show(v)}")
    if len(v) > limit:
        raise _Bad(k, f"is {len(v)} characters long, more than {limit}")
    return v


def _int_field(m: dict, k: str, lo: int, hi: int, required: bool = True, default: int = 0) -> int:
    if k not in m:
        if required:
            raise _Bad(k, "is missing")
        return default
    v = m[k]
    if not _is_int(v):
        raise _Bad(k, f"must be an integer, not {_show(v)}")
    if not lo <= v <= hi:
        raise _Bad(k, f"is {_show(v)}, outside {lo}…{hi}")
    return v


def _bool_field(m: dict, k: str) -> bool:
    v = m.get(k, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _Bad(k, f"must be true or false, not {_show(v)}")
    return v


def _list_field(m: dict, k: str) -> list:
    v = m.get(k, [])
    if v is None:
        return []
    if not isinstance(v, list):
        raise _Bad(k, f"must be a list, not {_show(v)}")
    if len(v) > MAX_LIST:
        raise _Bad(k, f"has {len(v)} entries, more than {MAX_LIST}")
    return v


def _str_list_field(m: dict, k: str, what: str) -> list:
    """A list field whose items must be strings of bounded length."""
    items = _list_field(m, k)
    for v in items:
        if not isinstance(v, str) or len(v) > MAX_STR:
            raise _Bad(k, f"must hold {what}, not {_show(v)}")
    return items


def _check_record(m: Any, i: int, n: int) -> dict:
    """Record `i` of `n`, every field checked; the normalised metadata (known fields only)."""
    if not isinstance(m, dict):
        raise _Bad("", f"is {_show(m)}, not an object")
    out: dict = {}
    idx = m.get("index")
    if "index" not in m:
        raise _Bad("index", "is missing")
    if not _is_int(idx):
        raise _Bad("index", f"must be an integer, not {_show(idx)}")
    if idx != i:
        raise _Bad("index", f"claims index {_show(idx)}; records must be numbered in order")
    out["index"] = idx
    for k in ("name", "kind"):
        out[k] = _str_field(m, k, nullable=False)
    for k in ("scope", "label", "function", "file", "op", "device"):
        out[k] = _str_field(m, k)
    out["line"] = _int_field(m, "line", 0, MAX_LINE)
    shape = m.get("shape")
    if "shape" not in m:
        raise _Bad("shape", "is missing")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise _Bad("shape", f"must be a list of at most {MAX_DIMS} sizes, not {_show(shape)}")
    for s in shape:
        if not _is_int(s) or not 0 <= s <= MAX_DIM:
            raise _Bad("shape", f"has a size {_show(s)}; sizes are integers from 0 to {MAX_DIM}")
    out["shape"] = shape
    dt = m.get("dtype")
    if "dtype" not in m:
        raise _Bad("dtype", "is missing")
    if not isinstance(dt, str) or dt not in _DTYPES:
        raise _Bad("dtype", f"is {_show(dt)}, not a dtype a capture holds ({', '.join(_DTYPES)})")
    out["dtype"] = dt
    out["aliases"] = _str_list_field(m, "aliases", "strings")
    out["is_output"] = _bool_field(m, "is_output")
    out["rebound"] = _bool_field(m, "rebound")
    inputs = _list_field(m, "inputs")
    for j in inputs:
        if not _is_int(j) or not 0 <= j < n:
            raise _Bad("inputs", f"holds {_show(j)}, not the index of a record (0…{n - 1})")
    out["inputs"] = inputs
    out["params"] = _str_list_field(m, "params", "parameter names (strings)")
    if "key" in m or "shard" in m:
        key, shard = m.get("key"), m.get("shard")
        if not isinstance(key, str) or not key or len(key) > 1024 or key == "__metadata__":
            raise _Bad("key", f"must name a tensor in the shard, not {_show(key)}")
        if not isinstance(shard, str):
            raise _Bad("shard", f"must be a file name, not {_show(shard)}")
        if not _plain_name(shard) or not shard.endswith(".safetensors"):
            raise _Bad("shard", f"points outside the capture: {_show(shard)} is not a shard file name in it")
        out["key"], out["shard"] = key, shard
    return out


def _check_error(err: Any) -> dict | None:
    if err is None or err == {}:
        return None
    if not isinstance(err, dict):
        raise _Bad("error", f"must be an object or null, not {_show(err)}")
    out = {}
    for k in _ERROR_FIELDS:
        if k == "line":
            v = err.get("line", 0)
            if v is None:
                v = 0
            if not _is_int(v) or not 0 <= v <= MAX_LINE:
                raise _Bad("error.line", f"must be a line number, not {_show(v)}")
            out[k] = v
        else:
            try:
                out[k] = _str_field(err, k, required=False, limit=MAX_TEXT)
            except _Bad as e:
                raise _Bad(f"error.{k}", e.why) from None
    return out


# what a capture's ``info`` may say, checked once here (`_check_info`); nothing read from it is ever run
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.manual_seed takes
MAX_TRIALS = 100_000
MAX_VALUE_INT = (1 << 63) - 1  # a stored argument (init inputs, non-tensor inputs): an int64 at most
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:[0-9]{1,4})?")
_CLASS = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
_PATH_FIELDS = ("source", "inputs_source")  # file names, kept as words: never run because a capture names them


def _check_info(info: Any) -> dict:
    """A capture's ``info``, every field diffkit reads checked for type and range (a `_Bad` naming it as
    ``info.FIELD``); fields it does not know are kept as they are and never read."""
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise _Bad("info", f"must be an object, not {_show(info)}")
    if not _depth_ok(info):
        raise _Bad("info", f"nests deeper than {MAX_DEPTH} levels")
    try:
        _check_info_fields(info)
    except _Bad as e:
        raise _Bad(f"info.{e.field}", e.why) from None
    return info


def _check_info_fields(info: dict) -> None:
    for k in _PATH_FIELDS:
        _str_field(info, k, required=False)
    cls = info.get("class")
    if cls is not None and (not isinstance(cls, str) or not _CLASS.fullmatch(cls)):
        raise _Bad("class", f"must be the name of a Python class (e.g. 'Model'), not {_show(cls)}")
    for k in ("seed", "input_seed", "kernelbench_seed"):
        if info.get(k) is not None:
            _int_field(info, k, *SEED_RANGE)
    if info.get("trial") is not None:
        _int_field(info, "trial", 1, MAX_TRIALS)
    for k in ("training", "eval", "outputs_only"):
        v = info.get(k)
        if v is not None and not isinstance(v, bool):
            raise _Bad(k, f"must be true or false, not {_show(v)}")
    dev = info.get("device")
    if dev is not None and (not isinstance(dev, str) or not _DEVICE.fullmatch(dev)):
        raise _Bad("device", f"must be a device such as 'cpu', 'cuda' or 'cuda:0', not {_show(dev)}")
    if isinstance(info.get("init_inputs"), list):  # (the arguments themselves, as plain JSON values)
        _check_plain_values(info["init_inputs"], "init_inputs")
    elif info.get("init_inputs") is not None:
        _check_encoded(info["init_inputs"], "init_inputs", tensors=False)
    tensors = _check_encoded(info["inputs"], "inputs", tensors=True) if info.get("inputs") is not None else None
    _check_layout(info.get("inputs_layout"), tensors)
    for k in ("reinit_zero", "health"):
        _str_list_field(info, k, "strings")
    if info.get("trials") is not None:
        _check_trials(info["trials"])
    if info.get("rerun_differs") is not None:
        _check_rerun_differs(info["rerun_differs"])


def _check_value(v: Any, f: str) -> None:
    """A stored argument that is not a tensor: a JSON scalar (a finite number, an int64 at most)."""
    if v is None or isinstance(v, bool):
        return
    if isinstance(v, str):
        if len(v) > MAX_STR:
            raise _Bad(f, f"is a string of {len(v)} characters, more than {MAX_STR}")
        return
    if isinstance(v, int):
        if not -MAX_VALUE_INT - 1 <= v <= MAX_VALUE_INT:
            raise _Bad(f, f"is {_show(v)}, outside the 64-bit integers an argument can be")
        return
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _Bad(f, f"is {_show(v)}, not a finite number")
        return
    raise _Bad(f, f"must be a number, a string, true/false or null, not {_show(v)}")


def _check_plain_values(values: list, k: str) -> None:
    """Arguments stored as plain JSON (lists, objects and `_check_value` scalars), not `encode_values`'s form."""
    stack = [(v, f"{k}[{i}]") for i, v in enumerate(values)]
    while stack:
        v, f = stack.pop()
        if isinstance(v, list):
            stack.extend((x, f"{f}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, dict):
            stack.extend((x, f"{f}[{_show(key)}]") for key, x in v.items())
        else:
            _check_value(v, f)


def _check_encoded(enc: Any, k: str, tensors: bool) -> int:
    """Stored call arguments (`load.encode_values`: a structure and its leaves), read as data; the number of
    tensor leaves."""
    if not isinstance(enc, dict):
        raise _Bad(k, f"must be an object with 'spec' and 'leaves', not {_show(enc)}")
    for part in ("spec", "leaves"):
        if part not in enc:
            raise _Bad(f"{k}.{part}", "is missing")
    spec, leaves = enc["spec"], enc["leaves"]
    if not isinstance(spec, str) or len(spec) > MAX_TEXT:
        raise _Bad(f"{k}.spec", f"must be the structure as a JSON string (at most {MAX_TEXT} characters), not "
                   f"{_show(spec)}")
    try:
        node, count = read_spec(spec)
    except ValueError as e:
        raise _Bad(f"{k}.spec", f"is not a structure diffkit reads: {e}") from None
    if not isinstance(leaves, list) or len(leaves) != count:
        raise _Bad(f"{k}.leaves", f"must be a list of the {count} leaves its spec has, not {_show(leaves)}")
    n, values = 0, []
    for i, leaf in enumerate(leaves):
        f = f"{k}.leaves[{i}]"
        if not isinstance(leaf, dict) or len(leaf) != 1 or not ({"tensor", "value"} & set(leaf)):
            shapes = "{'value': …} or {'tensor': 'input[…]'}" if tensors else "{'value': …}"
            raise _Bad(f, f"must be {shapes}, not {_show(leaf)}")
        if "tensor" in leaf:
            name = leaf["tensor"]
            if not tensors:
                raise _Bad(f, "names a tensor; these arguments are stored as values only")
            if not isinstance(name, str) or not name.startswith("input[") or len(name) > MAX_STR:
                raise _Bad(f, f"must name an input record ('input[0]' …), not {_show(name)}")
            n += 1
            values.append(None)
        else:
            _check_value(leaf["value"], f)
            values.append(leaf["value"])
    try:
        build_from_spec(node, values)
    except (TypeError, ValueError, OverflowError) as e:
        raise _Bad(f"{k}.spec", f"does not fit its leaves ({str(e)[:100]})") from None
    return n


def _check_layout(want: Any, tensors: int | None) -> None:
    """``inputs_layout`` (`inputs.layout`): per tensor input, [strides, storage offset, the first input sharing
    its memory, the first that is the same object]."""
    if want is None:
        return
    if not isinstance(want, list) or (tensors is not None and len(want) != tensors):
        raise _Bad("inputs_layout", f"must be a list of one entry per tensor input ({tensors}), not {_show(want)}")
    for j, e in enumerate(want):
        f = f"inputs_layout[{j}]"
        if not isinstance(e, list) or len(e) != 4:
            raise _Bad(f, f"must be [strides, offset, shared, same], not {_show(e)}")
        stride, offset, shared, same = e
        if stride is not None and (not isinstance(stride, list) or len(stride) > MAX_DIMS
                                   or not all(_is_int(x) and 0 <= x <= MAX_DIM for x in stride)):
            raise _Bad(f, f"has strides {_show(stride)}; strides are a list of integers from 0 to {MAX_DIM}")
        if not _is_int(offset) or not 0 <= offset <= MAX_DIM:
            raise _Bad(f, f"has storage offset {_show(offset)}, not an integer from 0 to {MAX_DIM}")
        for what, v in (("shared", shared), ("same", same)):
            if not _is_int(v) or not 0 <= v <= j:
                raise _Bad(f, f"has {what} {_show(v)}, not the index of this or an earlier input (0…{j})")


def _check_trials(trials: Any) -> None:
    """``trials``: one entry per KernelBench trial, in order; trial K > 1 stored in ``trial-K.dkt`` inside the
    capture (never a path: the capture names nothing outside itself)."""
    if not isinstance(trials, list) or not 1 <= len(trials) <= MAX_TRIALS:
        raise _Bad("trials", f"must be a list of 1 to {MAX_TRIALS} trial entries, not {_show(trials)}")
    for i, e in enumerate(trials):
        k, f = i + 1, f"trials[{i}]"
        if not isinstance(e, dict):
            raise _Bad(f, f"must be an object (trial, seed, capture), not {_show(e)}")
        try:
            if _int_field(e, "trial", 1, MAX_TRIALS) != k:
                raise _Bad("trial", f"is {e['trial']}; entry {i} must be trial {k} (trials are listed in order)")
            _int_field(e, "seed", *SEED_RANGE)
            _check_trial_dir(e, k)
            if e.get("outputs_only") is not None and not isinstance(e["outputs_only"], bool):
                raise _Bad("outputs_only", f"must be true or false, not {_show(e['outputs_only'])}")
            _str_field(e, "error", required=False, limit=MAX_TEXT)
        except _Bad as b:
            raise _Bad(f"{f}.{b.field}", b.why) from None


def _check_trial_dir(e: dict, k: int) -> None:
    name = e.get("capture")
    if name is None:
        if k > 1:
            raise _Bad("capture", f"is missing: trial {k} is stored in 'trial-{k}.dkt' inside the capture")
        return
    if not isinstance(name, str):
        raise _Bad("capture", f"must be the name 'trial-{k}.dkt', not {_show(name)}")
    if not _plain_name(name) or os.path.isabs(name) or ".." in name.split("/"):
        raise _Bad("capture", f"points outside the capture: {_show(name)} is not a directory name inside it "
                   f"(expected 'trial-{k}.dkt')")
    if name != f"trial-{k}.dkt":
        raise _Bad("capture", f"must be 'trial-{k}.dkt' (the directory of trial {k} inside the capture), not "
                   f"{_show(name)}")


def _check_rerun_differs(d: Any) -> None:
    """``rerun_differs`` (a captured candidate's records that changed between two runs: `trials.bitwise_difference`
    by record name)."""
    if not isinstance(d, dict) or len(d) > MAX_RECORDS:
        raise _Bad("rerun_differs", f"must be an object of record name to difference, not {_show(d)}")
    ints = lambda v: isinstance(v, list) and len(v) <= MAX_LIST and all(_is_int(x) for x in v)  # noqa: E731
    for name, e in d.items():
        f = f"rerun_differs[{_show(name)}]"
        if not isinstance(e, dict):
            raise _Bad(f, f"must be an object, not {_show(e)}")
        for k in ("elements", "numel"):
            if not _is_int(e.get(k)) or e[k] < 0:
                raise _Bad(f"{f}.{k}", f"must be a count (an integer >= 0), not {_show(e.get(k))}")
        m = e.get("max_abs")
        if isinstance(m, bool) or not isinstance(m, (int, float)) or m != m:
            raise _Bad(f"{f}.max_abs", f"must be a number, not {_show(m)}")
        at = e.get("at", [])
        if not isinstance(at, list) or len(at) > MAX_LIST or not all(ints(x) for x in at):
            raise _Bad(f"{f}.at", f"must be a list of element indices, not {_show(at)}")
        span, rows, shape = e.get("span"), e.get("row_span"), e.get("shape")
        if span is not None and (not isinstance(span, list) or not all(ints(x) and len(x) == 2 for x in span)):
            raise _Bad(f"{f}.span", f"must be a list of [first, last] pairs, not {_show(span)}")
        if rows is not None and not (ints(rows) and len(rows) == 2):
            raise _Bad(f"{f}.row_span", f"must be [first, last], not {_show(rows)}")
        if shape is not None and not (isinstance(shape, list) and len(shape) == 2 and all(ints(x) for x in shape)):
            raise _Bad(f"{f}.shape", f"must be two shapes, not {_show(shape)}")


def _check_inputs_named(info: dict, records: list[dict], idx_path: str) -> None:
    """Each tensor ``info.inputs`` names is an input record of the capture (whose value is the input)."""
    enc = info.get("inputs")
    if not isinstance(enc, dict):
        return
    have = {n for m in records for n in input_names(m["kind"], m["name"], m["aliases"])}
    for i, leaf in enumerate(enc["leaves"]):
        if "tensor" in leaf and leaf["tensor"] not in have:
            raise DiffkitError("", "read", f"{idx_path}: field 'info.inputs.leaves[{i}]' names the input "
                               f"{_show(leaf['tensor'])}, but no record of the capture is that input (its records "
                               f"name {', '.join(sorted(have)[:4]) or 'no input'})", idx_path)


def _recover_journal(path: str, records: list, root: _Root | None = None) -> tuple[list, dict[int, int]]:
    """An unfinished capture: the journal may hold records flushed after the index was last written.
    A torn last line (the writer died mid-write) ends the journal.  Returns the records and, for
    those taken from the journal, their line numbers there (for error messages); the records are
    checked afterwards like the index's."""
    own = root is None
    root = root or _Root(path)
    try:
        if not root.exists("records.jsonl"):
            return records, {}
        where = root.where("records.jsonl")
        fd = root.open_read("records.jsonl", f"{where} (the journal of an unfinished capture)")
        try:
            data = _read_limited(fd, MAX_JOURNAL_BYTES, where, where)
        finally:
            os.close(fd)
    finally:
        if own:
            root.close()
    by_index: dict[int, tuple[int, dict]] = {}
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            m = json.loads(raw.decode("utf-8", errors="replace"))
        except (ValueError, RecursionError):
            break  # torn (or garbage): the journal ends here
        if not isinstance(m, dict):
            raise DiffkitError("", "read", f"{where} line {lineno} is {_show(m)}, not a record object", where)
        idx = m.get("index")
        if not _is_int(idx) or not 0 <= idx < MAX_RECORDS:
            raise DiffkitError("", "read", f"{where} line {lineno}: field 'index' must be a record number "
                               f"(0…{MAX_RECORDS - 1}), not {_show(idx)}", where)
        by_index[idx] = (lineno, m)
    n = 0
    while n in by_index:
        n += 1
    if n < len(records):
        return records, {}
    return [by_index[i][1] for i in range(n)], {i: by_index[i][0] for i in range(n)}


# ---------------------------------------------------------------- reading


# shards of one capture mapped into memory at most (`CaptureFile.mapped`)
MAX_MAPPED = 256


@dataclass
class CaptureFile:
    """A capture on disk, read lazily.  `load()` gives a Trace with every value.

    `index` is the validated index: every record's metadata normalised (known fields only)."""

    path: str
    index: dict
    _headers: collections.OrderedDict = field(default_factory=collections.OrderedDict, init=False, repr=False,
                                              compare=False)
    # values as views of the shards mapped into memory (copy-on-write), not copies: only for a capture
    # this diff's own process wrote and nothing else changes (an isolated diff's handoff)
    mapped: bool = field(default=False, init=False, compare=False)
    _maps: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _params: dict | None = field(default=None, init=False, repr=False, compare=False)  # parameters(), read once
    # the values an isolated diff's reference process handed over on its GPU (handoff.Handed): its records
    # then hold names and shapes only, and values come from here
    handed: Any = field(default=None, init=False, repr=False, compare=False)
    # written by this very diff (`sources.CaptureSource.trusted`): only then may a reader run the reference file it
    # names (a capture is data: nothing in it, and nothing it names, is run because it says so)
    trusted: bool = field(default=False, init=False, compare=False)

    @classmethod
    def open(cls, path: str) -> "CaptureFile":
        idx_path = os.path.join(path, "index.json")
        if not os.path.isdir(path):
            raise DiffkitError("", "read", f"{path} is not a capture directory (expected index.json and shards)", path)
        try:
            root = _Root(path)
        except OSError as e:
            raise DiffkitError("", "read", f"{path} cannot be opened ({e.strerror or e})", path) from None
        with root:
            if not root.exists("index.json"):
                raise DiffkitError("", "read", f"{idx_path} is missing: not a diffkit capture, or it was never "
                                   f"written", path)
            fd = root.open_read("index.json", idx_path)
            try:
                data = _read_limited(fd, MAX_INDEX_BYTES, idx_path, idx_path)
            finally:
                os.close(fd)
            index = _parse_json(data, idx_path, idx_path)
            del data
            if not isinstance(index, dict) or index.get("format") != FORMAT:
                fmt = _show(index.get("format")) if isinstance(index, dict) else _show(index)
                raise DiffkitError("", "read", f"{idx_path} is not a diffkit capture index (format field is {fmt})",
                                   idx_path)
            version = index.get("version")
            if not _is_int(version) or version not in READABLE_VERSIONS:
                raise DiffkitError("", "read", f"{idx_path} has format version {_show(version)}; this diffkit reads "
                                   f"versions {', '.join(map(str, READABLE_VERSIONS))}", idx_path)
            records = index.get("records")
            if not isinstance(records, list):
                raise DiffkitError("", "read", f"{idx_path}: field 'records' must be the list of records, not "
                                   f"{_show(records)}", idx_path)
            clean: dict = {"format": FORMAT, "version": version}
            try:
                for k in ("side", "source"):
                    clean[k] = _str_field(index, k, required=False)
                complete = index.get("complete", False)
                if not isinstance(complete, bool):
                    raise _Bad("complete", f"must be true or false, not {_show(complete)}")
                clean["complete"] = complete
                clean["error"] = _check_error(index.get("error"))
                clean["output_form"] = _str_field(index, "output_form", required=False, limit=64)
                clean["output_others"] = _check_output_others(index.get("output_others"))
                clean["info"] = _check_info(index.get("info"))
                for key in ("parameters", "inputs_left", "rng_after"):
                    lf = index.get(key)
                    if lf is not None and (not _plain_name(lf) or not lf.endswith(".safetensors")):
                        raise _Bad(key, f"must name a .safetensors file in the capture, not {_show(lf)}")
                    clean[key] = lf
            except _Bad as e:
                raise DiffkitError("", "read", f"{idx_path}: field {e.field!r} {e.why}", idx_path) from None
            lines: dict[int, int] = {}
            if not complete:
                records, lines = _recover_journal(path, records, root)
            if len(records) > MAX_RECORDS:
                raise DiffkitError("", "read", f"{idx_path} lists {len(records)} records, more than {MAX_RECORDS}",
                                   idx_path)
        n = len(records)
        checked = []
        for i, m in enumerate(records):
            try:
                checked.append(_check_record(m, i, n))
            except _Bad as e:
                if i in lines:
                    where = os.path.join(path, "records.jsonl")
                    head = f"{where} line {lines[i]} (record {i})"
                else:
                    where, head = idx_path, f"{idx_path} record {i}"
                what = f"field {e.field!r} " if e.field else ""
                raise DiffkitError("", "read", f"{head}: {what}{e.why}", where) from None
        clean["records"] = checked
        if clean["complete"]:
            _check_inputs_named(clean["info"], checked, idx_path)
        return cls(path, clean)

    @property
    def complete(self) -> bool:
        return bool(self.index.get("complete"))

    @property
    def info(self) -> dict:
        """The capture's ``info`` metadata (empty for version 1 files and captures without it)."""
        return self.index.get("info") or {}

    def __len__(self) -> int:
        return len(self.index["records"])

    def _header(self, root: _Root, name: str, fd: int, label: str) -> tuple[dict, int, int]:
        """The shard's parsed header (cached for the last two shards, keyed by the file's identity)."""
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        hit = self._headers.get(name)
        if hit is not None and hit[0] == ident:
            self._headers.move_to_end(name)
            return hit[1], hit[2], st.st_size
        try:
            hdr, start = _st_header(fd, st.st_size)
        except ValueError as e:
            raise DiffkitError("", "read", f"{label} is truncated or corrupt ({e})", root.where(name)) from None
        self._headers[name] = (ident, hdr, start)
        while len(self._headers) > 2:
            self._headers.popitem(last=False)
        return hdr, start, st.st_size

    def _map(self, shard: str, fd: int, size: int):
        """The shard mapped into memory (copy-on-write: its pages are the file's until written), when
        `mapped`; at most MAX_MAPPED shards (each mapping holds a file descriptor), later ones are read."""
        if not self.mapped or size == 0:
            return None
        hit = self._maps.get(shard)
        if hit is None:
            import mmap

            if len(self._maps) >= MAX_MAPPED:
                return None
            try:
                hit = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError, AttributeError):  # no mmap here: read instead
                self.mapped = False
                return None
            self._maps[shard] = hit
        return hit

    @staticmethod
    def _agrees(value: torch.Tensor, meta: dict, rec: str, holds: str, where: str, then: str = "") -> torch.Tensor:
        """`value`, once its dtype and shape are the ones the index gives record `rec` (else an error: `holds`
        says what the value came from, `then` ends it, `where` locates it)."""
        got = str(value.dtype).replace("torch.", "")
        if list(value.shape) != list(meta.get("shape", [])) or got != meta.get("dtype"):
            raise DiffkitError("", "read", f"{rec}: the index says {meta.get('dtype')} {meta.get('shape')}, {holds} "
                               f"{got} {list(value.shape)}{then}", where)
        return value

    def _value(self, meta: dict) -> torch.Tensor | None:
        if self.handed is not None and meta.get("index") in self.handed.records:
            return self._agrees(self.handed.records[meta["index"]], meta,
                                f"record {meta.get('index')} ({_show(meta.get('name'))})", "the value handed over is",
                                self.path)
        if "key" not in meta:
            return None
        shard, key, name = meta.get("shard"), meta.get("key"), meta.get("name")
        rec = f"record {meta.get('index')} ({_show(name)})"
        if not _plain_name(shard):
            raise DiffkitError("", "read", f"{rec} points outside the capture: {_show(shard)}", self.path)
        label = f"shard {shard} (field 'shard' of {rec} in index.json)"
        with _Root(self.path) as root:
            fd = root.open_read(shard, label)
            try:
                hdr, start, size = self._header(root, shard, fd, f"shard {shard}")
                if not isinstance(key, str) or key not in hdr or key == "__metadata__":
                    raise DiffkitError("", "read", f"shard {shard} holds no tensor {_show(key)} for {rec}: the files "
                                       f"do not belong together", root.where(shard))
                try:
                    value = _st_tensor(fd, size, start, key, hdr[key], self._map(shard, fd, size))
                except ValueError as e:
                    raise DiffkitError("", "read", f"shard {shard} is truncated or corrupt ({e}) while reading {rec}",
                                       root.where(shard)) from None
            finally:
                os.close(fd)
        return self._agrees(value, meta, rec, "the shard holds", os.path.join(self.path, shard),
                            ": the files do not belong together")

    def parameters(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by qualified name (empty when the capture has none).
        Read once per CaptureFile; each call returns its own dict of the same tensors."""
        if self._params is None:
            self._params = dict(self.handed.parameters) if self.handed is not None else self._read_parameters()
        return dict(self._params)

    def _read_parameters(self) -> dict[str, torch.Tensor]:
        return self._read_named(self.index.get("parameters"), "parameter", "parameters")

    def inputs_left(self) -> dict[str, torch.Tensor]:
        """The input tensors the forward changed in place, by input record name, as it left them (empty
        when it changed none, or the capture predates this)."""
        return self._read_named(self.index.get("inputs_left"), "input", "inputs_left")

    def rng_after(self) -> dict[str, torch.Tensor]:
        """The random generators' states the forward left, by name (empty when the capture predates this)."""
        return self._read_named(self.index.get("rng_after"), "generator", "rng_after")

    def _read_named(self, name: str | None, what: str, fld: str) -> dict[str, torch.Tensor]:
        """The tensors of one of the capture's named-tensor files (parameters, inputs left), by name (`fld`: the
        index's field that names the file)."""
        if not name:
            return {}
        label = f"{what} file {name} (field {fld!r} in index.json)"
        out: dict[str, torch.Tensor] = {}
        with _Root(self.path) as root:
            fd = root.open_read(name, label)
            try:
                size = os.fstat(fd).st_size
                try:
                    hdr, start = _st_header(fd, size)
                except ValueError as e:
                    raise DiffkitError("", "read", f"{label} is truncated or corrupt ({e})", root.where(name)) from None
                keys = [k for k in hdr if k != "__metadata__"]
                if len(keys) > MAX_PARAMS:
                    raise DiffkitError("", "read", f"{label} holds {len(keys)} tensors, more than {MAX_PARAMS}",
                                       root.where(name))
                for k in keys:
                    if not isinstance(k, str) or not k or len(k) > MAX_STR:
                        raise DiffkitError("", "read", f"{label} has a bad {what} name {_show(k)}", root.where(name))
                    try:
                        out[k] = _st_tensor(fd, size, start, k, hdr[k])
                    except ValueError as e:
                        raise DiffkitError("", "read", f"{label} is truncated or corrupt ({e}) at {what} {k!r}",
                                           root.where(name)) from None
            finally:
                os.close(fd)
        return out

    def records(self, values: bool | Callable[[dict], bool] = True) -> Iterator[Record]:
        """Records one at a time (each value read from its shard when `values`; when `values` is a
        function of the record's index entry, only where it says so)."""
        for m in self.index["records"]:
            rec = Record(
                index=m["index"], name=m["name"], kind=m["kind"], scope=m["scope"], label=m["label"],
                function=m["function"], file=m["file"], line=m["line"], op=m["op"], shape=tuple(m["shape"]),
                dtype=_DTYPES[m["dtype"]], device=m["device"], value=None, aliases=list(m["aliases"]),
                is_output=m["is_output"], rebound=m["rebound"], inputs=tuple(Ref(j) for j in m["inputs"]),
                params=list(m["params"]))
            if values if isinstance(values, bool) else values(m):
                rec.value = self._value(m)
            yield rec

    def fill(self, trace: Trace, which: Callable[[Record], bool]) -> None:
        """Give the records of `trace` (the trace this capture was written from) that `which` picks their
        values as written here (mapped where they can be: nothing copied)."""
        want = {r.index: r for r in trace.records if r.value is None and which(r)}
        for m in self.index["records"]:
            rec = want.get(m.get("index"))
            if rec is not None and rec.name == m.get("name"):
                rec.value = self._value(m)

    def load(self, values: bool = True) -> Trace:
        trace = Trace(records=list(self.records(values)))
        trace.inputs = [r.value for r in trace.records if r.kind == "input"]
        err = self.index.get("error")
        if err:
            trace.error = CaptureError(**err)
        trace.output_form = self.index.get("output_form") or ""
        trace.output_others = self.index.get("output_others")
        trace.inputs_left = self.inputs_left()
        trace.rng_after = self.rng_after()
        return trace


def load_trace(path: str) -> Trace:
    return CaptureFile.open(path).load()
