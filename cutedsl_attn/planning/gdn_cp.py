"""Context-parallel (split-sequence) plan of GDN prefill: segments, their count, and the affine chaining.

A run of the delta rule over a segment is affine in the state it starts from.  In this package's V-major form
(``H [V, K]``, ``H_t = a_t H_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T``)::

    H_out = H_in M + B,    M = prod_t a_t (I - b_t k_t k_t^T)  (K x K, in token order),
                           B = the segment's final state from a zero state  (V x K)

so the segments of one sequence can run at once from known states (``M`` from the identity with ``v = 0``,
``B`` from zeros), then be chained (``H_in`` of segment ``j`` = ``H_out`` of ``j - 1``), then rerun from their
true starting states for the outputs.  Segments start on chunk (64-token) boundaries of their sequence, so each
segment's chunking is the whole sequence's.

Pure Python and torch (imported lazily, as :func:`cutedsl_attn.planning.gdn.plan_chunks` does); every tensor
is built on the device of its input, from shapes only (no host read-back: CUDA-graph safe).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from .gdn import CHUNK, MAX_SEQS

#: a context-parallel segment spans at least this many chunks (shorter ones spend more on the extra runs than
#: they gain on the state chain)
CP_MIN_SEGMENT_CHUNKS = 16
#: at most this many segments a sequence
CP_MAX_SEGMENTS = 64
#: whether ``use_cp="auto"`` may take the path: on, the shared-prep path (one prep, three main-kernel runs) measured
#: 2.15x the plain launch at 1 x 65536 tokens, 8 heads (perf/RESULTS.md, "Gated delta rule family")
CP_AUTO = True
#: ``use_cp="auto"`` splits only sequences of at least this many chunks on average (32768 tokens): the path's fixed
#: cost (the chain, fills and copies, ~0.1-0.2 ms) was measured only against a 1024-chunk sequence
CP_AUTO_MIN_CHUNKS = 512
#: main-kernel runs of the path over all the tokens (transition, offset, outputs), the prep shared by them
CP_RUNS = 3


class MainRun(enum.Enum):
    """What a main-only launch of a chunked GDN kernel computes from a prep it shares with other launches (the
    prep over the sequences' chunks is the prep of every segment: segments start on chunk boundaries).

    ``OUTPUT``: the outputs and, by the flags, the final state (the plain launch's main kernel); ``STATE``: the
    final state only (no q / Aqk reads, no outputs): the offset ``B`` from zeros; ``TRANSITION``: the final
    state with ``U = 0`` (``v = 0``; no U reads, no outputs) from the identity: the transition ``M``, a ``K x K``
    state (the main problem's ``head_dim_v`` is K).
    """

    OUTPUT = "output"
    STATE = "state"
    TRANSITION = "transition"


@dataclass(frozen=True)
class MainConfig:
    """The compile key of a chunked GDN kernel's main-only entry (its ``compile_main``): ``MainConfig(config,
    run)``, the main kernel of ``config`` computing what ``run`` names (:class:`MainRun`: the outputs, the final
    state only, or the final state with ``U = 0``).  Each kernel with that entry subclasses it, naming its
    ``Config`` class (``CONFIG``) and its ``NAME`` (``KERNEL``, for the message); the subclass's module and name
    are part of the compile-cache key.

    Raises TypeError for a ``config`` other than the kernel's ``Config`` or a ``run`` that is not a MainRun.
    """

    config: object
    run: MainRun = MainRun.OUTPUT
    CONFIG: ClassVar[type] = object
    KERNEL: ClassVar[str] = ""

    def __post_init__(self):
        if not isinstance(self.config, self.CONFIG):
            raise TypeError(f"config must be a {self.KERNEL} Config, got {type(self.config).__name__}")
        if not isinstance(self.run, MainRun):
            raise TypeError(f"run must be a MainRun, got {self.run!r}")

    @property
    def arch(self) -> str:
        return self.config.arch


def main_run_args(run: MainRun, args, scratch: tuple, head_dim_v: int) -> tuple:
    """``(args, scratch)`` as a main-only launch of ``run`` hands them to its compiled function (tensors of the
    shapes the main problem declares, its ``head_dim_v`` K for the transition run).  The state-only runs
    (``STATE``, ``TRANSITION``) get a ``[1, HO, head_dim_v]`` output (never written) instead of ``args.output``;
    ``TRANSITION`` also k in place of v and ``W`` in place of ``U`` (never read).  ``args``: a
    :class:`~cutedsl_attn.planning.gdn.GdnArgs`; ``scratch``: ``(chunks, chunk_offsets, W, U, Aqk, F)``.
    """
    if run is MainRun.OUTPUT:
        return args, scratch
    args = args._replace(output=args.output.new_empty(1, args.output.shape[1], head_dim_v))
    if run is MainRun.TRANSITION:
        chunks, chunk_off, w, _, aqk, f = scratch
        args, scratch = args._replace(v=args.k), (chunks, chunk_off, w, w, aqk, f)
    return args, scratch


def cp_segment_offsets(cu_seqlens, segments: int, chunk: int = CHUNK):
    """The offsets of the ``N * segments`` segments of the context-parallel path, on ``cu_seqlens``' device.

    ``cu_seqlens``: int ``[N + 1]`` token offsets (device or host); ``segments`` = P >= 1.  Sequence ``n`` of
    ``C_n = ceil(len_n / chunk)`` chunks is cut into P runs of whole chunks, segment ``j`` starting at chunk
    ``floor(j C_n / P)`` (balanced to one chunk; segments of a sequence shorter than P chunks may be empty).
    Returns int32 ``[N P + 1]``: segment ``n P + j`` is tokens ``[out[n P + j], out[n P + j + 1])``, so every
    segment but the last of its sequence is a multiple of ``chunk`` tokens and the segments tile the tokens in
    order.

    Raises ValueError for ``segments`` < 1 or ``cu_seqlens`` not 1-D with at least 2 entries.
    """
    import torch

    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be an int >= 1, got {segments!r}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1], got {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    n_chunks = (lens + chunk - 1) // chunk
    j = torch.arange(segments, dtype=torch.int64, device=cu.device)
    first_chunk = (j[None, :] * n_chunks[:, None]) // segments  # [N, P]
    starts = cu[:-1, None] + torch.minimum(first_chunk * chunk, lens[:, None])
    return torch.cat([starts.reshape(-1), cu[-1:]]).to(torch.int32)


def cp_num_segments(n_seq: int, heads: int, total_tokens: int, *, num_sms: int, ctas_of_chains, runs: int,
                    forced: bool) -> int:
    """Segments a sequence (P) of the context-parallel path; 1: the plain launch.

    ``n_seq`` N, ``heads`` HO, ``total_tokens`` T (host-known shapes: the lengths are not read back);
    ``ctas_of_chains(chains)``: the CTAs a launch of that many (sequence, head) chains takes (its V-slices);
    ``runs``: main-kernel runs the path makes over all the tokens (:data:`CP_RUNS`).  P is the largest count
    whose launch fits one wave (``ctas_of_chains(N P HO) <= num_sms``), at most :data:`CP_MAX_SEGMENTS`, the
    average sequence giving each segment :data:`CP_MIN_SEGMENT_CHUNKS` chunks.
    Unforced (``use_cp="auto"``): 1 while :data:`CP_AUTO` is off or the average sequence is shorter than
    :data:`CP_AUTO_MIN_CHUNKS` chunks; else FlashInfer's SM90 rule first (``N HO 2 < num_sms``), then P must
    be at least twice ``runs``, else 1: the plain launch is the prep plus one chain of
    ``L`` chunks, the path the same prep plus ``runs`` chains of ``L / P`` chunks side by side in one wave (and
    a float64 chain of P small matmuls), so it wins once ``runs / P`` times the wider tiles' cost a chunk (up to
    ~1.6x) is below 1.
    ``forced`` (``use_cp=True``): at least 2 segments, whatever the sizes.

    Raises NotImplementedError when ``forced`` and 2 segments a sequence exceed the launch's sequence limit.
    """
    if forced and 2 * n_seq > MAX_SEQS:
        raise NotImplementedError(f"use_cp=True: {n_seq} sequences split in two exceed the {MAX_SEQS} sequences a "
                                  "launch serves")
    avg_chunks = total_tokens // max(n_seq, 1) // CHUNK
    if not forced and not (CP_AUTO and n_seq * heads * 2 < num_sms and avg_chunks >= CP_AUTO_MIN_CHUNKS):
        return 1
    cap = min(CP_MAX_SEGMENTS, MAX_SEQS // max(n_seq, 1), max(avg_chunks // CP_MIN_SEGMENT_CHUNKS, 1))
    best = 1
    for p in range(2, cap + 1):
        if ctas_of_chains(n_seq * p * heads) <= num_sms:
            best = p
    if forced:
        return max(best, 2)
    # twice the runs: a segment's chunk costs up to ~1.6x more on the wider tiles the split's chains take
    return best if best >= 2 * runs else 1


def cp_chain(h0, transition, offset):
    """Chain the segments: the state each segment starts from, and each sequence's final state, in float64.

    ``h0`` ``[N, HO, V, K]`` (any float dtype, the sequences' initial states); ``transition`` ``[N, P, HO, K, K]``
    (``M``) and ``offset`` ``[N, P, HO, V, K]`` (``B``) of each segment.  Returns ``(starts, final)``:
    ``starts`` float64 ``[N, P, HO, V, K]`` (``starts[:, 0] = h0``, ``starts[:, j] = starts[:, j-1] M_{j-1} +
    B_{j-1}``; a view of a segment-major buffer) and ``final`` float64 ``[N, HO, V, K]`` (the last segment's
    end state).  P batched ``baddbmm`` into one buffer (few small kernels: the chain sits between two kernel
    runs); float64 so no TF32 setting can round the chain.
    """
    import torch

    N, P, HO, V, K = offset.shape
    f64 = torch.float64
    m = torch.empty(P, N, HO, K, K, device=offset.device, dtype=f64)
    m.copy_(transition.transpose(0, 1))
    b = torch.empty(P, N, HO, V, K, device=offset.device, dtype=f64)
    b.copy_(offset.transpose(0, 1))
    m, b = m.view(P, N * HO, K, K), b.view(P, N * HO, V, K)
    s = torch.empty(P + 1, N * HO, V, K, device=offset.device, dtype=f64)
    s[0].view(N, HO, V, K).copy_(h0)
    for j in range(P):
        torch.baddbmm(b[j], s[j], m[j], out=s[j + 1])
    return s[:P].view(P, N, HO, V, K).transpose(0, 1), s[P].view(N, HO, V, K)
