"""First-use self-check verdicts: whether a kernel may serve a configuration it has not been verified on.

A kernel that was built and checked without its hardware (the SM100 / SM103 kernels) serves a configuration only
after a check on the real device: a small problem of that configuration through the kernel and through the
portable kernel, compared with the float64 oracle (the check itself is injected: :func:`admitted` takes it as
a callable; ``cutedsl_attn.selfcheck`` builds it).  The verdict is recorded beside the compiled artifact in the
disk cache, ``<root>/<fingerprint>/<name>/<stem>.selfcheck.json`` next to ``<stem>.o``, so later processes skip
the check; the fingerprint covers the package's sources, so an edited kernel is checked again.  With the disk
cache off (``CUTEDSL_ATTN_DISABLE_DISK_CACHE=1``) verdicts live in this process only.

``CUTEDSL_ATTN_SELFCHECK=0`` (or false / no / off) turns the check off: every candidate is admitted unchecked
and no verdict is read or written.

Bottom of the import graph, as the rest of ``compile/``: imports nothing above it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

from .cache import _make_entry, _resolve_arch, disk_cache_enabled
from .files import atomic_write_bytes
from .keys import config_key

__all__ = [
    "SELFCHECK_ENV",
    "VERIFIED",
    "Verdict",
    "admitted",
    "clear_verdicts",
    "enabled",
    "read_verdict",
    "record_path",
    "write_verdict",
]

log = logging.getLogger("cutedsl_attn.selfcheck")

#: Env var: ``0`` / ``false`` / ``no`` / ``off`` turns the first-use self-check off (candidates run unchecked).
SELFCHECK_ENV = "CUTEDSL_ATTN_SELFCHECK"

#: kernel ``NAME`` -> config keys (:func:`config_key`) verified on their hardware by the GPU test suite: these
#: skip the first-use check.  Empty for ``prefill_sm100``: it has never run on a Blackwell GPU.
VERIFIED: dict[str, frozenset[str]] = {}

_RECORD_FORMAT = 1
_RECORD_SUFFIX = ".selfcheck.json"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one first-use check.

    ``passed``: the candidate matched the oracle within ``tolerance``; ``detail``: one line saying what was
    compared (or why it failed); ``candidate_err`` / ``reference_err``: relative Frobenius errors of O of the
    candidate and of the portable kernel against the oracle (None where not measured); ``seconds``: wall time
    of the check; ``device``: the GPU's name."""

    passed: bool
    detail: str
    candidate_err: Optional[float] = None
    reference_err: Optional[float] = None
    tolerance: Optional[float] = None
    seconds: Optional[float] = None
    device: str = ""


def enabled() -> bool:
    """Whether the first-use check is on (``CUTEDSL_ATTN_SELFCHECK`` unset or anything but 0/false/no/off)."""
    return os.environ.get(SELFCHECK_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def _entry_key(cfg) -> tuple[str, str]:
    """``(key, arch)`` exactly as the compile cache derives them for ``cfg`` (so the record sits beside the
    artifact)."""
    key = config_key(cfg)
    arch, in_key = _resolve_arch(cfg, None)
    return (key if in_key else f"{key}@{arch}"), arch


def record_path(name: str, cfg) -> Optional[Path]:
    """Where the verdict of kernel ``name`` on ``cfg`` is recorded: beside the compiled artifact
    (``<stem>.selfcheck.json`` next to ``<stem>.o``); None with the disk cache off.

    Raises OSError when the cache directory cannot be created; TypeError / ValueError as ``config_key`` and
    the cache's arch resolution."""
    if not disk_cache_enabled():
        return None
    key, arch = _entry_key(cfg)
    e = _make_entry(name, key, arch)
    return e.dir / f"{e.stem}{_RECORD_SUFFIX}"


def read_verdict(name: str, cfg) -> Optional[Verdict]:
    """The recorded verdict of ``name`` on ``cfg``, or None (none recorded, disk cache off, or a record that is
    unreadable or belongs to another key: those are ignored and rewritten by the next check)."""
    try:
        path = record_path(name, cfg)
        if path is None or not path.exists():
            return None
        data = json.loads(path.read_bytes())
        if data.get("format") != _RECORD_FORMAT or data.get("name") != name or data.get("key") != _entry_key(cfg)[0]:
            return None
        fields = {f.name for f in dataclasses.fields(Verdict)}
        return Verdict(**{k: v for k, v in data["verdict"].items() if k in fields})
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        log.debug("unreadable self-check record for %s: %s", name, e)
        return None


def write_verdict(name: str, cfg, verdict: Verdict) -> Optional[Path]:
    """Record ``verdict`` for ``name`` on ``cfg`` (an atomic replace); returns the path, None with the disk cache
    off or when the directory is not writable (the verdict then lives in this process only)."""
    try:
        path = record_path(name, cfg)
        if path is None:
            return None
        key, arch = _entry_key(cfg)
        record = {"format": _RECORD_FORMAT, "name": name, "key": key, "arch": arch, "created": time.time(),
                  "verdict": dataclasses.asdict(verdict)}
        atomic_write_bytes(path, json.dumps(record, indent=1, sort_keys=True).encode())
        return path
    except OSError as e:
        log.warning("cutedsl_attn self-check: could not record the verdict of %s: %s", name, e)
        return None


_lock = threading.Lock()
_memo: dict[tuple[str, str], bool] = {}  # (name, key) -> admitted, for this process
_warned: set[tuple[str, str]] = set()


def clear_verdicts() -> None:
    """Forget this process's verdicts and warnings (records on disk stay).  For tests."""
    with _lock:
        _memo.clear()
        _warned.clear()


def _warn_fallback(name: str, cfg, key: str, verdict: Verdict, path: Optional[Path], recorded: bool) -> None:
    with _lock:
        if (name, key) in _warned:
            return
        _warned.add((name, key))
    where = f"; verdict {'read from' if recorded else 'recorded in'} {path} (delete it to check again)" if path else ""
    warnings.warn(
        f"cutedsl_attn: kernel {name} failed its first-use self-check for {cfg!r}: {verdict.detail}; the portable "
        f"kernel serves this configuration instead{where}; {SELFCHECK_ENV}=0 skips the check",
        RuntimeWarning, stacklevel=3)


def admitted(name: str, cfg, check: Optional[Callable[[], Verdict]]) -> bool:
    """Whether kernel ``name`` may serve ``cfg``.

    True when the check is off (:func:`enabled`), when ``cfg``'s key is in :data:`VERIFIED` for ``name``, or
    when the check passed: a verdict remembered in this process, recorded on disk by an earlier process, or
    ``check()`` run now (its verdict is then recorded).  ``check`` None (no device here to run it on: a
    cross-compile, or a CUDA graph being captured) admits only a verdict already known.  A failed verdict
    warns once per process, naming the configuration; a ``check()`` that raises counts as failed for this
    process only (not recorded: it may be transient).
    """
    if not enabled():
        return True
    key = _entry_key(cfg)[0]
    if key in VERIFIED.get(name, ()):
        return True
    with _lock:
        ok = _memo.get((name, key))
    if ok is not None:
        return ok
    verdict = read_verdict(name, cfg)
    recorded = verdict is not None
    path = None
    if verdict is None:
        if check is None:
            return False
        try:
            verdict = check()
        except Exception as e:  # noqa: BLE001 - any failure of the candidate keeps the portable kernel
            verdict = Verdict(False, f"the check raised {type(e).__name__}: {str(e)[:300]}")
            with _lock:
                _memo[(name, key)] = False
            _warn_fallback(name, cfg, key, verdict, None, False)
            return False
        path = write_verdict(name, cfg, verdict)
    elif not verdict.passed:
        with contextlib.suppress(OSError, TypeError, ValueError):
            path = record_path(name, cfg)
    with _lock:
        _memo[(name, key)] = verdict.passed
    if not verdict.passed:
        _warn_fallback(name, cfg, key, verdict, path, recorded)
    return verdict.passed
