"""Kernel choice and launch of MLA (part of :mod:`cutedsl_attn.dispatch`, which re-exports its public names).

On sm_90a the SM90 kernel (:mod:`cutedsl_attn.sm90.mla`: TMA pages + wgmma, 64-row tiles, O split across two
consumer warpgroups) serves page size 64: bf16 / fp16 q with caches of q's dtype (any head count, qo_len, causal
or not, split-KV) and fp8 e4m3 caches / q (widened to f16 in shared memory) from ``FP8_SM90_MIN_HEADS`` query
heads; fewer heads with fp8 go to the portable kernel, measured faster there.  At 16-bit page 64 with at most
``SWAP_AB_MAX_ROWS`` packed query rows a request (``q_len x heads``, e.g. 16 heads under TP8) outside CUDA-graph
mode, the SM90 kernel takes its swapped form (``Tiles.swap_ab = 1``, ``tile_n = 16``: the rows on the wgmma N
dimension), measured 8% faster there.  Page sizes dividing 64 below 64 take the SM90 kernel's gathered path for
16-bit caches from ``SMALL_PAGE_SM90_MIN_HEADS`` query heads (measured ~4x the portable kernel at 128 heads, even
at 16); fewer heads and fp8 caches there keep the portable kernel.  The portable decode kernel (16-row mma.sync
tiles; page sizes 1..64, fp8 e4m3 caches) serves the rest and every other arch.  ``CUTEDSL_ATTN_MLA_KERNEL``:
``auto`` (the default, as above), ``sm90`` (the SM90 kernel wherever it serves the problem: any page size dividing
64, any head count) or ``portable`` (forces the portable kernel).  Under torch.compile the launch is the custom op
cutedsl_attn::mla_decode_portable or cutedsl_attn::mla_decode_sm90, the chosen tiles in its key.
"""

from __future__ import annotations

import ast
import dataclasses
import os

import torch

from ..compile import get_compiled, target_arch
from ..planning.mla import SPLIT_FIELDS, MlaArgs, MlaProblem, MlaSplit
from ..planning.mla import TILE_M as _PLAN_TILE_M
from ..portable import mla_decode as _mla_portable
from ..sm90 import mla as _mla_sm90
from . import _dtype_name, _override, _parse_tune, num_sms

#: "key=value,..." over the MLA kernel's Tiles fields and the planner's split keys (SPLIT_FIELDS): tuning experiments
MLA_TUNE_ENV = "CUTEDSL_ATTN_MLA_TUNE"
MLA_KERNEL_ENV = "CUTEDSL_ATTN_MLA_KERNEL"  # "auto" (default: see the module docstring), "sm90", "portable"
_MLA_KERNELS = ("auto", "portable", "sm90")

_MLA_FIELDS = tuple(f.name for f in dataclasses.fields(MlaProblem))
# the measurements behind it: perf/RESULTS.md, "MLA"
#: fp8 caches below this many query heads go to the portable kernel on sm_90a: its 16-row tiles beat the SM90
#: kernel's 64-row tiles and in-stage widening at few heads
FP8_SM90_MIN_HEADS = 64
#: 16-bit caches at page sizes below 64 take the SM90 kernel's gathered path from this many query heads
SMALL_PAGE_SM90_MIN_HEADS = 64
#: packed query rows a request (q_len x heads) up to which auto takes the SM90 kernel's swapped form (tile_n 16)
SWAP_AB_MAX_ROWS = 16
#: how plans cut long requests (both kernels): the modelled split, until a GPU A/B of ``split_waves`` says otherwise
#: (perf/bench_mla.py --variants 'split_waves=2;split_waves=4')
DEFAULT_SPLIT = MlaSplit()


def mla_problem(*, dtype, page_size: int, causal: bool, head_dim_ckv: int = 512, head_dim_kpe: int = 64,
                kv_dtype=None, device_index: int | None = None) -> MlaProblem:
    """The :class:`~cutedsl_attn.planning.mla.MlaProblem` of a plan on the target arch (``CUTEDSL_ATTN_ARCH`` or
    the device's).  ``dtype`` q's torch dtype (bf16, fp16 or float8_e4m3fn); ``kv_dtype`` the caches' (None:
    q's).  Raises MlaProblem's errors."""
    dev = torch.device("cuda", device_index) if device_index is not None and torch.cuda.is_available() else None
    kv = "" if kv_dtype is None else _dtype_name(kv_dtype)
    return MlaProblem(dtype=_dtype_name(dtype), page_size=page_size, head_dim_ckv=head_dim_ckv,
                      head_dim_kpe=head_dim_kpe, causal=bool(causal), arch=target_arch(dev), kv_dtype=kv)


def mla_choice(problem: MlaProblem, *, device_index: int | None = None, num_heads: int | None = None,
               max_qo_len: int | None = None, cuda_graph: bool = False):
    """``(kernel module, config)`` serving ``problem``.  Auto (see the module docstring for the measurements): the
    SM90 kernel where it serves the problem (its ``unsupported_reason`` is None) at page size 64, except fp8
    caches with ``num_heads`` (query heads, when given) below :data:`FP8_SM90_MIN_HEADS`, and at smaller page
    sizes for 16-bit caches from :data:`SMALL_PAGE_SM90_MIN_HEADS` heads (or ``num_heads`` not given); else the
    portable kernel.  On the SM90 kernel at 16-bit page 64, ``num_heads * max_qo_len <=``
    :data:`SWAP_AB_MAX_ROWS` (both given) and not ``cuda_graph`` (a captured plan keeps its tiles across
    re-plans) take the swapped form (``swap_ab=1, tile_n=16``).  ``CUTEDSL_ATTN_MLA_KERNEL=sm90`` takes the SM90
    kernel wherever it serves; ``CUTEDSL_ATTN_MLA_KERNEL=portable`` forces the portable kernel.
    ``CUTEDSL_ATTN_MLA_TUNE`` (``"key=value,..."`` over the chosen kernel's ``Tiles`` fields, tuning experiments)
    overrides the default tiles (a ``swap_ab`` / ``tile_n`` item replaces the automatic swapped form); its plan
    keys (``split_waves``, ``split_min_tokens``: :func:`mla_limits`) leave the tiles as they are.

    Raises NotImplementedError naming what is served when no kernel serves the problem; ValueError naming the
    variable for a bad ``CUTEDSL_ATTN_MLA_KERNEL``, a malformed item or a refused combination."""
    forced = os.environ.get(MLA_KERNEL_ENV, "").strip() or "auto"
    if forced not in _MLA_KERNELS:
        raise ValueError(f"{MLA_KERNEL_ENV} must be one of {_MLA_KERNELS}, got {forced!r}")
    m = _mla_portable
    few_heads = num_heads is not None and num_heads < FP8_SM90_MIN_HEADS
    if problem.page_size == 64:
        measured = not (problem.kv_fp8 and few_heads)
    else:
        measured = not problem.kv_fp8 and not (num_heads is not None and num_heads < SMALL_PAGE_SM90_MIN_HEADS)
    if (forced == "sm90" or (forced == "auto" and measured)) and _mla_sm90.unsupported_reason(problem) is None:
        m = _mla_sm90
    reason = m.unsupported_reason(problem)
    if reason is not None:
        raise NotImplementedError(f"MLA: {reason}")
    tiles = m.default_tiles(problem, num_sms=num_sms(device_index))
    tune = os.environ.get(MLA_TUNE_ENV, "").strip()
    items = _parse_tune(MLA_TUNE_ENV, tune, m.TUNING_FIELDS + SPLIT_FIELDS) if tune else {}
    tile_items = {k: v for k, v in items.items() if k not in SPLIT_FIELDS}
    swap = (m is _mla_sm90 and forced == "auto" and problem.page_size == 64 and not problem.kv_fp8
            and not cuda_graph and num_heads is not None and max_qo_len is not None
            and num_heads * max_qo_len <= SWAP_AB_MAX_ROWS and not {"swap_ab", "tile_n"} & set(tile_items))
    if swap:
        tiles = dataclasses.replace(tiles, swap_ab=1, tile_n=16)
    if tile_items:
        tiles = _override(m, MLA_TUNE_ENV, tune, tiles, tile_items)
    try:
        return m, m.Config(problem, tiles)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{e} (with {MLA_TUNE_ENV}={tune!r})" if tune else str(e)) from None


def mla_split(module) -> MlaSplit:
    """How plans of ``module`` (an MLA kernel module) cut long requests: :data:`DEFAULT_SPLIT` with the
    ``split_waves`` / ``split_min_tokens`` items of ``CUTEDSL_ATTN_MLA_TUNE`` (tuning experiments) replaced.
    Raises ValueError naming the variable for a malformed item or a value :class:`MlaSplit` refuses."""
    tune = os.environ.get(MLA_TUNE_ENV, "").strip()
    if not tune:
        return DEFAULT_SPLIT
    items = _parse_tune(MLA_TUNE_ENV, tune, module.TUNING_FIELDS + SPLIT_FIELDS)
    try:
        return MlaSplit.from_items(items, DEFAULT_SPLIT)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{e} (with {MLA_TUNE_ENV}={tune!r})") from None


def mla_limits(module, cfg) -> dict:
    """What the MLA planner needs of a choice (keyword arguments of
    :func:`~cutedsl_attn.planning.mla.plan_mla`): ``max_splits_per_request``, ``ctas_per_sm`` (the kernel's
    CTAs one SM holds at once, by shared memory), ``tile_m`` (query rows of one of them: the SM90 kernel's
    64, the portable kernel's 16) and ``split`` (:func:`mla_split`).  Raises :func:`mla_split`'s ValueError."""
    ctas = max(1, (228 * 1024) // (cfg.smem_bytes + 1024))
    tile_m = cfg.tile_m if module is _mla_sm90 else _PLAN_TILE_M
    return {"max_splits_per_request": cfg.max_splits_per_request, "ctas_per_sm": ctas, "tile_m": tile_m,
            "split": mla_split(module)}


def _mla_launch_direct(module, cfg, args: MlaArgs) -> None:
    module.launch(get_compiled(module.NAME, cfg, module.compile), cfg, args)


def _key_of_config(cfg) -> str:
    """The custom ops' string key of ``cfg``: its problem's and its tiles' fields, ``name=repr`` items (the
    plan was made for these tiles, so the op launches exactly them)."""
    prob = ";".join(f"{n}={getattr(cfg.problem, n)!r}" for n in _MLA_FIELDS)
    tiles = ";".join(f"{f.name}={getattr(cfg.tiles, f.name)!r}" for f in dataclasses.fields(cfg.tiles))
    return f"{prob}|{tiles}"


def _config_of_key(module, key: str):
    """The inverse of :func:`_key_of_config` for ``module``'s Config."""
    prob, tiles = key.split("|", 1)

    def items(text):
        return {n: ast.literal_eval(v) for n, v in (kv.split("=", 1) for kv in text.split(";") if kv)}

    return module.Config(MlaProblem(**items(prob)), module.Tiles(**items(tiles)))


@torch.library.custom_op("cutedsl_attn::mla_decode_portable", mutates_args=("out", "lse", "part_o", "part_lse",
                                                                             "counters"))
def _mla_op(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, indices: torch.Tensor,
            work: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor,
            counters: torch.Tensor, sm_scale: float, num_row_tiles: int, output_scale: float, key: str) -> None:
    _mla_launch_direct(_mla_portable, _config_of_key(_mla_portable, key), MlaArgs(q_nope, q_pe, ckv, kpe, indices, work, out, lse, part_o,
                                                   part_lse, counters, sm_scale, num_row_tiles, output_scale))


@_mla_op.register_fake
def _(q_nope, q_pe, ckv, kpe, indices, work, out, lse, part_o, part_lse, counters, sm_scale, num_row_tiles,
      output_scale, key) -> None:
    return None


@torch.library.custom_op("cutedsl_attn::mla_decode_sm90", mutates_args=("out", "lse", "part_o", "part_lse",
                                                                         "counters"))
def _mla_sm90_op(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                 indices: torch.Tensor, work: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, part_o: torch.Tensor,
                 part_lse: torch.Tensor, counters: torch.Tensor, sm_scale: float, num_row_tiles: int,
                 output_scale: float, key: str) -> None:
    _mla_launch_direct(_mla_sm90, _config_of_key(_mla_sm90, key), MlaArgs(q_nope, q_pe, ckv, kpe, indices, work, out, lse, part_o, part_lse,
                                               counters, sm_scale, num_row_tiles, output_scale))


@_mla_sm90_op.register_fake
def _(q_nope, q_pe, ckv, kpe, indices, work, out, lse, part_o, part_lse, counters, sm_scale, num_row_tiles,
      output_scale, key) -> None:
    return None


def mla_launch(module, cfg, args: MlaArgs) -> None:
    """Compile (cached in memory and on disk) the chosen MLA kernel and launch it on the current stream."""
    if torch.compiler.is_compiling():
        op = _mla_sm90_op if module is _mla_sm90 else _mla_op
        op(*args, _key_of_config(cfg))
        return
    _mla_launch_direct(module, cfg, args)
