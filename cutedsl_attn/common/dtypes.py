"""The 16-bit element types of the kernels, by the name their problem dataclasses carry (a string: the problems
are compile-cache keys); one home for the name -> CuTe DSL type mapping every kernel uses."""

from __future__ import annotations

import cutlass


def element_type(name: str):
    """The CuTe DSL element type of a problem's ``dtype`` name (``"bfloat16"``, else ``"float16"``)."""
    return cutlass.BFloat16 if name == "bfloat16" else cutlass.Float16
