"""Stand-ins for the dispatch layer's compiled kernels, shared by the CPU API tests (decode and prefill).

``Recorder(arg_names)`` replaces ``dispatch.paged_decode_kernel`` / ``dispatch.prefill_kernel``: it records
each requested config and each launch (checking the argument count against ``arg_names(cfg)``) and writes
recognisable values into ``o`` (1.0) and ``lse`` (0.5) so the wrappers' output handling can be checked.
``EntryRejects(arg_index, pname, signature)`` is a kernel whose tvm-ffi entry rejects one argument with
the entry's own message format.
"""

from __future__ import annotations


class Recorder:
    """Records configs and launches of a stubbed kernel family."""

    def __init__(self, arg_names):
        self.arg_names = arg_names  # cfg -> the kernel's argument names, in order
        self.cfgs = []
        self.calls = []

    def __call__(self, cfg):
        self.cfgs.append(cfg)

        def launch(*args):
            assert len(args) == len(self.arg_names(cfg))
            self.calls.append((cfg, args))
            args[5].fill_(1.0)  # o
            args[6].fill_(0.5)  # lse

        return launch

    def named(self, i):
        cfg, a = self.calls[i]
        return cfg, dict(zip(self.arg_names(cfg), a))

    @property
    def last(self):
        return self.named(-1)


class EntryRejects:
    """A kernel whose tvm-ffi entry rejects argument ``arg_index`` (named ``pname`` in the kernel signature
    ``signature``), with the entry's own message format; ``msg`` may be replaced by a test."""

    def __init__(self, arg_index, pname, signature):
        self.msg = (f"Mismatched {pname}.strides[2] on argument #{arg_index} when calling: "
                    f"`__call__({signature}, ...)`, expected 1")

    def __call__(self, cfg):
        def launch(*args):
            raise ValueError(self.msg)

        return launch


# ----------------------------------------------------------------------------- bad paged caches
# The decode and prefill wrappers share one paged-cache check (``api._common.paged_kv_views``); both CPU API
# test files run these cases against it through their own wrapper.
BAD_PAGED_CACHE_SHAPES = ("page_size", "heads", "dim", "layout", "4d_combined")


def bad_paged_cache(cache, what):
    """A wrong form of the planned NHD 5-D cache ``[pages, 2, page_size=16, Hkv=2, D=64]``: ``what`` in
    :data:`BAD_PAGED_CACHE_SHAPES`; every one must raise ``ValueError`` naming the cache."""
    import torch

    return {
        "page_size": cache[:, :, :8],
        "heads": cache[:, :, :, :1],
        "dim": torch.zeros(cache.shape[0], 2, 16, 2, 32, dtype=cache.dtype),
        "layout": cache.transpose(2, 3),  # HND cache handed to an NHD wrapper
        "4d_combined": cache[:, :, 0],
    }[what]


def bad_cache_tuples(k, v):
    """``(exception, message pattern, cache)``: wrong ``(k_cache, v_cache)`` tuples (arity, type, shape, dtype)."""
    import torch

    return [
        (ValueError, "paged_kv_cache", (k, v, v)),
        (TypeError, "k_cache", (k.tolist(), v)),
        (ValueError, "v_cache", (k, v[:, :8])),
        (ValueError, "k_cache", (k.to(torch.float16), v)),
        (ValueError, "v_cache", (k, v.to(torch.float16))),
    ]
