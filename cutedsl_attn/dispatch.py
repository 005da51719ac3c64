"""The one place an architecture is chosen: API calls -> kernel configs -> compiled kernels.

``api`` modules never import kernel modules directly; they ask this layer for a
compiled callable.  Decode runs the portable SM80-class kernel (``cutedsl_attn.portable``)
on every arch.  Prefill on SM90 runs the TMA + wgmma kernel (``cutedsl_attn.sm90.prefill``)
where it applies and the portable kernel elsewhere (see :func:`prefill_config`).  Verified on
an H200 (SM90); SM100 builds (portable only) are cross-compiled and PTX-checked.  Arch-specific
kernels take over here as they are verified.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from .compile import get_compiled, target_arch
from .planning.decode import occupancy
from .portable import paged_decode as _pd

PagedDecodeConfig = _pd.PagedDecodeConfig

_TORCH_TO_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def decode_config(
    *,
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    group_size: int,
    pos_encoding_mode: str = "NONE",
    use_soft_cap: bool = False,
    use_sinks: bool = False,
    arch: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> PagedDecodeConfig:
    """The paged-decode kernel configuration for a problem (tuning knobs chosen here)."""
    arch = arch or target_arch()
    tune = os.environ.get("CUTEDSL_ATTN_DECODE_TUNE")  # "warps,stages": tuning experiments only
    if tune and num_warps is None and num_stages is None:
        num_warps, num_stages = (int(x) for x in tune.split(","))
    if num_stages is None:
        num_stages = 2 if head_dim >= 256 else 3
    return PagedDecodeConfig(
        dtype=_TORCH_TO_NAME[dtype],
        head_dim=head_dim,
        page_size=page_size,
        group_size=group_size,
        pos_encoding_mode=pos_encoding_mode,
        use_soft_cap=use_soft_cap,
        use_sinks=use_sinks,
        num_warps=num_warps or 4,
        num_stages=num_stages,
        arch=arch,
    )


def decode_config_for_split(cfg: PagedDecodeConfig) -> PagedDecodeConfig | None:
    """The configuration to use instead of ``cfg`` when the plan splits requests (None: keep ``cfg``).

    Measured on the H200 (perf/RESULTS.md): with split-KV, 8 warps x 3 stages per CTA
    (one CTA per SM) beat 4 x 3 by 12-16% on (1, 8192) and matched it elsewhere.
    """
    if os.environ.get("CUTEDSL_ATTN_DECODE_TUNE") or cfg.head_dim > 128 or cfg.num_warps != 4:
        return None
    return dataclasses.replace(cfg, num_warps=8)


def paged_decode_kernel(cfg: PagedDecodeConfig):
    """Compiled (and cached, in memory and on disk) paged-decode callable for ``cfg``."""
    return get_compiled("paged_decode", cfg, _pd.compile)


def paged_decode_ctas_per_sm(cfg: PagedDecodeConfig) -> int:
    """Occupancy of the decode kernel, used by the split-KV planner."""
    return occupancy(cfg.smem_bytes, cfg.num_threads)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None = None) -> int:
    """Multiprocessor count of a CUDA device (132 on an H200/H100 SXM when none is present)."""
    if not torch.cuda.is_available():
        return 132
    idx = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(idx).multi_processor_count


# ---------------------------------------------------------------------------- prefill
def _portable_prefill_config(
    *,
    dtype: torch.dtype,
    head_dim_qk: int,
    head_dim_vo: int,
    group_size: int,
    page_size: int = 0,
    causal: bool = False,
    use_window: bool = False,
    use_soft_cap: bool = False,
    use_sinks: bool = False,
    use_custom_mask: bool = False,
    pos_encoding_mode: str = "NONE",
    score_mod=None,
    arch: str | None = None,
):
    """The portable (SM80-class) prefill kernel configuration for a problem."""
    from .portable import prefill as _pf

    return _pf.PrefillConfig(
        dtype=_TORCH_TO_NAME[dtype], head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, group_size=group_size,
        page_size=page_size, causal=causal, use_window=use_window, use_soft_cap=use_soft_cap,
        use_sinks=use_sinks, use_custom_mask=use_custom_mask, pos_encoding_mode=pos_encoding_mode,
        score_mod=score_mod, arch=arch or target_arch(),
    )


def prefill_config(*, positive_scale: bool = True, kernel: str = "auto", **kwargs):
    """The prefill kernel configuration for a problem (keyword arguments of the portable configuration).

    ``kernel``: ``"auto"`` (the choice below), ``"portable"`` (always the portable kernel) or
    ``"sm90"`` (the SM90 kernel wherever it applies, whatever ``CUTEDSL_ATTN_PREFILL_KERNEL`` says;
    the portable configuration where it does not -- callers check the returned type).

    ``positive_scale=False`` (a planned ``sm_scale <= 0``) keeps the portable kernel: the SM90 kernel
    folds the softmax scale into the exponent after the row max of the raw logits, which needs a
    positive scale.

    On SM90 the TMA + wgmma kernel (:mod:`cutedsl_attn.sm90.prefill`) serves every problem it
    supports (ragged or paged K/V, custom masks, no positional encoding, ``group_size`` dividing 128);
    everything else, and every other arch, runs the portable kernel.  The environment variable
    ``CUTEDSL_ATTN_PREFILL_KERNEL=portable`` forces the portable kernel (benchmarks compare both).

    Raises ValueError for ``CUTEDSL_ATTN_PREFILL_KERNEL`` other than ``auto`` / ``portable`` and for a
    ``CUTEDSL_ATTN_PREFILL_TUNE`` that does not parse (:func:`_prefill_tune`), whichever kernel is picked.
    """
    if kernel not in ("auto", "portable", "sm90"):
        raise ValueError(f"kernel must be 'auto', 'portable' or 'sm90', got {kernel!r}")
    env_kernel = os.environ.get("CUTEDSL_ATTN_PREFILL_KERNEL", "auto") or "auto"
    if env_kernel not in ("auto", "portable"):
        raise ValueError(f"CUTEDSL_ATTN_PREFILL_KERNEL must be 'auto' or 'portable', got {env_kernel!r}")
    tune = os.environ.get("CUTEDSL_ATTN_PREFILL_TUNE", "")
    override = _prefill_tune(tune)  # its keys and values checked whichever kernel serves the problem
    cfg = _portable_prefill_config(**kwargs)
    if kernel == "auto" and env_kernel == "portable":
        kernel = "portable"
    if kernel == "portable" or not positive_scale:
        return cfg
    from .sm90 import prefill as _sm90

    if _sm90.unsupported_reason(cfg) is None:
        fields = {name: getattr(cfg, name) for name in _sm90.PROBLEM_FIELDS}  # the tuning fields come next
        default = _sm90.default_tiles(cfg.head_dim_qk, cfg.head_dim_vo, cfg.group_size, use_window=cfg.use_window,
                                      use_soft_cap=cfg.use_soft_cap, use_score_mod=cfg.score_mod is not None,
                                      use_custom_mask=cfg.use_custom_mask,
                                      page_size=cfg.page_size, causal=cfg.causal, num_sms=_num_sms())
        if cfg.page_size > 0:
            for name in ("num_ctas", "head_section_mib"):  # ragged K/V only (documented below)
                override.pop(name, None)
        tiles = {**default, **override}
        if not tiles.get("smem_epilogue") and "tma_epilogue" not in override:
            tiles.pop("tma_epilogue", None)  # the default's TMA store rides on the staged epilogue turned off
        try:
            return _sm90.Sm90PrefillConfig(**fields, **tiles)
        except ValueError as e:
            if tune.strip():  # the override applies to every SM90 problem of the process, as given
                raise ValueError(f"{e} (with CUTEDSL_ATTN_PREFILL_TUNE={tune!r}; for this problem the default "
                                 f"tiles are {default})") from None
            raise
    return cfg


def _num_sms() -> int:
    """SMs of the current CUDA device (the persistent prefill grid's size), or 132 (H100 SXM / H200) when
    there is no GPU (cross-compiling)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132


def _prefill_tune(text: str) -> dict:
    """Parse ``CUTEDSL_ATTN_PREFILL_TUNE`` (``"key=value,..."``, tuning experiments only) into SM90 config
    overrides: integer fields take integers, boolean ones ``0/1/true/false``.  The overrides replace the
    defaults of :func:`cutedsl_attn.sm90.prefill.default_tiles` as given, for every SM90 problem of the
    process (``num_ctas``, the persistent grid, and ``head_section_mib``, the tile order by sections of kv
    heads, for those with ragged K/V only: paged ones keep one CTA per tile in the plain order;
    ``smem_epilogue=0`` also drops a default ``tma_epilogue``, which stores the staged rows): a
    combination that does not fit shared memory raises when a problem is planned, one that
    spills registers only runs slower (``cutedsl_attn.inspect.resources`` shows the stack frame).

    Raises ValueError naming the variable for an item that is not ``key=value``, a key outside
    :data:`cutedsl_attn.sm90.prefill.TUNING_FIELDS` (the config's fields that a problem does not fix), or a
    bad value (the config itself then checks the ranges).
    """
    from .sm90 import prefill as _sm90

    out = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, val = (x.strip() for x in item.partition("="))
        if not sep or key not in _sm90.TUNING_FIELDS:
            raise ValueError(f"CUTEDSL_ATTN_PREFILL_TUNE: {item!r} is not key=value with key in {_sm90.TUNING_FIELDS}")
        if isinstance(getattr(_sm90.Sm90PrefillConfig, key), bool):
            if val.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"CUTEDSL_ATTN_PREFILL_TUNE: {key} takes 0/1/true/false, got {val!r}")
            out[key] = val.lower() in ("1", "true")
        else:
            try:
                out[key] = int(val)
            except ValueError:
                raise ValueError(f"CUTEDSL_ATTN_PREFILL_TUNE: {key} takes an integer, got {val!r}") from None
    return out


def prefill_kernel(cfg):
    """Compiled (and cached) prefill callable for ``cfg`` (a portable or an SM90 configuration).

    Both share one signature and work table; see ``cutedsl_attn.portable.prefill.compile``.
    """
    from .portable import prefill as _pf
    from .sm90 import prefill as _sm90

    if isinstance(cfg, _sm90.Sm90PrefillConfig):
        return get_compiled("prefill_sm90", cfg, _sm90.compile)
    return get_compiled("prefill", cfg, _pf.compile)
