"""Atomic file writes: a reader, or a kill mid-write, sees the old file or the new one, never a part.

The new content goes to a temporary file beside the target, which is renamed over it once
complete; a failure removes the temporary file and leaves any previous file untouched. The
directory must exist. A leaf module: it imports nothing from the project.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """A file to write `path` through; it replaces `path` when the block ends without an exception."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, mode, encoding=None if mode == "wb" else encoding) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    with atomic_open(path, "w", encoding) as f:
        f.write(text)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, uniquely named file next to `path` (so the rename stays on one filesystem).

    Unlike `tempfile.mkstemp` (mode 0600), it gets the permissions a plain write would (0666
    less the umask): the temporary file becomes the target.
    """
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: no free temporary name for {path.name}")
