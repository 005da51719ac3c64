"""Delta-rule family oracles: GDN-2, Gated DeltaProduct and KDA, token-serial float64 straight from the equations.

Conventions as :mod:`cutedsl_attn.ref.gdn` (FlashInfer): packed tokens with ``cu_seqlens``, ``HO = max(Hq, Hv)``
heads with contiguous grouping, the state V-major ``H[V, K]`` per (sequence, head) (``H = S^T`` of fla's
``S[K, V]``), the readout after the token's update.  Per token, ``D(x) = Diag(x)``:

* GDN-2 (``chunk_gated_delta_rule2``; ``g`` log decay per K channel, erase gate ``b`` per K channel, write gate
  ``w`` per V channel)::

      H_t = H_{t-1} D(exp g_t) (I - (b_t * k_t) k_t^T) + (w_t * v_t) k_t^T,    o_t = scale H_t q_t

* Gated DeltaProduct (``chunk_gated_delta_product``; ``n = num_householder`` rank-1 updates a token, linear alpha
  per head on the first, the query read after the last; k / v / beta on the expanded timeline, row ``t n + j``)::

      H <- alpha_t H;  for j < n: H <- H (I - b_tj k_tj k_tj^T) + b_tj v_tj k_tj^T;  o_t = scale H q_t

* KDA (``recurrent_kda``; ``g`` log decay per K channel, scalar ``b``)::

      H_t = H_{t-1} D(exp g_t) (I - b_t k_t k_t^T) + b_t v_t k_t^T,            o_t = scale H_t q_t

  with the safe gate of ``use_gate_in_kernel`` (:func:`kda_gate`) and ``beta = sigmoid(beta)`` for
  ``beta_is_logit``.

Imports only torch and :mod:`.gdn`.
"""

from __future__ import annotations

import math

import torch

from .gdn import _l2norm, gdn_head_maps

__all__ = ["chunk_gated_delta_product", "chunk_gated_delta_rule2", "kda_gate", "recurrent_kda"]


def _unbatch(x, rank):
    """Drop the leading batch dim of 1 from ``x`` when it has ``rank + 1`` dims."""
    return x[0] if (x is not None and x.dim() == rank + 1) else x


def _prep(q, k, v, l2norm, dt):
    """q / k / v ``[T, H*, D]`` -> float ``dt`` at HO heads (head maps applied), plus HO."""
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    ho, qmap, kmap, vmap = gdn_head_maps(hq, hk, hv)
    qf, kf, vf = q.to(dt)[:, qmap], k.to(dt)[:, kmap], v.to(dt)[:, vmap]
    if l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    return qf, kf, vf, ho


def _offsets(cu_seqlens, T):
    return [0, T] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]


def _finish(out, final, output, output_state, batched, output_final_state):
    if output is not None:
        output.view(out.shape).copy_(out)
        out = output
    elif batched:
        out = out.unsqueeze(0)
    if output_state is not None:
        output_state.copy_(final)
        final = output_state
    return (out, final) if output_final_state else out


def chunk_gated_delta_rule2(q, k, v, g=None, beta=None, w=None, scale=None, initial_state=None,
                            output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None,
                            output_state=None):
    """Reference GDN-2 prefill (FlashInfer's ``chunk_gated_delta_rule2`` minus ``backend``), float64, CPU or GPU.

    Args:
        q: ``[T, Hq, K]`` or ``[1, T, Hq, K]``; k ``[T, Hk, K]``; v ``[T, Hv, V]`` (GVA or GQA heads).
        g: ``[T, HO, K]`` natural-log decay per key channel; None = 0 (no decay).
        beta: ``[T, HO, K]`` erase gate per key channel; None = 1.
        w: ``[T, HO, V]`` write gate per value channel; None = 1.
        scale: query scale; None or 0.0 = ``1 / sqrt(K)``.
        initial_state: ``[N, HO, V, K]`` V-major; None = zeros.
        output_final_state: return ``(output, final_state)``.
        cu_seqlens: ``[N + 1]`` offsets; None = one sequence.
        use_qk_l2norm_in_kernel: q, k become ``x * rsqrt(sum x^2 + 1e-6)`` first.
        output, output_state: optional buffers the results are copied into (then returned).

    Returns:
        ``output`` ``[T, HO, V]`` float64 (leading 1 kept for 4-D q), or ``(output, final_state [N, HO, V, K])``.

    Raises:
        ValueError: bad head counts or gate shapes.
    """
    batched = q.dim() == 4
    if batched:
        q, k, v, g, beta, w = q[0], k[0], v[0], _unbatch(g, 3), _unbatch(beta, 3), _unbatch(w, 3)
    dt, dev = torch.float64, q.device
    qf, kf, vf, ho = _prep(q, k, v, use_qk_l2norm_in_kernel, dt)
    T, K, V = q.shape[0], q.shape[2], v.shape[2]
    gd = torch.zeros(T, ho, K, dtype=dt, device=dev) if g is None else g.to(dt)
    bd = torch.ones(T, ho, K, dtype=dt, device=dev) if beta is None else beta.to(dt)
    wd = torch.ones(T, ho, V, dtype=dt, device=dev) if w is None else w.to(dt)
    for name, x, want in (("g", gd, (T, ho, K)), ("beta", bd, (T, ho, K)), ("w", wd, (T, ho, V))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must be {list(want)}, got {tuple(x.shape)}")
    scale = scale or 1.0 / math.sqrt(K)
    offsets = _offsets(cu_seqlens, T)
    n_seq = len(offsets) - 1
    out = torch.zeros(T, ho, V, dtype=dt, device=dev)
    final = torch.zeros(n_seq, ho, V, K, dtype=dt, device=dev)
    eye = torch.eye(K, dtype=dt, device=dev)
    for n in range(n_seq):
        h = torch.zeros(ho, V, K, dtype=dt, device=dev) if initial_state is None else initial_state[n].to(dt)
        for t in range(offsets[n], offsets[n + 1]):
            decay = torch.diag_embed(torch.exp(gd[t]))  # [HO, K, K]
            erase = eye - (bd[t] * kf[t])[:, :, None] * kf[t][:, None, :]
            h = h @ decay @ erase + (wd[t] * vf[t])[:, :, None] * kf[t][:, None, :]
            out[t] = scale * (h @ qf[t][:, :, None])[..., 0]
        final[n] = h
    return _finish(out, final, output, output_state, batched, output_final_state)


def chunk_gated_delta_product(q, k, v, g=None, beta=None, num_householder=1, scale=None, initial_state=None,
                              output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None,
                              output_state=None):
    """Reference Gated DeltaProduct prefill (FlashInfer's ``chunk_gated_delta_product`` minus ``backend``), float64.

    Args:
        q: ``[T, Hq, K]`` (or ``[1, T, Hq, K]``) at real-token rows.
        k: ``[T * n, Hk, K]``, v ``[T * n, Hv, V]`` on the expanded timeline (token t's n updates at rows
            ``t n .. t n + n - 1``), ``n = num_householder``.
        g: ``[T, HO]`` linear alpha per real token (applied before the token's first update); None = 1.
        beta: ``[T * n, HO]`` post-sigmoid strength per update; None = 1.
        num_householder: updates per token, ``n >= 1`` (1 is GDN).
        scale, initial_state, output_final_state, cu_seqlens (real tokens), use_qk_l2norm_in_kernel, output,
            output_state: as :func:`chunk_gated_delta_rule2`.

    Returns:
        ``output`` ``[T, HO, V]`` float64, or ``(output, final_state)``.

    Raises:
        ValueError: bad ``num_householder``, head counts or shapes.
    """
    n_h = num_householder
    if isinstance(n_h, bool) or not isinstance(n_h, int) or n_h < 1:
        raise ValueError(f"num_householder must be an int >= 1, got {n_h!r}")
    batched = q.dim() == 4
    if batched:
        q, k, v, g, beta = q[0], k[0], v[0], _unbatch(g, 2), _unbatch(beta, 2)
    T, K, V = q.shape[0], q.shape[2], v.shape[2]
    if k.shape[0] != T * n_h or v.shape[0] != T * n_h:
        raise ValueError(f"k and v must have T * num_householder = {T * n_h} rows, got {k.shape[0]}, {v.shape[0]}")
    dt, dev = torch.float64, q.device
    ho, qmap, kmap, vmap = gdn_head_maps(q.shape[1], k.shape[1], v.shape[1])
    qf, kf, vf = q.to(dt)[:, qmap], k.to(dt)[:, kmap], v.to(dt)[:, vmap]
    if use_qk_l2norm_in_kernel:
        qf, kf = _l2norm(qf), _l2norm(kf)
    alpha = torch.ones(T, ho, dtype=dt, device=dev) if g is None else g.to(dt)
    bt = torch.ones(T * n_h, ho, dtype=dt, device=dev) if beta is None else beta.to(dt)
    if tuple(alpha.shape) != (T, ho) or tuple(bt.shape) != (T * n_h, ho):
        raise ValueError(f"g must be [T, HO] = [{T}, {ho}] and beta [T * n, HO] = [{T * n_h}, {ho}]")
    scale = scale or 1.0 / math.sqrt(K)
    offsets = _offsets(cu_seqlens, T)
    n_seq = len(offsets) - 1
    out = torch.zeros(T, ho, V, dtype=dt, device=dev)
    final = torch.zeros(n_seq, ho, V, K, dtype=dt, device=dev)
    eye = torch.eye(K, dtype=dt, device=dev)
    for n in range(n_seq):
        h = torch.zeros(ho, V, K, dtype=dt, device=dev) if initial_state is None else initial_state[n].to(dt)
        for t in range(offsets[n], offsets[n + 1]):
            h = alpha[t][:, None, None] * h
            for j in range(n_h):
                e = t * n_h + j
                kt, bj = kf[e], bt[e][:, None, None]
                h = h @ (eye - bj * kt[:, :, None] * kt[:, None, :]) + bj * vf[e][:, :, None] * kt[:, None, :]
            out[t] = scale * (h @ qf[t][:, :, None])[..., 0]
        final[n] = h
    return _finish(out, final, output, output_state, batched, output_final_state)


def kda_gate(g, A_log, dt_bias, lower_bound=None):
    """KDA's in-kernel gate: log decay ``[..., HV, K]`` from the raw pre-activation ``g`` (float64).

    ``lower_bound`` None: ``-exp(A_log) softplus(g + dt_bias)``; ``lower_bound = L < 0`` (the safe gate):
    ``L sigmoid(exp(A_log) (g + dt_bias))`` in ``[L, 0)``.  ``A_log`` ``[HV]``, ``dt_bias`` ``[HV * K]`` or
    ``[HV, K]``.
    """
    hv, K = g.shape[-2], g.shape[-1]
    x = g.double() + dt_bias.double().reshape(hv, K)
    a = torch.exp(A_log.double().reshape(hv, 1))
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(x)
    return float(lower_bound) * torch.sigmoid(a * x)


def recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, lower_bound=None,
                  cu_seqlens=None, ssm_state_indices=None, num_spec_tokens=None, num_accepted_tokens=None,
                  output=None, initial_state_source=None, initial_state_indices=None, beta_is_logit=False,
                  seq_order=None, prefill_workspace=None, state_checkpoints=None, checkpoint_cu_starts=None,
                  checkpoint_every_n_tokens=0, checkpoint_state_indices=None, *, disable_state_update=False,
                  correction_cache=None, kg_cache=None):
    """Reference KDA (FlashInfer's ``recurrent_kda`` minus ``backend``), float64 math, CPU or GPU.

    Args:
        q, k: ``[B, T, H, K]`` (``B`` sequences of T tokens), ``[1, T, H, K]`` with ``cu_seqlens``, or
            ``[T, H, K]``; v ``[..., HV, V]``, ``HV`` a multiple of ``H``.
        g: ``[..., HV, K]`` log decay, or the raw pre-activation with ``use_gate_in_kernel`` (:func:`kda_gate`).
        beta: ``[..., HV]`` post-sigmoid, or logits with ``beta_is_logit``.
        A_log, dt_bias: the gate's parameters (``[HV]``, ``[HV * K]`` / ``[HV, K]``), with ``use_gate_in_kernel``.
        scale: query scale; None = ``1 / sqrt(K)``.
        initial_state: ``[N, HV, V, K]`` (a pool with ``ssm_state_indices``), advanced to the final state in
            place (rounded to its dtype) unless ``disable_state_update``; None = zeros.
        output_final_state: return the final state (``initial_state`` when given, else a new float32 tensor).
        use_qk_l2norm_in_kernel: l2-normalise q and k (default True).
        lower_bound: the safe gate's bound (< 0) or None.
        cu_seqlens: ``[N + 1]`` offsets over the packed tokens.
        ssm_state_indices: ``[N]`` pool rows of ``initial_state`` each sequence reads and writes.
        initial_state_source, initial_state_indices: a read-only pool the initial state is read from instead
            (row ``initial_state_indices[n]``); the final state still goes to ``initial_state``.
        output: optional buffer (v's shape) the output is copied into.
        disable_state_update: no state is written (``output_final_state`` must be False).
        num_spec_tokens, num_accepted_tokens, seq_order, prefill_workspace, state_checkpoints,
            checkpoint_cu_starts, checkpoint_every_n_tokens, checkpoint_state_indices, correction_cache,
            kg_cache: not modelled (NotImplementedError when given).

    Returns:
        ``(output, final_state or None)``; output has v's leading shape, float64 unless ``output`` is given.

    Raises:
        ValueError: bad shapes, missing gate parameters, ``HV`` not a multiple of ``H``.
        NotImplementedError: the arguments listed as not modelled.
    """
    for name, val in (("num_spec_tokens", num_spec_tokens), ("num_accepted_tokens", num_accepted_tokens),
                      ("seq_order", seq_order), ("prefill_workspace", prefill_workspace),
                      ("state_checkpoints", state_checkpoints), ("checkpoint_cu_starts", checkpoint_cu_starts),
                      ("checkpoint_state_indices", checkpoint_state_indices), ("correction_cache", correction_cache),
                      ("kg_cache", kg_cache)):
        if val is not None:
            raise NotImplementedError(f"ref.recurrent_kda: {name} is not modelled")
    if checkpoint_every_n_tokens:
        raise NotImplementedError("ref.recurrent_kda: checkpoint_every_n_tokens is not modelled")
    if use_gate_in_kernel and (A_log is None or dt_bias is None):
        raise ValueError("use_gate_in_kernel needs both A_log and dt_bias")
    if disable_state_update and output_final_state:
        raise ValueError("output_final_state=True is incompatible with disable_state_update=True")
    out_shape = tuple(v.shape)
    if q.dim() == 4:
        B, Tb = q.shape[0], q.shape[1]
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (B + 1) * Tb, Tb)
        elif B != 1:
            raise ValueError(f"with cu_seqlens q must be [1, T, H, K], got {tuple(q.shape)}")
        q, k, v, g = (x.reshape(-1, x.shape[-2], x.shape[-1]) for x in (q, k, v, g))
        beta = beta.reshape(-1, beta.shape[-1])
    T, H, K = q.shape
    hv, V = v.shape[1], v.shape[2]
    if hv % H or k.shape[1] != H:
        raise ValueError(f"KDA heads: k must have q's H and HV a multiple of H, got H={H}, Hk={k.shape[1]}, HV={hv}")
    if tuple(g.shape) != (T, hv, K) or tuple(beta.shape) != (T, hv):
        raise ValueError(f"g must be [T, HV, K] = [{T}, {hv}, {K}] and beta [T, HV], got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    dt, dev = torch.float64, q.device
    qf, kf, vf, _ = _prep(q, k, v, use_qk_l2norm_in_kernel, dt)
    gd = kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.to(dt)
    bd = torch.sigmoid(beta.to(dt)) if beta_is_logit else beta.to(dt)
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    offsets = _offsets(cu_seqlens, T)
    n_seq = len(offsets) - 1
    rows = list(range(n_seq)) if ssm_state_indices is None else [int(x) for x in ssm_state_indices.tolist()]
    src_rows = rows if initial_state_indices is None else [int(x) for x in initial_state_indices.tolist()]
    source = initial_state if initial_state_source is None else initial_state_source
    out = torch.zeros(T, hv, V, dtype=dt, device=dev)
    final = torch.zeros(n_seq, hv, V, K, dtype=dt, device=dev)
    eye = torch.eye(K, dtype=dt, device=dev)
    for n in range(n_seq):
        h = torch.zeros(hv, V, K, dtype=dt, device=dev) if source is None else source[src_rows[n]].to(dt)
        for t in range(offsets[n], offsets[n + 1]):
            bt = bd[t][:, None, None]
            decay = torch.diag_embed(torch.exp(gd[t]))
            kk = kf[t][:, :, None] * kf[t][:, None, :]
            h = h @ decay @ (eye - bt * kk) + bt * vf[t][:, :, None] * kf[t][:, None, :]
            out[t] = scale * (h @ qf[t][:, :, None])[..., 0]
        final[n] = h
    if output is not None:
        output.copy_(out.reshape(out_shape))
        out = output
    else:
        out = out.reshape(out_shape)
    if disable_state_update:
        return out, None
    if initial_state is not None:
        for n in range(n_seq):
            initial_state[rows[n]].copy_(final[n])
        final = initial_state
    else:
        final = final.float()
    return out, (final if output_final_state else None)
