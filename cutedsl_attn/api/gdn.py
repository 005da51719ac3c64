"""Gated delta rule (GDN) ops with FlashInfer's signatures: ``chunk_gated_delta_rule`` (prefill, here) and the
decode step (``gated_delta_rule_decode_pretranspose``, V-major state; ``gated_delta_rule_decode``, K-major state;
defined in :mod:`cutedsl_attn.api.gdn_decode`, re-exported here), and the tensor checks the delta-rule family's
ops share.

Conventions: q ``[T, Hq, K]``, k ``[T, Hk, K]``, v ``[T, Hv, V]``, packed varlen through ``cu_seqlens``;
``HO = max(Hq, Hv)`` heads for gates, state and output, contiguous grouping (GVA ``Hv > Hq = Hk`` or GQA
``Hq > Hk = Hv``); the state is V-major ``[N, HO, V, K]``; ``g`` is the linear forget gate alpha in [0, 1]
(``gate_domain="linear"``) or log alpha (``"log"``); ``o_t = scale * S_t q_t`` reads the state after token t.

Every check runs before any launch.  The value checks (alpha in [0, 1], ``cu_seqlens`` monotone,
``state_indices`` unique and in range) read device data: they cost one device-to-host copy (a stream sync)
per call, all checks batched into it, and are skipped while a CUDA graph is being captured (nothing can be
read back then).  Host (CPU) ``cu_seqlens`` / ``state_indices`` are checked without a sync.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..planning.gdn import (
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_HAS_INITIAL_STATE, FLAG_INITIAL_INDICES, FLAG_OUTPUT_INDICES, FLAG_WRITE_STATE,
    HEAD_DIMS, MAX_SEQS, GdnArgs, GdnProblem,
)
from ..dispatch import gdn_arch, gdn_launch
from ..dispatch.gdn import gdn_cp_segments, gdn_launch_cp
from ._common import check_bool

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_decode", "gated_delta_rule_decode_pretranspose"]

_IO_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_STATE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


# ---------------------------------------------------------------------------- checks
def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _on(name, t, device):
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (q's device), got {t.device}")


def _qkv(name, t, ndim_in, device, dtype):
    _tensor(name, t)
    if t.dim() != ndim_in:
        raise ValueError(f"{name} must have the rank of q ({ndim_in}), got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have q's dtype {dtype}, got {t.dtype}")
    _on(name, t, device)
    x = t[0] if ndim_in == 4 else t
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {tuple(t.stride())}")
    if any(s % 8 for s in x.stride()[:-1]) or x.data_ptr() % 16:
        raise ValueError(f"{name}: token and head strides must be multiples of 8 elements and the data 16-byte "
                         f"aligned, got strides {tuple(t.stride())}")
    return x


def _gate(name, t, T, ho, ndim_in, device):
    if t is None:
        return None
    _tensor(name, t)
    x = t[0] if (ndim_in == 4 and t.dim() == 3) else t
    if tuple(x.shape) != (T, ho):
        raise ValueError(f"{name} must be [T, HO] = [{T}, {ho}], got {tuple(t.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {x.dtype}")
    _on(name, x, device)
    if x.stride(-1) != 1:
        if ho > 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {tuple(x.stride())}")
        x = x.contiguous()  # [T, 1]: any stride is a view of the same column
    return x


def _state(name, t, ho, dv, dk, device, k_major=False):
    if t is None:
        return None
    _tensor(name, t)
    want = (ho, dk, dv) if k_major else (ho, dv, dk)
    if t.dim() != 4 or tuple(t.shape[1:]) != want:
        layout = "K-major [N, HO, K, V]" if k_major else "V-major [N, HO, V, K]"
        raise ValueError(f"{name} must be {layout} = [*, {', '.join(map(str, want))}], got {tuple(t.shape)}")
    if t.dtype not in _STATE_DTYPES:
        raise ValueError(f"{name} must be float32 or bfloat16, got {t.dtype}")
    _on(name, t, device)
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    return t


def _check_bool(op, **flags) -> None:
    """TypeError naming the flag unless each value is a bool (a string such as 'no' would read as True)."""
    for name, value in flags.items():
        check_bool(f"{op}: {name}", value)


def _check_backend(op, backend, flashinfer_only=()) -> None:
    """``backend`` in ``"auto"``, ``"cute"``, ``"cudnn"``; ``flashinfer_only``: FlashInfer's other names for the op."""
    if backend in flashinfer_only:
        raise NotImplementedError(f"{op}: FlashInfer's backend={backend!r} is not served here; served: 'auto', "
                                  "'cute' (this package's CuTe DSL kernel), 'cudnn'")
    if backend not in ("auto", "cute", "cudnn"):
        raise ValueError(f"{op}: backend must be 'auto', 'cute' or 'cudnn', got {backend!r}")


def _span(t):
    """``[lo, hi)``: the bytes a strided tensor can touch."""
    lo = hi = t.data_ptr()
    for n, st in zip(t.shape, t.stride()):
        if st >= 0:
            hi += (n - 1) * st * t.element_size()
        else:
            lo += (n - 1) * st * t.element_size()
    return lo, hi + t.element_size()


def _overlaps(a, b) -> bool:
    """Whether two tensors' memory ranges overlap (conservative for interleaved strided views)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _no_alias(op, written, read) -> None:
    """ValueError naming both when a tensor the kernel writes overlaps one it reads (CTAs race on it: each reads
    all of q_t / k_t while others write their V slices); ``written`` / ``read``: ``(name, tensor or None)``."""
    for wn, w in written:
        if w is None:
            continue
        _tensor(wn, w)
        for rn, r in read:
            if isinstance(r, torch.Tensor) and _overlaps(w, r):
                raise ValueError(f"{op}: {wn} must not overlap {rn} (the kernel reads {rn} while writing {wn}: "
                                 "a race, the result would be silently wrong); pass a separate buffer")


def _index_tensor(name, t, n, device):
    _tensor(name, t)
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor of {n} entries, got {t.dtype} {tuple(t.shape)}")
    if t.device.type != "cpu":
        _on(name, t, device)
    return t


def _value_checks(checks) -> None:
    """``checks``: (bad: bool tensor or bool, message); one read-back for all device tensors."""
    dev = [(b, m) for b, m in checks if isinstance(b, torch.Tensor) and b.device.type != "cpu"]
    host = [(bool(b), m) for b, m in checks if not (isinstance(b, torch.Tensor) and b.device.type != "cpu")]
    for bad, msg in host:
        if bad:
            raise ValueError(msg)
    if not dev:
        return
    if torch.cuda.is_current_stream_capturing():
        return  # nothing can be read back inside a capture
    flags = torch.stack([b.reshape(()) for b, _ in dev]).cpu().tolist()
    for bad, (_, msg) in zip(flags, dev):
        if bad:
            raise ValueError(msg)


def _unique_in_range(idx, pool_rows):
    if idx.numel() == 0:
        return False, False
    s = torch.sort(idx.to(torch.int64)).values
    dup = (s[1:] == s[:-1]).any() if idx.numel() > 1 else torch.zeros((), dtype=torch.bool, device=idx.device)
    return dup, (s[0] < 0) | (s[-1] >= pool_rows)


def _require_cuda(device):
    if device.type != "cuda":
        raise ValueError(f"q, k, v and every other tensor must be CUDA tensors, got {device}")


def _dummy(device, dtype, shape=(1,)):
    return torch.empty(shape, device=device, dtype=dtype)


def _problem(q, K, V, state_dtype, gate_domain, use_l2norm, decode=False, state_k_major=False, **family):
    """The :class:`GdnProblem`; ``family``: its delta-rule-family fields (``gate_per_channel``, ...)."""
    return GdnProblem(dtype=_IO_DTYPES[q.dtype], head_dim_k=K, head_dim_v=V, state_dtype=state_dtype,
                      gate_domain=gate_domain, use_qk_l2norm=bool(use_l2norm), decode=decode,
                      state_k_major=state_k_major, arch=gdn_arch(q.device), **family)


# ---------------------------------------------------------------------------- prefill
def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None, output_state=None,
                           state_checkpoints=None, checkpoint_cu_starts=None, checkpoint_every_n_tokens=0,
                           use_cp="auto", state_indices=None, _cp_chunk_len=None, backend="auto", max_seqlen=None, *,
                           gate_domain="linear"):
    """Gated delta rule prefill over packed variable-length sequences (FlashInfer 0.7.2 / 0.7.4 signature).

    Kernels (``backend="auto"`` / ``"cute"``): prefill runs a chunked kernel (the WY / UT form over 64-token
    chunks): on ``sm_90a`` the wgmma one (:mod:`cutedsl_attn.sm90.gdn_chunked`), elsewhere the portable one
    (:mod:`cutedsl_attn.portable.gdn_chunked`, ``mma.sync``, every arch; the two agree bit for bit).  Their
    tensor-core MMAs take the state rounded to 16 bits (q's dtype), so final states agree with a float64
    reference to about 5e-3 relative, the tolerance FlashInfer's tests allow (the state is accumulated in fp32;
    only its MMA operand copy is rounded).  The token-serial recurrent kernel serves the decode step
    (:func:`gated_delta_rule_decode_pretranspose`, :func:`gated_delta_rule_decode`) and the rest of the
    delta-rule family.  ``CUTEDSL_ATTN_GDN_KERNEL`` forces one for the problems of its family: ``auto`` (the
    default, as above), ``chunked`` (the portable chunked kernel), ``chunked_sm90`` (the SM90 chunked main
    kernel), ``fused_sm90`` (the SM90 fused prep + main kernel, opt-in), ``kda_chunked`` /
    ``kda_chunked_sm90`` (the portable / SM90 per-channel-decay chunked kernels of KDA / GDN-2) or
    ``recurrent`` (this prefill token by token on the recurrent kernel); a forced chunked kernel that cannot
    serve the problem raises NotImplementedError naming what it serves; see :mod:`cutedsl_attn.dispatch.gdn`.
    ``max_seqlen`` is checked and reaches neither kernel: both plan from ``cu_seqlens``.

    Context parallel (``use_cp``, FlashInfer's): few long sequences on few heads leave most SMs idle on one
    chain a (sequence, head), so each sequence is cut on the device into P segments of whole 64-token chunks
    (P from the shapes and the SM count: no sync, CUDA-graph safe); the chunked kernels' prep runs once, then
    their main kernel runs over the segments from the identity with ``U = 0`` and from zeros (each segment's
    transition ``M`` and offset ``B``: ``H_out = H_in M + B``), the segments are chained in float64, and the main
    kernel reruns them from their true starting states for the output; the final state is the chain's.  One prep
    and three main-kernel runs for a P-fold shorter serial chain; outputs and final states equal the plain
    launch's.  ``use_cp="auto"`` takes it for sequences of at least 512 chunks (32768 tokens) on average when
    ``N * HO * 2 < num_SMs`` and the split reaches at least 6 segments in one wave
    (:func:`cutedsl_attn.planning.gdn_cp.cp_num_segments`; measured 2.15x the plain launch at 1 x 65536 tokens,
    8 heads); True always; False never.

    Args:
        q: ``[T, Hq, K]`` (or ``[1, T, Hq, K]``) bfloat16 / float16 CUDA tensor, last dim contiguous, other
            strides multiples of 8 elements.
        k: ``[T, Hk, K]``, q's dtype and layout rules.
        v: ``[T, Hv, V]``; K and V are 64 or 128.
        g: ``[T, HO]`` float32 forget gate: alpha in [0, 1] (``gate_domain="linear"``) or log alpha
            (``"log"``); None = 1.
        beta: ``[T, HO]`` float32 write strength (post-sigmoid); None = 1.
        scale: query scale, a finite real (Python or numpy, not a bool); None or 0.0 = ``1 / sqrt(K)``.
        initial_state: ``[N, HO, V, K]`` float32 / bfloat16 V-major, read-only (a pool ``[P, HO, V, K]`` with
            ``state_indices``); None = zeros.
        output_final_state: return ``(output, final_state)``; the final state is written whenever
            ``output_state`` is given or this is True (this flag gates only what is returned).
        cu_seqlens: ``[N + 1]`` int32 / int64 offsets, 0 first and T last, non-decreasing (repeats: empty
            sequences, whose final state is their initial state); None = one sequence.
        use_qk_l2norm_in_kernel: l2-normalise q and k in the kernel (``x * rsqrt(sum x^2 + 1e-6)``, fp32).
        output: ``[T, HO, V]`` buffer (q's dtype, contiguous) to write; None = allocated.
        output_state: ``[N, HO, V, K]`` (pool ``[P, HO, V, K]`` with ``state_indices``) buffer of the
            initial state's dtype; None = allocated (initial state's dtype, float32 without one) when
            ``output_final_state``.  Must not overlap ``initial_state``, except the very same tensor with
            ``state_indices`` (an in-place pool update).
        state_checkpoints, checkpoint_cu_starts, checkpoint_every_n_tokens, _cp_chunk_len: not served.
        use_cp: ``"auto"`` (the rule above), True (context parallel, at least 2 segments a sequence) or False
            (never).
        state_indices: ``[N]`` int32 / int64 pool rows of each sequence's initial and final state, unique.
        backend: ``"auto"`` or ``"cute"`` (the CuTe DSL kernel), or ``"cudnn"`` (never chosen implicitly):
            :func:`cutedsl_attn.api.cudnn_linear.cudnn_chunk_gated_delta_rule`, which refuses state checkpoints,
            ``state_indices``, ``use_cp=True`` and ``_cp_chunk_len`` (NotImplementedError, before any call).
            FlashInfer's ``"flashinfer"`` and ``"cake_gdn"`` are not served (NotImplementedError).
        max_seqlen: None or an int (Python or numpy, not a bool) in ``[ceil(T / N), T]``; checked, unused (the
            kernels plan from ``cu_seqlens``).
        gate_domain: keyword-only, ``"linear"`` (FlashInfer) or ``"log"`` (fla).

    ``output`` and ``output_state`` must not overlap q, k, v, g, beta (nor ``output`` the states): the kernel
    reads those while writing these.

    Returns:
        ``output`` ``[T, HO, V]`` (``[1, T, HO, V]`` for 4-D q), or ``(output, final_state)``.

    Raises:
        TypeError: a tensor argument that is not a tensor; ``output_final_state`` /
            ``use_qk_l2norm_in_kernel`` not a bool.
        ValueError: bad shapes, dtypes, devices, layouts, head counts, ``cu_seqlens`` (missing with more than
            one sequence, not monotone), alpha outside [0, 1] with ``gate_domain="linear"``, overlapping
            states, ``output`` / ``output_state`` overlapping an input, duplicate or out-of-range
            ``state_indices``, ``output_final_state`` with ``state_indices`` but no ``output_state``, bad
            ``backend`` / ``use_cp`` / ``gate_domain`` / ``max_seqlen``, a ``scale`` that is not a finite real.
        NotImplementedError: head dims other than 64 / 128, ``use_cp=True`` with more than 32767 sequences, state
            checkpoints, ``_cp_chunk_len``, ``backend="flashinfer"`` / ``"cake_gdn"``.
    """
    op = "chunk_gated_delta_rule"
    _check_bool(op, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    _check_backend(op, backend, ("flashinfer", "cake_gdn"))
    if backend == "cudnn":
        return _cudnn_prefill(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                              use_qk_l2norm_in_kernel, output, output_state, state_checkpoints, checkpoint_cu_starts,
                              checkpoint_every_n_tokens, use_cp, state_indices, _cp_chunk_len, gate_domain)
    problem, args, result = _plan_prefill(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, output,
        output_state, state_checkpoints, checkpoint_cu_starts, checkpoint_every_n_tokens, use_cp, state_indices,
        _cp_chunk_len, backend, max_seqlen, gate_domain)
    if args is not None:
        segments = gdn_cp_segments(problem, args, use_cp, device_index=args.q.device.index)
        if segments > 1:
            gdn_launch_cp(problem, args, segments, device_index=args.q.device.index)
        else:
            gdn_launch(problem, args, device_index=args.q.device.index)
    return result


def _cudnn_prefill(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                   output, output_state, state_checkpoints, checkpoint_cu_starts, checkpoint_every_n_tokens, use_cp,
                   state_indices, _cp_chunk_len, gate_domain):
    """``backend="cudnn"``: cuDNN's ``gdn`` graph; the arguments its entry point lacks are refused first."""
    named = (("state_checkpoints", state_checkpoints), ("checkpoint_cu_starts", checkpoint_cu_starts),
             ("state_indices", state_indices), ("_cp_chunk_len", _cp_chunk_len))
    lacks = [name for name, val in named if val is not None]
    lacks += ["checkpoint_every_n_tokens"] if checkpoint_every_n_tokens else []
    lacks += ["use_cp=True"] if use_cp is True else []
    if lacks:
        raise NotImplementedError(f"chunk_gated_delta_rule: backend='cudnn' does not take {', '.join(lacks)} "
                                  "(cuDNN's GDN entry point has no state checkpoints, indexed state pools or "
                                  "context parallel)")
    if not (use_cp is False or use_cp == "auto"):  # 0 / "" would pass an equality test for False
        raise ValueError(f"use_cp must be 'auto', True or False, got {use_cp!r}")
    if gate_domain not in ("linear", "log"):
        raise ValueError(f"gate_domain must be 'linear' or 'log', got {gate_domain!r}")
    from .cudnn_linear import cudnn_chunk_gated_delta_rule
    nd = q.dim() if isinstance(q, torch.Tensor) else 3
    sq = [x[0] if (isinstance(x, torch.Tensor) and nd == 4 and x.dim() == 4) else x for x in (q, k, v)]
    gl = g[0] if (isinstance(g, torch.Tensor) and nd == 4 and g.dim() == 3) else g
    bl = beta[0] if (isinstance(beta, torch.Tensor) and nd == 4 and beta.dim() == 3) else beta
    if gl is not None and gate_domain == "log":
        gl = torch.exp(gl)  # cuDNN's GDN entry point takes FlashInfer's linear alpha
    o3 = output[0] if (isinstance(output, torch.Tensor) and output.dim() == 4) else output
    res = cudnn_chunk_gated_delta_rule(*sq, gl, bl, scale, initial_state, output_final_state, cu_seqlens,
                                       use_qk_l2norm_in_kernel, o3, output_state)
    out = res[0] if output_final_state else res
    out = output if output is not None else (out.unsqueeze(0) if nd == 4 else out)
    return (out, res[1]) if output_final_state else out


def _plan_prefill(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                  output, output_state, state_checkpoints, checkpoint_cu_starts, checkpoint_every_n_tokens, use_cp,
                  state_indices, _cp_chunk_len, backend, max_seqlen, gate_domain):
    """Every check, the allocations and the launch arguments of :func:`chunk_gated_delta_rule`:
    ``(problem, args, result)`` (``args`` None: nothing to launch)."""
    _check_backend("chunk_gated_delta_rule", backend, ("flashinfer", "cake_gdn"))
    if backend == "cudnn":
        raise ValueError("chunk_gated_delta_rule plans backend='auto' / 'cute' here; 'cudnn' has its own route")
    if not (use_cp is False or use_cp is True or use_cp == "auto"):  # 0 / "" / 1 would pass equality tests
        raise ValueError(f"use_cp must be 'auto', True or False, got {use_cp!r}")
    if state_checkpoints is not None or checkpoint_cu_starts is not None or checkpoint_every_n_tokens:
        raise NotImplementedError("chunk_gated_delta_rule: state checkpoints (state_checkpoints, "
                                  "checkpoint_cu_starts, checkpoint_every_n_tokens) are not served")
    if _cp_chunk_len is not None:
        raise NotImplementedError("chunk_gated_delta_rule: _cp_chunk_len is not served (the context-parallel "
                                  "path sizes its segments to the GPU; use_cp='auto' / True / False choose it)")
    if gate_domain not in ("linear", "log"):
        raise ValueError(f"gate_domain must be 'linear' or 'log', got {gate_domain!r}")
    _tensor("q", q)
    if q.dim() not in (3, 4) or (q.dim() == 4 and q.shape[0] != 1 and cu_seqlens is not None):
        raise ValueError(f"q must be [T, Hq, K] or [1, T, Hq, K] (packed varlen), got {tuple(q.shape)}")
    if q.dim() == 4 and q.shape[0] > 1:
        raise ValueError(f"cu_seqlens is required with more than one sequence (q has batch {q.shape[0]}); pack "
                         "the sequences as [T, H, K] with cu_seqlens")
    if q.dtype not in _IO_DTYPES:
        raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
    nd, dev = q.dim(), q.device
    q3 = _qkv("q", q, nd, dev, q.dtype)
    k3 = _qkv("k", k, nd, dev, q.dtype)
    v3 = _qkv("v", v, nd, dev, q.dtype)
    T, hq, K = q3.shape
    if k3.shape[0] != T or v3.shape[0] != T or k3.shape[2] != K:
        raise ValueError(f"q, k, v must share T and k the head dim of q: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    hk, hv, V = k3.shape[1], v3.shape[1], v3.shape[2]
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise NotImplementedError(f"chunk_gated_delta_rule: head dims K={K}, V={V} are not served; served: K, V "
                                  f"in {HEAD_DIMS}")
    if not ((hq == hk and hv % hq == 0) or (hk == hv and hq % hv == 0)):
        raise ValueError(f"head counts must be GVA (Hq == Hk, Hv a multiple of Hq) or GQA (Hk == Hv, Hq a "
                         f"multiple of Hv), got Hq={hq}, Hk={hk}, Hv={hv}")
    ho = max(hq, hv)
    g3 = _gate("g", g, T, ho, nd, dev)
    b3 = _gate("beta", beta, T, ho, nd, dev)

    n_seq, cu_dev = _cu_seqlens_arg(cu_seqlens, dev)
    if max_seqlen is not None:  # a Python or numpy int, not a bool
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or not (
                -(-T // n_seq) <= int(max_seqlen) <= max(T, 0) or T == 0):
            raise ValueError(f"max_seqlen must be an int in [ceil(T / N), T] = [{-(-T // n_seq)}, {T}], got "
                             f"{max_seqlen!r}")
    scale = _scale_arg(scale, K)
    h0, ht, write_state, state_dt = _states_arg(initial_state, output_state, output_final_state, state_indices,
                                                n_seq, ho, V, K, dev)
    _no_alias("chunk_gated_delta_rule", [("output", output), ("output_state", output_state)],
              [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)])
    _no_alias("chunk_gated_delta_rule", [("output", output)], [("initial_state", h0), ("output_state", output_state)])
    o3, output = _output_arg(output, nd, T, ho, V, q.dtype, dev)

    checks = []
    if g3 is not None and gate_domain == "linear":
        checks.append((((g3 < 0) | (g3 > 1) | torch.isnan(g3)).any(),
                       "g must be a linear-space alpha in [0, 1] with gate_domain='linear' (log-space gates need "
                       "gate_domain='log')"))
    elif g3 is not None:  # as GDN-2 and KDA check their log gates
        checks.append((((g3 > 0) | torch.isnan(g3)).any(),
                       "g must be a log-space decay <= 0 (not NaN) with gate_domain='log' (linear alphas need "
                       "gate_domain='linear')"))
    checks += _index_checks(cu_seqlens, T, state_indices, h0, ht)
    _value_checks(checks)
    _require_cuda(dev)

    if T == 0 or n_seq == 0:
        _empty_final_states(write_state, n_seq, state_indices, h0, ht)
        return None, None, ((output, ht) if output_final_state else output)

    if cu_dev is None:
        cu_dev = torch.tensor([0, T], device=dev, dtype=torch.int32)
    idx = None if state_indices is None else state_indices.to(device=dev, dtype=torch.int32, non_blocking=True)
    flags = ((FLAG_HAS_G if g3 is not None else 0) | (FLAG_HAS_BETA if b3 is not None else 0)
             | (FLAG_HAS_INITIAL_STATE if h0 is not None else 0) | (FLAG_WRITE_STATE if write_state else 0)
             | (FLAG_INITIAL_INDICES | FLAG_OUTPUT_INDICES if idx is not None else 0))
    problem = _problem(q, K, V, _STATE_DTYPES[state_dt], gate_domain, use_qk_l2norm_in_kernel)
    args = _prefill_args(q3, k3, v3, g3, b3, cu_dev, h0, ht, idx, o3, scale, hq, hk, hv, flags)
    return problem, args, ((output, ht) if output_final_state else output)


# ---------------------------------------------------------------------------- pieces shared by the family
def _cu_seqlens_arg(cu_seqlens, dev):
    """``(N, cu_seqlens as int32 on dev or None)``; shape / dtype / device checks (values: :func:`_index_checks`)."""
    if cu_seqlens is None:
        return 1, None
    _tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of N + 1 >= 2 offsets, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device.type != "cpu":
        _on("cu_seqlens", cu_seqlens, dev)
    n_seq = cu_seqlens.shape[0] - 1
    if n_seq > MAX_SEQS:
        raise ValueError(f"at most {MAX_SEQS} sequences a call, got {n_seq}")
    return n_seq, cu_seqlens.to(device=dev, dtype=torch.int32, non_blocking=True)


def _scale_arg(scale, K):
    """The query scale: None or 0 -> ``1 / sqrt(K)``, else a finite real (Python or numpy, not a bool); ValueError
    otherwise."""
    if isinstance(scale, bool) or not (scale is None or isinstance(scale, numbers.Real)) or (
            scale is not None and not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    return 1.0 / math.sqrt(K) if scale is None or scale == 0 else float(scale)


def _states_arg(initial_state, output_state, output_final_state, state_indices, n_seq, ho, V, K, dev):
    """``(h0, ht, write_state, state dtype)``: the checked states, ``ht`` allocated when a state is written."""
    h0 = _state("initial_state", initial_state, ho, V, K, dev)
    ht = _state("output_state", output_state, ho, V, K, dev)
    if state_indices is not None:
        _index_tensor("state_indices", state_indices, n_seq, dev)
        if h0 is None and ht is None:  # the indices would index nothing: refused, not ignored
            raise ValueError("state_indices needs initial_state or output_state (the pool its rows index)")
        if output_final_state and ht is None:
            raise ValueError("output_final_state with state_indices needs an explicit output_state (the pool)")
    for name, st in (("initial_state", h0), ("output_state", ht)):
        if st is not None and state_indices is None and st.shape[0] != n_seq:
            raise ValueError(f"{name} must have N = {n_seq} rows without state_indices, got {st.shape[0]}")
    if h0 is not None and ht is not None:
        if ht.dtype != h0.dtype:
            raise ValueError(f"output_state must have initial_state's dtype {h0.dtype}, got {ht.dtype}")
        in_place = ht is h0 and state_indices is not None
        if _overlaps(h0, ht) and not in_place:
            raise ValueError("output_state must not alias initial_state (only the very same tensor with "
                             "state_indices, an in-place pool update, may)")
    write_state = ht is not None or bool(output_final_state)
    state_dt = (h0 if h0 is not None else ht).dtype if (h0 is not None or ht is not None) else torch.float32
    if ht is None and write_state:
        ht = torch.empty(n_seq, ho, V, K, device=dev, dtype=state_dt)
    return h0, ht, write_state, state_dt


def _output_arg(output, nd, T, ho, V, dtype, dev):
    """``(output [T, HO, V] view, output as returned)``: the checked buffer, or a new one."""
    if output is not None:
        _tensor("output", output)
        o3 = output[0] if (nd == 4 and output.dim() == 4) else output
        if tuple(o3.shape) != (T, ho, V) or o3.dtype != dtype or not o3.is_contiguous():
            raise ValueError(f"output must be a contiguous [T, HO, V] = [{T}, {ho}, {V}] {dtype} tensor, got "
                             f"{output.dtype} {tuple(output.shape)}")
        _on("output", o3, dev)
        return o3, output
    o3 = torch.empty(T, ho, V, device=dev, dtype=dtype)
    return o3, (o3.unsqueeze(0) if nd == 4 else o3)


def _index_checks(cu_seqlens, T, state_indices, h0, ht) -> list:
    """The value checks of ``cu_seqlens`` and ``state_indices`` (for :func:`_value_checks`)."""
    checks = []
    if cu_seqlens is not None:
        c = cu_seqlens
        checks.append((((c[1:] < c[:-1]).any() | (c[0] != 0) | (c[-1] != T)),
                       f"cu_seqlens must be non-decreasing from 0 to T = {T}"))
    if state_indices is not None and (h0 is not None or ht is not None):
        pool = min(x.shape[0] for x in (h0, ht) if x is not None)
        dup, rng = _unique_in_range(state_indices, pool)
        checks.append((dup, "state_indices must be unique (two sequences would share a pool row)"))
        checks.append((rng, f"state_indices must be in [0, {pool}) (the pool's rows)"))
    return checks


def _empty_final_states(write_state, n_seq, state_indices, h0, ht) -> None:
    """Every sequence is empty: the final state is the initial one (zeros without one)."""
    if write_state and n_seq:
        for n in range(n_seq):
            r = n if state_indices is None else int(state_indices[n])
            if h0 is None:
                ht[r].zero_()
            elif ht is not h0:
                ht[r].copy_(h0[r])


def _prefill_args(q3, k3, v3, g3, b3, cu_dev, h0, ht, idx, o3, scale, hq, hk, hv, flags) -> GdnArgs:
    """The launch arguments, 1-element dummies for what is absent."""
    dev, (ho, V, K) = q3.device, o3.shape[1:] + q3.shape[2:]
    state_dt = (h0 if h0 is not None else ht).dtype if (h0 is not None or ht is not None) else torch.float32
    sdummy = None if (h0 is not None and ht is not None) else _dummy(dev, state_dt, (1, ho, V, K))
    return GdnArgs(
        q=q3, k=k3, v=v3,
        g=g3 if g3 is not None else _dummy(dev, torch.float32, (1, 1)),
        beta=b3 if b3 is not None else _dummy(dev, torch.float32, (1, 1)),
        cu_seqlens=cu_dev,
        initial_state=h0 if h0 is not None else sdummy,
        initial_state_indices=idx if idx is not None else _dummy(dev, torch.int32),
        output_state=ht if ht is not None else sdummy,
        output_state_indices=idx if idx is not None else _dummy(dev, torch.int32),
        output=o3, scale=float(scale), q_group=ho // hq, k_group=ho // hk, v_group=ho // hv, flags=flags)


# last: the decode step's module imports the checks above from this one (the package imports this one first)
from .gdn_decode import (  # noqa: E402,F401  (perf/bench_gdn.py plans decode through _cu_steps / _plan_in_place)
    _cu_steps, _plan_in_place, gated_delta_rule_decode, gated_delta_rule_decode_pretranspose,
)
