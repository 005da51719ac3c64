"""File-system primitives of the compile layer: temporary names, atomic writes, an inter-process lock.

Imports nothing from the rest of ``cutedsl_attn``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path


def tmp_path(final: Path, suffix: str) -> Path:
    """A temporary name beside ``final`` (hidden, unique per process and call) ending in ``suffix``."""
    return final.with_name(f".{final.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp{suffix}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``: readers see the old file or the new."""
    tmp = tmp_path(path, path.suffix)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def exclusive_lock(path: Path, timeout: float, warn):
    """Yield True while holding an exclusive inter-process lock on ``path``, False if it could not be taken
    within ``timeout`` seconds (or at all: then ``warn(kind, message)`` is called first)."""
    try:
        import filelock
    except ImportError:  # pragma: no cover - filelock comes with torch
        filelock = None
    if filelock is not None:
        lock = filelock.FileLock(str(path), timeout=timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            yield False
            return
        except OSError as e:
            warn("lock_error", f"cutedsl_attn compile cache: cannot lock {path}: {e}")
            yield False
            return
        try:
            yield True
        finally:
            lock.release()
        return
    import fcntl  # pragma: no cover

    try:  # pragma: no cover
        fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # pragma: no cover
        warn("lock_error", f"cutedsl_attn compile cache: cannot lock {path}: {e}")
        yield False
        return
    try:  # pragma: no cover
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if timeout >= 0 and time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:  # pragma: no cover
        os.close(fd)
