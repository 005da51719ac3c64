"""Compile cache for CuTe DSL kernels: in memory, then on disk.

Every kernel goes through it (``dispatch`` calls it with the kernel module's tensor-free ``compile``)::

    fn = get_compiled("paged_decode", cfg, paged_decode.compile)   # cfg: a frozen Config(problem, tiles)
    fn(*torch_tensors, *scalars)

Keys come from :mod:`.keys` (:func:`config_key`: every field of the frozen config, nested dataclasses and
callables included).

Layers:

1. **Memory**: a dict keyed by ``(name, config_key(cfg))`` (plus a cheaper
   identity/equality memo in front of it so the hot path does not rebuild the
   key string on every launch).
2. **Disk** (unless ``CUTEDSL_ATTN_DISABLE_DISK_CACHE=1``):
   ``<root>/<fingerprint>/<name>/<sha256(key)[:32]>.o`` plus a ``.json`` sidecar
   (key, arch, sha256 and size of the ``.o``, compile seconds). ``<root>`` is
   ``$CUTEDSL_ATTN_CACHE_DIR`` or ``~/.cache/cutedsl_attn``. The fingerprint
   covers the sha256 of every ``.py`` file of the installed ``cutedsl_attn``
   package, ``cutlass.__version__`` and the CUDA flavor of the DSL's compiler
   build, the tvm-ffi version, the Python minor version, the host machine type
   and the target arch; any edit to the package therefore invalidates every entry.
   The artifact is a tvm-ffi object file written by
   ``compiled.export_to_c(object_file_path=..., function_name=...)`` to a
   temporary name and published with an atomic ``os.replace``. Compile and
   store run under an exclusive per-entry file lock (``filelock``, else
   ``fcntl.flock``; :mod:`.files`), so concurrent processes compile each kernel once.
   Loading uses ``cute.runtime.load_module(path, enable_tvm_ffi=True)``.

Failures of the disk layer are never fatal: a corrupt entry (checksum mismatch,
unparsable or missing sidecar, loader error on a machine whose GPU matches the
artifact's arch) is deleted and rebuilt. When the loader fails where loading may
be impossible (no GPU, or a GPU of another arch: cross-compiling), the entry is
not deleted; the kernel is compiled afresh, the artifact rewritten, and the
fresh object returned. An unwritable cache directory, a lock timeout or a failed
export fall back to the freshly compiled object. Each kind of problem warns once
(``RuntimeWarning``). Measured with DSL 4.8.1: ``load_module`` of a tvm-ffi
object works without any GPU or driver (the cubin is loaded lazily), so on a
CPU-only box a disk hit returns a loaded (but unrunnable) function.

This module imports nothing from the rest of ``cutedsl_attn``; ``cutlass`` and
``torch`` are imported lazily.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import re
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from .arch import device_arch, normalize_arch, target_arch
from .files import atomic_write_bytes, exclusive_lock, tmp_path
from .keys import config_arch, config_key, hash_callable, memo_sig

__all__ = [
    "CACHE_DIR_ENV",
    "DISABLE_DISK_CACHE_ENV",
    "LOCK_TIMEOUT_ENV",
    "config_key",
    "hash_callable",
    "get_compiled",
    "cache_stats",
    "clear_memory_cache",
    "cache_root",
    "cache_fingerprint",
    "disk_cache_enabled",
]

log = logging.getLogger("cutedsl_attn.compile")

#: Env var: root directory of the disk cache (default ``~/.cache/cutedsl_attn``).
CACHE_DIR_ENV = "CUTEDSL_ATTN_CACHE_DIR"
#: Env var: ``1`` (or true/yes/on) disables the disk layer entirely.
DISABLE_DISK_CACHE_ENV = "CUTEDSL_ATTN_DISABLE_DISK_CACHE"
#: Env var: seconds to wait for another process's compile of the same entry
#: (default 900); on timeout the kernel is compiled here without being stored.
LOCK_TIMEOUT_ENV = "CUTEDSL_ATTN_CACHE_LOCK_TIMEOUT"

_ARTIFACT_FORMAT = 1
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # .../cutedsl_attn
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")



# --------------------------------------------------------------------------
# Disk layout and fingerprint
# --------------------------------------------------------------------------


def cache_root() -> Path:
    """Return the disk cache root directory (not created).

    Reads ``CUTEDSL_ATTN_CACHE_DIR``; default ``~/.cache/cutedsl_attn``.

    Returns:
        The root path.
    """
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/cutedsl_attn").expanduser()


def disk_cache_enabled() -> bool:
    """Whether the disk layer is on.

    Reads ``CUTEDSL_ATTN_DISABLE_DISK_CACHE``: ``1``/``true``/``yes``/``on``
    (any case) disables it.

    Returns:
        ``False`` when disabled.
    """
    v = os.environ.get(DISABLE_DISK_CACHE_ENV, "").strip().lower()
    return v not in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(_PACKAGE_ROOT.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        h.update(p.relative_to(_PACKAGE_ROOT).as_posix().encode())
        h.update(b"\0")
        try:
            h.update(p.read_bytes())
        except OSError:
            h.update(b"<unreadable>")
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _tool_versions() -> Tuple[str, str]:
    import cutlass

    from .arch import dsl_cuda_flavor

    try:
        import tvm_ffi

        tvm_v = str(getattr(tvm_ffi, "__version__", "unknown"))
    except Exception:
        tvm_v = "none"
    try:
        flavor = f"+cu{dsl_cuda_flavor()}"  # the cu12 and cu13 builds bundle different ptxas
    except RuntimeError:
        flavor = "+cu?"
    return str(cutlass.__version__) + flavor, tvm_v


def _fingerprint_components(arch: str) -> Dict[str, str]:
    dsl_v, tvm_v = _tool_versions()
    return {
        "sources_sha256": _source_digest(),
        "cutlass_dsl": dsl_v,
        "tvm_ffi": tvm_v,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "arch": normalize_arch(arch),
        "format": str(_ARTIFACT_FORMAT),
    }


def cache_fingerprint(arch: str) -> str:
    """Return the disk-cache subfolder name for ``arch``.

    A sha256 (24 hex chars) over: every ``.py`` file of the installed
    ``cutedsl_attn`` package (path and bytes), ``cutlass.__version__`` with the
    CUDA flavor of the DSL's compiler build (``4.8.1+cu13``), the tvm-ffi
    version, the Python ``major.minor``, ``platform.machine()``, the normalized
    arch and the artifact format version.

    Args:
        arch: target architecture (any spelling accepted by ``normalize_arch``).

    Returns:
        The fingerprint string.

    Raises:
        ValueError: unknown architecture.
    """
    comps = _fingerprint_components(arch)
    return hashlib.sha256(json.dumps(comps, sort_keys=True).encode()).hexdigest()[:24]


@dataclasses.dataclass
class _Entry:
    name: str
    key: str
    arch: str
    dir: Path
    stem: str

    @property
    def obj(self) -> Path:
        return self.dir / f"{self.stem}.o"

    @property
    def meta(self) -> Path:
        return self.dir / f"{self.stem}.json"

    @property
    def lock(self) -> Path:
        return self.dir / f"{self.stem}.lock"

    @property
    def function_name(self) -> str:
        return re.sub(r"[^A-Za-z0-9_]", "_", self.name) + "_" + self.stem[:16]


def _make_entry(name: str, key: str, arch: str) -> _Entry:
    fp = cache_fingerprint(arch)
    fp_dir = cache_root() / fp
    d = fp_dir / name
    d.mkdir(parents=True, exist_ok=True)
    info = fp_dir / "fingerprint.json"
    if not info.exists():
        with contextlib.suppress(OSError):
            atomic_write_bytes(info, json.dumps(_fingerprint_components(arch), indent=1, sort_keys=True).encode())
    stem = hashlib.sha256(key.encode()).hexdigest()[:32]
    return _Entry(name=name, key=key, arch=arch, dir=d, stem=stem)


def _lock_timeout() -> float:
    try:
        return float(os.environ.get(LOCK_TIMEOUT_ENV, "900"))
    except ValueError:
        return 900.0


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------

_state_lock = threading.RLock()
_memory: Dict[Tuple[str, str], Any] = {}
_modules: Dict[Tuple[str, str], Any] = {}  # keep loaded modules alive
_fast: Dict[Any, Any] = {}  # (name, cfg, type sig, arch) -> fn
_by_id: Dict[int, Any] = {}  # id(cfg) -> (cfg, name, arch, fn)
_FAST_MAX = 4096
_key_locks: Dict[Tuple[str, str], threading.Lock] = {}
_stats: Dict[Tuple[str, str], Dict[str, Any]] = {}
_warned: set = set()
_preloaded_libs: list = []
_preloaded = False


def _warn_once(kind: str, msg: str) -> None:
    log.warning(msg)
    with _state_lock:
        if kind in _warned:
            return
        _warned.add(kind)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _preload_runtime_libs() -> None:
    """FA4 workaround: make the DSL runtime's symbols global before loading a
    cached object (upstream ``load_module`` opens them RTLD_LOCAL)."""
    global _preloaded
    if _preloaded:
        return
    import cutlass.cute as cute

    for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        try:
            _preloaded_libs.append(ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL))
        except OSError as e:
            log.debug("could not preload %s: %s", p, e)
    _preloaded = True


def _new_stats(name: str, key: str, arch: str) -> Dict[str, Any]:
    return {
        "name": name,
        "key": key,
        "arch": arch,
        "compile_s": None,
        "compiled_here": False,
        "load_s": None,
        "store_s": None,
        "source": None,
        "path": None,
    }


def cache_stats() -> Dict[Tuple[str, str], Dict[str, Any]]:
    """Return timing statistics per ``(name, key)`` (a deep copy).

    Each value is a dict with:

    * ``compile_s``: seconds of the cold compile (``build(cfg)``), measured in
      this process, or read from the artifact's sidecar when this process only
      loaded it from disk (then ``compiled_here`` is False); None if unknown.
    * ``compiled_here``: whether this process ran ``build``.
    * ``load_s``: seconds of the last warm disk load (checksum +
      ``load_module``), None if never loaded from disk.
    * ``store_s``: seconds spent exporting and publishing the artifact.
    * ``source``: ``"compile"`` or ``"disk"``: how the latest fill happened.
    * ``path``: the artifact path, or None without a disk layer.
    * ``name``, ``key``, ``arch``.

    Stats survive :func:`clear_memory_cache` (unless ``reset_stats=True``), so
    compile-then-clear-then-load yields both cold and warm numbers.
    """
    with _state_lock:
        return copy.deepcopy(_stats)


def clear_memory_cache(*, reset_stats: bool = False) -> None:
    """Drop every in-memory compiled kernel (the disk cache is untouched).

    Also re-arms the warn-once warnings. The source fingerprint is computed
    once per process and kept. For tests and benchmarks.

    Args:
        reset_stats: also clear :func:`cache_stats`.
    """
    with _state_lock:
        _memory.clear()
        _modules.clear()
        _fast.clear()
        _by_id.clear()
        _key_locks.clear()
        _warned.clear()
        if reset_stats:
            _stats.clear()


# --------------------------------------------------------------------------
# Disk load / store
# --------------------------------------------------------------------------

_MISSING, _LOADED, _CORRUPT = "missing", "loaded", "corrupt"


def _remove_entry(e: _Entry) -> None:
    for p in (e.obj, e.meta):
        with contextlib.suppress(OSError):
            p.unlink()


def _try_load(e: _Entry, stats: Dict[str, Any], *, may_delete: bool):
    """Returns (status, fn, module)."""
    if not e.obj.exists():
        return _MISSING, None, None
    t0 = time.perf_counter()
    problem = None
    meta = None
    try:
        meta = json.loads(e.meta.read_bytes())
        data = e.obj.read_bytes()
        if meta.get("format") != _ARTIFACT_FORMAT or meta.get("key") != e.key:
            problem = "sidecar does not match the entry"
        elif meta.get("size") != len(data) or meta.get("sha256") != hashlib.sha256(data).hexdigest():
            problem = "checksum mismatch (truncated or corrupted object file)"
    except FileNotFoundError:
        problem = "missing sidecar"
    except (OSError, ValueError) as err:
        problem = f"unreadable entry ({err})"
    if problem is not None:
        if may_delete:
            _warn_once("corrupt", f"cutedsl_attn compile cache: {e.obj}: {problem}; deleting and rebuilding")
            _remove_entry(e)
        return _CORRUPT, None, None
    try:
        _preload_runtime_libs()
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(e.obj), enable_tvm_ffi=True)
        fn = getattr(module, meta["function_name"])
    except Exception as err:  # noqa: BLE001 - the loader raises RuntimeError/DSL errors
        dev = device_arch()
        if dev is not None and dev == e.arch:
            if may_delete:
                _warn_once(
                    "unloadable",
                    f"cutedsl_attn compile cache: cannot load {e.obj} ({type(err).__name__}: {err}); "
                    "deleting and rebuilding",
                )
                _remove_entry(e)
            return _CORRUPT, None, None
        # No GPU here, or a GPU of another arch: loading may simply be
        # impossible. Do not delete; the caller compiles and overwrites.
        if may_delete:
            _warn_once(
                "cannot_load_here",
                f"cutedsl_attn compile cache: cannot load {e.obj} on this machine (device arch "
                f"{dev}, artifact arch {e.arch}; {type(err).__name__}: {err}); using a fresh "
                "compile and rewriting the artifact",
            )
        return _CORRUPT, None, None
    dt = time.perf_counter() - t0
    stats["load_s"] = dt
    stats["source"] = "disk"
    stats["path"] = str(e.obj)
    if not stats["compiled_here"]:
        stats["compile_s"] = meta.get("compile_s")
    log.debug("loaded %s from %s in %.4f s", e.name, e.obj, dt)
    return _LOADED, fn, module


def _is_tvm_ffi_compiled(fn) -> bool:
    return any(c.__name__ == "TVMFFIJitCompiledFunctionBase" for c in type(fn).__mro__)


def _store(e: _Entry, fn, stats: Dict[str, Any], compile_s: float) -> None:
    if not _is_tvm_ffi_compiled(fn) or not hasattr(fn, "export_to_c"):
        _warn_once(
            "not_exportable",
            f"cutedsl_attn compile cache: {e.name}: build returned {type(fn).__name__}, not a "
            "tvm-ffi compiled function (compile with options=compile_options(arch)); "
            "kept in memory only",
        )
        return
    t0 = time.perf_counter()
    tmp_obj = tmp_path(e.obj, ".o")  # the exporter picks the format by extension
    tmp_meta = tmp_path(e.meta, ".json")
    try:
        fn.export_to_c(object_file_path=str(tmp_obj), function_name=e.function_name)
        data = tmp_obj.read_bytes()
        meta = {
            "format": _ARTIFACT_FORMAT,
            "name": e.name,
            "key": e.key,
            "arch": e.arch,
            "function_name": e.function_name,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "compile_s": compile_s,
            "created": time.time(),
            "fingerprint": _fingerprint_components(e.arch),
        }
        tmp_meta.write_bytes(json.dumps(meta, indent=1, sort_keys=True).encode())
        os.replace(tmp_obj, e.obj)
        os.replace(tmp_meta, e.meta)
    except Exception as err:  # noqa: BLE001
        _warn_once(
            "store_failed",
            f"cutedsl_attn compile cache: could not store {e.obj} ({type(err).__name__}: {err}); "
            "kept in memory only",
        )
        return
    finally:
        for p in (tmp_obj, tmp_meta):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    stats["store_s"] = time.perf_counter() - t0
    stats["path"] = str(e.obj)
    log.debug("stored %s at %s in %.4f s", e.name, e.obj, stats["store_s"])


# --------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------


def _resolve_arch(cfg, arch: Optional[str]) -> Tuple[str, bool]:
    cfg_arch = config_arch(cfg)
    if arch is not None:
        a = normalize_arch(arch)
        if cfg_arch is not None and normalize_arch(cfg_arch) != a:
            raise ValueError(f"get_compiled: arch={arch!r} contradicts the config's arch {cfg_arch!r}")
        return a, cfg_arch is not None
    if cfg_arch is not None:
        return normalize_arch(cfg_arch), True
    return target_arch(), False


# The DSL's compiler keeps per-process state (an MLIR context/session) that is not safe to
# use from several threads at once: every build in this process is serialised.
_compile_lock = threading.RLock()


def _build(build, cfg, stats):
    t0 = time.perf_counter()
    with _compile_lock:
        fn = build(cfg)
    dt = time.perf_counter() - t0
    if fn is None:
        raise TypeError("get_compiled: build(cfg) returned None (it must return the compiled callable)")
    stats["compile_s"] = dt
    stats["compiled_here"] = True
    stats["source"] = "compile"
    log.debug("compiled %s in %.3f s", stats["name"], dt)
    return fn, dt


def _fill(name: str, key: str, arch: str, cfg, build):
    """Returns (fn, module_or_None). Caller holds the per-key thread lock."""
    mk = (name, key)
    with _state_lock:
        stats = _stats.get(mk)
        if stats is None:
            stats = _stats[mk] = _new_stats(name, key, arch)
    if not disk_cache_enabled():
        fn, _ = _build(build, cfg, stats)
        return fn, None
    try:
        e = _make_entry(name, key, arch)
    except OSError as err:
        _warn_once(
            "disk_unavailable",
            f"cutedsl_attn compile cache: cache directory {cache_root()} is unusable ({err}); "
            f"compiling in memory only (set {CACHE_DIR_ENV} or {DISABLE_DISK_CACHE_ENV}=1)",
        )
        fn, _ = _build(build, cfg, stats)
        return fn, None

    # Fast path: no lock. os.replace publishes whole files and the checksum
    # guards the rest; nothing is deleted outside the lock.
    status, fn, module = _try_load(e, stats, may_delete=False)
    if status == _LOADED:
        return fn, module

    with exclusive_lock(e.lock, _lock_timeout(), _warn_once) as locked:
        if not locked:
            _warn_once(
                "lock_timeout",
                f"cutedsl_attn compile cache: timed out waiting for {e.lock} "
                f"({LOCK_TIMEOUT_ENV}); compiling without storing",
            )
            fn, _ = _build(build, cfg, stats)
            return fn, None
        # Another process may have published it while we waited.
        status, fn, module = _try_load(e, stats, may_delete=True)
        if status == _LOADED:
            return fn, module
        fn, compile_s = _build(build, cfg, stats)
        _store(e, fn, stats, compile_s)
        return fn, None


def get_compiled(name: str, cfg, build: Callable[[Any], Any], *, arch: Optional[str] = None):
    """Return the compiled kernel for ``cfg``, compiling at most once.

    Lookup order: memory -> disk -> ``build(cfg)`` (then stored to disk). See
    the module docstring for the disk layout, locking and failure handling.

    Args:
        name: kernel family name, e.g. ``"paged_decode"``; a path component
            (letters, digits, ``_ . -``).
        cfg: frozen dataclass instance describing every compile-time choice;
            keyed with :func:`config_key`. Its ``arch`` field (or that of a
            nested part, ``cfg.problem.arch``), if present, selects the target.
        build: ``cfg -> compiled`` callable; should return the tvm-ffi callable
            of ``cute.compile(..., options=compile_options(cfg.arch))``
            (only tvm-ffi compiled functions are stored on disk).
        arch: target arch for the disk fingerprint when ``cfg`` has no ``arch``
            field (default: :func:`target_arch`); must agree with ``cfg.arch``
            when both are given.

    Returns:
        The callable: the object returned by ``build`` after a compile, or the
        function loaded from the disk artifact (``tvm_ffi.Function``). Both take
        torch tensors and use the current torch stream.

    Raises:
        TypeError: ``cfg`` cannot be keyed (see :func:`config_key`), or
            ``build`` returned None.
        ValueError: bad ``name``, unknown arch, or ``arch`` contradicting
            ``cfg.arch``.
        RuntimeError: no arch could be determined (no GPU, no ``cfg.arch``, no
            ``CUTEDSL_ATTN_ARCH``).
        Any exception raised by ``build`` itself.

    Env vars: ``CUTEDSL_ATTN_CACHE_DIR``, ``CUTEDSL_ATTN_DISABLE_DISK_CACHE``,
    ``CUTEDSL_ATTN_CACHE_LOCK_TIMEOUT``, and ``CUTEDSL_ATTN_ARCH`` (through
    :func:`target_arch` when ``cfg`` names no ``arch``).

    Note: a config holding a callable (a ``score_mod``) skips the equality memo: its
    key (:func:`hash_callable`: source, closure values, referenced globals) is derived
    on every call, so a changed closure value or global gives another kernel (FA4's
    memo would not see a mutated closure).  Call it once per plan, not per launch.
    """
    # Hottest path: the very config object seen before (dispatch keeps one per plan).
    ent = _by_id.get(id(cfg))
    if ent is not None and ent[0] is cfg and ent[1] == name and ent[2] == arch:
        return ent[3]
    # Hot path: equality memo on the config itself (cheap: no key string).
    memo, fn = None, None
    if getattr(cfg, "__dataclass_fields__", None) is not None and not isinstance(cfg, type):
        memo_arch = arch
        try:
            if arch is None and config_arch(cfg) is None:
                memo_arch = target_arch()  # env / device decide: part of the memo key
            # a config holding a callable (not a class) at any depth re-derives its key: no memo entry
            sig = memo_sig(cfg)
            memo = None if sig is None else (name, cfg, sig, memo_arch)
            fn = _fast.get(memo) if memo is not None else None
        except TypeError:  # unhashable field: config_key raises the proper error
            memo = None
        if fn is not None:
            _remember_id(cfg, name, arch, memo_arch, fn)
            return fn

    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"get_compiled: name must match {_NAME_RE.pattern}, got {name!r}")
    key = config_key(cfg)
    resolved_arch, arch_in_key = _resolve_arch(cfg, arch)
    if not arch_in_key:
        key = f"{key}@{resolved_arch}"
    mk = (name, key)

    with _state_lock:
        fn = _memory.get(mk)
        klock = _key_locks.setdefault(mk, threading.Lock())
    if fn is None:
        with klock:
            with _state_lock:
                fn = _memory.get(mk)
            if fn is None:
                fn, module = _fill(name, key, resolved_arch, cfg, build)
                with _state_lock:
                    _memory[mk] = fn
                    if module is not None:
                        _modules[mk] = module
    if memo is not None:
        with _state_lock:
            if len(_fast) >= _FAST_MAX:
                _fast.clear()
            _fast[memo] = fn
        _remember_id(cfg, name, arch, memo[3], fn)
    return fn


def _remember_id(cfg, name, arch, memo_arch, fn) -> None:
    """Identity memo for a config without callables whose target does not depend on env or device."""
    if arch is None and memo_arch is not None:  # target_arch() decided: the env may change it
        return
    with _state_lock:
        if len(_by_id) >= _FAST_MAX:
            _by_id.clear()
        _by_id[id(cfg)] = (cfg, name, arch, fn)  # holding cfg keeps its id from being reused
