"""Look at what the kernels compile to: PTX, SASS and an instruction summary.

Everything here works on a machine without a GPU: kernels are cross-compiled for
an explicit target architecture (``sm_90a``, ``sm_100a``, ``sm_103a``), which is
how the SM100 builds of this package are checked.

Example::

    from cutedsl_attn import inspect as ci
    text = ci.ptx("decode", "sm_100a", head_dim=128, page_size=16, group_size=4)
    print(ci.instruction_summary(text))

Command line: ``python -m cutedsl_attn ptx decode --head-dim 128 --arch sm_100a``.

Config keys of op ``"decode"`` (a :class:`cutedsl_attn.planning.decode.DecodeProblem` plus the decode
kernel's ``Tiles``; dispatch's defaults for anything not given):

===================== ============================================= ===========
key                   values                                        default
===================== ============================================= ===========
``dtype``             ``"bfloat16"``/``"bf16"``, ``"float16"``/      ``bfloat16``
                      ``"fp16"``/``"half"``, or a torch dtype
``head_dim``          32, 64, 128, 256                              128
``page_size``         >= 1                                          16
``group_size``        query heads per kv head, 1..16                4
``pos_encoding_mode`` ``"NONE"``, ``"ROPE_LLAMA"``, ``"ALIBI"``     ``NONE``
``use_soft_cap``      bool                                          False
``use_sinks``         bool                                          False
``num_warps``         1, 2, 4, 8 (a field of the kernel's tiles)    dispatch's
``num_stages``        2..6 (a field of the kernel's tiles)          dispatch's
===================== ============================================= ===========

Config keys of op ``"prefill"`` (a :class:`cutedsl_attn.planning.prefill.PrefillProblem`; the kernel and
its tiles are what :func:`cutedsl_attn.dispatch.prefill_choice` picks for ``arch``: the SM90 TMA + wgmma
kernel on ``sm_90a`` where it applies, else the portable one):

===================== ============================================= ===========
key                   values                                        default
===================== ============================================= ===========
``dtype``             as decode                                     ``bfloat16``
``head_dim_qk``       32, 64, 128, 192, 256                         128
``head_dim_vo``       32, 64, 128, 256                              head_dim_qk (128 for 192)
``group_size``        query heads per kv head, 1..16                4
``page_size``         0 (ragged K/V) or >= 1 (paged)                0
``causal``            bool                                          False
``use_window``        bool                                          False
``use_soft_cap``      bool                                          False
``use_sinks``         bool                                          False
``use_custom_mask``   bool                                          False
``pos_encoding_mode`` ``"NONE"``, ``"ROPE_LLAMA"``, ``"ALIBI"``     ``NONE``
``score_mod``         a Python callable traced into the logits      None
``kv_dtype``          ``""`` (the cache has ``dtype``) or            ``""``
                      ``"float8_e4m3fn"``/``"fp8"`` (paged only: the
                      portable kernel widens e4m3 in shared memory)
``kernel``            ``"auto"``, ``"portable"``, ``"sm90"``,        ``auto``
                      ``"sm100"`` (the tcgen05 kernel, ``sm_100a`` /
                      ``sm_103a``)
===================== ============================================= ===========

Config keys of op ``"mla"`` (a :class:`cutedsl_attn.planning.mla.MlaProblem`; the kernel
:func:`cutedsl_attn.dispatch.mla_choice` picks, the SM90 one on ``sm_90a`` at page 64, with its tiles, ``head_dim_ckv`` 512 / ``head_dim_kpe`` 64):

===================== ============================================= ===========
key                   values                                        default
===================== ============================================= ===========
``dtype``             q's: as decode, or ``"float8_e4m3fn"`` (fp8    ``bfloat16``
                      q over fp8 caches, bf16 output)
``kv_dtype``          ``""`` (the caches have ``dtype``) or          ``""``
                      ``"float8_e4m3fn"``/``"fp8"``
``page_size``         1..64                                         64
``causal``            bool (bottom-right mask of multi-token rows)  False
===================== ============================================= ===========

Config keys of op ``"gdn"`` (a :class:`cutedsl_attn.planning.gdn.GdnProblem`; the kernel and tiles are what
:func:`cutedsl_attn.dispatch.gdn_choice` picks: the chunked kernel for GDN / GDP prefill, the per-channel chunked
kernel for KDA / GDN-2 prefill, the recurrent kernel for the decode step):

===================== ============================================= ===========
key                   values                                        default
===================== ============================================= ===========
``dtype``             as decode (q / k / v / output)                ``bfloat16``
``head_dim_k``        64, 128                                       128
``head_dim_v``        64, 128                                       128
``state_dtype``       ``"float32"``, ``"bfloat16"``                 ``float32``
``gate_domain``       ``"linear"`` (alpha), ``"log"`` (log alpha)   ``linear`` (``log`` with
                                                                    ``gate_per_channel``)
``use_qk_l2norm``     bool                                          False
``decode``            bool (the decode step: recurrent kernel)      False
``state_k_major``     bool (``[*, HO, K, V]`` state: recurrent)     False
``gate_per_channel``  bool (GDN-2, KDA: the per-channel chunked     False
                      kernel for prefill)
``erase_write_gates`` bool (GDN-2; needs ``gate_per_channel``)      False
``num_householder``   1..8 (Gated DeltaProduct: chunked on the      1
                      expanded timeline)
``chains``            N * HO of the launch (the default tiles       None (many)
                      depend on it)
===================== ============================================= ===========

The environment is not consulted for the target (``arch`` is explicit), but the dispatch layer's
switches are: ``CUTEDSL_ATTN_PREFILL_KERNEL=portable`` makes ``kernel="auto"`` pick the portable kernel
(an explicit ``kernel="sm90"`` overrides it), ``CUTEDSL_ATTN_GDN_KERNEL`` forces a GDN kernel,
``CUTEDSL_ATTN_MLA_KERNEL`` an MLA one, and the tuning
hooks (``CUTEDSL_ATTN_*_TUNE``) override the chosen kernel's tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile
import threading

from .compile.cubin import cubin_kernel_resources, cubin_resources
from .ptx_summary import SUMMARY_KEYS, format_summary, instruction_summary  # noqa: F401 (re-exported)

__all__ = ["OPS", "DEFAULTS", "config", "ptx", "sass", "resources", "shared_memory", "prep_plan", "ctas_per_sm",
           "cubin_resources", "cubin_kernel_resources", "cubin_static_shared", "instruction_summary", "format_summary",
           "SUMMARY_KEYS", "SMEM_FIELDS", "CTA_FIELDS"]

#: Kernel families this module can build.
OPS = ("decode", "prefill", "mla", "gdn")

#: Default config of each op (what ``ptx(op)`` compiles when no key is given).
DEFAULTS = {
    "decode": dict(
        dtype="bfloat16", head_dim=128, page_size=16, group_size=4, pos_encoding_mode="NONE",
        use_soft_cap=False, use_sinks=False, num_warps=None, num_stages=None, kv_dtype="", kernel="auto",
    ),
    "prefill": dict(
        dtype="bfloat16", head_dim_qk=128, head_dim_vo=None, group_size=4, page_size=0, causal=False,
        use_window=False, use_soft_cap=False, use_sinks=False, use_custom_mask=False, pos_encoding_mode="NONE",
        score_mod=None, kv_dtype="", kernel="auto",
    ),
    "mla": dict(dtype="bfloat16", kv_dtype="", page_size=64, causal=False),
    "gdn": dict(
        dtype="bfloat16", head_dim_k=128, head_dim_v=128, state_dtype="float32", gate_domain=None,
        use_qk_l2norm=False, decode=False, state_k_major=False, gate_per_channel=False, erase_write_gates=False,
        num_householder=1, chains=None,
    ),
}

_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16",
}
_FP8_ALIASES = {"float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
                "torch.float8_e4m3fn": "float8_e4m3fn"}

_compile_lock = threading.Lock()


# ----------------------------------------------------------------------------- configs
def _dtype_name(value) -> str:
    key = str(value).strip().lower() if not isinstance(value, str) else value.strip().lower()
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    raise ValueError(f"dtype must be one of 'bfloat16' ('bf16') or 'float16' ('fp16', 'half'), got {value!r}")


def _fp8_or_dtype_name(name: str, value, *, empty: bool) -> str:
    """``value`` as ``"float8_e4m3fn"`` or a 16-bit dtype name (``empty``: ``""`` / None too, given back as ``""``).
    ValueError naming ``name`` otherwise."""
    if empty and (value is None or value == ""):
        return ""
    key = str(value).strip().lower()
    if key in _FP8_ALIASES:
        return _FP8_ALIASES[key]
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    allowed = "'' (the query's dtype), " if empty else ""
    raise ValueError(f"{name} must be {allowed}'float8_e4m3fn' ('fp8'), 'bfloat16' or 'float16', got {value!r}")


def config(op: str = "decode", arch: str = "sm_90a", **cfg):
    """The kernel configuration object that :func:`ptx` / :func:`sass` compile.

    Args:
      op: kernel family, one of :data:`OPS` (``"decode"``: the paged-decode kernel, ``kernel="sm100"`` the
        tcgen05 one on ``sm_100a`` / ``sm_103a``; ``"prefill"``: the prefill kernel the dispatch layer picks for
        ``arch`` (the SM90 TMA + wgmma kernel on ``sm_90a`` where it applies, else the portable one, which
        also serves an fp8 ``kv_dtype``; ``kernel="portable"``, ``"sm90"`` or ``"sm100"`` (the tcgen05
        kernel, ``sm_100a`` / ``sm_103a``) forces one); ``"mla"``: the MLA decode kernel
        :func:`cutedsl_attn.dispatch.mla_choice` picks (the SM90 one on ``sm_90a`` at page size 64, fp8 caches
        included, and at smaller page sizes dividing 64 for 16-bit caches: the head count is not known here, so
        the choice of 64 heads and more, with the 64-row tiles; else the portable one; ``CUTEDSL_ATTN_MLA_KERNEL=portable|sm90`` forces one); ``"gdn"``:
        the gated-delta-rule kernel dispatch picks (a chunked kernel for GDN / GDP prefill, the per-channel
        chunked one for KDA / GDN-2 prefill, recurrent for the decode step and a K-major state), keys as
        :data:`DEFAULTS`).
      arch: target architecture, any spelling accepted by
        :func:`cutedsl_attn.compile.normalize_arch` (``"sm_90a"``, ``"sm_100a"``,
        ``"sm_103a"``, ``"hopper"``, ``"blackwell"``, ...).  Always explicit: the
        environment (``CUTEDSL_ATTN_ARCH``) and the local GPU are not consulted (the dispatch
        layer's switches are, see the module docstring, and the SM90 prefill kernel's persistent
        grid takes the local GPU's SM count, 132 without a GPU).
      **cfg: config keys (see the module docstring); unset keys take :data:`DEFAULTS`.

    Returns:
      The kernel's frozen ``Config(problem, tiles)`` as dispatch builds it (``problem`` a
      :class:`~cutedsl_attn.planning.decode.DecodeProblem`,
      :class:`~cutedsl_attn.planning.prefill.PrefillProblem`, :class:`~cutedsl_attn.planning.mla.MlaProblem`
      or :class:`~cutedsl_attn.planning.gdn.GdnProblem`).

    Raises:
      ValueError: unknown ``op``, unknown ``arch``, a value the kernel does not support (bad dtype,
        head_dim, group_size, ...; a problem no MLA / GDN kernel serves), or ``kernel="sm90"`` /
        ``kernel="sm100"`` for a problem that kernel cannot serve (the message names its reason, e.g. the arch,
        head_dim 32, RoPE, an fp8 cache).
      TypeError: an unknown config key, or a non-int size (a non-bool flag of ``"mla"`` / ``"gdn"``).
      NotImplementedError: an fp8 prefill ``kv_dtype`` with ragged K/V (``page_size`` 0), as
        :class:`~cutedsl_attn.planning.prefill.PrefillProblem` refuses it.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; supported: {OPS}")
    from .compile import normalize_arch

    arch = normalize_arch(arch)
    unknown = sorted(set(cfg) - set(DEFAULTS[op]))
    if unknown:
        raise TypeError(f"unknown config key(s) for op {op!r}: {unknown}; known: {sorted(DEFAULTS[op])}")
    merged = {**DEFAULTS[op], **{k: v for k, v in cfg.items() if v is not None or DEFAULTS[op][k] is None}}
    import torch

    from . import dispatch

    if op == "mla":
        return _mla_config(dispatch, arch, merged)
    if op == "gdn":
        return _gdn_config(dispatch, arch, merged)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[_dtype_name(merged["dtype"])]
    if op == "prefill":
        kernel = merged["kernel"]
        if kernel not in ("auto", "portable", "sm90", "sm100"):
            raise ValueError(f"kernel must be 'auto', 'portable', 'sm90' or 'sm100', got {kernel!r}")
        dqk = merged["head_dim_qk"]
        problem = dispatch.prefill_problem(
            # head_dim_vo defaults to head_dim_qk, except 192 (DeepSeek's 192/128 prefill), as the CLI
            dtype=torch_dtype, head_dim_qk=dqk, head_dim_vo=merged["head_dim_vo"] or (128 if dqk == 192 else dqk),
            group_size=merged["group_size"], page_size=merged["page_size"], causal=bool(merged["causal"]),
            use_window=bool(merged["use_window"]), use_soft_cap=bool(merged["use_soft_cap"]),
            use_sinks=bool(merged["use_sinks"]), use_custom_mask=bool(merged["use_custom_mask"]),
            pos_encoding_mode=merged["pos_encoding_mode"], score_mod=merged["score_mod"], arch=arch,
            kv_dtype=_fp8_or_dtype_name("kv_dtype", merged["kv_dtype"], empty=True),
        )
        choice = dispatch.prefill_choice(problem, kernel=kernel)
        forced = {"sm90": (_SM90_PREFILL, "SM90"), "sm100": (_SM100_PREFILL, "SM100")}.get(kernel)
        if forced is not None and choice.name != forced[0]:  # dispatch fell back to the portable kernel
            module = _kernel_module_named(dispatch, forced[0])
            reason = (module.unsupported_reason(problem) if module is not None else "not available") or (
                "dispatch picked the portable kernel")
            raise ValueError(f"the {forced[1]} prefill kernel cannot serve this config: {reason}")
        return choice.cfg
    for k in ("head_dim", "page_size", "group_size"):
        if isinstance(merged[k], bool) or not isinstance(merged[k], int):
            raise ValueError(f"{k} must be an int, got {merged[k]!r}")
    if merged["pos_encoding_mode"] not in ("NONE", "ROPE_LLAMA", "ALIBI"):
        raise ValueError(
            f"pos_encoding_mode must be 'NONE', 'ROPE_LLAMA' or 'ALIBI', got {merged['pos_encoding_mode']!r}"
        )
    problem = dispatch.decode_problem(
        dtype=torch_dtype, head_dim=merged["head_dim"], page_size=merged["page_size"],
        group_size=merged["group_size"], pos_encoding_mode=merged["pos_encoding_mode"],
        use_soft_cap=bool(merged["use_soft_cap"]), use_sinks=bool(merged["use_sinks"]), arch=arch,
        kv_dtype=_fp8_or_dtype_name("kv_dtype", merged["kv_dtype"], empty=True),
    )
    kernel = merged["kernel"]
    if kernel not in ("auto", "portable", "sm100"):
        raise ValueError(f"decode kernel must be 'auto', 'portable' or 'sm100', got {kernel!r}")
    choice = dispatch.decode_choice(problem, kernel=kernel)
    if kernel == "sm100" and choice.name == "paged_decode":
        sm100 = _kernel_module_named(dispatch, "paged_decode_sm100")
        reason = sm100.unsupported_reason(problem) if sm100 is not None else "not available"
        raise ValueError(f"the SM100 decode kernel cannot serve this config: {reason}")
    cfg = choice.cfg
    explicit = {k: merged[k] for k in ("num_warps", "num_stages") if merged[k] is not None}
    if explicit:
        missing = sorted(set(explicit) - {f.name for f in dataclasses.fields(cfg.tiles)})
        if missing:
            raise TypeError(f"the decode kernel's tiles have no field(s) {missing}")
        # the kernel's Config re-checks the combination (ValueError naming the rule)
        cfg = dataclasses.replace(cfg, tiles=dataclasses.replace(cfg.tiles, **explicit))
    return cfg


def _mla_config(dispatch, arch: str, merged: dict):
    """The Config of the MLA decode kernel :func:`cutedsl_attn.dispatch.mla_choice` picks for ``arch`` (the SM90
    one on ``sm_90a`` at page size 64, fp8 caches included, else the portable one; dispatch's tiles; the problem
    built here, not by ``dispatch.mla_problem``, which takes the target from the environment)."""
    from .planning.mla import MlaProblem

    problem = MlaProblem(dtype=_fp8_or_dtype_name("dtype", merged["dtype"], empty=False),
                         page_size=merged["page_size"], causal=merged["causal"], arch=arch,
                         kv_dtype=_fp8_or_dtype_name("kv_dtype", merged["kv_dtype"], empty=True))
    try:
        return dispatch.mla_choice(problem)[1]
    except NotImplementedError as e:  # no MLA kernel for this arch / problem
        raise ValueError(str(e)) from None


def _gdn_config(dispatch, arch: str, merged: dict):
    """The Config of the GDN kernel :func:`cutedsl_attn.dispatch.gdn_choice` picks for the problem on ``arch``."""
    from .planning.gdn import GdnProblem

    chains = merged.pop("chains")
    if chains is not None and (isinstance(chains, bool) or not isinstance(chains, int) or chains < 1):
        raise ValueError(f"chains must be a positive int or None, got {chains!r}")
    if merged["gate_domain"] is None:  # the API's: GDN-2 and KDA take log gates, GDN and GDP linear alphas
        merged["gate_domain"] = "log" if merged["gate_per_channel"] else "linear"
    problem = GdnProblem(**dict(merged, dtype=_dtype_name(merged["dtype"])), arch=arch)
    try:
        return dispatch.gdn_choice(problem, chains=chains)[1]
    except NotImplementedError as e:  # no GDN kernel serves this problem
        raise ValueError(str(e)) from None


_SM90_PREFILL = "prefill_sm90"  # the SM90 prefill kernel's NAME
_SM100_PREFILL = "prefill_sm100"  # the SM100 (tcgen05) prefill kernel's NAME


def _kernel_module_named(dispatch, name: str):
    """The kernel module of ``dispatch.KERNEL_MODULES`` whose ``NAME`` is ``name`` (None when absent)."""
    mods = dispatch.KERNEL_MODULES
    for m in (mods.values() if isinstance(mods, dict) else mods):
        if getattr(m, "NAME", None) == name:
            return m
    return None


def _builder(cfg):
    """The ``compile`` of the kernel module that builds ``cfg`` (dispatch's map)."""
    from . import dispatch

    return dispatch.kernel_module(cfg).compile


def _cfg_arch(cfg) -> str:
    from .compile import config_arch

    return config_arch(cfg)


# ----------------------------------------------------------------------------- compile + artifacts
def _read_artifact(value, dump_dir: str, ext: str, binary: bool):
    """``compiled.artifacts.PTX/CUBIN`` holds the content, or a path when the dump failed."""
    if isinstance(value, bytes) and binary and len(value) > 64:
        return value
    if isinstance(value, str) and not binary and ".target" in value:
        return value
    candidates = []
    if isinstance(value, str) and len(value) < 4096 and os.path.isfile(value):
        candidates.append(value)
    candidates += sorted(glob.glob(os.path.join(dump_dir, f"*.{ext}")))
    for path in candidates:
        with open(path, "rb" if binary else "r") as f:
            return f.read()
    return None


def _compile_artifacts(cfg, want_cubin: bool):
    build = _builder(cfg)
    with _compile_lock, tempfile.TemporaryDirectory(prefix="cutedsl_attn_inspect_") as d:
        compiled = build(cfg, keep_ptx_dir=d, keep_cubin=want_cubin)
        arts = compiled.artifacts
        ptx_text = _read_artifact(getattr(arts, "PTX", None), d, "ptx", binary=False)
        cubin = _read_artifact(getattr(arts, "CUBIN", None), d, "cubin", binary=True) if want_cubin else None
    if ptx_text is None:
        raise RuntimeError(f"the compiler produced no PTX for {cfg} (dump directory was empty)")
    if want_cubin and cubin is None:
        raise RuntimeError(f"the compiler produced no cubin for {cfg} (keep_cubin wrote nothing)")
    return ptx_text, cubin


@functools.lru_cache(maxsize=64)
def _ptx_cached(cfg) -> str:
    return _compile_artifacts(cfg, want_cubin=False)[0]


@functools.lru_cache(maxsize=16)
def _artifacts_cached(cfg) -> tuple[str, bytes]:
    return _compile_artifacts(cfg, want_cubin=True)


def _cubin_cached(cfg) -> bytes:
    return _artifacts_cached(cfg)[1]


#: the config properties that plan a launch's dynamic shared memory (bytes per CTA), where a kernel has them
SMEM_FIELDS = ("smem_bytes", "prep_smem_bytes", "main_smem_bytes")
#: the CTAs an SM each kernel of a two-kernel (prep + main) launch is planned for, where its config plans them
CTA_FIELDS = ("prep_ctas_per_sm", "main_ctas_per_sm")


def _kernel_name(cfg):
    """The ``NAME`` of the kernel module whose Config ``cfg`` is (None for another object)."""
    from . import dispatch

    try:
        return getattr(dispatch.kernel_module(cfg), "NAME", None)
    except TypeError:
        return None


def prep_plan(cfg) -> dict[str, int]:
    """The prep kernel of a chunked delta-rule launch (a prep kernel over every chunk, then the main kernel):
    ``prep_smem_bytes``, the dynamic shared memory its launch plans (bytes per CTA), and ``prep_ctas_per_sm``, the
    CTAs an SM it is planned for; ``{}`` for a config without a separate prep kernel.  No compile.

    * SM90 chunked GDN (``gdn_chunked_sm90``): its config carries no prep figure; ``Tiles.prep = 1`` launches the
      SM90 prep (:func:`cutedsl_attn.sm90.gdn_prep.prep_sm90_smem_bytes`, the budget that bounds its shared
      storage), ``prep = 0`` the shared one (:func:`cutedsl_attn.common.gdn_prep.prep_smem_bytes`), both with
      ``min_blocks_per_mp = PREP_CTAS_PER_SM``;
    * the per-channel kernels (``kda_chunked_sm90``, ``kda_chunked``): the config's ``prep_smem_bytes``, its
      layout's ``Tiles.prep_ctas``;
    * the portable chunked GDN (``gdn_chunked``): the config's ``prep_smem_bytes`` only (its prep launch plans no
      CTA count: occupancy decides).
    """
    name = _kernel_name(cfg)
    if name == "gdn_chunked_sm90":
        from .common.gdn_prep import PREP_CTAS_PER_SM, prep_smem_bytes
        from .sm90.gdn_prep import prep_sm90_smem_bytes

        k, v = cfg.problem.head_dim_k, cfg.problem.head_dim_v
        smem = prep_sm90_smem_bytes(k, v) if cfg.tiles.prep == 1 else prep_smem_bytes(k, v)
        return {"prep_smem_bytes": smem, "prep_ctas_per_sm": PREP_CTAS_PER_SM}
    if name in ("kda_chunked_sm90", "kda_chunked"):
        return {"prep_smem_bytes": cfg.prep_smem_bytes, "prep_ctas_per_sm": cfg.tiles.prep_ctas}
    if name == "gdn_chunked":
        return {"prep_smem_bytes": cfg.prep_smem_bytes}
    return {}


def ctas_per_sm(cfg) -> dict[str, int]:
    """The :data:`CTA_FIELDS` a config plans: ``prep_ctas_per_sm`` (:func:`prep_plan`) and ``main_ctas_per_sm``
    (the main kernel's, where its config has the property: the SM90 chunked GDN's persistent grid multiple).  No
    compile."""
    out = {n: v for n, v in prep_plan(cfg).items() if n in CTA_FIELDS}
    main = getattr(cfg, "main_ctas_per_sm", None)
    if type(main) is int:
        out["main_ctas_per_sm"] = main
    return out


def cubin_static_shared(cubin: bytes) -> dict[str, int]:
    """``{kernel symbol: bytes}`` of the static shared memory each kernel of ``cubin`` declares (the size of its
    ``.nv.shared.<symbol>`` ELF section; kernels without one are absent).  The dynamic shared memory is a launch
    parameter, not in the cubin.  Raises ``ValueError`` for a blob that is not a 64-bit ELF."""
    import struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = [cubin[heads[shstrndx][4] + h[0]: cubin.index(b"\0", heads[shstrndx][4] + h[0])].decode() for h in heads]
    return {n[len(".nv.shared."):]: h[5] for n, h in zip(names, heads)
            if n.startswith(".nv.shared.") and not n.startswith(".nv.shared.reserved")}


def shared_memory(cfg) -> dict[str, int]:
    """The shared memory (bytes per CTA) of one compiled configuration: ``static_smem_bytes`` (the largest static
    declaration over the cubin's kernels, :func:`cubin_static_shared`; 0 for none) and the dynamic shared memory
    the launch requests, from the config's :data:`SMEM_FIELDS` where it has them (``smem_bytes``, or a two-kernel
    launch's ``prep_smem_bytes`` / ``main_smem_bytes``; the prep's from :func:`prep_plan` where the config has no
    property for it), or 0 where its PTX declares no dynamic shared memory; ``smem_bytes`` is static + the largest
    dynamic figure.  Compiles like :func:`resources` (memoised)."""
    ptx_text, cubin = _artifacts_cached(cfg)
    static = max(cubin_static_shared(cubin).values(), default=0)
    prep = prep_plan(cfg)
    planned = {}
    for n in SMEM_FIELDS:
        v = getattr(cfg, n, None)
        v = v if type(v) is int else prep.get(n)
        if type(v) is int:
            planned[n] = v
    out = {"static_smem_bytes": static}
    if planned:
        out.update({n: v for n, v in planned.items() if n != "smem_bytes"})
        out["smem_bytes"] = static + max(planned.values())
    elif not re.search(r"\.extern\s+\.shared", ptx_text):  # no dynamic shared memory at all
        out["smem_bytes"] = static
    return out


def ptx(op: str = "decode", arch: str = "sm_90a", **config_kw) -> str:
    """PTX text of one kernel configuration, cross-compiled for ``arch`` (no GPU needed).

    Args:
      op: kernel family, one of :data:`OPS`.
      arch: target, e.g. ``"sm_90a"`` (default), ``"sm_100a"``, ``"sm_103a"``.
      **config_kw: config keys of ``op`` (decode: ``dtype``, ``head_dim``, ``page_size``,
        ``group_size``, ``pos_encoding_mode``, ``use_soft_cap``, ``use_sinks``, ``num_warps``,
        ``num_stages``; prefill: ``dtype``, ``head_dim_qk``, ``head_dim_vo``, ``group_size``,
        ``page_size``, ``causal``, ``use_window``, ``use_soft_cap``, ``use_sinks``,
        ``use_custom_mask``, ``pos_encoding_mode``, ``kv_dtype``, ``kernel``; mla: ``dtype``, ``kv_dtype``,
        ``page_size``, ``causal``; gdn: the :class:`~cutedsl_attn.planning.gdn.GdnProblem` fields but
        ``arch``, and ``chains``); see the module docstring for values and defaults.

    Returns:
      The PTX module text (starts with the NVVM header, has ``.target <arch>``).
      Results are memoised per kernel configuration in this process; a first call costs one
      compile (~2-5 s).

    Raises:
      ValueError: unknown op / arch / unsupported config value.
      TypeError: unknown config key.
      NotImplementedError: as :func:`config`.
      RuntimeError: the compiler wrote no PTX.
      Any compiler error (the DSL's own exception types).
    """
    return _ptx_cached(config(op, arch, **config_kw))


def resources(op: str = "decode", arch: str = "sm_90a", **config_kw) -> dict[str, int]:
    """``{"registers": ..., "stack_bytes": ..., "static_smem_bytes": ..., "smem_bytes": ...}`` of one kernel
    configuration (see :func:`cubin_resources` and :func:`shared_memory`; ``smem_bytes`` is left out only where
    the config plans no dynamic shared memory its PTX declares).  A two-kernel launch (the chunked GDN / KDA
    kernels: a prep kernel, then the main kernel) reports each kernel's dynamic shared memory
    (``prep_smem_bytes``, ``main_smem_bytes``), each followed by the CTAs an SM it is planned for where the config
    plans them (``prep_ctas_per_sm``, ``main_ctas_per_sm``: :func:`ctas_per_sm`).

    Compiles like :func:`ptx` with ``--keep-cubin`` (the DSL's own assembler: no GPU and no
    CUDA toolkit needed), so spills are visible on a CPU-only machine.  ``registers`` is the launch
    count; the warp-specialised SM90 prefill kernel rebalances them with ``setmaxnreg``, so for it the
    result also holds ``consumer_registers`` and ``producer_registers`` (per thread of a consumer /
    the producer warpgroup, the config's ``registers``).  Raises like :func:`ptx`, plus
    ``RuntimeError`` when the compiler wrote no cubin.
    """
    cfg = config(op, arch, **config_kw)
    res = cubin_resources(_cubin_cached(cfg))
    ctas = ctas_per_sm(cfg)
    for n, v in shared_memory(cfg).items():
        res[n] = v
        kernel_ctas = n.replace("_smem_bytes", "_ctas_per_sm")
        if kernel_ctas in ctas:  # next to that kernel's shared memory
            res[kernel_ctas] = ctas.pop(kernel_ctas)
    res.update(ctas)
    regs = getattr(cfg, "registers", None)
    if regs is None:
        regs = getattr(cfg.tiles, "registers", None)
    if regs is not None:  # a kernel that rebalances registers between warp roles with setmaxnreg
        res["consumer_registers"], res["producer_registers"] = regs
    return res


def _find_tool(name: str):
    """A CUDA binary tool: on PATH, under ``$CUDA_HOME``/``$CUDA_PATH``/``/usr/local/cuda``, or from the
    ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` wheels (``nvidia/*/bin``; the ``test`` extra
    installs them, so SASS checks run on a CPU-only machine too)."""
    path = shutil.which(name)
    if path:
        return path
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels

        for pkg_dir in nvidia.__path__:
            roots += sorted(glob.glob(os.path.join(pkg_dir, "*")))
    except ImportError:
        pass
    for root in roots:
        if root:
            cand = os.path.join(root, "bin", name)
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    return None


def sass(op: str = "decode", arch: str = "sm_90a", **config_kw) -> str:
    """SASS (machine code) of one kernel configuration, disassembled from its cubin.

    Compiles like :func:`ptx` with ``--keep-cubin`` and runs ``cuobjdump --dump-sass``
    (or ``nvdisasm`` when cuobjdump is missing) on the cubin.  The tools come from a
    CUDA toolkit on ``PATH``, ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin`` or
    ``/usr/local/cuda/bin``, or from the ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm``
    wheels (the ``test`` extra installs them); no GPU is needed.

    Args:
      op, arch, **config_kw: as :func:`ptx`.

    Returns:
      The disassembly text.

    Raises:
      RuntimeError: neither ``cuobjdump`` nor ``nvdisasm`` is installed (checked before
        compiling), the compiler wrote no cubin, or the disassembler failed (its
        stderr is in the message; an old toolkit may not know a newer arch).
      ValueError, TypeError: as :func:`ptx`.
    """
    cfg = config(op, arch, **config_kw)
    cuobjdump, nvdisasm = _find_tool("cuobjdump"), _find_tool("nvdisasm")
    if cuobjdump is None and nvdisasm is None:
        raise RuntimeError(
            "sass() needs cuobjdump or nvdisasm from a CUDA toolkit (searched PATH, $CUDA_HOME/bin, "
            "$CUDA_PATH/bin, /usr/local/cuda/bin and the pip nvidia-cuda-* wheels) and found neither; use ptx() "
            "instead, or `pip install nvidia-cuda-cuobjdump` (or a CUDA toolkit's binary utilities)"
        )
    cubin = _cubin_cached(cfg)
    with tempfile.TemporaryDirectory(prefix="cutedsl_attn_sass_") as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        errors = []
        for tool, args in ((cuobjdump, ["--dump-sass"]), (nvdisasm, [])):
            if tool is None:
                continue
            r = subprocess.run([tool, *args, path], capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout
            errors.append(f"{os.path.basename(tool)} exited {r.returncode}: {r.stderr.strip()[:2000]}")
    raise RuntimeError(f"could not disassemble the {_cfg_arch(cfg)} cubin: " + "; ".join(errors))
