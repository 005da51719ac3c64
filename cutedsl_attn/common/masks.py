"""Attention masks shared by the kernels (FlashInfer's conventions), evaluated per score element.

Plain Python helpers called while a kernel is traced; the ``causal`` / ``use_window`` flags are
compile-time Python bools, so a disabled mask emits no code.
"""

from __future__ import annotations


def visible(j, kv_len, qpos, window_left, *, causal: bool, use_window: bool):
    """Whether key ``j`` (request-relative) is visible to the query at bottom-right position ``qpos``
    (``= i + kv_len - qo_len`` for query row ``i``): inside the request, ``j <= qpos`` when ``causal``,
    and ``j >= qpos - window_left`` when ``use_window`` and ``window_left >= 0`` (``w + 1`` keys)."""
    ok = j < kv_len
    if causal:
        ok = ok & (j <= qpos)
    if use_window:
        ok = ok & ((window_left < 0) | (j >= qpos - window_left))
    return ok
