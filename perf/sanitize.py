"""Run compute-sanitizer's memcheck, racecheck and synccheck over one small problem of every kernel (GPU).

    python perf/sanitize.py                       # every case x every tool, a table, exit 1 on an unexpected error
    python perf/sanitize.py --cases sm90 --tools racecheck --log-dir /tmp/san   # a subset; full logs kept
    python perf/sanitize.py --child prefill_sm90_ragged_causal                 # one case, no sanitizer

Each case builds its problem through the public API only (``cutedsl_attn.BatchPrefillWithRaggedKVCacheWrapper``
and friends), so the sweep does not depend on the package's internals; the portable prefill kernel is selected
with ``CUTEDSL_ATTN_PREFILL_KERNEL=portable``.  Every (case, tool) pair runs in its own process
(``compute-sanitizer --tool TOOL python3 perf/sanitize.py --child CASE``), after one plain run of the case that
fills the compile cache (so the sanitized processes load kernels instead of compiling them) and lists the CUDA
kernels it launched.  A tool's count is its "ERROR SUMMARY: N errors" (racecheck: "RACECHECK SUMMARY: N hazards")
less the reports that :data:`SUPPRESSIONS` explain in full (a racecheck report lists one or more access pairs; it is
suppressed only when every pair is matched).  The racecheck suppressions name instruction offsets of one build of
the kernel: a change to the kernel moves them, the reports count again, and the offsets are re-derived from the
SASS (``cutedsl_attn.inspect.sass``).  A child ran when it printed ``CHILD OK`` (see :func:`run_ok`).  A new kernel
joins the sweep with a case in :data:`CASES`; a case's own sanitizer options go in ``Case.sanitizer_args``.

compute-sanitizer comes from a CUDA toolkit or from the ``sanitize`` extra (``pip install -e ".[sanitize]"``).
Exit status: 0 when every count is 0 and every child ran; 1 otherwise; 2 for bad options or no compute-sanitizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

TOOLS = ("memcheck", "racecheck", "synccheck")

# One small problem per kernel path: 2 requests of 64 queries over 128 keys, 8 query / 8 kv heads, head_dim 128,
# bf16 (the shape racecheck first reported hazards on), paged with 16-token pages in a shuffled pool.
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 8, 128, 16
QO_LENS, KV_LENS = (64, 64), (128, 128)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kernel: str  # what the case exercises, for the table
    run: str  # name of the function below that builds and runs it
    env: tuple = ()  # (name, value) pairs set for the child
    optional: bool = False  # a missing dependency (cuDNN frontend) reports "n/a" instead of a failure
    sanitizer_args: tuple = ()  # (tool, (option, ...)) pairs: extra compute-sanitizer options of this case


CASES = (
    Case("decode_paged", "paged decode", "_decode_paged"),
    Case("decode_paged_split", "paged decode, split-KV + merge", "_decode_paged_split"),
    Case("prefill_sm90_ragged_causal", "SM90 prefill", "_prefill_ragged_causal"),
    Case("prefill_sm90_ragged", "SM90 prefill", "_prefill_ragged"),
    Case("prefill_sm90_paged_causal", "SM90 prefill", "_prefill_paged_causal"),
    Case("prefill_portable_ragged_causal", "portable prefill", "_prefill_ragged_causal",
         env=(("CUTEDSL_ATTN_PREFILL_KERNEL", "portable"),)),
    Case("prefill_portable_paged_causal", "portable prefill", "_prefill_paged_causal",
         env=(("CUTEDSL_ATTN_PREFILL_KERNEL", "portable"),)),
    # cuDNN's kernel uses more cuda::barrier objects than synccheck detects on its own ("Detected overflow of
    # tracked cuda::barrier structures ... Try using --num-cuda-barriers"), and then fails its launch
    Case("prefill_cudnn_ragged_causal", "cuDNN prefill", "_prefill_cudnn_ragged_causal", optional=True,
         sanitizer_args=(("synccheck", ("--num-cuda-barriers", "64")),)),
    Case("decode_paged_fp8", "paged decode, fp8 e4m3 cache", "_decode_paged_fp8"),
    # fp8 caches are served by the portable prefill kernel only (dispatch picks it on every arch)
    Case("prefill_portable_multirow_fp8", "portable prefill, fp8 e4m3 cache (trtllm q_len_per_req 4)",
         "_prefill_multirow_fp8"),
    # GDN prefill runs the chunked kernel by default: the recurrent one is forced here to keep it in the sweep
    Case("gdn_prefill", "gated delta rule (recurrent)", "_gdn_prefill",
         env=(("CUTEDSL_ATTN_GDN_KERNEL", "recurrent"),)),
    # on sm_90a the chunked GDN runs the SM90 wgmma prep (prep=1) and the wgmma main kernel; the portable twin is
    # forced in the next case, the shared mma.sync prep in gdn_prefill_sm90_prep0
    Case("gdn_prefill_chunked", "gated delta rule (chunked: prep + main kernel)", "_gdn_prefill_chunked"),
    Case("gdn_prefill_chunked_portable", "gated delta rule (chunked, portable main kernel)", "_gdn_prefill_chunked",
         env=(("CUTEDSL_ATTN_GDN_KERNEL", "chunked"),)),
    # the SM90 chunked GDN's tuning variants: a persistent grid of 2 CTAs (each walks 16 (V-slice, head, sequence)
    # items on one ring, an empty sequence's among them), TMA loads, the shared mma.sync prep
    Case("gdn_prefill_sm90_persistent", "gated delta rule (SM90 chunked, persistent grid of 2 CTAs)",
         "_gdn_prefill_varlen", env=(("CUTEDSL_ATTN_GDN_TUNE", "persistent=2"),)),
    Case("gdn_prefill_sm90_tma", "gated delta rule (SM90 chunked, TMA loads)", "_gdn_prefill_chunked",
         env=(("CUTEDSL_ATTN_GDN_TUNE", "tma=1"),)),
    Case("gdn_prefill_sm90_prep0", "gated delta rule (SM90 chunked main kernel, shared mma.sync prep)",
         "_gdn_prefill_chunked", env=(("CUTEDSL_ATTN_GDN_TUNE", "prep=0"),)),
    Case("kda_prefill", "KDA (chunked, per-channel decay: prep + main kernel)", "_kda_prefill"),
    Case("kda_prefill_recurrent", "KDA (recurrent, per-channel decay)", "_kda_prefill",
         env=(("CUTEDSL_ATTN_GDN_KERNEL", "recurrent"),)),
    Case("kda_prefill_sm90", "KDA (chunked: per-channel prep + SM90 wgmma main kernel)", "_kda_prefill",
         env=(("CUTEDSL_ATTN_GDN_KERNEL", "kda_chunked_sm90"),)),
    Case("kda_prefill_sm90_tma", "KDA (chunked: per-channel prep + SM90 wgmma main kernel, TMA loads)",
         "_kda_prefill", env=(("CUTEDSL_ATTN_GDN_KERNEL", "kda_chunked_sm90"), ("CUTEDSL_ATTN_GDN_TUNE", "tma=1"))),
    # GDN-2 runs the per-channel kernels (on sm_90a the SM90 one); Gated DeltaProduct (n = 2) the SM90 chunked GDN
    # kernel on its native rows by default (Config.expand_rows), the expansion forced in the next case
    Case("gdn2_prefill", "GDN-2 (chunked: per-channel prep + main kernel)", "_gdn2_prefill"),
    Case("gdp_prefill", "Gated DeltaProduct n = 2 (chunked GDN kernel, native rows on sm_90a)", "_gdp_prefill"),
    Case("gdp_prefill_expansion", "Gated DeltaProduct n = 2 (chunked GDN kernel on the expanded copies)",
         "_gdp_prefill", env=(("CUTEDSL_ATTN_GDP_NATIVE", "0"),)),
    Case("mla_decode", "MLA decode (portable)", "_mla_decode"),
    # page 64 on sm_90a: the SM90 MLA kernel by default (2 requests split into one-page work items, two of them
    # gathered tail pages, merged by the last CTA); then its tuning variants (the S-first schedule, the merge kernel)
    Case("mla_decode_sm90", "MLA decode (SM90 wgmma)", "_mla_decode_p64"),
    Case("mla_tuned_sm90", "MLA decode (SM90 wgmma, S-first schedule, merge kernel)", "_mla_decode_p64",
         env=(("CUTEDSL_ATTN_MLA_TUNE", "schedule=1,merge_kernel=1"),)),
    Case("mla_decode_fp8", "MLA decode (portable), fp8 e4m3 cache (trtllm MLA, q_len 2)", "_mla_decode_fp8"),
    # the SM90 MLA kernel's gathered path (auto keeps pages below 64 on the portable kernel: forced here) and its
    # fp8 path (auto takes it for fp8 caches at page 64 from 64 query heads)
    Case("mla_decode_sm90_small_pages", "MLA decode (SM90 wgmma, gathered 16-token pages)", "_mla_decode_p16",
         env=(("CUTEDSL_ATTN_MLA_KERNEL", "sm90"),)),
    Case("mla_decode_sm90_fp8", "MLA decode (SM90 wgmma), fp8 e4m3 cache (trtllm MLA, 128 heads, q_len 2, page 64)",
         "_mla_decode_fp8_p64"),
)


@dataclasses.dataclass(frozen=True)
class Suppression:
    """One kind of report the sweep does not count: ``pattern`` (a regular expression, multi-line mode) searched
    in each item of a report (:func:`items`: a racecheck access pair, else the report's first line and the
    indented lines under it), for cases matching ``cases`` (a glob) and ``tool``."""

    cases: str
    tool: str
    pattern: str
    reason: str  # one line: why this report is not a defect (e.g. accesses ordered by an mbarrier)


def _race(kernel: str, a: tuple[str, int], b: tuple[str, int]) -> str:
    """The pattern of one racecheck access pair of ``kernel`` (a regex of its symbol): accesses ``a`` and ``b``
    (``("Write", 0xf00)``: kind and function-relative offset), in either order."""
    def one(kind, off):
        return rf"{kind} access at \S*{kernel}\S*\+{off:#x}(?![0-9a-fA-F])"

    return (rf"^Error: Race reported between (?:{one(*a)}\nand {one(*b)}|{one(*b)}\nand {one(*a)})")


_SM90_PREFILL = "Sm90PrefillKernel"
# The producer's store of the tile index into s_tile (after its wait on the Q stage's empty mbarrier, before the
# arrive on the full one) and the consumers' load of it (after their wait on the full mbarrier, before they
# arrive on the empty one): the mbarrier arrive (release) / try_wait (acquire) pairs order them, racecheck does
# not model mbarriers (SASS offsets of each case's build, sm_90a, bf16 d128 group 1).
_HAND_OVER_RAW = "STS of s_tile before SYNCS.ARRIVE on the full mbarrier vs LDS after TRYWAIT on it: mbarrier-ordered"
_HAND_OVER_WAR = ("LDS of s_tile before the consumers' SYNCS.ARRIVE on the empty mbarrier vs the producer's next STS "
                  "after TRYWAIT on it: mbarrier-ordered")

# The SM90 MLA main kernel (not its merge kernel): each pair below is separated by a BAR.SYNC that every thread of
# both accessing groups executes, the same number of times on every path; racecheck reports it only between two
# groups whose counts of other barriers differ (one warpgroup's BAR.ARV where the other BAR.SYNCs on a block's signal
# barrier).  SASS offsets of each case's build (sm_90a, bf16, page 64, default tiles).  (The delta-rule preps'
# blockwise inverse had reports of this kind until its diagonal step's 64-thread barrier became a warp sync.)
_MLA_SM90 = "kernel_cutlass_kernel_cutedsl_attnsm90mlakernelMlaSm90Kernel_"
_S_SUM_BAR = ("s_sum STS before BAR.SYNC 1, 256 (the two consumer warpgroups, its only users) vs the other "
              "warpgroup's LDS after it: barrier-ordered")

# Narrow suppressions, each with the reason read from the SASS at the reported offsets.
SUPPRESSIONS: tuple[Suppression, ...] = (
    # ragged causal (q_stages 2, persistent): tile index STS [s_tile+0] at +0xf00, LDS at +0x2090
    Suppression("prefill_sm90_ragged_causal", "racecheck",
                _race(_SM90_PREFILL, ("Write", 0xF00), ("Read", 0x2090)), _HAND_OVER_RAW),
    # ragged (q_stages 1, persistent): tile index STS at +0x920, end marker (-1) STS at +0x1860; the consumers'
    # first LDS at +0x1a30, the LDS at the bottom of their tile loop at +0x8da0
    Suppression("prefill_sm90_ragged", "racecheck",
                _race(_SM90_PREFILL, ("Write", 0x920), ("Read", 0x1A30)), _HAND_OVER_RAW),
    Suppression("prefill_sm90_ragged", "racecheck",
                _race(_SM90_PREFILL, ("Write", 0x1860), ("Read", 0x1A30)), _HAND_OVER_WAR),
    Suppression("prefill_sm90_ragged", "racecheck",
                _race(_SM90_PREFILL, ("Write", 0x1860), ("Read", 0x8DA0)), _HAND_OVER_RAW),
    # paged causal (q_stages 1, one tile per CTA): tile index STS at +0x610, end marker STS at +0x3710; LDS at
    # +0x38e0 (first) and +0xbd40 (tile loop bottom)
    Suppression("prefill_sm90_paged_causal", "racecheck",
                _race(_SM90_PREFILL, ("Write", 0x610), ("Read", 0x38E0)), _HAND_OVER_RAW),
    Suppression("prefill_sm90_paged_causal", "racecheck",
                _race(_SM90_PREFILL, ("Write", 0x3710), ("Read", 0x38E0)), _HAND_OVER_WAR),
    Suppression("prefill_sm90_paged_causal", "racecheck",
                _race(_SM90_PREFILL, ("Write", 0x3710), ("Read", 0xBD40)), _HAND_OVER_RAW),
    # MLA epilogue: warpgroup w's row sums STS into s_sum[w][row] (h = 0, 1) / BAR.SYNC 1, 256 / LDS of
    # s_sum[1][row] (h = 0, 1): +0xb350, +0xb370 / +0xb380 / +0xb4a0, +0xea30 with the in-kernel split-KV merge
    # (merge_kernel 0); +0xb2f0, +0xb320 / +0xb330 / +0xb4b0, +0xea20 with the merge kernel (merge_kernel 1)
    *(Suppression("mla_decode_sm90", "racecheck", _race(_MLA_SM90, ("Write", w), ("Read", r)), _S_SUM_BAR)
      for w, r in ((0xB350, 0xB4A0), (0xB370, 0xEA30), (0xB2F0, 0xB4B0), (0xB320, 0xEA20))),
    # cuDNN backend: not our code
    Suppression("prefill_cudnn_*", "racecheck",
                _race("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", ("Read", 0x1440), ("Write", 0x7520)),
                "inside cuDNN's own fprop kernel: third-party kernel, not ours"),
    Suppression("prefill_cudnn_*", "memcheck",
                r'^Program hit CUDA_ERROR_INVALID_VALUE \(error 1\) due to "invalid argument" on CUDA API call to '
                r"cuGetProcAddress_v2\.",
                "API return code of cuda-python's driver-entry-point probing (cuGetProcAddress of entry points this "
                "driver lacks), not a device error"),
)


# ----------------------------------------------------------------------------- the problems (child side)
def _dev():
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def _indptr(lens):
    import torch

    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=_dev())


def _randn(*shape):
    import torch

    return torch.randn(*shape, dtype=torch.bfloat16, device=_dev())


def _workspace():
    import torch

    return torch.empty(128 << 20, dtype=torch.uint8, device=_dev())


def _paged_kv(kv_lens):
    """An NHD paged cache ``[pages, 2, PAGE_SIZE, kv heads, d]`` whose pages are shuffled, and its CSR table."""
    import torch

    npages = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in kv_lens]
    total = sum(npages)
    cache = _randn(total, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    indices = torch.randperm(total, device=_dev()).to(torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE_SIZE for n, p in zip(kv_lens, npages)], dtype=torch.int32, device=_dev())
    return cache, _indptr(npages), indices, last


def _prefill_ragged(causal=False, backend="auto"):
    import cutedsl_attn as ca

    q = _randn(sum(QO_LENS), NUM_QO_HEADS, HEAD_DIM)
    k, v = _randn(sum(KV_LENS), NUM_KV_HEADS, HEAD_DIM), _randn(sum(KV_LENS), NUM_KV_HEADS, HEAD_DIM)
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), "NHD", backend=backend)
    w.plan(_indptr(QO_LENS), _indptr(KV_LENS), NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, causal=causal,
           q_data_type=q.dtype)
    return w.run(q, k, v, return_lse=True)


def _prefill_ragged_causal():
    return _prefill_ragged(causal=True)


def _prefill_cudnn_ragged_causal():
    return _prefill_ragged(causal=True, backend="cudnn")


def _prefill_paged_causal():
    import cutedsl_attn as ca

    q = _randn(sum(QO_LENS), NUM_QO_HEADS, HEAD_DIM)
    cache, kv_indptr, indices, last = _paged_kv(KV_LENS)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD")
    w.plan(_indptr(QO_LENS), kv_indptr, indices, last, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE,
           causal=True, q_data_type=q.dtype)
    return w.run(q, cache, return_lse=True)


def _decode(kv_lens, num_qo_heads):
    import cutedsl_attn as ca

    q = _randn(len(kv_lens), num_qo_heads, HEAD_DIM)
    cache, kv_indptr, indices, last = _paged_kv(kv_lens)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD")
    w.plan(kv_indptr, indices, last, num_qo_heads, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, q_data_type=q.dtype)
    return w.run(q, cache, return_lse=True)


def _decode_paged():
    return _decode(KV_LENS, NUM_QO_HEADS)


def _decode_paged_split():
    # one long request among short ones: the planner splits it across CTAs, the same launch merges the partials
    return _decode((4096, 16, 100), 4 * NUM_KV_HEADS)


def _decode_paged_fp8():
    import torch

    import cutedsl_attn as ca

    q = _randn(len(KV_LENS), NUM_QO_HEADS, HEAD_DIM)
    cache, kv_indptr, indices, last = _paged_kv(KV_LENS)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD")
    w.plan(kv_indptr, indices, last, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, q_data_type=q.dtype,
           kv_data_type=torch.float8_e4m3fn)
    return w.run(q, cache.to(torch.float8_e4m3fn), k_scale=0.5, v_scale=2.0, return_lse=True)


def _block_table(kv_indptr, indices):
    """The CSR page table as a dense ``[B, max_pages]`` block table (rows padded with page 0)."""
    import torch

    ptr = kv_indptr.tolist()
    table = torch.zeros(len(ptr) - 1, max(b - a for a, b in zip(ptr, ptr[1:])), dtype=torch.int32, device=_dev())
    for i, (a, b) in enumerate(zip(ptr, ptr[1:])):
        table[i, : b - a] = indices[a:b]
    return table


def _prefill_multirow_fp8():
    # trtllm decode with 4 query rows per request (bottom-right causal) over an fp8 cache: the portable prefill
    # kernel's fp8 staging (cp.async of e4m3 tiles, widened once in shared memory)
    import torch

    import cutedsl_attn as ca

    q_len = 4
    q = _randn(len(KV_LENS) * q_len, NUM_QO_HEADS, HEAD_DIM)
    cache, kv_indptr, indices, _ = _paged_kv(KV_LENS)
    seq_lens = torch.tensor(KV_LENS, dtype=torch.int32, device=_dev())
    return ca.trtllm_batch_decode_with_kv_cache(
        q, cache.to(torch.float8_e4m3fn), _workspace(), _block_table(kv_indptr, indices), seq_lens, max(KV_LENS),
        bmm1_scale=0.5 / HEAD_DIM ** 0.5, bmm2_scale=2.0, kv_layout="NHD", q_len_per_req=q_len, return_lse=True)


def _gdn_chunked(cu_seqlens):
    # sequences at offsets cu_seqlens, 4 heads, K = V = 128, l2norm, initial and final state
    import torch

    import cutedsl_attn as ca

    T, H = cu_seqlens[-1], 4
    q, k, v = _randn(T, H, HEAD_DIM), _randn(T, H, HEAD_DIM), _randn(T, H, HEAD_DIM)
    g = torch.rand(T, H, device=_dev()) * 0.1 + 0.9
    beta = torch.rand(T, H, device=_dev())
    s0 = torch.randn(len(cu_seqlens) - 1, H, HEAD_DIM, HEAD_DIM, device=_dev()) * 0.01
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=_dev())
    return ca.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                                     use_qk_l2norm_in_kernel=True)


def _gdn_prefill():
    # two sequences of 64 and 128 tokens
    return _gdn_chunked((0, 64, 192))


def _gdn_prefill_chunked():
    # three sequences of 1, 64 and 135 tokens (cu_seqlens [0, 1, 65, 200]: a one-token chunk, one full chunk, a
    # ragged tail)
    return _gdn_chunked((0, 1, 65, 200))


def _gdn_prefill_varlen():
    # four sequences of 1, 64, 0 and 135 tokens (the empty one writes its initial state as its final state): with
    # the default 64-row V-slices, 32 (V-slice, head, sequence) items
    return _gdn_chunked((0, 1, 65, 65, 200))


def _kda_prefill():
    import torch

    import cutedsl_attn as ca

    T, H = 192, 4
    q, k, v = _randn(1, T, H, HEAD_DIM), _randn(1, T, H, HEAD_DIM), _randn(1, T, H, HEAD_DIM)
    g = -torch.rand(1, T, H, HEAD_DIM, device=_dev()) * 0.1
    beta = torch.rand(1, T, H, device=_dev())
    return ca.recurrent_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=_indptr((64, 128)))


def _gdn2_prefill():
    # two sequences of 64 and 128 tokens, per-channel log decay, erase and write gates, initial and final state
    import torch

    import cutedsl_attn as ca

    T, H = 192, 4
    q, k, v = _randn(T, H, HEAD_DIM), _randn(T, H, HEAD_DIM), _randn(T, H, HEAD_DIM)
    g = -torch.rand(T, H, HEAD_DIM, device=_dev()) * 0.1
    beta, w = torch.rand(T, H, HEAD_DIM, device=_dev()), torch.rand(T, H, HEAD_DIM, device=_dev())
    s0 = torch.randn(2, H, HEAD_DIM, HEAD_DIM, device=_dev()) * 0.01
    return ca.chunk_gated_delta_rule2(q, k, v, g, beta, w, initial_state=s0, output_final_state=True,
                                      cu_seqlens=_indptr((64, 128)), use_qk_l2norm_in_kernel=True, backend="cute")


def _gdp_prefill():
    # three sequences of 1, 40 and 90 tokens, two updates a token (k / v / beta on the 2 T expanded rows: chunks
    # that straddle sequences' token boundaries), initial and final state
    import torch

    import cutedsl_attn as ca

    lens, n, H = (1, 40, 90), 2, 4
    T = sum(lens)
    q, k, v = _randn(T, H, HEAD_DIM), _randn(T * n, H, HEAD_DIM), _randn(T * n, H, HEAD_DIM)
    alpha = torch.rand(T, H, device=_dev()) * 0.1 + 0.9
    beta = torch.rand(T * n, H, device=_dev())
    s0 = torch.randn(len(lens), H, HEAD_DIM, HEAD_DIM, device=_dev()) * 0.01
    return ca.chunk_gated_delta_product(q, k, v, alpha, beta, num_householder=n, initial_state=s0,
                                        output_final_state=True, cu_seqlens=_indptr(lens),
                                        use_qk_l2norm_in_kernel=True, backend="cute")


def _mla_run(lens, H, ckv, kpe, kv_indptr, indices):
    """BatchMLAPagedAttentionWrapper over the pages ``ckv`` ``[pages, ps, 512]`` / ``kpe`` ``[pages, ps, 64]``: one
    random query per request of ``lens`` latent tokens, ``H`` heads, bf16."""
    import torch

    import cutedsl_attn as ca

    w = ca.BatchMLAPagedAttentionWrapper(_workspace())
    w.plan(_indptr((1,) * len(lens)), kv_indptr, indices, torch.tensor(lens, dtype=torch.int32, device=_dev()), H,
           512, 64, ckv.shape[1], False, 1.0 / (192 ** 0.5), torch.bfloat16, torch.bfloat16)
    return w.run(_randn(len(lens), H, 512), _randn(len(lens), H, 64), ckv, kpe, return_lse=True)


def _mla_decode(H=16, ps=16):
    # 2 requests of 1 query over 100 / 300 latent tokens (a partial last page each), 16 heads, page 16, pages
    # shuffled
    import torch

    lens = (100, 300)
    npages = [(n + ps - 1) // ps for n in lens]
    total = sum(npages)
    ckv, kpe = _randn(total, ps, 512), _randn(total, ps, 64)
    return _mla_run(lens, H, ckv, kpe, _indptr(npages), torch.randperm(total, device=_dev()).to(torch.int32))


def _mla_decode_p64():
    # _mla_decode at 64 heads, page 64
    return _mla_decode(H=64, ps=64)


def _mla_pool(lens, ps, dtype, spare=2):
    """A pool of ``ps``-token pages ``[pages, ps, 576]`` in ``dtype`` holding random ``[ckv | kpe]`` rows of
    ``lens`` tokens a request on shuffled pages, NaN in every slot no request owns (the last pages' tails and
    ``spare`` unused pages), and its CSR table ``(kv_indptr, kv_indices)``."""
    import torch

    npages = [(n + ps - 1) // ps for n in lens]
    pool = torch.full((sum(npages) + spare, ps, 576), float("nan"), device=_dev())
    kv_indptr, indices = _indptr(npages), torch.randperm(pool.shape[0], device=_dev()).to(torch.int32)[: sum(npages)]
    for b, n in enumerate(lens):
        rows = torch.randn(npages[b] * ps, 576, device=_dev())
        rows[n:] = float("nan")
        pool[indices[int(kv_indptr[b]): int(kv_indptr[b + 1])].long()] = rows.view(-1, ps, 576)
    return pool.to(dtype), kv_indptr, indices


def _mla_decode_p16():
    # 3 requests of 1 query over 7 / 100 / 300 latent tokens (the planner splits the two longer into 64-token work
    # items), 16 heads (one 64-row tile, its rows past the heads unused), page 16, pool from _mla_pool
    import torch

    lens = (7, 100, 300)
    kv, kv_indptr, indices = _mla_pool(lens, 16, torch.bfloat16)
    return _mla_run(lens, 16, kv[..., :512].contiguous(), kv[..., 512:].contiguous(), kv_indptr, indices)


def _mla_decode_fp8_p64():
    # trtllm MLA: 2 requests of 2 query rows (bottom-right causal) over 100 / 300 latent tokens (split into
    # 64-token work items), 128 heads, bf16 q over an fp8 e4m3 combined cache, page 64, pool from _mla_pool
    import torch

    import cutedsl_attn as ca

    lens, H, ps, q_len = (100, 300), 128, 64, 2
    kv, kv_indptr, indices = _mla_pool(lens, ps, torch.float8_e4m3fn)
    return ca.trtllm_batch_decode_with_kv_cache_mla(
        _randn(len(lens), q_len, H, 576), kv, _workspace(), 128, 512, 64, _block_table(kv_indptr, indices),
        torch.tensor(lens, dtype=torch.int32, device=_dev()), max(lens), bmm1_scale=0.7 / (192 ** 0.5),
        bmm2_scale=1.5, return_lse=True)


def _mla_decode_fp8():
    # trtllm MLA: 2 requests of 2 query rows (bottom-right causal) over 100 / 300 latent tokens, 16 heads, bf16 q
    # over an fp8 e4m3 combined [ckv | kpe] cache, page 32, pages shuffled
    import torch

    import cutedsl_attn as ca

    lens, H, ps, q_len = (100, 300), 16, 32, 2
    npages = [(n + ps - 1) // ps for n in lens]
    total = sum(npages)
    kv = _randn(total, ps, 576).to(torch.float8_e4m3fn)
    table = _block_table(_indptr(npages), torch.randperm(total, device=_dev()).to(torch.int32))
    return ca.trtllm_batch_decode_with_kv_cache_mla(
        _randn(len(lens), q_len, H, 576), kv, _workspace(), 128, 512, 64, table,
        torch.tensor(lens, dtype=torch.int32, device=_dev()), max(lens), bmm1_scale=0.7 / (192 ** 0.5),
        bmm2_scale=1.5, return_lse=True)


def _is_missing_dependency(exc: BaseException) -> bool:
    return isinstance(exc, (ImportError, NotImplementedError)) or "cudnn" in str(exc).lower()


def child(case: Case, list_kernels: bool) -> int:
    """Run ``case`` once in this process; prints ``CHILD OK`` (and the kernels launched) or the failure."""
    import torch

    if not torch.cuda.is_available():
        print("CHILD FAIL: no CUDA GPU")
        return 1
    torch.manual_seed(0)
    fn = globals()[case.run]
    try:
        if list_kernels:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out, lse = fn()
                torch.cuda.synchronize()
            names = sorted({e.name for e in prof.events() if getattr(e.device_type, "name", "") == "CUDA"})
            for name in names:
                print(f"KERNEL {name}")
        else:
            out, lse = fn()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        if case.optional and _is_missing_dependency(exc):
            print(f"CHILD N/A: {type(exc).__name__}: {exc}")
            return 0
        raise
    if not (torch.isfinite(out).all() and not torch.isnan(lse).any()):
        print("CHILD FAIL: non-finite output or NaN LSE")
        return 1
    print("CHILD OK")
    return 0


# ----------------------------------------------------------------------------- the sweep (parent side)
_SUMMARY = {
    "memcheck": re.compile(r"ERROR SUMMARY: (\d+) errors?"),
    "synccheck": re.compile(r"ERROR SUMMARY: (\d+) errors?"),
    "racecheck": re.compile(r"RACECHECK SUMMARY: (\d+) hazards?"),
}
_PREFIX = re.compile(r"^=+ ?")


def reports(log: str) -> list[str]:
    """The sanitizer's individual reports in ``log``: a line ``========= <text>`` starts one, the indented
    ``=========     ...`` lines under it belong to it; banners and summaries are not reports."""
    out: list[str] = []
    for line in log.splitlines():
        if not line.startswith("="):
            continue
        body = _PREFIX.sub("", line, count=1)
        if not body.strip():
            continue
        if body[:1].isspace():
            if out:
                out[-1] += "\n" + body.strip()
            continue
        if body.startswith(("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY")):
            continue
        out.append(body.strip())
    return out


def items(report: str) -> list[str]:
    """What one suppression must explain in ``report``: for a racecheck report (``Error: Race reported between
    <access>`` and ``and <access> [N hazards]`` lines), each access pair as ``"<first line>\\nand <access> ..."``;
    for any other report, the report itself."""
    lines = report.split("\n")
    pairs = [line for line in lines[1:] if line.startswith("and ")]
    if not lines[0].startswith("Error: Race reported between") or not pairs:
        return [report]
    return [lines[0] + "\n" + p for p in pairs]


def suppressed(case: str, tool: str, log: str, suppressions=None) -> list[tuple[str, list[Suppression]]]:
    """The reports of ``log`` that suppressions for ``case`` and ``tool`` explain in full (every item of
    :func:`items` matched), each with the suppression of each item.  ``suppressions``: None for
    :data:`SUPPRESSIONS`."""
    mine = [s for s in (SUPPRESSIONS if suppressions is None else suppressions)
            if s.tool == tool and fnmatch.fnmatch(case, s.cases)]
    hits = []
    for rep in reports(log):
        why = [next((s for s in mine if re.search(s.pattern, item, re.M)), None) for item in items(rep)]
        if all(why):
            hits.append((rep, why))
    return hits


def count(case: str, tool: str, log: str, suppressions=None):
    """(unexpected count, raw count, suppressed count), or None when the log has no summary line.  Reports past
    ``--print-limit`` are in the raw count but not printed, so they count as unexpected."""
    m = _SUMMARY[tool].findall(log)
    if not m:
        return None
    raw = int(m[-1])
    sup = len(suppressed(case, tool, log, suppressions))
    return max(raw - sup, 0), raw, sup


# nanobind's reference-leak report, printed at interpreter exit (the cuDNN frontend's bindings)
_NANOBIND_LEAK = re.compile(r"^nanobind: leaked ", re.M)
_CHILD_OK = re.compile(r"^CHILD OK$", re.M)


def run_ok(rc, out: str) -> bool:
    """Whether a child (plain or under a sanitizer, whose exit status is the child's) ran its case: it printed
    ``CHILD OK`` and exited 0, or exited non-zero with nanobind's leak report at interpreter exit and no Python
    traceback (the case itself had finished).  ``rc`` None (a timeout) or negative (a signal) is a failure."""
    if rc is None or not _CHILD_OK.search(out):
        return False
    if rc == 0:
        return True
    return rc > 0 and bool(_NANOBIND_LEAK.search(out)) and "Traceback (most recent call last)" not in out


def case_sanitizer_args(case: Case, tool: str) -> list[str]:
    """The extra compute-sanitizer options of ``case`` for ``tool`` (``Case.sanitizer_args``)."""
    return [a for t, opts in case.sanitizer_args if t == tool for a in opts]


def _find_sanitizer(explicit: str | None):
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels (the "sanitize" extra: nvidia-cuda-sanitizer-api)

        for pkg_dir in nvidia.__path__:
            roots += sorted(os.path.join(pkg_dir, d) for d in os.listdir(pkg_dir))
    except ImportError:
        pass
    for root in roots:
        cand = os.path.join(root, "bin", "compute-sanitizer") if root else ""
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _run(cmd, env, timeout):
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout + r.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, text + f"\nTIMEOUT after {timeout} s", time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", metavar="CASE", help="run one case in this process (no sanitizer)")
    ap.add_argument("--list-kernels", action="store_true", help="with --child: print the CUDA kernels launched")
    ap.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    ap.add_argument("--sanitizer", default=None,
                    help="path of compute-sanitizer (default: PATH, $CUDA_HOME/bin, "
                         "the nvidia-cuda-sanitizer-api wheel)")
    ap.add_argument("--sanitizer-args", default="",
                    help="extra compute-sanitizer options, e.g. a kernel-name filter (split on spaces)")
    ap.add_argument("--log-dir", default=None, help="keep each run's full output here (default: a temp dir)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per sanitized run (default 1200)")
    args = ap.parse_args(argv)
    by_name = {c.name: c for c in CASES}
    if args.child:
        if args.child not in by_name:
            ap.error(f"unknown case {args.child!r}; known: {', '.join(by_name)}")
        return child(by_name[args.child], args.list_kernels)

    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = sorted(set(tools) - set(TOOLS))
    if bad:
        ap.error(f"unknown tool(s) {bad}; known: {', '.join(TOOLS)}")
    wanted = [s.strip() for s in args.cases.split(",") if s.strip()]
    cases = [c for c in CASES if not wanted or any(w in c.name for w in wanted)]
    if not cases:
        ap.error(f"--cases {args.cases!r} matches none of {', '.join(by_name)}")
    sanitizer = _find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, nvidia/*/bin); "
              'pip install -e ".[sanitize]" or give --sanitizer PATH', file=sys.stderr)
        return 2
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="cutedsl_attn_sanitize_")
    os.makedirs(log_dir, exist_ok=True)
    me = os.path.abspath(__file__)
    repo = os.path.dirname(os.path.dirname(me))
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = repo + os.pathsep + base_env.get("PYTHONPATH", "")

    table, failed = [], False
    for case in cases:
        env = dict(base_env, **dict(case.env))
        rc, out, dt = _run([sys.executable, me, "--child", case.name, "--list-kernels"], env, args.timeout)
        with open(os.path.join(log_dir, f"{case.name}.plain.log"), "w") as f:
            f.write(out)
        kernels = [line[len("KERNEL "):] for line in out.splitlines() if line.startswith("KERNEL ")]
        if "CHILD N/A" in out:
            table.append((case, {t: "n/a" for t in tools}, kernels))
            continue
        if not run_ok(rc, out):
            failed = True
            table.append((case, {t: "run failed" for t in tools}, kernels))
            print(f"{case.name}: the plain run failed (rc {rc}); see {log_dir}/{case.name}.plain.log", file=sys.stderr)
            continue
        cells = {}
        for tool in tools:
            tenv = dict(env)
            if tool == "memcheck":
                tenv["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # torch's caching allocator would hide overruns
            cmd = [sanitizer, "--tool", tool, "--print-limit", "100", *case_sanitizer_args(case, tool),
                   *args.sanitizer_args.split(), sys.executable, me, "--child", case.name]
            rc, out, dt = _run(cmd, tenv, args.timeout)
            path = os.path.join(log_dir, f"{case.name}.{tool}.log")
            with open(path, "w") as f:
                f.write(out)
            n = count(case.name, tool, out)
            if n is None or not run_ok(rc, out):
                failed = True
                cells[tool] = "no summary" if n is None else "run failed"
                print(f"{case.name} / {tool}: rc {rc}, see {path}", file=sys.stderr)
                continue
            unexpected, raw, sup = n
            failed |= unexpected > 0
            cells[tool] = f"{unexpected}" + (f" (+{sup} suppressed)" if sup else "")
            print(f"{case.name} / {tool}: {raw} reported, {sup} suppressed, {dt:.0f} s", file=sys.stderr)
        table.append((case, cells, kernels))

    w_case = max(len(c.name) for c, _, _ in table)
    w_cell = max([len(t) for t in tools] + [len(v) for _, cells, _ in table for v in cells.values()])
    print(f"\n{'case':<{w_case}}  " + "  ".join(f"{t:>{w_cell}}" for t in tools) + "  kernel")
    for case, cells, _ in table:
        print(f"{case.name:<{w_case}}  " + "  ".join(f"{cells.get(t, '-'):>{w_cell}}" for t in tools)
              + f"  {case.kernel}")
    print("\nCUDA kernels launched per case (plain run):")
    for case, _, kernels in table:
        print(f"  {case.name}: " + (", ".join(k[:90] for k in kernels) or "-"))
    print(f"\nlogs: {log_dir}")
    print("SANITIZERS CLEAN" if not failed else "SANITIZER ERRORS OR FAILED RUNS (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
