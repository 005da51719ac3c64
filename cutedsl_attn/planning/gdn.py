"""Host-side problem and launch arguments of the gated delta rule (GDN) kernels.

Pure Python; imports nothing above it.  A GDN launch covers ``N`` sequences packed end to end (``cu_seqlens``),
``HO = max(Hq, Hv)`` output heads with contiguous grouping, and a V-major fp32 / bf16 state ``[*, HO, V, K]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

DTYPES = ("bfloat16", "float16")
STATE_DTYPES = ("float32", "bfloat16")
GATE_DOMAINS = ("linear", "log")
HEAD_DIMS = (64, 128)
ARCHS = ("sm_90a", "sm_100a", "sm_103a")

# bits of GdnArgs.flags (run-time choices: one compiled kernel serves every combination)
FLAG_HAS_G = 1  # g given (else alpha = 1)
FLAG_HAS_BETA = 2  # beta given (else beta = 1)
FLAG_HAS_INITIAL_STATE = 4  # read initial_state (else zeros)
FLAG_WRITE_STATE = 8  # write the final state to output_state
FLAG_INITIAL_INDICES = 16  # initial_state row of sequence n is initial_state_indices[n] (else n)
FLAG_OUTPUT_INDICES = 32  # output_state row of sequence n is output_state_indices[n] (else n)

MAX_SEQS = 65535  # grid.y of the recurrent kernel
MAX_HOUSEHOLDER = 8


@dataclass(frozen=True)
class GdnProblem:
    """What a GDN caller fixes (the problem half of a GDN kernel's config and compile key).

    ``dtype`` of q / k / v / output (``"bfloat16"`` / ``"float16"``); ``head_dim_k`` / ``head_dim_v`` in
    :data:`HEAD_DIMS`; ``state_dtype`` of the initial and final state (``"float32"`` / ``"bfloat16"``, math is
    fp32 either way); ``gate_domain`` of ``g`` (``"linear"``: alpha, ``"log"``: log alpha);
    ``use_qk_l2norm`` fuses ``x * rsqrt(sum x^2 + 1e-6)`` on q and k; ``decode``: a few tokens a sequence (the
    decode step), which the kernels' defaults size for; ``state_k_major``: the state is ``[*, HO, K, V]``
    instead of V-major ``[*, HO, V, K]``; ``arch`` the compile target.
    The rest of the delta-rule family: ``gate_per_channel``: ``g`` is ``[T, HO, K]``, a decay per key channel
    (GDN-2, KDA); ``erase_write_gates``: ``beta`` is ``[T, HO, K + V]``, an erase gate per key channel then a
    write gate per value channel (GDN-2; needs ``gate_per_channel``); ``num_householder`` ``n`` updates a token
    on the expanded timeline (Gated DeltaProduct: k / v / beta ``[T n, ...]``, the gate on the first update, the
    readout after the last; scalar gates only).  Token and
    sequence counts, head counts and their grouping (GVA / GQA ratios), strides, the scale and which optional
    tensors are present are run-time arguments (:class:`GdnArgs`).

    Raises:
        TypeError: a field of the wrong type (the problem is a cache key: no 128.0 for 128).
        ValueError: a value outside the lists above.
    """

    dtype: str
    head_dim_k: int
    head_dim_v: int
    state_dtype: str = "float32"
    gate_domain: str = "linear"
    use_qk_l2norm: bool = False
    decode: bool = False
    state_k_major: bool = False
    arch: str = "sm_90a"
    gate_per_channel: bool = False
    erase_write_gates: bool = False
    num_householder: int = 1

    def __post_init__(self):
        for name in ("head_dim_k", "head_dim_v"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        for name in ("use_qk_l2norm", "decode", "state_k_major", "gate_per_channel", "erase_write_gates"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.head_dim_k not in HEAD_DIMS or self.head_dim_v not in HEAD_DIMS:
            raise ValueError(f"head_dim_k and head_dim_v must be in {HEAD_DIMS}, got "
                             f"{self.head_dim_k}/{self.head_dim_v}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}")
        if self.gate_domain not in GATE_DOMAINS:
            raise ValueError(f"gate_domain must be one of {GATE_DOMAINS}, got {self.gate_domain!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        n = self.num_householder
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_HOUSEHOLDER:
            raise ValueError(f"num_householder must be an int in [1, {MAX_HOUSEHOLDER}], got {n!r}")
        if self.erase_write_gates and not self.gate_per_channel:
            raise ValueError("erase_write_gates (GDN-2) needs gate_per_channel")
        if n > 1 and (self.gate_per_channel or self.erase_write_gates):
            raise ValueError("num_householder > 1 (Gated DeltaProduct) takes scalar gates only")


class GdnArgs(NamedTuple):
    """One GDN launch's tensors and scalars (the kernel's ``launch`` orders them).

    ``q`` ``[T, Hq, K]``, ``k`` ``[T, Hk, K]``, ``v`` ``[T, Hv, V]`` (16-bit, last dim contiguous, other strides
    multiples of 8 elements; k / v ``[T n, ...]`` with ``num_householder`` n); ``g`` / ``beta`` fp32 ``[T, HO]``
    (last dim contiguous; 1-element dummies when absent; ``g`` contiguous ``[T, HO, K]`` with
    ``gate_per_channel``, ``beta`` contiguous ``[T, HO, K + V]`` with ``erase_write_gates``, ``[T n, HO]``
    with n updates a token); ``cu_seqlens`` int32 ``[N + 1]``; ``initial_state`` ``[P, HO, V, K]`` and ``output_state``
    ``[P', HO, V, K]`` (``[*, HO, K, V]`` when ``state_k_major``) contiguous, ``state_dtype`` (dummies when
    absent; the same tensor for an in-place pool update); ``initial_state_indices`` / ``output_state_indices``
    int32 ``[N]`` pool rows (dummies when absent);
    ``output`` ``[T, HO, V]`` contiguous (written); ``scale`` the query scale; ``q_group`` / ``k_group`` /
    ``v_group`` = ``HO // Hq``, ``HO // Hk``, ``HO // Hv``; ``flags`` the ``FLAG_*`` bits.
    """

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    cu_seqlens: Any
    initial_state: Any
    initial_state_indices: Any
    output_state: Any
    output_state_indices: Any
    output: Any
    scale: float
    q_group: int
    k_group: int
    v_group: int
    flags: int


CHUNK = 64  # tokens a chunk of the chunked kernels


def plan_chunks(cu_seqlens, total_tokens: int, chunk: int = CHUNK):
    """The chunk tables of a chunked GDN launch, built on ``cu_seqlens``' device without a host read-back (CUDA-graph
    safe; the sizes come from shapes only).

    ``cu_seqlens``: int32 ``[N + 1]`` (device), ``total_tokens`` = T.  Returns ``(chunks, chunk_offsets)``:
    ``chunks`` int32 ``[T // chunk + N, 4]``, row ``c`` = (sequence, first token, tokens in the chunk, 0), the
    rows past the real chunk count with 0 tokens (their CTAs exit); ``chunk_offsets`` int32 ``[N + 1]``: the
    chunks of sequence ``n`` are rows ``chunk_offsets[n] .. chunk_offsets[n + 1]``, in token order.
    ``T // chunk + N`` bounds ``sum ceil(len_n / chunk)`` for any split of T tokens into N sequences.
    """
    import torch

    cu = cu_seqlens.to(torch.int64)
    n = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=cu.device)
    torch.cumsum((lens + chunk - 1) // chunk, 0, out=offsets[1:])
    n_rows = total_tokens // chunk + n
    cid = torch.arange(n_rows, dtype=torch.int64, device=cu.device)
    seq = torch.searchsorted(offsets[1:], cid, right=True).clamp_(max=max(n - 1, 0))
    tok0 = cu[seq] + (cid - offsets[seq]) * chunk
    ntok = (cu[seq + 1] - tok0).clamp_(0, chunk)
    ntok = torch.where(cid < offsets[n], ntok, torch.zeros_like(ntok))
    chunks = torch.stack([seq, tok0, ntok, torch.zeros_like(ntok)], 1).to(torch.int32)
    return chunks, offsets.to(torch.int32)


def plan_sequences(chunk_offsets):
    """The work order of a persistent chunked GDN main kernel, built on ``chunk_offsets``' device without a host
    read-back (CUDA-graph safe): the sequence ids sorted by chunk count, longest first (stable: ties keep id
    order).  The kernel's work items are (sequence, output head, V-slice); item position ``p`` of the sorted
    order is sequence ``order[p // per_seq]`` and its item ``p % per_seq`` (= ``ho num_vb + vb``), so the heads
    and V-slices of one sequence stay adjacent, run side by side and share its q / k rows in L2.  The CTAs deal
    the positions among themselves in snake order (:func:`persistent_walk`).

    ``chunk_offsets``: int ``[N + 1]`` (:func:`plan_chunks`' second table).  Returns int32 ``[N]``.
    """
    import torch

    return torch.argsort(chunk_offsets[1:] - chunk_offsets[:-1], descending=True, stable=True).to(torch.int32)


def persistent_walk(num_items: int, grid: int, cta: int) -> list[int]:
    """The positions (into :func:`plan_sequences`' item order) CTA ``cta`` of a persistent grid of ``grid`` CTAs
    walks, as the kernel computes them: round ``r`` deals positions ``r grid .. r grid + grid - 1`` to CTAs
    ``0 .. grid - 1``, reversed when ``r`` is odd (the CTA that took a round's shortest item takes the next
    round's longest), so each CTA walks its items longest first and every position is walked once.  A static
    deal, not an atomic counter: no counter to reset every launch (CUDA-graph replay) and no hand-over of a
    claimed item from the producer warpgroup to the consumer warpgroups, which each compute their walk.

    Raises ValueError unless ``0 <= cta < grid <= num_items``.
    """
    if not 0 <= cta < grid <= num_items:
        raise ValueError(f"need 0 <= cta < grid <= num_items, got cta {cta}, grid {grid}, num_items {num_items}")
    full, m = divmod(num_items, grid)
    last = cta < m if full % 2 == 0 else grid - 1 - cta < m
    return [r * grid + (grid - 1 - cta if r % 2 else cta) for r in range(full + int(last))]


def chunked_launch_tensors(args: GdnArgs, head_dim_k: int, head_dim_v: int) -> tuple:
    """``(chunks, chunk_offsets, W, U, Aqk, F)`` of a chunked GDN launch: :func:`plan_chunks` on the device and
    the prep kernel's scratch (``W`` / ``U`` / ``Aqk`` ``[chunks, HO, CHUNK, K / V / CHUNK]`` in q's dtype, the
    fp32 row factors ``F`` ``[chunks, HO, 3, CHUNK]``: about ``(2 K + 2 V + 2 CHUNK + 12) CHUNK`` bytes a chunk
    and head), allocated on torch's current stream."""
    import torch

    chunks, chunk_off = plan_chunks(args.cu_seqlens, args.q.shape[0])
    nc, ho = chunks.shape[0], args.output.shape[1]
    kw = dict(device=args.q.device, dtype=args.q.dtype)
    w = torch.empty(nc, ho, CHUNK, head_dim_k, **kw)
    u = torch.empty(nc, ho, CHUNK, head_dim_v, **kw)
    aqk = torch.empty(nc, ho, CHUNK, CHUNK, **kw)
    f = torch.empty(nc, ho, 3, CHUNK, device=args.q.device, dtype=torch.float32)
    return chunks, chunk_off, w, u, aqk, f


def kda_chunked_launch_tensors(args: GdnArgs, problem: GdnProblem) -> tuple:
    """``(chunks, chunk_offsets, Qg, Kd, W, U, Aqk, F)`` of a per-channel (KDA / GDN-2) chunked launch: the chunk
    plan (:func:`plan_chunks`, on the device, no host sync) and the prep kernel's scratch on torch's current
    stream: Qg / Kd ``[T, HO, K]``, W / U / Aqk ``[chunks, HO, CHUNK, K / V / CHUNK]`` (q's dtype), F
    ``[chunks, HO, 2 CHUNK + K]`` fp32 -- about ``(4 K + 2 V + 2 CHUNK + 8) CHUNK + 4 K`` bytes a chunk and head.

    Raises ValueError when g / beta do not have the per-channel shapes (:class:`GdnArgs`).
    """
    import torch

    T, ho, K, V = args.q.shape[0], args.output.shape[1], problem.head_dim_k, problem.head_dim_v
    if args.flags & FLAG_HAS_G and (tuple(args.g.shape) != (T, ho, K) or not args.g.is_contiguous()):
        raise ValueError(f"g must be a contiguous [T, HO, K] = [{T}, {ho}, {K}] fp32 tensor, got "
                         f"{tuple(args.g.shape)}")
    want_b = (T, ho, K + V) if problem.erase_write_gates else (T, ho)
    if tuple(args.beta.shape) != want_b or not args.beta.is_contiguous():
        raise ValueError(f"beta must be a contiguous {list(want_b)} fp32 tensor, got {tuple(args.beta.shape)}")
    chunks, chunk_off = plan_chunks(args.cu_seqlens, T)
    nc = chunks.shape[0]
    kw = dict(device=args.q.device, dtype=args.q.dtype)
    qg = torch.empty(T, ho, K, **kw)
    kd = torch.empty(T, ho, K, **kw)
    w = torch.empty(nc, ho, CHUNK, K, **kw)
    u = torch.empty(nc, ho, CHUNK, V, **kw)
    aqk = torch.empty(nc, ho, CHUNK, CHUNK, **kw)
    f = torch.empty(nc, ho, 2 * CHUNK + K, device=args.q.device, dtype=torch.float32)
    return chunks, chunk_off, qg, kd, w, u, aqk, f
