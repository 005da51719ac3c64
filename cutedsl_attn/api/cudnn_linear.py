"""The cuDNN linear-attention entry points (FlashInfer's ``flashinfer.cudnn`` signatures):
``cudnn_chunk_gated_delta_rule``, ``cudnn_chunk_gated_delta_rule2``, ``cudnn_chunk_gated_delta_product`` and
``cudnn_recurrent_kda``, each one cuDNN frontend graph (a ``gdn`` / ``gdn2`` / ``gdp`` / ``kda`` node) cached by
shape key.

Conventions as FlashInfer's: packed THD q / k / v with ``cu_seqlens`` (required), ``HO = max(Hq, Hv)``, the state
V-major ``[N, HO, V, K]`` float32 or bfloat16 passed through untransposed (cuDNN's layout too) and the final state
returned in its dtype; GDN / GDP gates are linear alpha (``gate_domain="linear"``), GDN-2 / KDA gates natural-log
decay (``"log"``).  ``output_state`` must not alias ``initial_state`` (cuDNN splits a sequence across CTAs).

cuDNN's GDN, GDN-2 and GDP engines are SM100-family only; on SM90 only its KDA engines exist.  A declined graph
raises NotImplementedError naming the op, cuDNN's engine decision, the GPU, the versions and ``backend="cute"``.
Every argument check runs before the frontend is imported.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from ..cudnn import linear_attention as la
from .gdn import _check_bool, _no_alias, _on, _overlaps, _require_cuda, _tensor

__all__ = ["cudnn_chunk_gated_delta_product", "cudnn_chunk_gated_delta_rule", "cudnn_chunk_gated_delta_rule2",
           "cudnn_recurrent_kda"]

_IO = (torch.bfloat16, torch.float16)
_STATE = (torch.float32, torch.bfloat16)
_GATE = (torch.float32, torch.bfloat16, torch.float16)
#: fp16 KDA gates: the engine's chunk-cumulative decay inverse overflows below about this alpha a token
FP16_ALPHA_MIN = 0.9


def _qkv(op, name, t, dtype, device, rank=3):
    _tensor(name, t)
    if t.dim() != rank:
        raise ValueError(f"{op}: {name} must be [T, H, D] (packed), got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{op}: {name} must have q's dtype {dtype}, got {t.dtype}")
    _on(name, t, device)
    if t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have a contiguous last dim, got strides {tuple(t.stride())}")
    return t


def _cu(op, cu_seqlens, device):
    if cu_seqlens is None:
        raise ValueError(f"{op}: cu_seqlens is required")
    _tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{op}: cu_seqlens must be a 1-D int32/int64 tensor of N + 1 >= 2 offsets, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    _on("cu_seqlens", cu_seqlens, device)
    return cu_seqlens.shape[0] - 1


def _gate(op, name, t, shape, dtypes, device):
    if t is None:
        return None
    _tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be {list(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} must be one of {[str(d).replace('torch.', '') for d in dtypes]}, got "
                         f"{t.dtype}")
    _on(name, t, device)
    if t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have a contiguous last dim")
    return t


def _states(op, initial_state, output_state, n_seq, ho, V, K, device):
    want = (n_seq, ho, V, K)
    for name, t in (("initial_state", initial_state), ("output_state", output_state)):
        if t is None:
            continue
        _tensor(name, t)
        if tuple(t.shape) != want:
            raise ValueError(f"{op}: {name} must be V-major [N, HO, V, K] = {list(want)}, got {tuple(t.shape)}")
        if t.dtype not in _STATE:
            raise ValueError(f"{op}: {name} must be float32 or bfloat16, got {t.dtype}")
        _on(name, t, device)
    if initial_state is not None and output_state is not None and _overlaps(initial_state, output_state):
        raise ValueError(f"{op}: output_state must not alias initial_state (cuDNN splits a sequence across CTAs: "
                         "the CTA reading the incoming state would race the one writing the outgoing state)")


def _flags(op, output_final_state, use_qk_l2norm_in_kernel, batch_invariant):
    _check_bool(op, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                batch_invariant=batch_invariant)


def _writes(op, output, output_state, initial_state, reads, state_name="output_state"):
    """ValueError naming both when ``output`` / the state written overlaps an input the graph reads."""
    _no_alias(op, [("output", output), (state_name, output_state)], reads)
    _no_alias(op, [("output", output)], [("initial_state", initial_state), (state_name, output_state)])


def _output(op, output, shape, dtype, device):
    if output is None:
        return torch.empty(shape, dtype=dtype, device=device)
    _tensor("output", output)
    if tuple(output.shape) != tuple(shape) or output.dtype != dtype:
        raise ValueError(f"{op}: output must be a {list(shape)} {dtype} tensor, got {output.dtype} "
                         f"{tuple(output.shape)}")
    _on("output", output, device)
    return output


def _heads(op, hq, hk, hv):
    if hk not in (hq, hv) or max(hq, hv) % min(hq, hv):
        raise ValueError(f"{op}: k heads must equal q's or v's and Hq, Hv be equal or one a multiple of the "
                         f"other, got Hq={hq}, Hk={hk}, Hv={hv}")
    return max(hq, hv)


def _scale(scale, K):
    return float(scale) if scale else 1.0 / math.sqrt(K)


def _final(initial_state, output_state, shape, device):
    if output_state is not None:
        return output_state
    return torch.empty(shape, dtype=torch.float32 if initial_state is None else initial_state.dtype, device=device)


def _prefill(op, q, k, v, cu_seqlens, n_h=1):
    _tensor("q", q)
    if q.dtype not in _IO:
        raise ValueError(f"{op}: q must be bfloat16 or float16, got {q.dtype}")
    dev = q.device
    _qkv(op, "q", q, q.dtype, dev)
    _qkv(op, "k", k, q.dtype, dev)
    _qkv(op, "v", v, q.dtype, dev)
    T, hq, K = q.shape
    if k.shape[0] != T * n_h or v.shape[0] != T * n_h or k.shape[2] != K:
        rows = "T" if n_h == 1 else f"T * num_householder = {T * n_h}"
        raise ValueError(f"{op}: k and v must have {rows} rows and k q's head dim: q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    ho = _heads(op, hq, k.shape[1], v.shape[1])
    n_seq = _cu(op, cu_seqlens, dev)
    return dev, T, ho, K, v.shape[2], n_seq


def cudnn_chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                 output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None,
                                 output_state=None, batch_invariant=False):
    """Chunked gated delta rule prefill on a cuDNN ``gdn`` graph (FlashInfer's signature).

    Args:
        q, k, v: ``[T, Hq / Hk / Hv, D]`` bfloat16 / float16 CUDA, last dim contiguous (strides pass through).
        g: ``[T, HO]`` linear alpha (float32 / bfloat16 / float16, ``gate_domain="linear"``); None = 1.
        beta: ``[T, HO]`` post-sigmoid, float32 or q's dtype; None = 1.
        scale: query scale; None or 0.0 = ``1 / sqrt(D)``.
        initial_state, output_state: ``[N, HO, V, K]`` V-major float32 / bfloat16; must not alias.
        output_final_state: return and write the final state (none is written otherwise).
        cu_seqlens: ``[N + 1]`` int32 / int64, required.
        use_qk_l2norm_in_kernel: l2-normalise q and k in the kernel.
        output: ``[T, HO, V]`` q's dtype, written in place.
        batch_invariant: disable cuDNN's split-K (results independent of the batch's composition).

    Returns:
        ``output``, or ``(output, final_state)`` with ``output_final_state``.

    Raises:
        TypeError / ValueError: a bad argument (before the frontend is touched): a flag that is not a bool
            (TypeError), ``output`` / ``output_state`` overlapping q, k, v, g, beta or (``output``) the states.
        ImportError / RuntimeError: cudnn-frontend missing or older than 1.29.
        NotImplementedError: cuDNN's engines decline the graph (SM90: always; the message says what serves it).
    """
    op = "cudnn_chunk_gated_delta_rule"
    _flags(op, output_final_state, use_qk_l2norm_in_kernel, batch_invariant)
    dev, T, ho, K, V, n_seq = _prefill(op, q, k, v, cu_seqlens)
    g = _gate(op, "g", g, (T, ho), _GATE, dev)
    beta = _gate(op, "beta", beta, (T, ho), (torch.float32, q.dtype), dev)
    _states(op, initial_state, output_state, n_seq, ho, V, K, dev)
    _writes(op, output, output_state, initial_state, [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)])
    output = _output(op, output, (T, ho, V), q.dtype, dev)
    _require_cuda(dev)
    g = torch.ones(T, ho, dtype=q.dtype, device=dev) if g is None else g
    beta = torch.ones(T, ho, dtype=torch.float32, device=dev) if beta is None else beta
    final = _final(initial_state, output_state, (n_seq, ho, V, K), dev) if output_final_state else None
    _run(op, q, k, v, g, beta, cu_seqlens, output, final, initial_state, scale=_scale(scale, K),
         use_qk_l2norm=use_qk_l2norm_in_kernel, batch_invariant=batch_invariant, gate_domain="linear")
    return (output, final) if output_final_state else output


def cudnn_chunk_gated_delta_rule2(q, k, v, g=None, beta=None, w=None, scale=None, initial_state=None,
                                  output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                                  output=None, output_state=None, batch_invariant=False):
    """GDN-2 prefill on a cuDNN ``gdn2`` graph (FlashInfer's signature).

    Args as :func:`cudnn_chunk_gated_delta_rule`, but ``g`` ``[T, HO, K]`` natural-log decay per key channel
    (float32 / bfloat16 / float16; None = 0), ``beta`` ``[T, HO, K]`` erase gate and ``w`` ``[T, HO, V]`` write
    gate (any float dtype, converted to q's; None = 1).

    Returns / Raises: as :func:`cudnn_chunk_gated_delta_rule`.
    """
    op = "cudnn_chunk_gated_delta_rule2"
    _flags(op, output_final_state, use_qk_l2norm_in_kernel, batch_invariant)
    dev, T, ho, K, V, n_seq = _prefill(op, q, k, v, cu_seqlens)
    g = _gate(op, "g", g, (T, ho, K), _GATE, dev)
    beta = _gate(op, "beta", beta, (T, ho, K), _GATE, dev)
    w = _gate(op, "w", w, (T, ho, V), _GATE, dev)
    _states(op, initial_state, output_state, n_seq, ho, V, K, dev)
    _writes(op, output, output_state, initial_state,
            [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("w", w)])
    output = _output(op, output, (T, ho, V), q.dtype, dev)
    _require_cuda(dev)
    g = torch.zeros(T, ho, K, dtype=q.dtype, device=dev) if g is None else g
    beta = torch.ones(T, ho, K, dtype=q.dtype, device=dev) if beta is None else beta.to(q.dtype)
    w = torch.ones(T, ho, V, dtype=q.dtype, device=dev) if w is None else w.to(q.dtype)
    final = _final(initial_state, output_state, (n_seq, ho, V, K), dev) if output_final_state else None
    _run(op, q, k, v, g, beta, cu_seqlens, output, final, initial_state, w=w, scale=_scale(scale, K),
         use_qk_l2norm=use_qk_l2norm_in_kernel, batch_invariant=batch_invariant, gate_domain="log")
    return (output, final) if output_final_state else output


def cudnn_chunk_gated_delta_product(q, k, v, g=None, beta=None, num_householder=1, scale=None, initial_state=None,
                                    output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                                    output=None, output_state=None, batch_invariant=False):
    """Gated DeltaProduct prefill on a cuDNN ``gdp`` graph (FlashInfer's signature).

    Args as :func:`cudnn_chunk_gated_delta_rule`, but k / v ``[T n, H, D]`` and ``beta`` ``[T n, HO]`` on the
    expanded timeline (``n = num_householder >= 1``), q / g / output at the ``T`` real-token rows and
    ``cu_seqlens`` over real tokens.

    Returns / Raises: as :func:`cudnn_chunk_gated_delta_rule`.
    """
    op = "cudnn_chunk_gated_delta_product"
    _flags(op, output_final_state, use_qk_l2norm_in_kernel, batch_invariant)
    if isinstance(num_householder, bool) or not isinstance(num_householder, int) or num_householder < 1:
        raise ValueError(f"{op}: num_householder must be an int >= 1, got {num_householder!r}")
    n_h = num_householder
    dev, T, ho, K, V, n_seq = _prefill(op, q, k, v, cu_seqlens, n_h)
    g = _gate(op, "g", g, (T, ho), _GATE, dev)
    beta = _gate(op, "beta", beta, (T * n_h, ho), (torch.float32, q.dtype), dev)
    _states(op, initial_state, output_state, n_seq, ho, V, K, dev)
    _writes(op, output, output_state, initial_state, [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)])
    output = _output(op, output, (T, ho, V), q.dtype, dev)
    _require_cuda(dev)
    g = torch.ones(T, ho, dtype=q.dtype, device=dev) if g is None else g
    beta = torch.ones(T * n_h, ho, dtype=torch.float32, device=dev) if beta is None else beta
    final = _final(initial_state, output_state, (n_seq, ho, V, K), dev) if output_final_state else None
    _run(op, q, k, v, g, beta, cu_seqlens, output, final, initial_state, num_householder=n_h,
         scale=_scale(scale, K), use_qk_l2norm=use_qk_l2norm_in_kernel, batch_invariant=batch_invariant,
         gate_domain="linear")
    return (output, final) if output_final_state else output


def cudnn_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                        lower_bound=None, cu_seqlens=None, beta_is_logit=False, output=None, output_state=None,
                        batch_invariant=False):
    """Kimi Delta Attention prefill on a cuDNN ``kda`` graph (FlashInfer's signature): on SM90 cuDNN's Hopper KDA
    engines serve it.

    Args:
        q, k: ``[1, T, H, 128]`` or ``[T, H, 128]`` bfloat16 / float16; v ``[..., T, HV, 128]``, ``HV >= H``.
        g: ``[..., T, HV, 128]`` log decay (or the raw pre-activation with ``use_gate_in_kernel``), float32 /
            bfloat16 / float16, forwarded with no copy.  float16 log gates warn (RuntimeWarning) where
            ``exp(g) < 0.9`` (:data:`FP16_ALPHA_MIN`): the engine's chunk-cumulative decay inverse overflows
            there.
        beta: ``[..., T, HV]`` post-sigmoid (float32 or q's dtype), or logits with ``beta_is_logit``.
        A_log, dt_bias: the safe gate's parameters, both required with ``use_gate_in_kernel``.
        lower_bound: the safe gate's bound (< 0), cuDNN's ``gate_lower_bound``.
        initial_state, output_state: ``[N, HV, 128, 128]`` V-major float32 / bfloat16, must not alias; without
            ``output_state`` the given ``initial_state`` is advanced to the final state in place, whatever
            ``output_final_state`` says (it gates only the return).
        cu_seqlens: ``[N + 1]`` int32 / int64, required.
        scale, use_qk_l2norm_in_kernel (default True), use_gate_in_kernel, beta_is_logit, output,
            batch_invariant: as FlashInfer's.

    Returns:
        ``(output, final_state or None)``, output in v's shape.

    Raises:
        TypeError / ValueError: bad arguments (a flag that is not a bool, an output or the state written
            overlapping an input, ``use_gate_in_kernel`` without both ``A_log`` and ``dt_bias``,
            a bound >= 0, shapes, dtypes, aliasing states, missing ``cu_seqlens``).
        NotImplementedError: ``HV < H`` (cuDNN carries the state at ``max(H, HV)``, FlashInfer at HV), or cuDNN
            declines the graph.
        ImportError / RuntimeError: cudnn-frontend missing or older than 1.29.
    """
    op = "cudnn_recurrent_kda"
    _check_bool(op, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, beta_is_logit=beta_is_logit, batch_invariant=batch_invariant)
    _tensor("q", q)
    if q.dtype not in _IO:
        raise ValueError(f"{op}: q must be bfloat16 or float16, got {q.dtype}")
    if q.dim() == 4 and q.shape[0] != 1:
        raise ValueError(f"{op}: q must be [1, T, H, K] or [T, H, K] (packed with cu_seqlens), got "
                         f"{tuple(q.shape)}")
    if use_gate_in_kernel and (A_log is None or dt_bias is None):
        raise ValueError(f"{op}: use_gate_in_kernel requires both A_log and dt_bias")
    if lower_bound is not None and not (isinstance(lower_bound, numbers.Real) and not isinstance(lower_bound, bool) and lower_bound < 0):
        raise ValueError(f"{op}: lower_bound must be a negative float, got {lower_bound!r}")
    out_shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
    for name, x in (("k", k), ("v", v), ("g", g)):
        if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[0] != 1:
            raise ValueError(f"{op}: {name} must be [1, T, H, D] or [T, H, D], got {tuple(x.shape)}")
    sq = [x[0] if (isinstance(x, torch.Tensor) and x.dim() == 4) else x for x in (q, k, v, g)]
    q3, k3, v3, g3 = sq
    _tensor("beta", beta)
    b2 = beta[0] if beta.dim() == 3 else beta
    dev = q.device
    for name, t in (("k", k3), ("v", v3)):
        _qkv(op, name, t, q.dtype, dev)
    _qkv(op, "q", q3, q.dtype, dev)
    T, H, K = q3.shape
    hv, V = v3.shape[1], v3.shape[2]
    if v3.shape[0] != T or k3.shape != q3.shape:
        raise ValueError(f"{op}: k must be q's shape and v have q's T, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if hv < H:
        raise NotImplementedError(f"{op}: cuDNN carries the KDA state at max(H, HV) heads, FlashInfer at HV; got "
                                  f"H={H} > HV={hv}")
    if hv % H:
        raise ValueError(f"{op}: HV must be a multiple of H, got H={H}, HV={hv}")
    _gate(op, "g", g3, (T, hv, K), _GATE, dev)
    _gate(op, "beta", b2, (T, hv), (torch.float32, q.dtype) if not beta_is_logit else _GATE, dev)
    if use_gate_in_kernel:
        _gate(op, "A_log", A_log, (hv,), _GATE, dev)
        _tensor("dt_bias", dt_bias)
        if dt_bias.numel() != hv * K:
            raise ValueError(f"{op}: dt_bias must be [HV * K] or [HV, K] = {hv * K} values, got "
                             f"{tuple(dt_bias.shape)}")
        _on("dt_bias", dt_bias, dev)
    n_seq = _cu(op, cu_seqlens, dev)
    _states(op, initial_state, output_state, n_seq, hv, V, K, dev)
    # initial_state is advanced in place without output_state: then it is written too
    _writes(op, output, output_state if output_state is not None else initial_state, initial_state,
            [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)],
            state_name="output_state" if output_state is not None else "initial_state")
    if output is not None:
        _output(op, output, out_shape, q.dtype, dev)
    _require_cuda(dev)
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()  # nothing can be read back then
    if g3.dtype == torch.float16 and not use_gate_in_kernel and not capturing:
        if bool((g3 < math.log(FP16_ALPHA_MIN)).any()):
            warnings.warn(f"{op}: float16 log gates with decay stronger than alpha = {FP16_ALPHA_MIN} a token can "
                          "overflow cuDNN's chunk-cumulative decay inverse; pass bfloat16 or float32 gates",
                          RuntimeWarning, stacklevel=2)
    if beta_is_logit and b2.dtype != q.dtype:
        b2 = b2.to(q.dtype)
    output = torch.empty(out_shape, dtype=q.dtype, device=dev) if output is None else output
    o3 = output[0] if output.dim() == 4 else output
    final = (_final(initial_state, output_state, (n_seq, hv, V, K), dev)
             if (output_final_state or output_state is not None or initial_state is not None) else None)
    _run(op, q3, k3, v3, g3, b2, cu_seqlens, o3, final, initial_state,
         a_log=A_log.float() if use_gate_in_kernel else None,
         dt_bias=dt_bias.float().reshape(hv, K) if use_gate_in_kernel else None,
         scale=1.0 / math.sqrt(K) if scale is None else float(scale), use_qk_l2norm=use_qk_l2norm_in_kernel,
         use_beta_sigmoid=beta_is_logit, safe_gate=use_gate_in_kernel, gate_lower_bound=lower_bound,
         batch_invariant=batch_invariant, gate_domain="log")
    if output_state is None and initial_state is not None:
        initial_state.copy_(final)
        final = initial_state
    return output, (final if output_final_state else None)


def _run(op, q, k, v, g, beta, cu_seqlens, o, final, initial_state, *, w=None, a_log=None, dt_bias=None,
         num_householder=None, scale, use_qk_l2norm, use_beta_sigmoid=False, safe_gate=False, gate_lower_bound=None,
         batch_invariant=False, gate_domain):
    bound = dict(q=q, k=k, v=v, g=g, beta=beta, w=w, cu_seqlens=cu_seqlens, a_log=a_log, dt_bias=dt_bias,
                 initial_state=initial_state, O=o, final_state=final)
    key = la.graph_key(op.replace("cudnn_", ""), bound, num_householder=num_householder, scale=scale,
                       use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, safe_gate=safe_gate,
                       gate_lower_bound=gate_lower_bound, batch_invariant=batch_invariant, gate_domain=gate_domain)
    la.run_graph(key, bound)
