"""Compile layer of cutedsl_attn: target-arch selection and the kernel cache.

Bottom of the import graph: imports nothing else from ``cutedsl_attn``;
``torch`` and ``cutlass`` are imported lazily.

Typical use in a kernel module::

    from cutedsl_attn.compile import compile_options, config_key, get_compiled, target_arch

    cfg = MyKernelConfig(..., arch=target_arch(q.device))
    fn = get_compiled("my_kernel", cfg,
                      lambda c: cute.compile(kernel, *fake_args, options=compile_options(c.arch)))
    fn(q, k, v, out, scale)
"""

from .arch import (
    ARCH_ENV_VAR,
    SUPPORTED_ARCHS,
    arch_major,
    compile_options,
    device_arch,
    is_cross_compiling,
    normalize_arch,
    target_arch,
)
from .cache import (
    CACHE_DIR_ENV,
    DISABLE_DISK_CACHE_ENV,
    LOCK_TIMEOUT_ENV,
    cache_fingerprint,
    cache_root,
    cache_stats,
    clear_memory_cache,
    config_key,
    disk_cache_enabled,
    get_compiled,
    hash_callable,
)

__all__ = [
    "ARCH_ENV_VAR",
    "SUPPORTED_ARCHS",
    "arch_major",
    "compile_options",
    "device_arch",
    "is_cross_compiling",
    "normalize_arch",
    "target_arch",
    "CACHE_DIR_ENV",
    "DISABLE_DISK_CACHE_ENV",
    "LOCK_TIMEOUT_ENV",
    "cache_fingerprint",
    "cache_root",
    "cache_stats",
    "clear_memory_cache",
    "config_key",
    "disk_cache_enabled",
    "get_compiled",
    "hash_callable",
]
