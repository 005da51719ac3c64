"""Gated delta rule (GDN) decode step with FlashInfer's signatures: ``gated_delta_rule_decode_pretranspose``
(V-major state ``[B, HV, V, K]``) and ``gated_delta_rule_decode`` (K-major state ``[B, HV, K, V]``), the state
(or rows of a state pool) updated in place by the token-serial recurrent kernel.

Conventions and checks as :mod:`cutedsl_attn.api.gdn` (whose tensor checks this module uses):
q / k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (T > 1: multi-token verify), ``HO = max(H, HV)``; the gates come from
FlashInfer's ``A_log`` / ``a`` / ``dt_bias`` / ``b``, computed in fp32 before the launch.  The pool index checks
(unique, in range, no row read by one sequence and written by another) read the indices back: one stream sync a
call, none inside a CUDA graph capture.
"""

from __future__ import annotations

import torch

from ..dispatch import gdn_launch
from ..planning.gdn import (
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_HAS_INITIAL_STATE, FLAG_INITIAL_INDICES, FLAG_OUTPUT_INDICES, FLAG_WRITE_STATE,
    HEAD_DIMS, GdnArgs,
)
from .gdn import (
    _IO_DTYPES, _STATE_DTYPES, _check_bool, _dummy, _index_tensor, _no_alias, _on, _problem, _qkv, _require_cuda,
    _scale_arg, _state, _tensor, _unique_in_range, _value_checks,
)

__all__ = ["gated_delta_rule_decode", "gated_delta_rule_decode_pretranspose"]

#: ``cu_seqlens`` of B sequences of T tokens each, by (device, B, T): built once, reused by every step
_ARANGE: dict = {}


def _cu_steps(n, t, device):
    key = (device, n, t)
    c = _ARANGE.get(key)
    if c is None:
        c = _ARANGE[key] = torch.arange(0, (n + 1) * t, t, device=device, dtype=torch.int32)
    return c


def _decode_gates(A_log, a, dt_bias, b, B, T, hv, dev):
    """alpha = exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b), fp32 ``[B * T, HV]``."""
    for name, t, shape in (("A_log", A_log, (hv,)), ("dt_bias", dt_bias, (hv,)), ("a", a, (B, T, hv)),
                           ("b", b, (B, T, hv))):
        _tensor(name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
        _on(name, t, dev)
    x = a.float() + dt_bias.float()
    alpha = torch.exp(-torch.exp(A_log.float()) * torch.nn.functional.softplus(x))
    return alpha.reshape(B * T, hv).contiguous(), torch.sigmoid(b.float()).reshape(B * T, hv).contiguous()


def gated_delta_rule_decode_pretranspose(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None,
                                         use_qk_l2norm=True, initial_state=None, initial_state_indices=None,
                                         output_state_indices=None):
    """GDN decode step(s) with a V-major state, updated in place (FlashInfer's signature).

    Args:
        q, k: ``[B, T, H, K]`` bfloat16 / float16 (T = 1: decode; T > 1: multi-token verify); K in 64, 128.
        v: ``[B, T, HV, V]``, HV a multiple of H (or H of HV).
        state: ``[B, HV, V, K]`` float32 / bfloat16, updated in place; None with ``initial_state``.
        A_log, dt_bias: ``[HV]`` float; a, b: ``[B, T, HV]`` float: ``alpha = exp(-exp(A_log) softplus(a +
            dt_bias))``, ``beta = sigmoid(b)`` (computed in fp32 before the kernel).
        scale: query scale, a finite real (Python or numpy, not a bool); None or 0.0 = ``1 / sqrt(K)``.
        output: ``[B, T, HO, V]`` contiguous buffer of q's dtype on q's device; None = allocated.
        use_qk_l2norm: l2-normalise q and k in the kernel.
        initial_state: a pool ``[P, HV, V, K]`` (instead of ``state``), read at rows ``initial_state_indices``
            and written in place at rows ``output_state_indices`` (default: the same rows): the written rows
            unique, a row read by one sequence written by no other (sequences may share a read row when
            ``output_state_indices`` gives each its own); checking that reads the indices back (one stream
            sync a call, none inside a CUDA graph capture).

    Returns:
        ``(output, state)`` (the pool when ``initial_state`` is given).

    Raises:
        TypeError / ValueError / NotImplementedError as :func:`~cutedsl_attn.api.gdn.chunk_gated_delta_rule`;
        TypeError when ``use_qk_l2norm`` is not a bool; ValueError when both or neither of ``state`` and
        ``initial_state`` are given, ``output`` / the state overlaps q, k, v (or ``output`` the state), ``scale``
        is not a finite real, or ``output`` has another shape, dtype or device or is not contiguous (the rules of
        the prefill's).
    """
    return _decode(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
                   initial_state_indices, output_state_indices, k_major=False)


def _decode(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, initial_state,
            initial_state_indices, output_state_indices, *, k_major):
    _check_bool("gated delta rule decode", use_qk_l2norm=use_qk_l2norm)
    _tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {tuple(q.shape)}")
    if (state is None) == (initial_state is None):
        raise ValueError("give exactly one of state (per-batch state) and initial_state (a state pool)")
    B, T, hq, K = q.shape
    for name, t in (("k", k), ("v", v)):
        _tensor(name, t)
        if t.dim() != 4 or t.shape[:2] != q.shape[:2]:
            raise ValueError(f"{name} must be [B, T, H, D] with q's B, T, got {tuple(t.shape)}")
    hv, V = v.shape[2], v.shape[3]
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise NotImplementedError(f"gated delta rule decode: head dims K={K}, V={V} are not served; served: K, "
                                  f"V in {HEAD_DIMS}")
    ho = max(hq, hv)
    scale = _scale_arg(scale, K)
    alpha, beta = _decode_gates(A_log, a, dt_bias, b, B, T, ho, q.device)
    if output is not None:  # prefill's rules (_output_arg): shape, q's dtype, contiguous, q's device
        _tensor("output", output)
        if tuple(output.shape) != (B, T, ho, V) or output.dtype != q.dtype or not output.is_contiguous():
            raise ValueError(f"output must be a contiguous [B, T, HO, V] = [{B}, {T}, {ho}, {V}] {q.dtype} tensor, "
                             f"got {output.dtype} {tuple(output.shape)}")
        _on("output", output, q.device)
    else:
        output = torch.empty(B, T, ho, V, device=q.device, dtype=q.dtype)
    out_flat = output.view(B * T, ho, V)
    inputs = [("q", q), ("k", k), ("v", v)]
    st_name, st_t = ("state", state) if state is not None else ("initial_state", initial_state)
    _no_alias("gated delta rule decode", [("output", output), (st_name, st_t)], inputs)
    _no_alias("gated delta rule decode", [("output", output)], [(st_name, st_t)])
    cu = _cu_steps(B, T, q.device)
    flat = [x.reshape(B * T, x.shape[2], x.shape[3]) for x in (q, k, v)]
    if state is not None:
        _tensor("state", state)
        if state.dim() != 4 or state.shape[0] != B:
            raise ValueError(f"state must be [B, HV, {'K, V' if k_major else 'V, K'}] with B = {B}, got "
                             f"{tuple(state.shape)}")
        # one tensor as initial and final state, row n per sequence: each CTA reads its slice before writing it
        _state("state", state, ho, V, K, q.device, k_major)
        _in_place(flat, alpha, beta, cu, state, None, None, out_flat, scale, use_qk_l2norm, k_major)
        return output, state
    pool = _state("initial_state", initial_state, ho, V, K, q.device, k_major)
    if initial_state_indices is None:
        raise ValueError("initial_state (a pool) needs initial_state_indices")
    _index_tensor("initial_state_indices", initial_state_indices, B, q.device)
    if output_state_indices is None:
        output_state_indices = initial_state_indices
    _index_tensor("output_state_indices", output_state_indices, B, q.device)
    checks = []
    for name, ix in (("initial_state_indices", initial_state_indices), ("output_state_indices",
                                                                        output_state_indices)):
        dup, rng = _unique_in_range(ix, pool.shape[0])
        checks.append((rng, f"{name} must be in [0, {pool.shape[0]})"))
        # sequences may fork from one read row when each writes a row of its own (the cross check below)
        if name == "output_state_indices" or output_state_indices is initial_state_indices:
            checks.append((dup, f"{name} must be unique"))
    if output_state_indices is not initial_state_indices:
        # a row written by one sequence and read by another would race between CTAs
        i0 = initial_state_indices.to(device=q.device, dtype=torch.int64)
        i1 = output_state_indices.to(device=q.device, dtype=torch.int64)
        cross = ((i0[None, :] == i1[:, None]) & ~torch.eye(B, dtype=torch.bool, device=q.device)).any()
        checks.append((cross, "output_state_indices may only reuse the initial_state_indices row of the same "
                              "sequence"))
    _value_checks(checks)
    _in_place(flat, alpha, beta, cu, pool, initial_state_indices, output_state_indices, out_flat, scale,
              use_qk_l2norm, k_major)
    return output, pool


def _in_place(*a):
    """Validate the flattened decode problem and launch with ``state`` as both initial and final state."""
    problem, args = _plan_in_place(*a)
    gdn_launch(problem, args, device_index=args.q.device.index)


def _plan_in_place(flat, alpha, beta, cu, state, idx_in, idx_out, out_flat, scale, use_l2norm, k_major=False):
    """``(problem, args)`` of a decode launch with ``state`` as both initial and final state."""
    q3, k3, v3 = flat
    dev = q3.device
    if q3.dtype not in _IO_DTYPES:
        raise ValueError(f"q must be bfloat16 or float16, got {q3.dtype}")
    for name, t in (("q", q3), ("k", k3), ("v", v3)):
        _qkv(name, t, 3, dev, q3.dtype)
    T, hq, K = q3.shape
    hk, hv, V = k3.shape[1], v3.shape[1], v3.shape[2]
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise NotImplementedError(f"gated delta rule decode: head dims K={K}, V={V} are not served; served: K, "
                                  f"V in {HEAD_DIMS}")
    if k3.shape[2] != K or not ((hq == hk and hv % hq == 0) or (hk == hv and hq % hv == 0)):
        raise ValueError(f"q / k / v heads must be GVA or GQA with k of q's head dim, got Hq={hq}, Hk={hk}, "
                         f"Hv={hv}")
    if out_flat.dtype != q3.dtype or not out_flat.is_contiguous():
        raise ValueError(f"output must be contiguous with q's dtype {q3.dtype}")
    ho = max(hq, hv)
    scale = _scale_arg(scale, K)
    _on("output", out_flat, dev)
    _require_cuda(dev)
    flags = FLAG_HAS_G | FLAG_HAS_BETA | FLAG_HAS_INITIAL_STATE | FLAG_WRITE_STATE
    i_in = i_out = _dummy(dev, torch.int32)
    if idx_in is not None:
        flags |= FLAG_INITIAL_INDICES | FLAG_OUTPUT_INDICES
        i_in = idx_in.to(device=dev, dtype=torch.int32)
        i_out = i_in if idx_out is idx_in else idx_out.to(device=dev, dtype=torch.int32)
    problem = _problem(q3, K, V, _STATE_DTYPES[state.dtype], "linear", use_l2norm, decode=True,
                       state_k_major=k_major)
    args = GdnArgs(q=q3, k=k3, v=v3, g=alpha, beta=beta, cu_seqlens=cu, initial_state=state,
                   initial_state_indices=i_in, output_state=state, output_state_indices=i_out, output=out_flat,
                   scale=float(scale), q_group=ho // hq, k_group=ho // hk, v_group=ho // hv, flags=flags)
    return problem, args


def gated_delta_rule_decode(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True):
    """GDN decode step(s) with a K-major state ``[B, HV, K, V]``, updated in place (FlashInfer's signature).

    The same kernel as :func:`gated_delta_rule_decode_pretranspose` reading and writing the state K-major;
    arguments, returns and errors as there (``state`` float32 / bfloat16, no pools).
    """
    return _decode(q, k, v, state, A_log, a, dt_bias, b, scale, output, use_qk_l2norm, None, None, None,
                   k_major=True)
