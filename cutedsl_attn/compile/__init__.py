"""Compile layer of cutedsl_attn: target-arch selection (``arch``), compile keys (``keys``), the kernel
cache in memory and on disk (``cache``) and fake tensors for tensor-free compiles (``fake``).

Bottom of the import graph: imports nothing else from ``cutedsl_attn``;
``torch`` and ``cutlass`` are imported lazily.

Typical use (``dispatch`` does this for every kernel)::

    from cutedsl_attn.compile import get_compiled, target_arch

    cfg = module.Config(problem, module.default_tiles(problem, num_sms=...))   # problem.arch = target_arch(dev)
    fn = get_compiled(module.NAME, cfg, module.compile)   # module.compile builds with compile_options(arch)
"""

from .arch import (
    ARCH_ENV_VAR,
    SUPPORTED_ARCHS,
    arch_major,
    compile_options,
    device_arch,
    dsl_cuda_flavor,
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
    disk_cache_enabled,
    get_compiled,
)
from .keys import config_arch, config_key, hash_callable

__all__ = [
    "ARCH_ENV_VAR",
    "SUPPORTED_ARCHS",
    "arch_major",
    "compile_options",
    "device_arch",
    "dsl_cuda_flavor",
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
    "config_arch",
    "config_key",
    "disk_cache_enabled",
    "get_compiled",
    "hash_callable",
]
