"""The 16-bit element types of the kernels, by the name their config dataclasses carry (a string: the
configs are compile-cache keys), shared by every kernel config."""

from __future__ import annotations

import cutlass

DTYPES = ("bfloat16", "float16")


def dtype_error(dtype) -> str | None:
    """Why ``dtype`` is not a kernel element type name, or None."""
    if dtype not in DTYPES:
        return f"dtype must be 'bfloat16' or 'float16', got {dtype!r}"
    return None


class Dtype16:
    """Mixin of the kernel config dataclasses (field ``dtype`` in :data:`DTYPES`)."""

    @property
    def cutlass_dtype(self):
        """The CuTe DSL element type named by ``dtype``."""
        return cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
