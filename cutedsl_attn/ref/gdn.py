"""Gated delta rule (GDN) oracles: a token-serial float64 recurrence and a chunked (WY / UT) float32 reference.

Conventions (FlashInfer ``chunk_gated_delta_rule``):

* packed tokens: q ``[T, Hq, K]``, k ``[T, Hk, K]``, v ``[T, Hv, V]`` (or with a leading batch dim of 1),
  sequences delimited by ``cu_seqlens`` ``[N + 1]`` (repeated offsets: empty sequences);
* ``HO = max(Hq, Hv)`` heads for the gates, the state and the output, contiguous grouping: output head ``o``
  reads q head ``o // (HO // Hq)``, k head ``o // (HO // Hk)``, v head ``o // (HO // Hv)`` (GVA ``Hv > Hq = Hk``,
  GQA ``Hq > Hk = Hv``);
* state V-major ``H[V, K]`` per (sequence, head), ``[N, HO, V, K]``;
* per token, with ``a = alpha_t`` (linear gate, or ``exp(g_t)`` for ``gate_domain="log"``) and ``b = beta_t``::

      H_t = a H_{t-1} (I - b k_t k_t^T) + b v_t k_t^T        (= S_t^T of S_t = a (I - b k k^T) S_{t-1} + b k v^T)
      o_t = scale * H_t q_t                                    (the state after token t's update)

* ``use_qk_l2norm_in_kernel``: q and k become ``x * rsqrt(sum x^2 + 1e-6)`` per head first.

Imports only torch.
"""

from __future__ import annotations

import math

import torch

__all__ = ["chunk_gated_delta_rule", "gdn_head_maps"]

L2NORM_EPS = 1e-6


def gdn_head_maps(hq: int, hk: int, hv: int) -> tuple[int, list[int], list[int], list[int]]:
    """``(HO, q_head, k_head, v_head)``: the output head count and, per output head, the input head it reads.

    Raises ValueError unless GVA (``Hq == Hk`` and ``Hv % Hq == 0``) or GQA (``Hk == Hv`` and ``Hq % Hv == 0``).
    """
    gva = hq == hk and hv % hq == 0
    gqa = hk == hv and hq % hv == 0
    if not (gva or gqa):
        raise ValueError(f"head counts must be GVA (Hq == Hk, Hv a multiple of Hq) or GQA (Hk == Hv, Hq a "
                         f"multiple of Hv), got Hq={hq}, Hk={hk}, Hv={hv}")
    ho = max(hq, hv)
    return ho, [o // (ho // hq) for o in range(ho)], [o // (ho // hk) for o in range(ho)], \
        [o // (ho // hv) for o in range(ho)]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _serial_sequence(q, k, v, alpha, beta, h0, scale):
    """One sequence, every head at once, float64: q/k ``[L, HO, K]``, v ``[L, HO, V]``, gates ``[L, HO]``,
    ``h0`` ``[HO, V, K]``.  Returns (o ``[L, HO, V]``, final state)."""
    h = h0.clone()
    eye = torch.eye(q.shape[-1], dtype=h.dtype, device=h.device)
    out = torch.empty(v.shape, dtype=h.dtype, device=h.device)
    for t in range(q.shape[0]):
        kt, bt = k[t], beta[t]
        # H a (I - b k k^T) + b v k^T, straight from the equation
        proj = eye - bt[:, None, None] * kt[:, :, None] * kt[:, None, :]
        h = alpha[t][:, None, None] * torch.matmul(h, proj) + bt[:, None, None] * v[t][:, :, None] * kt[:, None, :]
        out[t] = scale * torch.matmul(h, q[t][:, :, None])[..., 0]
    return out, h


def _chunked_sequence(q, k, v, alpha, beta, h0, scale, chunk_size):
    """One sequence, every head at once, float32, chunked WY / UT form (``chunk_size`` tokens a chunk)."""
    ho, dv, dk = h0.shape
    h = h0.clone()
    out = torch.empty(v.shape, dtype=h.dtype, device=h.device)
    # the 1e-10 floor of the linear gate (as the production kernels): alpha = 0 stays finite in log space
    logalpha = torch.log(alpha.clamp_min(1e-10))
    for s in range(0, q.shape[0], chunk_size):
        e = min(s + chunk_size, q.shape[0])
        n = e - s
        qc, kc, vc = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [HO, n, D]
        bc = beta[s:e].transpose(0, 1)  # [HO, n]
        g_cum = torch.cumsum(logalpha[s:e].transpose(0, 1), dim=-1)  # G_r, log of the decay since the chunk start
        gamma = torch.exp(g_cum)
        diff = g_cum[:, :, None] - g_cum[:, None, :]
        causal = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
        big_gamma = torch.where(causal, torch.exp(torch.where(causal, diff, torch.zeros_like(diff))),
                                torch.zeros_like(diff))  # Gamma_rs = exp(G_r - G_s), r >= s
        a = (bc[:, :, None] * torch.matmul(kc, kc.transpose(1, 2)) * big_gamma).tril(-1)
        eye = torch.eye(n, dtype=h.dtype, device=h.device).expand(ho, n, n)
        t_inv = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)  # (I + A)^-1
        w = torch.matmul(t_inv, (bc * gamma)[:, :, None] * kc)  # [HO, n, K]
        u = torch.matmul(t_inv, bc[:, :, None] * vc)  # [HO, n, V]
        v_new = u - torch.matmul(w, h.transpose(1, 2))  # U - W S0, S0 = H^T
        o_inter = gamma[:, :, None] * torch.matmul(qc, h.transpose(1, 2))
        o_intra = torch.matmul(torch.matmul(qc, kc.transpose(1, 2)) * big_gamma, v_new)
        out[s:e] = (scale * (o_inter + o_intra)).transpose(0, 1)
        decay_to_end = torch.exp(g_cum[:, -1:] - g_cum)  # gamma_last / gamma_r
        h = gamma[:, -1, None, None] * h + torch.matmul(v_new.transpose(1, 2), decay_to_end[:, :, None] * kc)
    return out, h


def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None, output_state=None,
                           state_indices=None, max_seqlen=None, use_cp="auto", gate_domain="linear",
                           method="serial", chunk_size=64):
    """Reference GDN prefill (FlashInfer's ``chunk_gated_delta_rule`` minus ``backend``), CPU or GPU.

    Args:
        q: ``[T, Hq, K]`` or ``[1, T, Hq, K]``, any float dtype.
        k: ``[T, Hk, K]`` (same leading layout as q).
        v: ``[T, Hv, V]``.
        g: ``[T, HO]`` forget gate, linear alpha (``gate_domain="linear"``) or log alpha (``"log"``); None = 1.
        beta: ``[T, HO]`` post-sigmoid write strength; None = 1.
        scale: query scale; None or 0.0 = ``1 / sqrt(K)``.
        initial_state: ``[N, HO, V, K]`` V-major (a pool ``[P, HO, V, K]`` with ``state_indices``); None = zeros.
        output_final_state: return ``(output, final_state)`` instead of ``output``.
        cu_seqlens: ``[N + 1]`` int offsets; None = one sequence of all T tokens.
        use_qk_l2norm_in_kernel: l2-normalise q and k (``x * rsqrt(sum x^2 + 1e-6)``) first.
        output: optional ``[T, HO, V]`` buffer the output is copied into (then returned).
        output_state: optional ``[N, HO, V, K]`` (or pool) buffer the final state is copied into (pool rows
            ``state_indices``); then it is the returned final state.
        state_indices: ``[N]`` pool rows of each sequence's initial and final state.
        max_seqlen, use_cp: accepted for signature parity; they change nothing here.
        gate_domain: ``"linear"`` or ``"log"``.
        method: ``"serial"`` (token loop, float64: the oracle) or ``"chunked"`` (WY / UT form, float32).
        chunk_size: tokens per chunk of ``method="chunked"``.

    Returns:
        ``output`` ``[T, HO, V]`` (float64 for serial, float32 for chunked, unless ``output`` is given; a leading
        dim of 1 is kept when q has one), and with ``output_final_state`` the final state ``[N, HO, V, K]`` (or
        ``output_state``).

    Raises:
        ValueError: bad head counts, method, gate domain, or mismatching shapes.
    """
    if method not in ("serial", "chunked"):
        raise ValueError(f"method must be 'serial' or 'chunked', got {method!r}")
    if gate_domain not in ("linear", "log"):
        raise ValueError(f"gate_domain must be 'linear' or 'log', got {gate_domain!r}")
    batched = q.dim() == 4
    if batched:
        if q.shape[0] != 1:
            raise ValueError(f"q with a leading batch dim must have batch 1 (packed varlen), got {tuple(q.shape)}")
        q, k, v = q[0], k[0], v[0]
        g = None if g is None else g.reshape(g.shape[-2:])
        beta = None if beta is None else beta.reshape(beta.shape[-2:])
    T, hq, dk = q.shape
    hk, hv, dv = k.shape[1], v.shape[1], v.shape[2]
    ho, qmap, kmap, vmap = gdn_head_maps(hq, hk, hv)
    dt = torch.float64 if method == "serial" else torch.float32
    dev = q.device
    qf, kf, vf = q.to(dt)[:, qmap], k.to(dt)[:, kmap], v.to(dt)[:, vmap]
    if use_qk_l2norm_in_kernel:
        qf, kf = _l2norm(qf), _l2norm(kf)
    alpha = torch.ones(T, ho, dtype=dt, device=dev) if g is None else g.to(dt)
    if g is not None and gate_domain == "log":
        alpha = torch.exp(alpha)
    bt = torch.ones(T, ho, dtype=dt, device=dev) if beta is None else beta.to(dt)
    if alpha.shape != (T, ho) or bt.shape != (T, ho):
        raise ValueError(f"g and beta must be [T, HO] = [{T}, {ho}]")
    if not scale:
        scale = 1.0 / math.sqrt(dk)
    offsets = [0, T] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    n_seq = len(offsets) - 1
    rows = list(range(n_seq)) if state_indices is None else [int(x) for x in state_indices.tolist()]

    out = torch.empty(T, ho, dv, dtype=dt, device=dev)
    final = torch.empty(n_seq, ho, dv, dk, dtype=dt, device=dev)
    for n in range(n_seq):
        s, e = offsets[n], offsets[n + 1]
        if initial_state is None:
            h0 = torch.zeros(ho, dv, dk, dtype=dt, device=dev)
        else:
            h0 = initial_state[rows[n]].to(dt)
        if e == s:
            final[n] = h0
            continue
        if method == "serial":
            o_n, h_n = _serial_sequence(qf[s:e], kf[s:e], vf[s:e], alpha[s:e], bt[s:e], h0, scale)
        else:
            o_n, h_n = _chunked_sequence(qf[s:e], kf[s:e], vf[s:e], alpha[s:e], bt[s:e], h0, scale, chunk_size)
        out[s:e] = o_n
        final[n] = h_n

    if output is not None:
        output.view(T, ho, dv).copy_(out)
        out = output
    elif batched:
        out = out.unsqueeze(0)
    if output_state is not None:
        for n in range(n_seq):
            output_state[rows[n]].copy_(final[n])
        final = output_state
    return (out, final) if output_final_state else out
