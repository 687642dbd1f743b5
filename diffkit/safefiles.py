"""Files diffkit writes where someone else may have planted a link (a shared report folder, a suite's output
folder): never written through a symbolic link or into a hard-linked victim.

`write_text` / `write_bytes` write a fresh file made with O_CREAT|O_EXCL (which fails rather than follow a link
at that name) under a random name in the target's folder, then rename it over the target: a link planted at the
target's name is replaced, the file it pointed at is left untouched, and a reader sees the old file or the new
one, never half of one.  `open_fresh` is the same for a file written as it goes (a log): whatever is at the name
is removed first, then the file is made with O_EXCL|O_NOFOLLOW.  (Capture folders do the same through their
folder's descriptor: store_io.)"""
from __future__ import annotations

import os
import tempfile
from typing import IO

def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# read once, at import: reading it means setting it, and a suite writes from several threads at once
_UMASK = _read_umask()
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def write_bytes(path: str, data: bytes) -> str:
    """Write `data` to `path` (folders made as needed) without following a link at `path`; returns `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644 & ~_UMASK)  # (mkstemp makes it 0600; as open() would have made it)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_text(path: str, text: str) -> str:
    """`write_bytes` of `text` in UTF-8, newlines as given.  Surrogates UTF-8 cannot hold (a name a model gave,
    e.g. a `diffkit.tap` name with a lone surrogate) are written as their escape (\\ud800), never an error; the
    bytes of an undecodable file name (surrogateescape) as they were."""
    try:
        data = text.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:
        data = text.encode("utf-8", errors="backslashreplace")
    return write_bytes(path, data)


def open_fresh(path: str) -> IO[str]:
    """A new file at `path` for writing text as it goes: whatever was at that name (a file, a planted link) is
    removed, the file is created exclusively and a link is never followed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
    return os.fdopen(fd, "w", encoding="utf-8", errors="replace")
