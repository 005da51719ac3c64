"""The rest of the delta-rule family with FlashInfer's signatures: ``chunk_gated_delta_rule2`` (GDN-2),
``chunk_gated_delta_product`` (Gated DeltaProduct) and ``recurrent_kda`` (Kimi Delta Attention, prefill and the
T = 1 decode step with state pools).

Conventions as :mod:`cutedsl_attn.api.gdn`: packed q / k / v with ``cu_seqlens``, ``HO = max(Hq, Hv)`` heads
with contiguous grouping, the state V-major ``[N, HO, V, K]`` float32 or bfloat16 (math in fp32), the readout
after the token's update.  Gates: GDN-2 and KDA natural-log decay per key channel, GDP linear alpha per head.

Backends (``backend`` in ``"auto"``, ``"cute"``, ``"cudnn"``): ``"cute"`` is this package's CuTe DSL kernels
(Gated DeltaProduct: the chunked GDN kernels on the expanded timeline; GDN-2 and KDA prefill: the per-channel
chunked kernel, :mod:`cutedsl_attn.sm90.kda_chunked` on SM90 and :mod:`cutedsl_attn.portable.kda_chunked`
elsewhere; the KDA decode step: the token-serial recurrent kernel
of :mod:`cutedsl_attn.portable.gdn_recurrent`; ``CUTEDSL_ATTN_GDN_KERNEL=recurrent`` runs all of them on the
recurrent kernel, GDP on its sub-token variant);
``"cudnn"`` the cuDNN frontend graphs of :mod:`cutedsl_attn.api.cudnn_linear`.  ``"auto"``
never picks cuDNN for KDA; for GDN-2 and GDP (which FlashInfer serves only through cuDNN) it picks cuDNN where
cuDNN's engines run them (an SM100-family GPU with cudnn-frontend >= 1.29, K = V = 128) and our kernels
elsewhere (Hopper included).  Arguments cuDNN lacks (state pools, speculative decode, checkpoints) are refused
with ``backend="cudnn"`` before any call, naming them.

Every check runs before any launch; value checks (``cu_seqlens`` monotone, gate ranges, unique pool rows) cost
one device-to-host copy a call and are skipped inside a CUDA graph capture.  The in-kernel gates of KDA
(``use_gate_in_kernel``'s safe gate, ``beta_is_logit``'s sigmoid) are computed in fp32 before the kernel.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..planning.gdn import (
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_HAS_INITIAL_STATE, FLAG_INITIAL_INDICES, FLAG_OUTPUT_INDICES, FLAG_WRITE_STATE,
    HEAD_DIMS, MAX_HOUSEHOLDER, GdnArgs,
)
from . import gdn as _g
from ..dispatch import gdn_launch

__all__ = ["chunk_gated_delta_product", "chunk_gated_delta_rule2", "recurrent_kda"]

_BACKENDS = ("auto", "cute", "cudnn")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------- shared checks
#: FlashInfer's KDA backends other than "auto" / "cudnn" (not served: NotImplementedError, not "unknown")
_KDA_FLASHINFER_ONLY = ("cute-dsl", "cute-dsl-persistent", "tirx", "ptx", "cake", "small-bh")


def _backend(op, backend, flashinfer_only=()):
    _g._check_backend(op, backend, flashinfer_only)


def _inputs(op, q, k, v, n_h=1):
    """``(q3, k3, v3, nd, T, hq, hk, hv, K, V, ho)``: q / k / v checked (rank 3, or 4 with a leading 1)."""
    _g._tensor("q", q)
    if q.dim() not in (3, 4) or (q.dim() == 4 and q.shape[0] != 1):
        raise ValueError(f"{op}: q must be [T, Hq, K] or [1, T, Hq, K] (packed varlen), got {tuple(q.shape)}")
    if q.dtype not in _g._IO_DTYPES:
        raise ValueError(f"{op}: q must be bfloat16 or float16, got {q.dtype}")
    nd, dev = q.dim(), q.device
    q3 = _g._qkv("q", q, nd, dev, q.dtype)
    k3 = _g._qkv("k", k, nd, dev, q.dtype)
    v3 = _g._qkv("v", v, nd, dev, q.dtype)
    T, hq, K = q3.shape
    if k3.shape[0] != T * n_h or v3.shape[0] != T * n_h or k3.shape[2] != K:
        rows = "q's T" if n_h == 1 else f"T * num_householder = {T * n_h}"
        raise ValueError(f"{op}: k and v must have {rows} rows and k q's head dim: q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    hk, hv, V = k3.shape[1], v3.shape[1], v3.shape[2]
    if not ((hq == hk and hv % hq == 0) or (hk == hv and hq % hv == 0)):
        raise ValueError(f"{op}: head counts must be GVA (Hq == Hk, Hv a multiple of Hq) or GQA (Hk == Hv, Hq a "
                         f"multiple of Hv), got Hq={hq}, Hk={hk}, Hv={hv}")
    return q3, k3, v3, nd, T, hq, hk, hv, K, V, max(hq, hv)


def _fgate(op, name, t, shape, nd, dev, dtypes=_FLOATS, given=None):
    """A gate of ``shape`` (a leading 1 dropped for 4-D inputs), a float dtype of ``dtypes``, last dim
    contiguous; None stays None.  ``given``: the caller's shape, for the message, when ``t`` is a reshaped view."""
    if t is None:
        return None
    _g._tensor(name, t)
    x = t[0] if (nd == 4 and t.dim() == len(shape) + 1 and t.shape[0] == 1) else t
    if tuple(x.shape) != tuple(shape):
        flat = "" if given is None else " (batch and time flattened)"
        raise ValueError(f"{op}: {name} must be {list(shape)}{flat}, got {tuple(t.shape if given is None else given)}")
    if x.dtype not in dtypes:
        raise ValueError(f"{op}: {name} must be one of {[str(d).replace('torch.', '') for d in dtypes]}, got "
                         f"{x.dtype}")
    _g._on(name, x, dev)
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{op}: {name} must have a contiguous last dim, got strides {tuple(x.stride())}")
    return x


def _f32(x):
    """fp32, contiguous, 16-byte aligned (the kernel's vector loads): a copy only when needed."""
    x = x.float().contiguous()
    return x.clone() if x.data_ptr() % 16 else x


def _head_dims(op, K, V):
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise NotImplementedError(f"{op}: head dims K={K}, V={V} are not served by backend='cute'; served: K, V "
                                  f"in {HEAD_DIMS}")


def _cudnn_serves_family(dev, K, V) -> bool:
    """Whether cuDNN's GDN-2 / GDP engines run here: an SM100-family GPU, cudnn-frontend >= 1.29, K = V = 128."""
    if dev.type != "cuda" or K != 128 or V != 128 or torch.cuda.get_device_capability(dev)[0] != 10:
        return False
    from ..cudnn.linear_attention import require_linear_attention
    try:
        require_linear_attention()
    except (ImportError, RuntimeError):
        return False
    return True


def _unbatch_out(out, nd, given):
    return out if (given is not None or nd == 3) else out.unsqueeze(0)


# ---------------------------------------------------------------------------- GDN-2
def chunk_gated_delta_rule2(q, k, v, g=None, beta=None, w=None, scale=None, initial_state=None,
                            output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None,
                            output_state=None, *, backend="auto"):
    """GDN-2 prefill (FlashInfer's signature): ``H <- H D(exp g)``, ``u = w * v - H (beta * k)``,
    ``H <- H + u k^T``, ``o = scale H q``.

    Args:
        q: ``[T, Hq, K]`` (or ``[1, T, Hq, K]``) bfloat16 / float16 CUDA tensor, last dim contiguous, other
            strides multiples of 8 elements; k ``[T, Hk, K]``, v ``[T, Hv, V]`` alike (GVA or GQA heads).
        g: ``[T, HO, K]`` natural-log decay per key channel (<= 0), float32 / bfloat16 / float16; None = 0.
        beta: ``[T, HO, K]`` erase gate per key channel; None = 1.
        w: ``[T, HO, V]`` write gate per value channel; None = 1.
        scale: query scale; None or 0.0 = ``1 / sqrt(K)``.
        initial_state: ``[N, HO, V, K]`` float32 / bfloat16 V-major, read-only; None = zeros.
        output_final_state: return ``(output, final_state)`` (the state is written whenever ``output_state``
            is given or this is True).
        cu_seqlens: ``[N + 1]`` int32 / int64 offsets, 0 first and T last, non-decreasing; required.
        use_qk_l2norm_in_kernel: l2-normalise q and k in the kernel.
        output: ``[T, HO, V]`` buffer (q's dtype, contiguous); output_state ``[N, HO, V, K]`` of the initial
            state's dtype, not overlapping it.
        backend: ``"auto"``, ``"cute"`` or ``"cudnn"`` (see the module docstring).

    Returns:
        ``output`` ``[T, HO, V]`` (``[1, T, HO, V]`` for 4-D q), or ``(output, final_state)``.

    Raises:
        TypeError: a tensor argument that is not a tensor; ``output_final_state`` / ``use_qk_l2norm_in_kernel``
            not a bool.
        ValueError: bad shapes, dtypes, devices, layouts, heads, ``cu_seqlens`` (missing, not monotone), ``g``
            above 0 or NaN, overlapping states, ``output`` / ``output_state`` overlapping an input (q, k, v, g,
            beta, w; for ``output`` also the states), a bad ``backend``.
        NotImplementedError: ``backend="cute"`` with head dims other than 64 / 128; cuDNN declining the graph.
    """
    op = "chunk_gated_delta_rule2"
    _g._check_bool(op, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    _backend(op, backend)
    if cu_seqlens is None:
        raise ValueError(f"{op}: cu_seqlens is required (packed varlen)")
    q3, k3, v3, nd, T, hq, hk, hv, K, V, ho = _inputs(op, q, k, v)
    dev = q3.device
    g3 = _fgate(op, "g", g, (T, ho, K), nd, dev)
    b3 = _fgate(op, "beta", beta, (T, ho, K), nd, dev)
    w3 = _fgate(op, "w", w, (T, ho, V), nd, dev)
    _g._no_alias(op, [("output", output), ("output_state", output_state)],
                 [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("w", w)])
    _g._no_alias(op, [("output", output)], [("initial_state", initial_state), ("output_state", output_state)])
    if backend == "cudnn" or (backend == "auto" and _cudnn_serves_family(dev, K, V)):
        from .cudnn_linear import cudnn_chunk_gated_delta_rule2
        o3 = None if output is None else (output[0] if output.dim() == 4 else output)
        res = cudnn_chunk_gated_delta_rule2(q3, k3, v3, g3, b3, w3, scale, initial_state, output_final_state,
                                            cu_seqlens, use_qk_l2norm_in_kernel, o3, output_state)
        out = _unbatch_out(res[0] if output_final_state else res, nd, output)
        out = output if output is not None else out
        return (out, res[1]) if output_final_state else out
    _head_dims(op, K, V)
    n_seq, cu_dev = _g._cu_seqlens_arg(cu_seqlens, dev)
    scale = _g._scale_arg(scale, K)
    h0, ht, write_state, state_dt = _g._states_arg(initial_state, output_state, output_final_state, None, n_seq,
                                                   ho, V, K, dev)
    o3, output = _g._output_arg(output, nd, T, ho, V, q.dtype, dev)
    checks = _g._index_checks(cu_seqlens, T, None, h0, ht)
    if g3 is not None:
        checks.append((((g3 > 0) | torch.isnan(g3)).any(), f"{op}: g must be a natural-log decay (<= 0, not NaN)"))
    _g._value_checks(checks)
    _g._require_cuda(dev)
    if T == 0 or n_seq == 0:
        _g._empty_final_states(write_state, n_seq, None, h0, ht)
        return (output, ht) if output_final_state else output
    gk = _f32(g3) if g3 is not None else _g._dummy(dev, torch.float32, (1, 1, K))
    ones = None
    if b3 is None or w3 is None:
        ones = torch.ones(T, ho, max(K, V), device=dev, dtype=torch.float32)
    bw = torch.cat([b3.float() if b3 is not None else ones[..., :K],
                    w3.float() if w3 is not None else ones[..., :V]], dim=-1)  # [T, HO, K + V]: erase | write
    flags = ((FLAG_HAS_G if g3 is not None else 0) | FLAG_HAS_BETA
             | (FLAG_HAS_INITIAL_STATE if h0 is not None else 0) | (FLAG_WRITE_STATE if write_state else 0))
    problem = _g._problem(q3, K, V, _g._STATE_DTYPES[state_dt], "log", use_qk_l2norm_in_kernel,
                          gate_per_channel=True, erase_write_gates=True)
    args = _g._prefill_args(q3, k3, v3, gk, _f32(bw), cu_dev, h0, ht, None, o3, scale, hq, hk, hv, flags)
    gdn_launch(problem, args, device_index=dev.index)
    return (output, ht) if output_final_state else output


# ---------------------------------------------------------------------------- Gated DeltaProduct
def chunk_gated_delta_product(q, k, v, g=None, beta=None, num_householder=1, scale=None, initial_state=None,
                              output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None,
                              output_state=None, *, backend="auto"):
    """Gated DeltaProduct prefill (FlashInfer's signature): per token ``H <- alpha H``, then
    ``n = num_householder`` delta-rule updates, then ``o = scale H q``.

    ``backend="cute"`` runs GDN's chunked kernel on the expanded timeline of ``T n`` rows (q at the token's last
    row, zeros elsewhere; alpha at its first row, 1 elsewhere; ``cu_seqlens * n``; with
    ``use_qk_l2norm_in_kernel`` k normalised per update and q per token), so states agree with the float64
    oracle to about 5e-3 relative in bf16 (16-bit state MMA operands, as GDN prefill);
    ``CUTEDSL_ATTN_GDN_KERNEL=recurrent`` runs the token-serial kernel instead (1e-3).  The SM90 chunked kernel
    (``tma = 0``, its default) maps those rows itself, with no copies and the same result bit for bit
    (``CUTEDSL_ATTN_GDP_NATIVE=0`` runs the expansion instead); elsewhere the expansion takes scratch of ``n``
    times q and the output (q's dtype).

    Args:
        q: ``[T, Hq, K]`` (or ``[1, T, Hq, K]``) at the real-token rows, as :func:`chunk_gated_delta_rule2`.
        k, v: ``[T n, Hk, K]``, ``[T n, Hv, V]`` on the expanded timeline (token t's updates at rows
            ``t n .. t n + n - 1``).
        g: ``[T, HO]`` linear alpha in [0, 1] per real token (float32 / bfloat16 / float16); None = 1.
        beta: ``[T n, HO]`` post-sigmoid strength per update, float32 or q's dtype; None = 1.
        num_householder: updates a token, an int >= 1 (``backend="cute"``: at most 8); 1 is GDN.
        scale, initial_state, output_final_state, cu_seqlens (over real tokens, required),
            use_qk_l2norm_in_kernel, output (``[T, HO, V]``), output_state, backend: as
            :func:`chunk_gated_delta_rule2`.

    Returns:
        ``output`` ``[T, HO, V]``, or ``(output, final_state)``.

    Raises:
        TypeError / ValueError: as :func:`chunk_gated_delta_rule2`; alpha outside [0, 1]; a bad
            ``num_householder``.
        NotImplementedError: ``backend="cute"`` with more than 8 updates a token or head dims other than 64 /
            128; cuDNN declining the graph.
    """
    op = "chunk_gated_delta_product"
    _g._check_bool(op, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    _backend(op, backend)
    n_h = num_householder
    if isinstance(n_h, bool) or not isinstance(n_h, int) or n_h < 1:
        raise ValueError(f"{op}: num_householder must be an int >= 1, got {n_h!r}")
    if cu_seqlens is None:
        raise ValueError(f"{op}: cu_seqlens is required (packed varlen)")
    q3, k3, v3, nd, T, hq, hk, hv, K, V, ho = _inputs(op, q, k, v, n_h)
    dev = q3.device
    g3 = _fgate(op, "g", g, (T, ho), nd, dev)
    b3 = _fgate(op, "beta", beta, (T * n_h, ho), nd, dev, (torch.float32, q.dtype))
    _g._no_alias(op, [("output", output), ("output_state", output_state)],
                 [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)])
    _g._no_alias(op, [("output", output)], [("initial_state", initial_state), ("output_state", output_state)])
    if backend == "cudnn" or (backend == "auto" and _cudnn_serves_family(dev, K, V)):
        from .cudnn_linear import cudnn_chunk_gated_delta_product
        o3 = None if output is None else (output[0] if output.dim() == 4 else output)
        res = cudnn_chunk_gated_delta_product(q3, k3, v3, g3, b3, n_h, scale, initial_state, output_final_state,
                                              cu_seqlens, use_qk_l2norm_in_kernel, o3, output_state)
        out = _unbatch_out(res[0] if output_final_state else res, nd, output)
        out = output if output is not None else out
        return (out, res[1]) if output_final_state else out
    if n_h > MAX_HOUSEHOLDER:
        raise NotImplementedError(f"{op}: num_householder={n_h} is not served by backend='cute'; served: 1 to "
                                  f"{MAX_HOUSEHOLDER}")
    _head_dims(op, K, V)
    n_seq, cu_dev = _g._cu_seqlens_arg(cu_seqlens, dev)
    scale = _g._scale_arg(scale, K)
    h0, ht, write_state, state_dt = _g._states_arg(initial_state, output_state, output_final_state, None, n_seq,
                                                   ho, V, K, dev)
    o3, output = _g._output_arg(output, nd, T, ho, V, q.dtype, dev)
    checks = _g._index_checks(cu_seqlens, T, None, h0, ht)
    if g3 is not None:
        checks.append((((g3 < 0) | (g3 > 1) | torch.isnan(g3)).any(),
                       f"{op}: g must be a linear-space alpha in [0, 1] (FlashInfer's GDP gate)"))
    _g._value_checks(checks)
    _g._require_cuda(dev)
    if T == 0 or n_seq == 0:
        _g._empty_final_states(write_state, n_seq, None, h0, ht)
        return (output, ht) if output_final_state else output
    flags = ((FLAG_HAS_G if g3 is not None else 0) | (FLAG_HAS_BETA if b3 is not None else 0)
             | (FLAG_HAS_INITIAL_STATE if h0 is not None else 0) | (FLAG_WRITE_STATE if write_state else 0))
    problem = _g._problem(q3, K, V, _g._STATE_DTYPES[state_dt], "linear", use_qk_l2norm_in_kernel,
                          num_householder=n_h)
    args = _g._prefill_args(q3, k3, v3, None if g3 is None else _f32(g3), None if b3 is None else _f32(b3), cu_dev,
                            h0, ht, None, o3, scale, hq, hk, hv, flags)
    gdn_launch(problem, args, device_index=dev.index)
    return (output, ht) if output_final_state else output


# ---------------------------------------------------------------------------- KDA
_KDA_NEVER = ("num_spec_tokens", "num_accepted_tokens", "seq_order", "prefill_workspace", "state_checkpoints",
              "checkpoint_cu_starts", "checkpoint_state_indices", "correction_cache", "kg_cache")
_KDA_NOT_CUDNN = ("ssm_state_indices", "initial_state_source", "initial_state_indices")


def kda_gate_fp32(g, A_log, dt_bias, lower_bound):
    """KDA's gate in fp32: ``-exp(A_log) softplus(g + dt_bias)``, or with ``lower_bound = L``
    ``L sigmoid(exp(A_log) (g + dt_bias))``; ``g`` ``[T, HV, K]``, ``A_log`` ``[HV]``, ``dt_bias`` ``HV * K``."""
    T, hv, K = g.shape
    x = g.float() + dt_bias.float().reshape(1, hv, K)
    a = torch.exp(A_log.float()).reshape(1, hv, 1)
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(x)
    return float(lower_bound) * torch.sigmoid(a * x)


def recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, lower_bound=None,
                  cu_seqlens=None, ssm_state_indices=None, num_spec_tokens=None, num_accepted_tokens=None,
                  output=None, initial_state_source=None, initial_state_indices=None, beta_is_logit=False,
                  seq_order=None, prefill_workspace=None, state_checkpoints=None, checkpoint_cu_starts=None,
                  checkpoint_every_n_tokens=0, checkpoint_state_indices=None, *, disable_state_update=False,
                  correction_cache=None, kg_cache=None, backend="auto"):
    """Kimi Delta Attention, prefill and decode (FlashInfer's signature): ``H <- H D(exp g)``,
    ``u = beta (v - H k)``, ``H <- H + u k^T``, ``o = scale H q``.

    Args:
        q, k: ``[B, T, H, K]`` (B sequences of T tokens; T = 1 is the decode step), ``[1, T, H, K]`` with
            ``cu_seqlens``, or ``[T, H, K]``; bfloat16 / float16 CUDA, last dim contiguous.
        v: ``[..., HV, V]``, ``HV`` a multiple of ``H``.
        g: ``[..., HV, K]`` natural-log decay (<= 0), or the raw pre-activation with ``use_gate_in_kernel``;
            float32 / bfloat16 / float16.
        beta: ``[..., HV]`` post-sigmoid, or logits with ``beta_is_logit``; float.
        A_log, dt_bias: ``[HV]`` and ``[HV * K]`` / ``[HV, K]`` float, both required with
            ``use_gate_in_kernel``: ``g <- -exp(A_log) softplus(g + dt_bias)``, or with ``lower_bound = L < 0``
            the safe gate ``L sigmoid(exp(A_log) (g + dt_bias))``.  Without ``use_gate_in_kernel``, ``A_log``,
            ``dt_bias`` and ``lower_bound`` are not used (as in FlashInfer, where they parametrise only the
            in-kernel gate); ``lower_bound`` is still checked.
        scale: query scale; None = ``1 / sqrt(K)``.
        initial_state: ``[N, HV, V, K]`` float32 / bfloat16 (a pool ``[P, HV, V, K]`` with
            ``ssm_state_indices``), advanced to the final state in place unless ``disable_state_update``;
            None = zeros.
        output_final_state: return the final state (``initial_state``, or a new float32 one without it).
        use_qk_l2norm_in_kernel: l2-normalise q and k (default True).
        cu_seqlens: ``[N + 1]`` int32 / int64 offsets over the packed tokens.
        ssm_state_indices: ``[N]`` int32 / int64 unique pool rows each sequence reads and writes.
        initial_state_source, initial_state_indices: a read-only pool of initial_state's dtype and its row per
            sequence, read instead of ``initial_state`` (which still receives the final state); given together,
            with ``initial_state``.
        output: buffer of v's shape and q's dtype, contiguous; must not overlap q, k, v, g, beta or the states
            (nor may a state that is written overlap q, k, v, g, beta).
        disable_state_update: write no state (``output_final_state`` must be False).
        backend: ``"auto"`` / ``"cute"`` (this package's kernel) or ``"cudnn"`` (:func:`cudnn_recurrent_kda`:
            no pools, no ``disable_state_update``); FlashInfer's other names (``"cute-dsl"``, ``"cake"``, ...)
            are not served (NotImplementedError).
        num_spec_tokens, num_accepted_tokens, seq_order, prefill_workspace, state_checkpoints,
            checkpoint_cu_starts, checkpoint_every_n_tokens, checkpoint_state_indices, correction_cache,
            kg_cache: not served.

    Returns:
        ``(output, final_state or None)``; output in v's shape.

    Raises:
        TypeError: a flag (``output_final_state``, ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``,
            ``beta_is_logit``, ``disable_state_update``) that is not a bool; a tensor argument not a tensor.
        ValueError: an output overlapping an input; bad shapes, dtypes, devices, layouts, heads (``HV`` not a
            multiple of ``H``),
            gate parameters, ``lower_bound`` >= 0, ``g`` above 0 without the in-kernel gate, ``cu_seqlens``,
            duplicate or out-of-range pool rows, overlapping pools, ``output_final_state`` with
            ``disable_state_update``, a bad ``backend``.
        NotImplementedError: the arguments listed as not served, ``backend="cudnn"`` with pools or
            ``disable_state_update``, head dims other than 64 / 128, FlashInfer's other backend names.
    """
    op = "recurrent_kda"
    _g._check_bool(op, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, beta_is_logit=beta_is_logit,
                   disable_state_update=disable_state_update)
    _backend(op, backend, _KDA_FLASHINFER_ONLY)
    given = dict(num_spec_tokens=num_spec_tokens, num_accepted_tokens=num_accepted_tokens, seq_order=seq_order,
                 prefill_workspace=prefill_workspace, state_checkpoints=state_checkpoints,
                 checkpoint_cu_starts=checkpoint_cu_starts, checkpoint_state_indices=checkpoint_state_indices,
                 correction_cache=correction_cache, kg_cache=kg_cache, ssm_state_indices=ssm_state_indices,
                 initial_state_source=initial_state_source, initial_state_indices=initial_state_indices)
    never = [n for n in _KDA_NEVER if given[n] is not None] + (["checkpoint_every_n_tokens"]
                                                              if checkpoint_every_n_tokens else [])
    if never:
        raise NotImplementedError(f"{op}: {', '.join(never)} not served (speculative decode, state checkpoints "
                                  "and prefill workspaces have no kernel here)")
    if backend == "cudnn":
        lacks = [n for n in _KDA_NOT_CUDNN if given[n] is not None] + (["disable_state_update"]
                                                                     if disable_state_update else [])
        if lacks:
            raise NotImplementedError(f"{op}: backend='cudnn' does not take {', '.join(lacks)} (cuDNN's KDA entry "
                                      "point has no state pools and always updates the state); backend='cute' "
                                      "serves them")
    if use_gate_in_kernel and (A_log is None or dt_bias is None):
        raise ValueError(f"{op}: use_gate_in_kernel requires both A_log and dt_bias")
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real)
                                    or not lower_bound < 0):
        raise ValueError(f"{op}: lower_bound must be a negative float (the safe gate's bound), got {lower_bound!r}")
    if disable_state_update and output_final_state:
        raise ValueError(f"{op}: output_final_state=True is incompatible with disable_state_update=True")
    if (initial_state_source is None) != (initial_state_indices is None):
        given_one, missing = (("initial_state_source", "initial_state_indices") if initial_state_indices is None
                              else ("initial_state_indices", "initial_state_source"))
        raise ValueError(f"{op}: {given_one} needs {missing} (the two must be given together or not at all)")
    _g._tensor("q", q)
    if q.dim() not in (3, 4):
        raise ValueError(f"{op}: q must be [B, T, H, K] or [T, H, K], got {tuple(q.shape)}")
    if q.dim() == 4 and q.shape[0] != 1 and cu_seqlens is not None:
        raise ValueError(f"{op}: with cu_seqlens q must be [1, T, H, K] (packed), got {tuple(q.shape)}")
    if q.dtype not in _g._IO_DTYPES:
        raise ValueError(f"{op}: q must be bfloat16 or float16, got {q.dtype}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _g._tensor(name, t)
    reads = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state_source", initial_state_source)]
    _g._no_alias(op, [("output", output)] + ([] if disable_state_update else [("initial_state", initial_state)]),
                 reads)
    _g._no_alias(op, [("output", output)], [("initial_state", initial_state)])
    B = q.shape[0] if q.dim() == 4 else 1
    Tb = q.shape[1] if q.dim() == 4 else q.shape[0]
    if q.dim() == 4 and cu_seqlens is None:
        cu_seqlens = torch.arange(0, (B + 1) * Tb, Tb, dtype=torch.int32)
    if backend == "cudnn":
        from .cudnn_linear import cudnn_recurrent_kda
        flat = [x.reshape(1, -1, *x.shape[-2:]) if x.dim() == 4 else x for x in (q, k, v, g)]
        b_flat = beta.reshape(1, -1, beta.shape[-1]) if beta.dim() == 3 else beta
        if output is not None and not output.is_contiguous():  # a reshape would copy: cuDNN would write the copy
            raise ValueError(f"{op}: output must be contiguous with backend='cudnn', got strides {output.stride()}")
        o_flat = None if output is None else output.view(flat[2].shape)
        cu = cu_seqlens.to(q.device) if cu_seqlens is not None else None
        o, st = cudnn_recurrent_kda(*flat, b_flat, A_log, dt_bias, scale, initial_state, output_final_state,
                                    use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, cu, beta_is_logit,
                                    o_flat)
        return (output if output is not None else o.reshape(v.shape)), st
    dev = q.device
    q3 = _g._qkv("q", q.reshape(-1, *q.shape[-2:]), 3, dev, q.dtype)
    k3 = _g._qkv("k", k.reshape(-1, *k.shape[-2:]), 3, dev, q.dtype)
    v3 = _g._qkv("v", v.reshape(-1, *v.shape[-2:]), 3, dev, q.dtype)
    T, H, K = q3.shape
    hv, V = v3.shape[1], v3.shape[2]
    if tuple(k3.shape) != (T, H, K) or v3.shape[0] != T or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"{op}: k must have q's shape and v q's leading dims, got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if hv % H:
        raise ValueError(f"{op}: HV must be a multiple of H (KDA shares q / k heads across value heads), got "
                         f"H={H}, HV={hv}")
    _head_dims(op, K, V)
    g3 = _fgate(op, "g", g.reshape(-1, *g.shape[-2:]) if g.dim() == 4 else g, (T, hv, K), 3, dev, given=g.shape)
    b2 = _fgate(op, "beta", beta.reshape(-1, beta.shape[-1]) if beta.dim() == 3 else beta, (T, hv), 3, dev,
                given=beta.shape)
    if use_gate_in_kernel:
        _fgate(op, "A_log", A_log, (hv,), 3, dev)
        _g._tensor("dt_bias", dt_bias)
        if dt_bias.numel() != hv * K or not dt_bias.is_floating_point():
            raise ValueError(f"{op}: dt_bias must be a float [HV * K] or [HV, K] = {hv * K} values, got "
                             f"{dt_bias.dtype} {tuple(dt_bias.shape)}")
        _g._on("dt_bias", dt_bias, dev)
    n_seq, cu_dev = _g._cu_seqlens_arg(cu_seqlens, dev)
    if scale is None:
        scale = 1.0 / math.sqrt(K)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite float, got {scale!r}")
    h_src = initial_state if initial_state_source is None else initial_state_source
    st = _g._state("initial_state", initial_state, hv, V, K, dev)
    _g._state("initial_state_source", initial_state_source, hv, V, K, dev)
    if initial_state_source is not None:
        if st is None:
            raise ValueError(f"{op}: initial_state_source needs initial_state (it receives the final state)")
        if initial_state_source.dtype != st.dtype:
            raise ValueError(f"{op}: initial_state_source must have initial_state's dtype {st.dtype}, got "
                             f"{initial_state_source.dtype}")
        if _g._overlaps(initial_state_source, st):
            raise ValueError(f"{op}: initial_state_source must not overlap initial_state (a row written by one "
                             "sequence could be read by another)")
        _g._index_tensor("initial_state_indices", initial_state_indices, n_seq, dev)
    if ssm_state_indices is not None:
        if st is None:
            raise ValueError(f"{op}: ssm_state_indices needs initial_state (the pool)")
        _g._index_tensor("ssm_state_indices", ssm_state_indices, n_seq, dev)
    elif st is not None and st.shape[0] != n_seq:
        raise ValueError(f"{op}: initial_state must have N = {n_seq} rows without ssm_state_indices, got "
                         f"{st.shape[0]}")
    if output is not None:
        _g._tensor("output", output)
        if tuple(output.shape) != tuple(v.shape) or output.dtype != q.dtype or not output.is_contiguous():
            raise ValueError(f"{op}: output must be a contiguous {list(v.shape)} {q.dtype} tensor, got "
                             f"{output.dtype} {tuple(output.shape)}")
        _g._on("output", output, dev)
    checks = _g._index_checks(cu_seqlens, T, None, None, None)
    if ssm_state_indices is not None:
        dup, rng = _g._unique_in_range(ssm_state_indices, st.shape[0])
        checks += [(dup, f"{op}: ssm_state_indices must be unique (two sequences would share a pool row)"),
                   (rng, f"{op}: ssm_state_indices must be in [0, {st.shape[0]})")]
    if initial_state_indices is not None:
        _, rng = _g._unique_in_range(initial_state_indices, initial_state_source.shape[0])
        checks.append((rng, f"{op}: initial_state_indices must be in [0, {initial_state_source.shape[0]})"))
    if not use_gate_in_kernel:
        checks.append((((g3 > 0) | torch.isnan(g3)).any(),
                       f"{op}: g must be a natural-log decay (<= 0, not NaN) without use_gate_in_kernel"))
    _g._value_checks(checks)
    _g._require_cuda(dev)

    out = output if output is not None else torch.empty(v.shape, device=dev, dtype=q.dtype)
    write = st is not None and not disable_state_update
    ht = st if write else None
    if ht is None and output_final_state:
        ht = torch.empty(n_seq, hv, V, K, device=dev, dtype=torch.float32)
    final = ht if output_final_state else None
    if T == 0 or n_seq == 0:
        _kda_empty(ht, h_src, n_seq, initial_state_indices, ssm_state_indices)
        return out, final
    if cu_dev is None:
        cu_dev = torch.tensor([0, T], device=dev, dtype=torch.int32)
    gl = kda_gate_fp32(g3, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g3
    bl = torch.sigmoid(b2.float()) if beta_is_logit else b2
    idx_in = initial_state_indices if initial_state_source is not None else ssm_state_indices
    flags = (FLAG_HAS_G | FLAG_HAS_BETA | (FLAG_HAS_INITIAL_STATE if h_src is not None else 0)
             | (FLAG_WRITE_STATE if ht is not None else 0) | (FLAG_INITIAL_INDICES if idx_in is not None else 0)
             | (FLAG_OUTPUT_INDICES if (ssm_state_indices is not None and ht is st) else 0))
    state_dt = (h_src if h_src is not None else ht).dtype if (h_src is not None or ht is not None) else torch.float32
    sdummy = _g._dummy(dev, state_dt, (1, hv, V, K))
    i32 = _g._dummy(dev, torch.int32)
    problem = _g._problem(q3, K, V, _g._STATE_DTYPES[state_dt], "log", use_qk_l2norm_in_kernel,
                          decode=T <= 2 * n_seq, gate_per_channel=True)
    args = GdnArgs(
        q=q3, k=k3, v=v3, g=_f32(gl), beta=_f32(bl), cu_seqlens=cu_dev,
        initial_state=h_src if h_src is not None else sdummy,
        initial_state_indices=i32 if idx_in is None else idx_in.to(device=dev, dtype=torch.int32),
        output_state=ht if ht is not None else sdummy,
        output_state_indices=(ssm_state_indices.to(device=dev, dtype=torch.int32)
                              if (ssm_state_indices is not None and ht is st) else i32),
        output=out.view(T, hv, V), scale=float(scale), q_group=hv // H, k_group=hv // H, v_group=1, flags=flags)
    gdn_launch(problem, args, device_index=dev.index)
    return out, final


def _kda_empty(ht, h_src, n_seq, src_idx, dst_idx) -> None:
    """No tokens: each sequence's final state is its initial state (zeros without one)."""
    if ht is None:
        return
    for n in range(n_seq):
        r_out = n if dst_idx is None else int(dst_idx[n])
        if h_src is None:
            ht[r_out].zero_()
        elif h_src is not ht:
            ht[r_out].copy_(h_src[n if src_idx is None else int(src_idx[n])])
