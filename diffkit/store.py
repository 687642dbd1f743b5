"""Capture files: a forward's records on disk, safe to open from strangers.

A capture is a directory (conventionally ``*.dkt``) holding safetensors shards and one
``index.json`` with every record's metadata, the shard and key of its value, and the error if
the forward raised.  It is written incrementally: a shard whenever the buffer passes
`shard_bytes`, each flushed record's metadata appended as one line to ``records.jsonl``, and
``index.json`` rewritten atomically at most once a second and at the end.  A process that dies
mid-forward thus leaves every record flushed before it, at a cost linear in the records.  Reading is lazy: one tensor at a time.
Nothing in it is executable: no pickle anywhere.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from .capture import CaptureError, Record, Ref, Trace
from .errors import DiffkitError

FORMAT = "diffkit-capture"
VERSION = 1
_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
_FIELDS = ("index", "name", "kind", "scope", "label", "function", "file", "line", "op", "aliases", "is_output",
           "rebound")


def _meta(rec: Record) -> dict:
    d = {k: getattr(rec, k) for k in _FIELDS}
    d["shape"] = list(rec.shape)
    d["dtype"] = str(rec.dtype).replace("torch.", "")
    d["device"] = rec.device
    d["inputs"] = [r.index for r in rec.inputs]
    return d


class CaptureWriter:
    """Append records; `flush()` writes a shard; `close()` marks the capture complete."""

    def __init__(self, path: str, side: str = "", source: str = "", shard_bytes: int = 64 << 20,
                 values: bool = True):
        self.path = path
        self.values = values  # False: metadata only (a streaming diff's crash insurance)
        self.side, self.source = side, source
        self.shard_bytes = shard_bytes
        os.makedirs(path, exist_ok=True)
        self.entries: list[dict] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_meta: list[dict] = []
        self.pending_bytes = 0
        self.shards = 0
        self.error: dict | None = None
        self.complete = False
        self._last_index = 0.0
        self._journal = open(os.path.join(path, "records.jsonl"), "w", encoding="utf-8")
        self._write_index()

    def add(self, rec: Record) -> None:
        meta = _meta(rec)
        if rec.value is not None and self.values:
            key = f"r{rec.index:06d}"
            v = rec.value.detach()
            self.pending[key] = v.to("cpu").contiguous()
            meta["key"] = key
            self.pending_bytes += v.numel() * v.element_size()
        self.pending_meta.append(meta)
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def update(self, rec: Record) -> None:
        """A record already written got another name (aliases, renames): keep the index in step."""
        for m in reversed(self.pending_meta):
            if m["index"] == rec.index:
                m.update({k: getattr(rec, k) for k in ("name", "kind", "aliases", "is_output", "rebound")})
                return
        if 0 <= rec.index < len(self.entries) and self.entries[rec.index]["index"] == rec.index:
            m = self.entries[rec.index]
            m.update({k: getattr(rec, k) for k in ("name", "kind", "aliases", "is_output", "rebound")})
            self._journal.write(json.dumps(m) + "\n")  # a later line for an index replaces the earlier
            self._journal.flush()

    def flush(self) -> None:
        if not self.pending_meta:
            return
        from safetensors.torch import save_file

        shard = f"shard-{self.shards:05d}.safetensors"
        if self.pending:
            tmp = os.path.join(self.path, shard + ".tmp")
            save_file(self.pending, tmp)
            os.replace(tmp, os.path.join(self.path, shard))
            self.shards += 1
        for m in self.pending_meta:
            if "key" in m:
                m["shard"] = shard
        self.entries += self.pending_meta
        self._journal.write("".join(json.dumps(m) + "\n" for m in self.pending_meta))
        self._journal.flush()
        self.pending, self.pending_meta, self.pending_bytes = {}, [], 0
        import time

        if time.monotonic() - self._last_index > 1.0:
            self._write_index()

    def set_error(self, err: CaptureError | None) -> None:
        self.error = None if err is None else {k: getattr(err, k) for k in (
            "type", "message", "scope", "function", "file", "line", "traceback", "call")}

    def close(self) -> None:
        self.flush()
        self.complete = True
        self._write_index()
        self._journal.close()

    def _write_index(self) -> None:
        import time

        self._last_index = time.monotonic()
        data = {"format": FORMAT, "version": VERSION, "side": self.side, "source": self.source,
                "complete": self.complete, "error": self.error, "records": self.entries}
        tmp = os.path.join(self.path, "index.json.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, os.path.join(self.path, "index.json"))


def _recover(path: str, records: list) -> list:
    """An unfinished capture: the journal may hold records flushed after the index was last written.
    A torn last line (the writer died mid-write) ends the journal."""
    journal = os.path.join(path, "records.jsonl")
    if not os.path.exists(journal):
        return records
    by_index: dict[int, dict] = {}
    with open(journal, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                m = json.loads(line)
                by_index[int(m["index"])] = m
            except (ValueError, KeyError, TypeError):
                break
    if len(by_index) < len(records):
        return records
    return [by_index[i] for i in range(len(by_index)) if i in by_index]


def save_trace(trace: Trace, path: str, side: str = "", source: str = "", shard_bytes: int = 64 << 20) -> str:
    w = CaptureWriter(path, side, source, shard_bytes)
    for rec in trace.records:
        w.add(rec)
    w.set_error(trace.error)
    w.close()
    return path


@dataclass
class CaptureFile:
    """A capture on disk, read lazily.  `load()` gives a Trace with every value."""

    path: str
    index: dict

    @classmethod
    def open(cls, path: str) -> "CaptureFile":
        idx_path = os.path.join(path, "index.json")
        if not os.path.isdir(path):
            raise DiffkitError("", "read", f"{path} is not a capture directory (expected index.json and shards)", path)
        if not os.path.exists(idx_path):
            raise DiffkitError("", "read", f"{idx_path} is missing: not a diffkit capture, or it was never written",
                               path)
        try:
            with open(idx_path, encoding="utf-8") as fh:
                index = json.load(fh)
        except json.JSONDecodeError as e:
            raise DiffkitError("", "read", f"{idx_path} is not valid JSON (line {e.lineno}, column {e.colno}): "
                               f"truncated or edited", idx_path) from e
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise DiffkitError("", "read", f"{idx_path} is not a diffkit capture index (format field is "
                               f"{index.get('format') if isinstance(index, dict) else type(index).__name__!r})", idx_path)
        if index.get("version") != VERSION:
            raise DiffkitError("", "read", f"{idx_path} has format version {index.get('version')!r}; this diffkit reads "
                               f"version {VERSION}", idx_path)
        if not isinstance(index.get("records"), list):
            raise DiffkitError("", "read", f"{idx_path} has no record list", idx_path)
        if not index.get("complete"):
            index["records"] = _recover(path, index["records"])
        return cls(path, index)

    @property
    def complete(self) -> bool:
        return bool(self.index.get("complete"))

    def __len__(self) -> int:
        return len(self.index["records"])

    def _value(self, meta: dict) -> torch.Tensor | None:
        if "key" not in meta:
            return None
        from safetensors import safe_open

        shard = os.path.join(self.path, str(meta.get("shard", "")))
        if not os.path.basename(shard) or os.path.dirname(os.path.abspath(shard)) != os.path.abspath(self.path):
            raise DiffkitError("", "read", f"record {meta.get('name')!r} points outside the capture: {meta.get('shard')!r}",
                               self.path)
        if not os.path.exists(shard):
            raise DiffkitError("", "read", f"shard {meta.get('shard')} listed for record {meta.get('name')!r} is missing",
                               self.path)
        try:
            with safe_open(shard, framework="pt") as fh:
                value = fh.get_tensor(meta["key"])
        except Exception as e:
            raise DiffkitError("", "read", f"shard {meta.get('shard')} is truncated or corrupt ({type(e).__name__}: "
                               f"{str(e)[:200]}) while reading record {meta.get('name')!r}", shard) from e
        if list(value.shape) != list(meta.get("shape", [])) or str(value.dtype).replace("torch.", "") != meta.get("dtype"):
            raise DiffkitError("", "read", f"record {meta.get('name')!r}: the index says {meta.get('dtype')} "
                               f"{meta.get('shape')}, the shard holds {value.dtype} {list(value.shape)}: the files "
                               f"do not belong together", shard)
        return value

    def records(self, values: bool = True) -> Iterator[Record]:
        """Records one at a time (each value read from its shard when `values`)."""
        for i, m in enumerate(self.index["records"]):
            try:
                rec = Record(
                    index=int(m["index"]), name=str(m["name"]), kind=str(m["kind"]), scope=str(m["scope"]),
                    label=str(m["label"]), function=str(m["function"]), file=str(m["file"]), line=int(m["line"]),
                    op=str(m["op"]), shape=tuple(int(s) for s in m["shape"]), dtype=_DTYPES[m["dtype"]],
                    device=str(m["device"]), value=None, aliases=[str(a) for a in m.get("aliases", [])],
                    is_output=bool(m.get("is_output")), rebound=bool(m.get("rebound")),
                    inputs=tuple(Ref(int(i)) for i in m.get("inputs", [])))
            except (KeyError, TypeError, ValueError) as e:
                raise DiffkitError("", "read", f"record {i} of {self.path}/index.json is malformed ({type(e).__name__}: "
                                   f"{e})", self.path) from e
            if rec.index != i:
                raise DiffkitError("", "read", f"record {i} of {self.path}/index.json claims index {rec.index}", self.path)
            if values:
                rec.value = self._value(m)
            yield rec

    def load(self, values: bool = True) -> Trace:
        trace = Trace(records=list(self.records(values)))
        trace.inputs = [r.value for r in trace.records if r.kind == "input"]
        err = self.index.get("error")
        if err:
            trace.error = CaptureError(**{k: err.get(k, "" if k != "line" else 0) for k in (
                "type", "message", "scope", "function", "file", "line", "traceback", "call")})
        return trace


def load_trace(path: str) -> Trace:
    return CaptureFile.open(path).load()
