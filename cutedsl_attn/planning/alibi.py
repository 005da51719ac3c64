"""ALiBi slopes of the product (host torch; imports nothing above it).

FlashInfer's ``flashinfer.utils.get_alibi_slopes`` formula: with ``n`` the largest power of two
``<= num_heads``, head ``h < n`` has slope ``(2^(-8/n))^(h+1)``; the remaining heads take the odd
powers ``(2^(-4/n))^(2i+1)``, i.e. every other slope of the ``2n``-head sequence (Press et al., ALiBi).
"""

from __future__ import annotations

import math
import operator

import torch


def get_alibi_slopes(num_qo_heads: int) -> torch.Tensor:
    """ALiBi slopes ``[num_qo_heads]`` float32 on the CPU (bias ``slope_h * (kv_idx - q_idx)`` on the logit).

    Raises TypeError for a non-int ``num_qo_heads``, ValueError for one below 1."""
    if isinstance(num_qo_heads, bool):
        raise TypeError("num_qo_heads must be an int, got bool")
    try:
        h = operator.index(num_qo_heads)
    except TypeError:
        raise TypeError(f"num_qo_heads must be an int, got {type(num_qo_heads).__name__}") from None
    if h < 1:
        raise ValueError(f"num_qo_heads must be >= 1, got {h}")
    n = 2 ** int(math.floor(math.log2(h)))
    m = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, 1 + n, dtype=torch.float64))
    if n < h:
        extra = torch.pow(2.0 ** (-4.0 / n), torch.arange(1, 1 + 2 * (h - n), 2, dtype=torch.float64))
        m = torch.cat([m, extra])
    return m.float()
