"""Stable compile keys: a frozen config dataclass or a callable to a deterministic string.

:func:`config_key` encodes every field of a frozen dataclass (nested dataclasses recursively, callables
through :func:`hash_callable`), so two configs share a compiled kernel exactly when they describe the same
kernel. The same config gives the same key in every process with the same sources and Python version.

This module imports nothing from the rest of ``cutedsl_attn``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import types
from typing import Callable, Optional

__all__ = ["config_key", "hash_callable", "config_arch", "memo_sig", "field_values"]

#: Attributes of a callable mixed into its hash (FA4's convention).
_MIXER_ATTRS = ("__vec_size__",)
_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)
_BUILTIN_TYPES = (
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
)


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def _const_repr(c) -> str:
    """Deterministic repr of a code-object constant (nested code, frozensets)."""
    if isinstance(c, types.CodeType):
        h = hashlib.sha256()
        _hash_code(c, h)
        return f"code:{h.hexdigest()}"
    if isinstance(c, tuple):
        return "(" + ",".join(_const_repr(x) for x in c) + ")"
    if isinstance(c, frozenset):
        return "frozenset{" + ",".join(sorted(_const_repr(x) for x in c)) + "}"
    return repr(c)


def _hash_code(code: types.CodeType, h) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    h.update(repr(code.co_varnames).encode())
    h.update(repr(code.co_freevars).encode())
    for c in code.co_consts:
        h.update(_const_repr(c).encode())
        h.update(b"\0")


def _global_names(code: types.CodeType):
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _global_names(c)


@functools.lru_cache(maxsize=4096)
def _code_digest(code: types.CodeType) -> str:
    """sha256 of a function's source text (when available) and bytecode; cached
    per code object (immutable), since ``inspect.getsource`` is slow."""
    try:
        source = inspect.getsource(code)
    except (OSError, TypeError):
        source = ""
    h = hashlib.sha256(source.encode())
    _hash_code(code, h)
    return h.hexdigest()


def _value_repr(v, visiting) -> str:
    """Repr of a closure cell / default value: callables hashed, others encoded
    strictly when possible, else ``repr`` (FA4's behaviour)."""
    if callable(v) and not isinstance(v, type):
        try:
            return "fn:" + hash_callable(v, _visiting=visiting)
        except TypeError:
            return repr(v)
    try:
        return _encode(v, "closure value", visiting)
    except TypeError:
        return repr(v)


def _hash_function(f: types.FunctionType, h, visiting: set) -> None:
    if id(f) in visiting:
        h.update(f"recursive:{_qualname(f)}".encode())
        return
    visiting.add(id(f))
    h.update(_qualname(f).encode())
    h.update(_code_digest(f.__code__).encode())
    cells = f.__closure__ or ()
    for name, cell in zip(f.__code__.co_freevars, cells):
        try:
            contents = cell.cell_contents
        except ValueError:
            rep = "<empty cell>"
        else:
            rep = _value_repr(contents, visiting)
        h.update(f"|cell:{name}={rep}".encode())
    for d in f.__defaults__ or ():
        h.update(f"|default={_value_repr(d, visiting)}".encode())
    for k, d in sorted((f.__kwdefaults__ or {}).items()):
        h.update(f"|kwdefault:{k}={_value_repr(d, visiting)}".encode())
    # Referenced module globals: constants by value, other values as closure values are (tuples, lists, dicts
    # by content), user functions by hash (any module), library functions and modules by name; for a user
    # module, every attribute the code names (``helpers.bias`` names ``bias``) by value / hash.
    g = f.__globals__
    names = sorted(set(_global_names(f.__code__)))
    for name in names:
        if name not in g:
            continue
        v = g[name]
        if type(v) in _PRIMITIVES:
            h.update(f"|global:{name}={v!r}".encode())
        elif isinstance(v, types.ModuleType):
            h.update(f"|global:{name}=module:{v.__name__}".encode())
            if not _is_library(v.__name__):
                for attr in names:
                    if not attr.startswith("__") and hasattr(v, attr):
                        h.update(f"|global:{name}.{attr}={_global_repr(getattr(v, attr), visiting)}".encode())
        else:
            h.update(f"|global:{name}={_global_repr(v, visiting)}".encode())


# modules whose functions and attributes a user function may call without their code entering its hash
_LIBRARY_PREFIXES = ("cutlass", "cuda", "torch", "math", "cmath", "numpy", "builtins", "operator", "functools",
                     "typing", "cutedsl_attn")


def _is_library(module_name) -> bool:
    root = str(module_name or "").split(".")[0]
    return root in _LIBRARY_PREFIXES or root.startswith("_")


def _global_repr(v, visiting) -> str:
    """A referenced global other than a primitive or a module: a library function (or class) by name, anything
    else as a closure value (:func:`_value_repr`: user functions hashed, values encoded or ``repr``'d)."""
    if (isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type))
            and _is_library(getattr(v, "__module__", ""))):
        return f"lib:{_qualname(v)}"
    return _value_repr(v, visiting)


def hash_callable(fn: Callable, *, _visiting: Optional[set] = None) -> str:
    """Return a stable sha256 hex digest describing a callable's behaviour.

    Like FA4's ``hash_callable``: source text (``inspect.getsource``) plus, for
    robustness, the bytecode and constants (two lambdas on one source line
    differ), plus the ``repr`` of every closure cell, the defaults and
    kw-defaults, module-level constants it references, same-module helper
    functions it calls (recursively) and the ``__vec_size__`` attribute. A
    ``__cute_hash__`` attribute on the callable (or its ``__wrapped__``) is
    used as-is (FA4 convention). ``functools.partial`` and bound methods are
    supported; builtins hash by qualified name.

    Args:
        fn: the callable (e.g. a user ``score_mod``).

    Returns:
        64-character hex digest.

    Raises:
        TypeError: ``fn`` is not callable, or is a callable object whose
            behaviour cannot be described stably (give it ``__cute_hash__``).

    Caveats: a closure cell whose ``repr`` contains a memory address gives a key
    that is stable within a process but not across processes (no disk hits).
    """
    if not callable(fn):
        raise TypeError(f"hash_callable needs a callable, got {type(fn).__name__}")
    visiting = set() if _visiting is None else _visiting
    h = hashlib.sha256()
    explicit = getattr(fn, "__cute_hash__", None)
    if explicit is None:
        explicit = getattr(getattr(fn, "__wrapped__", None), "__cute_hash__", None)
    if explicit is not None:
        h.update(f"explicit:{explicit}".encode())
    elif isinstance(fn, functools.partial):
        h.update(b"partial:")
        h.update(hash_callable(fn.func, _visiting=visiting).encode())
        for a in fn.args:
            h.update(f"|arg={_value_repr(a, visiting)}".encode())
        for k, a in sorted(fn.keywords.items()):
            h.update(f"|kw:{k}={_value_repr(a, visiting)}".encode())
    elif isinstance(fn, types.MethodType):
        h.update(b"method:")
        h.update(hash_callable(fn.__func__, _visiting=visiting).encode())
        h.update(f"|self={_value_repr(fn.__self__, visiting)}".encode())
    else:
        base = inspect.unwrap(fn)
        if isinstance(base, types.FunctionType):
            _hash_function(base, h, visiting)
        elif isinstance(base, _BUILTIN_TYPES) or type(base).__name__ == "ufunc":
            h.update(f"builtin:{_qualname(base)}".encode())
        elif dataclasses.is_dataclass(base) and not isinstance(base, type):
            h.update(f"callable-dataclass:{config_key(base)}".encode())
            call = type(base).__call__
            if isinstance(call, types.FunctionType):
                _hash_function(call, h, visiting)
        else:
            raise TypeError(
                f"cannot derive a stable hash for callable of type {type(base).__name__!r}; "
                "use a plain function / lambda / functools.partial, a frozen dataclass with "
                "__call__, or set a __cute_hash__ attribute on it"
            )
    for attr in _MIXER_ATTRS:
        v = getattr(fn, attr, None)
        if v is not None:
            h.update(f"|{attr}={v!r}".encode())
    return h.hexdigest()


def _encode(v, where: str, visiting: Optional[set] = None) -> str:
    """Strict, deterministic encoding of one config value."""
    t = type(v)
    if t in _PRIMITIVES:
        return repr(v)
    if isinstance(v, enum.Enum):
        return f"{_qualname(t)}.{v.name}"
    if isinstance(v, type):
        return f"type:{_qualname(v)}"
    if t.__module__ == "torch" and t.__name__ in ("dtype", "device"):
        return f"torch:{v}"
    if isinstance(v, _PRIMITIVES):  # subclass of a primitive (e.g. numpy.float64)
        base = next(b for b in _PRIMITIVES if isinstance(v, b))
        return f"{_qualname(t)}({base(v)!r})"
    if isinstance(v, tuple):
        inner = ",".join(_encode(x, where, visiting) for x in v)
        prefix = "" if t is tuple else _qualname(t)
        return f"{prefix}({inner})"
    if isinstance(v, frozenset):
        return "frozenset{" + ",".join(sorted(_encode(x, where, visiting) for x in v)) + "}"
    if dataclasses.is_dataclass(v):
        return config_key(v)
    if callable(v):
        return "fn:" + hash_callable(v, _visiting=visiting)
    ck = getattr(v, "cache_key", None)
    if callable(ck):
        return f"{_qualname(t)}:{ck()}"
    try:
        hash(v)
    except TypeError:
        raise TypeError(
            f"{where}: value of type {t.__name__!r} is unhashable; config fields must be "
            "hashable (use tuples / frozensets instead of lists / sets / dicts)"
        ) from None
    raise TypeError(
        f"{where}: no stable key for a value of type {t.__name__!r}; supported: None, bool, "
        "int, float, str, bytes, enums, classes (dtypes), torch.dtype/device, tuples, "
        "frozensets, frozen dataclasses, callables, or objects with a cache_key() method"
    )


def config_key(cfg) -> str:
    """Derive a stable string key from a frozen dataclass instance.

    The key lists the class's qualified name and every field as
    ``name=value`` in declaration order. Values are encoded deterministically
    (``repr`` for None/bool/int/float/str/bytes, so ``1``, ``1.0`` and ``True``
    differ; qualified names for enums and classes such as ``cutlass.Float32``;
    ``torch.float16``; tuples/frozensets element-wise; nested frozen
    dataclasses recursively; callables such as a user ``score_mod`` via
    :func:`hash_callable`; objects with a ``cache_key()`` method via it). The
    same config gives the same key in every process with the same sources and
    Python version.

    Args:
        cfg: an instance of a ``@dataclass(frozen=True)`` class.

    Returns:
        The key string.

    Raises:
        TypeError: ``cfg`` is not a frozen dataclass instance, a field value is
            unhashable (list, dict, set, non-frozen dataclass), or a field value
            has no stable encoding.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"config_key needs a dataclass instance, got {type(cfg).__name__}")
    cls = type(cfg)
    if not cls.__dataclass_params__.frozen:
        raise TypeError(f"{_qualname(cls)} must be declared @dataclass(frozen=True) to be a cache key")
    parts = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        where = f"{cls.__qualname__}.{f.name}"
        try:
            hash(v)
        except TypeError:
            raise TypeError(
                f"{where}: value of type {type(v).__name__!r} is unhashable; config fields must be "
                "hashable (use tuples / frozensets instead of lists / sets / dicts)"
            ) from None
        parts.append(f"{f.name}={_encode(v, where)}")
    return f"{_qualname(cls)}(" + ",".join(parts) + ")"


class _HoldsCallable(Exception):
    """Raised inside :func:`memo_sig` when a config value (at any depth) is a callable."""


# Types whose instances are leaves of a memo signature (not callable, or classes such as ``cutlass.Float32``);
# callability is a property of the type, so the set only grows. Keeps the launch hot path in C (``issuperset``).
_LEAF_TYPES = {type(None), bool, int, float, complex, str, bytes}


def _type_sig(v):
    t = type(v)
    if t in _LEAF_TYPES:
        return t
    if t is tuple:
        vals = v
    elif hasattr(t, "__dataclass_fields__") and not callable(v):  # a nested config part (``Config(problem, tiles)``)
        vals = field_values(v)
    elif isinstance(v, type) or not callable(v):
        _LEAF_TYPES.add(t)
        return t
    else:
        raise _HoldsCallable
    ts = tuple(map(type, vals))
    if _LEAF_TYPES.issuperset(ts):
        return (t,) + ts
    return (t,) + tuple(x if x in _LEAF_TYPES else _type_sig(y) for x, y in zip(ts, vals))


def field_values(cfg) -> tuple:
    """The field values of the config dataclass ``cfg`` (its ``__dict__`` where it has one: the hot path)."""
    d = getattr(cfg, "__dict__", None)
    return tuple(d.values()) if d is not None else tuple(getattr(cfg, f.name) for f in dataclasses.fields(cfg))


def memo_sig(cfg):
    """The value types of a config, deep through tuples and nested dataclasses, or None when any value is a
    callable (a ``score_mod``: its key must be re-derived, see :func:`hash_callable`).

    Equal configs whose values differ only in type (``1`` / ``1.0`` / ``True``) compare and hash equal, so an
    equality memo keyed on the config must also key on this signature.
    """
    try:
        return _type_sig(cfg)
    except _HoldsCallable:
        return None


def _arch_path(cfg) -> Optional[tuple]:
    """Field names leading from ``cfg`` to its ``arch`` field (``("arch",)``, ``("problem", "arch")``)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        return None
    fields = dataclasses.fields(cfg)
    if any(f.name == "arch" for f in fields):
        return ("arch",)
    for f in fields:
        sub = _arch_path(getattr(cfg, f.name))
        if sub is not None:
            return (f.name,) + sub
    return None


_ARCH_PATHS: dict = {}  # config class -> _arch_path of its first instance (the hot path skips fields())


def config_arch(cfg) -> Optional[str]:
    """The target arch a config names: its own ``arch`` field, else that of a nested dataclass field
    (``Config(problem, tiles)`` keeps it in ``problem``); None when no field names one.

    Raises:
        TypeError: ``cfg`` is not a dataclass instance.
    """
    cls = type(cfg)
    path = _ARCH_PATHS.get(cls)
    if path is None:
        if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
            raise TypeError(f"config_arch needs a dataclass instance, got {cls.__name__}")
        path = _ARCH_PATHS.setdefault(cls, _arch_path(cfg) or ())
    v = cfg
    for name in path:
        v = getattr(v, name, None)
        if v is None:
            return None
    return v if path else None
