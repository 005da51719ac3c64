"""Float32 chunked reference of the per-channel-decay delta rule (KDA, GDN-2): exactly the algorithm, the
sub-chunk references and the operand roundings of the chunked kernel (:mod:`cutedsl_attn.portable.kda_chunked`
with its prep :mod:`cutedsl_attn.common.kda_prep`), for validating that algorithm against the float64 oracle
(:mod:`cutedsl_attn.ref.delta_family`) on the CPU.

Per token (V-major state ``H [V, K]``, ``D(x) = Diag(x)``), with an erase key ``e_t`` and a written value
``x_t``::

    u_t = x_t - H_{t-1} D(exp g_t) e_t,      H_t = H_{t-1} D(exp g_t) + u_t k_t^T,      o_t = scale H_t q_t

KDA: ``e = beta k``, ``x = beta v`` (scalar beta); GDN-2: ``e = b * k``, ``x = w * v`` (erase gate ``b`` per key
channel, write gate ``w`` per value channel).  Per chunk of ``C = 64`` tokens, ``G_r`` = the cumulative log2
decay per channel from the chunk's start (each token's log2 gate floored at :data:`GATE_FLOOR_LOG2`, which
underflows to 0 anyway, so ``-inf`` gates give no ``inf - inf``)::

    A[r, s]   = sum_d e_r[d] k_s[d] 2^(G_r[d] - G_s[d])   (s < r)      T = (I + A)^-1
    Aqk[r, s] = scale sum_d q_r[d] k_s[d] 2^(G_r[d] - G_s[d])   (s <= r)
    W = T (e * 2^G)      U = T x      V' = U - W S^T      O = scale (q * 2^G) S^T + Aqk V'
    S <- S D(2^G_last) + V'^T (k * 2^(G_last - G))

Every factor of ``W``, ``O`` and the state update is ``<= 1``.  ``A`` and ``Aqk`` are built per 16-token
sub-chunk ``i`` (rows ``16 i ..``) against the reference ``p = 16 i - 1`` (``G_p = 0`` for ``i = 0``): row
operands ``e_r 2^(G_r - G_p)``, ``q_r 2^(G_r - G_p)`` (factors ``<= 1``) times the column operand
``k_s 2^(G_p - G_s)`` for ``s < 16 (i + 1)`` (``<= 1`` before the sub-chunk; inside it ``<= 2^span``).  Where
the diagonal 16 x 16 block's column factor would pass :func:`diag_limit` (``2^96`` in bf16, ``2^4`` in fp16)
or its operand would overflow the io dtype, that block is recomputed directly in fp32
(``2^min(G_r - G_s, 0)`` per channel): no factor ever overflows, so any gate the API accepts is exact.

Imports only torch.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CHUNK", "GATE_FLOOR_LOG2", "SUB", "diag_limit", "kda_chunked"]

CHUNK = 64
SUB = 16
GATE_FLOOR_LOG2 = -200.0  # a token's log2 decay floor: 2^-200 is 0 in fp32, so exact; keeps G finite
L2NORM_EPS = 1e-6
LOG2E = 1.4426950408889634
_IO_MAX = {torch.bfloat16: 3.0e38, torch.float16: 65000.0}


def diag_limit(io_dtype) -> float:
    """Largest log2 column factor of a diagonal sub-block computed by the factored MMA (larger: direct fp32).
    bf16 keeps a row factor ``2^-96`` normal; fp16's narrow exponent range allows ``2^4``."""
    return 96.0 if io_dtype == torch.bfloat16 else 4.0


def _rnd(x, io):
    return x.to(io).float()


def _chunk(qh, kh, e, x, G, ln, scale, io):
    """Prep of one chunk, every head at once: ``[HO, C, *]`` fp32 operands (rows past ``ln`` zero, ``G``
    constant there).  Returns (W, U, Aqk, Qg, Kd, gl) as the kernel stores them."""
    C, ho = CHUNK, qh.shape[0]
    lim, io_max = diag_limit(io), _IO_MAX[io]
    akk = torch.zeros(ho, C, C)
    aqk = torch.zeros(ho, C, C)
    for i in range(C // SUB):
        r0, r1 = SUB * i, SUB * (i + 1)
        gp = G[:, r0 - 1] if i > 0 else torch.zeros_like(G[:, 0])  # [HO, K]
        er = _rnd(e[:, r0:r1] * torch.exp2(G[:, r0:r1] - gp[:, None]), io)
        qr = _rnd(qh[:, r0:r1] * torch.exp2(G[:, r0:r1] - gp[:, None]), io)
        xexp = gp[:, None] - G[:, :r1]
        kc_f = kh[:, :r1] * torch.exp2(torch.clamp(xexp, max=lim))
        kc = _rnd(kc_f, io)
        akk[:, r0:r1, :r1] = er @ kc.transpose(1, 2)
        aqk[:, r0:r1, :r1] = qr @ kc.transpose(1, 2)
        # per head: the diagonal block directly where the factored operand cannot hold its factor
        diag_ok = ((xexp[:, r0:r1] <= lim) & (kc_f[:, r0:r1].abs() <= io_max)).flatten(1).all(1)
        for h in torch.nonzero(~diag_ok).flatten().tolist():
            f = torch.exp2(torch.clamp(G[h, r0:r1, None, :] - G[h, None, r0:r1, :], max=0.0))  # [16, 16, K]
            ks = kh[h, r0:r1]
            akk[h, r0:r1, r0:r1] = (e[h, r0:r1, None, :] * ks[None] * f).sum(-1)
            aqk[h, r0:r1, r0:r1] = (qh[h, r0:r1, None, :] * ks[None] * f).sum(-1)
    a = torch.tril(akk, -1)
    aqk = _rnd(scale * torch.tril(aqk), io)
    eye = torch.eye(C).expand(ho, C, C)
    t = _rnd(torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True), io)
    gam = torch.exp2(G)
    gl = G[:, C - 1]
    w = _rnd(t @ _rnd(e * gam, io), io)
    u = _rnd(t @ x, io)
    qg = _rnd(qh * gam, io)
    kd = _rnd(kh * torch.exp2(gl[:, None] - G), io)
    valid = (torch.arange(C) < ln).float()[None, :, None]
    return w, u, aqk, qg * valid, kd * valid, torch.exp2(gl)


def kda_chunked(q, k, v, g, beta, *, w=None, erase_write=False, scale=None, initial_state=None, cu_seqlens=None,
                use_qk_l2norm=False, state_dtype=torch.float32):
    """The chunked kernel's computation in float32 (module docstring), CPU.

    Args:
        q: ``[T, Hq, K]``, k ``[T, Hk, K]``, v ``[T, Hv, V]`` (bf16 / fp16, the io dtype; GVA / GQA heads).
        g: ``[T, HO, K]`` natural-log decay (``<= 0``, ``-inf`` allowed) or None (no decay).
        beta: KDA: ``[T, HO]`` post-sigmoid strength; GDN-2 (``erase_write``): ``[T, HO, K]`` erase gate
            (None = 1).
        w: GDN-2 only: ``[T, HO, V]`` write gate (None = 1).
        scale: query scale (None = ``1 / sqrt(K)``).
        initial_state: ``[N, HO, V, K]`` V-major (read as ``state_dtype``) or None (zeros).
        cu_seqlens: ``[N + 1]`` offsets (None: one sequence).
        use_qk_l2norm: ``x * rsqrt(sum x^2 + 1e-6)`` on q and k, rounded to the io dtype, first.
        state_dtype: the state's storage dtype (final state rounded to it).

    Returns:
        ``(output [T, HO, V], final_state [N, HO, V, K])`` float32, rounded to the io / state dtypes.

    Raises:
        ValueError: ``w`` without ``erase_write``.
    """
    from .gdn import gdn_head_maps

    if w is not None and not erase_write:
        raise ValueError("w (the write gate) is GDN-2's: pass erase_write=True")
    io = q.dtype
    T, K, V = q.shape[0], q.shape[2], v.shape[2]
    ho, qmap, kmap, vmap = gdn_head_maps(q.shape[1], k.shape[1], v.shape[1])
    scale = scale or 1.0 / math.sqrt(K)
    qf, kf, vf = q.float()[:, qmap], k.float()[:, kmap], v.float()[:, vmap]
    if use_qk_l2norm:
        qf = _rnd(qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2NORM_EPS), io)
        kf = _rnd(kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + L2NORM_EPS), io)
    lg = torch.zeros(T, ho, K) if g is None else torch.clamp(g.float() * LOG2E, min=GATE_FLOOR_LOG2)
    if erase_write:
        b = torch.ones(T, ho, K) if beta is None else beta.float()
        wv = torch.ones(T, ho, V) if w is None else w.float()
        e, x = _rnd(b * kf, io), _rnd(wv * vf, io)
    else:
        e, x = _rnd(beta.float()[..., None] * kf, io), _rnd(beta.float()[..., None] * vf, io)
    offsets = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    n_seq = len(offsets) - 1
    out = torch.zeros(T, ho, V)
    final = torch.zeros(n_seq, ho, V, K)
    C = CHUNK
    for n in range(n_seq):
        s = (torch.zeros(ho, V, K) if initial_state is None
             else initial_state[n].to(state_dtype).float())
        for t0 in range(offsets[n], offsets[n + 1], C):
            ln = min(C, offsets[n + 1] - t0)

            def pad(a):  # [ln, HO, D] -> [HO, C, D], zero rows past the chunk's end
                z = torch.zeros(C, *a.shape[1:])
                z[:ln] = a[t0:t0 + ln]
                return z.transpose(0, 1)

            G = torch.cumsum(pad(lg), dim=1)
            wm, um, aqk, qg, kd, gl = _chunk(pad(qf), pad(kf), pad(e), pad(x), G, ln, scale, io)
            sb = _rnd(s, io)
            vp = um - wm @ sb.transpose(1, 2)
            vpr = _rnd(vp, io)
            o = scale * (qg @ sb.transpose(1, 2)) + aqk @ vpr
            out[t0:t0 + ln] = _rnd(o, io).transpose(0, 1)[:ln]
            s = s * gl[:, None, :] + vpr.transpose(1, 2) @ kd
        final[n] = _rnd(s, state_dtype)
    return out, final
