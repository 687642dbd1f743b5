"""A capture directory's files, opened safely, and the safetensors format, read and written here (see
`diffkit.store` for the capture format and the safety rules: every member opened relative to the directory with
``O_NOFOLLOW``, a regular file directly inside it; writes never through an existing file; a safetensors header
parsed here, then one tensor's bytes with ``pread``, so no library opens a path by name)."""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import stat
import struct
import sys
import warnings
from typing import Any, Iterable

import torch

from .errors import DiffkitError

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
# safetensors dtype codes ("C128" is ours: safetensors has none for complex128)
_ST_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL", torch.complex64: "C64", torch.complex128: "C128"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
                     ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _ST_CODES[getattr(torch, _name)] = _code
        _DTYPES[_name] = getattr(torch, _name)
_ST_DTYPES = {c: d for d, c in _ST_CODES.items()}

# limits on a tensor's header (with those of `diffkit.store`: a stranger's file must not exhaust memory)
MAX_DIMS = 64
MAX_DIM = 1 << 62
MAX_ST_HEADER = 100 << 20  # a safetensors header

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a planted FIFO must not hang
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)
# relative opens (openat) make a member's name the whole story: no component but the last is looked up
_DIR_FD = bool(_O_NOFOLLOW and _O_DIRECTORY and os.open in os.supports_dir_fd and os.unlink in os.supports_dir_fd)
_LITTLE = sys.byteorder == "little"
_MEMBER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,254}")


def _show(v: Any) -> str:
    """A short, safe description of a bad value (never a deep repr)."""
    if isinstance(v, str):
        return repr(v[:60] + ("…" if len(v) > 60 else ""))
    if v is None or isinstance(v, (bool, int, float)):
        s = repr(v)
        return s if len(s) <= 40 else s[:40] + "…"
    if isinstance(v, list):
        return f"a list of {len(v)}"
    if isinstance(v, dict):
        return f"an object with {len(v)} keys"
    return type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------- the capture directory


class _Root:
    """A capture directory: members opened relative to it, never through a link, never outside it."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC) if _DIR_FD else None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "_Root":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _at(self, name: str) -> tuple[str, dict]:
        return (name, {"dir_fd": self.fd}) if self.fd is not None else (os.path.join(self.path, name), {})

    def where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open_read(self, name: str, label: str, phase: str = "read") -> int:
        """A read-only fd on member `name`, which must be a regular file directly in the directory.
        `label` names it in errors ("shard 'x' listed for record 3")."""
        if not _plain_name(name):
            raise DiffkitError("", phase, f"{label} points outside the capture: {_show(name)} is not a plain file "
                               f"name", self.path)
        p, kw = self._at(name)
        flags = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC | _O_BINARY
        try:
            if self.fd is None:  # no openat: check the name, open it, check it is the same file
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode):
                    raise OSError(errno.ELOOP, "is a symbolic link")
                real, root = os.path.realpath(p), os.path.realpath(self.path)
                if os.path.dirname(real) != root:
                    raise DiffkitError("", phase, f"{label} points outside the capture ({real})", self.path)
            fd = os.open(p, flags, **kw)
        except FileNotFoundError:
            raise DiffkitError("", phase, f"{label} is missing", self.where(name)) from None
        except OSError as e:
            if self._is_link(name) or e.errno in (errno.ELOOP, errno.EMLINK):
                raise DiffkitError("", phase, f"{label} is a symbolic link; a capture's files must be regular "
                                   f"files inside it, so it is not followed", self.where(name)) from None
            raise DiffkitError("", phase, f"{label} cannot be opened ({e.strerror or e})", self.where(name)) from None
        try:
            fst = os.fstat(fd)
            if self.fd is None and (fst.st_ino, fst.st_dev) != (st.st_ino, st.st_dev):
                raise DiffkitError("", phase, f"{label} changed while it was opened (replaced by a link?)",
                                   self.where(name))
            if not stat.S_ISREG(fst.st_mode):
                raise DiffkitError("", phase, f"{label} is not a regular file", self.where(name))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _is_link(self, name: str) -> bool:
        p, kw = self._at(name)
        try:
            return stat.S_ISLNK(os.stat(p, follow_symlinks=False, **kw).st_mode)
        except OSError:
            return False

    def exists(self, name: str) -> bool:
        p, kw = self._at(name)
        try:
            os.stat(p, follow_symlinks=False, **kw)
            return True
        except OSError:
            return False

    def create(self, name: str) -> int:
        """A write fd on a fresh, empty file `name`: whatever stood there (a planted link, a stale
        file, perhaps hard-linked elsewhere) is unlinked first, never written through."""
        p, kw = self._at(name)
        try:
            os.unlink(p, **kw)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise DiffkitError("", "capture", f"cannot write {name}: something that is not a file is in the way "
                               f"({e.strerror or e})", self.where(name)) from None
        try:
            return os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC | _O_BINARY, 0o644,
                           **kw)
        except FileExistsError:
            raise DiffkitError("", "capture", f"refusing to write {name}: it reappeared while being replaced "
                               f"(is something else writing into the capture?)", self.where(name)) from None

    def write_atomic(self, name: str, write) -> None:
        """`write(fileobj)` into ``name.tmp``, then rename it over `name`."""
        tmp = name + ".tmp"
        fd = self.create(tmp)
        try:
            with os.fdopen(fd, "wb") as fh:
                write(fh)
        except BaseException:
            try:
                p, kw = self._at(tmp)
                os.unlink(p, **kw)
            except OSError:
                pass
            raise
        src, kw = self._at(tmp)
        dst, _ = self._at(name)
        if self.fd is not None:
            os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        else:
            os.replace(src, dst)


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and bool(_MEMBER.fullmatch(name)) and name not in (".", "..")


def _pread(fd: int, n: int, offset: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        if hasattr(os, "pread"):
            b = os.pread(fd, min(n - got, 1 << 30), offset + got)
        else:
            os.lseek(fd, offset + got, os.SEEK_SET)
            b = os.read(fd, min(n - got, 1 << 30))
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read_limited(fd: int, limit: int, label: str, where: str) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise DiffkitError("", "read", f"{label} is {size} bytes; more than the {limit >> 20} MiB a capture's "
                           f"metadata may be", where)
    data = _pread(fd, limit + 1, 0)
    if len(data) > limit:
        raise DiffkitError("", "read", f"{label} is more than the {limit >> 20} MiB a capture's metadata may be",
                           where)
    return data


def _parse_json(data: bytes | str, label: str, where: str) -> Any:
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text)
    except UnicodeDecodeError as e:
        raise DiffkitError("", "read", f"{label} is not valid UTF-8 (byte {e.start}): truncated or edited",
                           where) from None
    except RecursionError:
        raise DiffkitError("", "read", f"{label} nests its JSON deeper than can be read (not a diffkit capture, "
                           f"or a hostile one)", where) from None
    except MemoryError:
        raise DiffkitError("", "read", f"{label} needs more memory to parse than there is", where) from None
    except json.JSONDecodeError as e:
        raise DiffkitError("", "read", f"{label} is not valid JSON (line {e.lineno}, column {e.colno}): truncated "
                           f"or edited", where) from None
    except ValueError as e:  # e.g. an integer with too many digits
        raise DiffkitError("", "read", f"{label} is not valid JSON ({str(e)[:200]}): truncated or edited",
                           where) from None


# ---------------------------------------------------------------- safetensors, read and written here


def _st_header(fd: int, size: int) -> tuple[dict, int]:
    """A safetensors file's header (validated to be an object) and where its data starts.
    Raises ValueError with the reason."""
    if size < 8:
        raise ValueError(f"{size} bytes, shorter than a header")
    (n,) = struct.unpack("<Q", _pread(fd, 8, 0))
    if n > size - 8:
        raise ValueError(f"the header claims {n} bytes, the file has {size - 8} after the length")
    if n > MAX_ST_HEADER:
        raise ValueError(f"a {n}-byte header, more than {MAX_ST_HEADER >> 20} MiB")
    raw = _pread(fd, n, 8)
    if len(raw) != n:
        raise ValueError("the header is cut short")
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("the header nests too deep") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"the header is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(hdr, dict):
        raise ValueError(f"the header is {_show(hdr)}, not an object")
    return hdr, 8 + n


def _st_tensor(fd: int, size: int, start: int, key: str, entry: Any, mapped: Any = None) -> torch.Tensor:
    """One tensor of a safetensors file, read with pread after checking its header entry (`mapped`: the
    file mapped into memory, a copy-on-write `mmap`: the tensor is a view of it, nothing is copied).
    Raises ValueError with the reason."""
    if not isinstance(entry, dict):
        raise ValueError(f"entry {key!r} is {_show(entry)}, not an object")
    code, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(code, str) or code not in _ST_DTYPES:
        raise ValueError(f"entry {key!r} has unknown dtype {_show(code)}")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(_is_int(s) and 0 <= s <= MAX_DIM for s in shape)):
        raise ValueError(f"entry {key!r} has a bad shape ({_show(shape)})")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs) and 0 <= offs[0] <= offs[1]):
        raise ValueError(f"entry {key!r} has bad data_offsets ({_show(offs)})")
    dtype = _ST_DTYPES[code]
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if offs[1] - offs[0] != nbytes:
        raise ValueError(f"entry {key!r}: {code} {shape} needs {nbytes} bytes, its offsets span {offs[1] - offs[0]}")
    if start + offs[1] > size:
        raise ValueError(f"the data of {key!r} ends at byte {start + offs[1]}, the file has {size}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if mapped is not None and _LITTLE and dtype != torch.bool:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(mapped, dtype=dtype, count=numel, offset=start + offs[0]).reshape(shape)
    if _LITTLE and dtype != torch.bool and hasattr(os, "preadv"):
        # straight into the tensor's memory: one copy, no intermediate bytes
        out = torch.empty(numel, dtype=dtype)
        view = memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B")
        got = 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:got + (1 << 30)]], start + offs[0] + got)
            if n <= 0:
                break
            got += n
        if got != nbytes:
            raise ValueError(f"the data of {key!r} is cut short ({got} of {nbytes} bytes)")
        return out.reshape(shape)
    data = _pread(fd, nbytes, start + offs[0])
    if len(data) != nbytes:
        raise ValueError(f"the data of {key!r} is cut short ({len(data)} of {nbytes} bytes)")
    if not _LITTLE:  # safetensors is little-endian: let the library convert
        from safetensors.torch import load

        raw = json.dumps({key: {"dtype": code, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
        return load(struct.pack("<Q", len(raw)) + raw + data)[key]
    if dtype == torch.bool:  # bytes other than 0/1 are not valid booleans
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).ne(0).reshape(shape)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def _st_write(fh, tensors: Iterable[tuple[str, torch.Tensor]], scratch: list | None = None) -> None:
    """Write `tensors` (name, tensor) as a safetensors file, one contiguous CPU copy at a time (a CPU tensor
    laid out otherwise is copied into a buffer kept in `scratch[0]` for the next call, not a fresh one)."""
    items = list(tensors)
    if not _LITTLE:
        from safetensors.torch import save

        fh.write(save({k: t.detach().to("cpu").contiguous() for k, t in items}))
        return
    header, off = {}, 0
    for name, t in items:
        nb = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    fh.write(struct.pack("<Q", len(raw)) + raw)
    scratch = scratch if scratch is not None else [None]
    for _, t in items:
        if not t.numel():
            continue
        t = t.detach()
        if t.device.type == "cuda" and _write_through_pinned(fh, t, scratch):
            continue
        if t.device.type == "cpu" and not t.is_contiguous():
            nb = t.numel() * t.element_size()
            if scratch[0] is None or scratch[0].numel() < nb:
                scratch[0] = torch.empty(nb, dtype=torch.uint8)
            c = scratch[0][:nb].view(t.dtype).view(t.shape)
            c.copy_(t)
        else:
            c = t.to("cpu").contiguous()
        fh.write(memoryview(c.reshape(-1).view(torch.uint8).numpy()))


# a device tensor is written through a pinned host buffer of this many bytes, a piece at a time (a
# pageable copy of each whole value is several times slower and takes a host copy of its size)
PINNED_STAGE_BYTES = 64 << 20


def _write_through_pinned(fh, t: torch.Tensor, scratch: list) -> bool:
    """Write device tensor `t`'s bytes to `fh` through a pinned buffer kept in `scratch` (its second slot)
    for the next call.  False (nothing written) where no pinned memory can be had: the caller copies."""
    if len(scratch) < 2:
        scratch.append(None)
    if scratch[1] is False:  # no pinned memory here: asked once
        return False
    nb = t.numel() * t.element_size()
    stage = scratch[1]
    if stage is None or stage.numel() < min(nb, PINNED_STAGE_BYTES):  # grown as the values need, up to the cap
        old = 0 if stage is None else stage.numel()
        scratch[1] = None
        try:
            stage = scratch[1] = torch.empty(min(max(nb, 2 * old, 1 << 20), PINNED_STAGE_BYTES), dtype=torch.uint8,
                                             pin_memory=True)
        except RuntimeError:
            scratch[1] = False
            return False
    try:  # what else could refuse, before a byte is written (the caller then copies as before)
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        host = stage.numpy()
    except (RuntimeError, TypeError):
        return False
    step = stage.numel()
    for i in range(0, flat.numel(), step):
        n = min(step, flat.numel() - i)
        stage[:n].copy_(flat[i:i + n])  # (synchronous: the buffer is written out next)
        fh.write(memoryview(host[:n]))
    return True
