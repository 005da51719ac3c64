"""The one place a kernel and a backend are chosen and launched: problems -> kernel choices -> launches.

``api`` modules never import a kernel module, ``compile/`` or ``ref/``: they describe the problem
(:func:`prefill_problem`, :func:`decode_problem`), ask for a :class:`KernelChoice`
(:func:`prefill_choice`, :func:`decode_choice`), build the family's launch arguments
(``PrefillArgs`` / ``DecodeArgs`` of ``cutedsl_attn.planning``) and call :meth:`KernelChoice.launch`.

Decode on SM100 / SM103 runs the tcgen05 kernel (``cutedsl_attn.sm100.decode``) where it applies and has passed
its first-use self-check, the portable SM80-class kernel (``cutedsl_attn.portable.paged_decode``) elsewhere.
Prefill on SM90 runs the TMA + wgmma kernel (``cutedsl_attn.sm90.prefill``) where it applies, on SM100 / SM103
the tcgen05 kernel (``cutedsl_attn.sm100.prefill``) where it applies and has passed its first-use self-check
(``cutedsl_attn.selfcheck``), and the portable kernel (``cutedsl_attn.portable.prefill``) elsewhere.
``backend="cudnn"`` (prefill wrappers) runs cuDNN frontend graphs instead (:func:`prefill_backend`); the decode
wrapper's ``backend`` rule is :func:`decode_backend`.  Backends live in ``dispatch/backends.py``, the gated
delta rule family in ``dispatch/gdn.py``, MLA in ``dispatch/mla.py``; this package re-exports their public names.

Every kernel launch is a torch custom op ``cutedsl_attn::<NAME>`` (:data:`KERNEL_MODULES`' keys), with
a fake implementation: ``torch.compile`` traces through it; eager calls go straight to the kernel
module's ``launch`` (no dispatcher cost).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import torch

from .. import selfcheck as _selfcheck
from ..compile import config_key, device_arch, get_compiled, hash_callable, target_arch
from ..compile import selfcheck as _verdicts
from ..planning.decode import DecodeArgs, DecodeProblem, max_items, occupancy, plan_paged_decode
from ..planning.prefill import PrefillArgs, PrefillProblem
from ..portable import gdn_chunked as _gdn_chunked
from ..portable import gdn_recurrent as _rec
from ..portable import kda_chunked as _kda_chunked
from ..portable import mla_decode as _mla_portable
from ..portable import paged_decode as _paged_decode
from ..portable import prefill as _prefill_portable
from ..sm90 import gdn_chunked as _gdn_chunked_sm90
from ..sm90 import gdn_fused as _gdn_fused_sm90
from ..sm90 import kda_chunked as _kda_chunked_sm90
from ..sm90 import mla as _mla_sm90
from ..sm90 import prefill as _prefill_sm90
from ..sm100 import decode as _decode_sm100
from ..sm100 import prefill as _prefill_sm100
from .backends import DECODE_AUTO_CUDNN, DECODE_BACKENDS, PREFILL_BACKENDS, decode_backend, prefill_backend

__all__ = [
    "KERNEL_MODULES",
    "KernelChoice",
    "KernelEntryError",
    "callable_key",
    "decode_backend",
    "decode_choice",
    "decode_problem",
    "decode_schedule",
    "gdn_arch",
    "gdn_choice",
    "gdn_launch",
    "mla_choice",
    "mla_launch",
    "mla_limits",
    "mla_problem",
    "graph_signature",
    "kernel_module",
    "num_sms",
    "prefill_backend",
    "prefill_choice",
    "prefill_problem",
]

#: every kernel module by its ``NAME`` (the compile-cache and custom-op name)
KERNEL_MODULES = {
    "prefill_sm90": _prefill_sm90,
    "prefill_portable": _prefill_portable,
    "prefill_sm100": _prefill_sm100,
    "paged_decode": _paged_decode,
    "paged_decode_sm100": _decode_sm100,
    "gdn_recurrent": _rec,
    "gdn_chunked": _gdn_chunked,
    "gdn_chunked_sm90": _gdn_chunked_sm90,
    "gdn_fused_sm90": _gdn_fused_sm90,
    "kda_chunked": _kda_chunked,
    "kda_chunked_sm90": _kda_chunked_sm90,
    "mla_decode_portable": _mla_portable,
    "mla_decode_sm90": _mla_sm90,
}

PREFILL_KERNEL_ENV = "CUTEDSL_ATTN_PREFILL_KERNEL"
PREFILL_TUNE_ENV = "CUTEDSL_ATTN_PREFILL_TUNE"
DECODE_KERNEL_ENV = "CUTEDSL_ATTN_DECODE_KERNEL"
DECODE_TUNE_ENV = "CUTEDSL_ATTN_DECODE_TUNE"
DECODE_MIN_WAVES_ENV = "CUTEDSL_ATTN_DECODE_MIN_WAVES"

_TORCH_TO_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_is_compiling = torch.compiler.is_compiling
_profiler = torch.autograd.profiler  # ._is_profiler_enabled: a module flag, read per launch (cheap)


# ----------------------------------------------------------------------------- small shared pieces
@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None = None) -> int:
    """Multiprocessor count of a CUDA device (the current one for None); 132 (H100 SXM / H200) without a GPU."""
    if not torch.cuda.is_available():
        return 132
    idx = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(idx).multi_processor_count


def callable_key(fn) -> str:
    """The compile-key digest of a user callable (a ``score_mod``): source, closure values, referenced globals.

    Raises TypeError for a callable without a stable key (e.g. an object with ``__call__``; give it
    ``__cute_hash__``)."""
    return hash_callable(fn)


def _dtype_name(dtype) -> str:
    """A torch dtype as its name (``torch.bfloat16`` -> ``"bfloat16"``); a string as given."""
    if isinstance(dtype, str):
        return dtype
    return _TORCH_TO_NAME.get(dtype) or str(dtype).replace("torch.", "")


def kernel_module(cfg):
    """The kernel module whose ``Config`` ``cfg`` is (for builds of a given configuration).

    Raises TypeError for anything else."""
    for m in KERNEL_MODULES.values():
        cls = getattr(m, "Config", None)
        if cls is not None and isinstance(cfg, cls):
            return m
    raise TypeError(f"{type(cfg).__qualname__} is not the Config of a kernel module ({sorted(KERNEL_MODULES)})")


def _parse_tune(var: str, text: str, fields) -> dict[str, str]:
    """``"key=value,..."`` of a tuning variable as ``{key: value}`` (strings; the kernel module parses values).

    Raises ValueError naming ``var`` for an item that is not ``key=value`` or a key outside ``fields``."""
    out: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, val = (x.strip() for x in item.partition("="))
        if not sep or key not in fields:
            raise ValueError(f"{var}: {item!r} is not key=value with key in {tuple(fields)}")
        out[key] = val
    return out


def _override(module, var: str, text: str, tiles, items: dict[str, str]):
    """``module.override_tiles(tiles, items)``; a refused value or combination names the variable."""
    try:
        return module.override_tiles(tiles, items)
    except ValueError as e:
        raise ValueError(f"{e} (with {var}={text!r}; for this problem the default tiles are {tiles})") from None


# ----------------------------------------------------------------------------- the choice
class KernelEntryError(ValueError):
    """A compiled kernel's entry refused an argument (layout, alignment, device); the message names the
    argument by its ``PrefillArgs`` / ``DecodeArgs`` field.  :meth:`named` renames the fields (the API's
    argument names)."""

    def __init__(self, template: str, fields: tuple[str, ...]):
        self.template, self.fields = template, fields
        super().__init__(self._render({}))

    def _render(self, names: dict[str, str]) -> str:
        text = self.template
        for f in self.fields:
            text = text.replace(f"\x00{f}\x00", names.get(f, f))
        return text

    def named(self, names: dict[str, str]) -> ValueError:
        """A plain ValueError with the fields renamed by ``names`` (``{field: api_name}``)."""
        return ValueError(self._render(names))


_ENTRY_HINT = ("(inputs must be CUDA tensors with a contiguous last dim, 16-byte aligned pointers and strides; "
               "out and lse contiguous)")


class _Recording:
    """Stands in for a compiled kernel to learn the order in which ``launch`` passes the arguments."""

    def __call__(self, *a):
        self.args = a


def _entry_error(e: ValueError, choice: "KernelChoice", args) -> KernelEntryError:
    """The tvm-ffi entry's message (positions ``argument #3``, parameter names ``mK``) in the args' field names."""
    import re

    rec = _Recording()
    choice.module.launch(rec, choice.cfg, args)  # the kernel's own argument order
    position = {}
    for i, a in enumerate(getattr(rec, "args", ())):
        if isinstance(a, torch.Tensor):
            for f in args._fields:  # the first field holding that very tensor (dummies are shared)
                if getattr(args, f) is a:
                    position[i] = f
                    break
    params = {"mQ": "q", "mK": "k", "mV": "v", "mIdx": "indices", "mWork": "work", "mO": "out", "mLSE": "lse",
              "mMask": "mask", "mSinks": "sinks", "mAlibi": "alibi_slopes", "mPartO": "part_o",
              "mPartLSE": "part_lse", "mCounters": "counters"}
    text = str(e).replace("\x00", "")
    head, _, tail = text.partition(" when calling")
    reason = tail.split("`", 2)[-1].strip(" :,.\n") if "`" in tail else tail.strip(" :,.\n")
    used = set()

    def pos(m):
        f = position.get(int(m.group(1)))
        if f is None:
            return m.group(0)
        used.add(f)
        return f"argument \x00{f}\x00"

    msg = re.sub(r"argument #(\d+)", pos, head)
    for pname, f in params.items():
        if re.search(rf"\b{pname}\b", msg):
            used.add(f)
            msg = re.sub(rf"\b{pname}\b", f"\x00{f}\x00", msg)
    if reason:
        msg = f"{msg}: {reason[:300]}"
    return KernelEntryError(f"{msg} {_ENTRY_HINT}", tuple(sorted(used)))


_BY_KEY: dict[str, "KernelChoice"] = {}  # graph_key -> choice: the custom ops find their kernel here


class KernelChoice:
    """A kernel module and its configuration for one problem, with the compiled kernel (lazily) and its launch.

    ``module``: the kernel module; ``name``: its ``NAME``; ``problem``: the ``PrefillProblem`` /
    ``DecodeProblem``; ``cfg``: ``module.Config(problem, tiles)``, the compile key; ``tile_m``: packed rows per
    CTA (prefill: the work table's tile height); ``fn``: the compiled callable (compiled or loaded on first
    use, cached here); ``graph_key``: the string a captured CUDA graph of this choice depends on.
    """

    __slots__ = ("module", "name", "problem", "tiles", "cfg", "_fn", "_key", "_sinks", "_positive_only", "_op")

    def __init__(self, module, problem, tiles):
        self.module = module
        self.name = module.NAME
        self.problem = problem
        self.tiles = tiles
        self.cfg = module.Config(problem, tiles)
        self._fn = None
        self._key = f"{self.name}:{config_key(self.cfg)}"  # now, not while torch.compile traces a launch
        _BY_KEY.setdefault(self._key, self)
        self._sinks = None
        self._positive_only = bool(getattr(self.cfg, "positive_scale_only", False))
        self._op = _OPS[self.name]

    def __repr__(self) -> str:
        return f"KernelChoice({self.name}, {self.cfg!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, KernelChoice) and self.name == other.name and self.cfg == other.cfg

    def __hash__(self) -> int:
        return hash((self.name, self.cfg))

    @property
    def tile_m(self) -> int:
        return self.cfg.tile_m

    @property
    def fn(self):
        """The compiled kernel (compiled on first use, cached).  Raises TypeError naming ``score_mod`` when the
        DSL cannot trace the problem's ``score_mod`` (a data-dependent Python ``if``, say), instead of the DSL's
        own error class."""
        fn = self._fn
        if fn is None:
            try:
                fn = self._fn = get_compiled(self.name, self.cfg, self.module.compile)
            except Exception as e:  # noqa: BLE001 - only the DSL's tracing errors of a user score_mod are renamed
                mod = getattr(self.problem, "score_mod", None)
                if mod is None or not type(e).__module__.startswith("cutlass"):
                    raise
                name = getattr(mod, "__name__", repr(mod))
                raise TypeError(f"score_mod {name!r} could not be traced into the {self.name} kernel (it must be "
                                f"straight-line tensor arithmetic on its arguments, no Python branch on them): "
                                f"{type(e).__name__}: {e}") from e
        return fn

    @property
    def graph_key(self) -> str:
        return self._key

    def with_sinks(self) -> "KernelChoice":
        """The same kernel and tiles for the problem with attention sinks (``use_sinks=True``)."""
        if self.problem.use_sinks:
            return self
        c = self._sinks
        if c is None:
            c = self._sinks = KernelChoice(self.module, dataclasses.replace(self.problem, use_sinks=True),
                                           self.tiles)
        return c

    def launch(self, args) -> None:
        """Launch the kernel on ``args`` (the family's ``PrefillArgs`` / ``DecodeArgs``) on torch's current stream.

        Eager calls go straight to ``module.launch``; under ``torch.compile`` the call is the custom op
        ``cutedsl_attn::<name>`` (the profiler shows that name either way).  Raises NotImplementedError for
        ``args.sm_scale <= 0`` with a kernel that needs a positive softmax scale; :class:`KernelEntryError`
        (a ValueError) when the compiled entry refuses an argument's layout.
        """
        if self._positive_only and args.sm_scale <= 0.0:
            raise NotImplementedError(
                f"q_scale * k_scale <= 0 (sm_scale * q_scale * k_scale = {args.sm_scale}) is not supported by the "
                "SM90 prefill kernel this plan chose (it needs a positive softmax scale); fold the sign into "
                "sm_scale at plan() (a plan with sm_scale <= 0 runs the portable kernel) or set "
                f"{PREFILL_KERNEL_ENV}=portable before plan()"
            )
        if _is_compiling():
            self._op(*args, self._key)
            return
        fn = self._fn
        if fn is None:
            fn = self.fn
        try:
            if _profiler._is_profiler_enabled:
                with torch.profiler.record_function(f"cutedsl_attn::{self.name}"):
                    self.module.launch(fn, self.cfg, args)
            else:
                self.module.launch(fn, self.cfg, args)
        except KernelEntryError:
            raise
        except ValueError as e:
            raise _entry_error(e, self, args) from None


def graph_signature(choice: KernelChoice | None, **scalars) -> dict:
    """What a captured CUDA graph of ``choice`` depends on besides buffer contents: the given plan scalars
    and the choice's :attr:`KernelChoice.graph_key` (``kernel``); ``choice`` None leaves the kernel out.

    Two plans may replay one graph only when their signatures are equal."""
    sig = dict(scalars)
    if choice is not None:
        sig["kernel"] = choice.graph_key
    return sig


# ----------------------------------------------------------------------------- custom ops
def _launch_by_key(key: str, args) -> None:
    choice = _BY_KEY.get(key)
    if choice is None:
        raise RuntimeError(f"cutedsl_attn: no kernel choice with key {key[:120]!r} in this process (a graph traced "
                           "here runs here; plan() again after loading one)")
    choice.module.launch(choice.fn, choice.cfg, args)


def _prefill_op(name: str, mutates: tuple[str, ...]):
    @torch.library.custom_op(f"cutedsl_attn::{name}", mutates_args=mutates)
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, work: torch.Tensor,
           out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, alibi_slopes: torch.Tensor,
           sm_scale: float, soft_cap: float, window_left: int, rope_rcp_scale: float, rope_log2_theta: float,
           output_scale: float, key: str) -> None:
        _launch_by_key(key, PrefillArgs(q, k, v, indices, work, out, lse, mask, sinks, alibi_slopes, sm_scale,
                                        soft_cap, window_left, rope_rcp_scale, rope_log2_theta, output_scale))

    @op.register_fake
    def _(q, k, v, indices, work, out, lse, mask, sinks, alibi_slopes, sm_scale, soft_cap, window_left,
          rope_rcp_scale, rope_log2_theta, output_scale, key) -> None:
        return None

    return op


def _decode_op(name: str):
    @torch.library.custom_op(f"cutedsl_attn::{name}", mutates_args=("out", "lse", "part_o", "part_lse", "counters"))
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, work: torch.Tensor,
           out: torch.Tensor, lse: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, counters: torch.Tensor,
           sinks: torch.Tensor, alibi_slopes: torch.Tensor, sm_scale: float, soft_cap: float, rope_rcp_scale: float,
           rope_log2_theta: float, output_scale: float, key: str) -> None:
        _launch_by_key(key, DecodeArgs(q, k, v, indices, work, out, lse, part_o, part_lse, counters, sinks,
                                       alibi_slopes, sm_scale, soft_cap, rope_rcp_scale, rope_log2_theta,
                                       output_scale))

    @op.register_fake
    def _(q, k, v, indices, work, out, lse, part_o, part_lse, counters, sinks, alibi_slopes, sm_scale, soft_cap,
          rope_rcp_scale, rope_log2_theta, output_scale, key) -> None:
        return None

    return op


_OPS = {
    # the persistent SM90 kernel claims tiles with an atomic counter in the work table (left at 0 after a launch)
    "prefill_sm90": _prefill_op("prefill_sm90", ("out", "lse", "work")),
    "prefill_portable": _prefill_op("prefill_portable", ("out", "lse")),
    "prefill_sm100": _prefill_op("prefill_sm100", ("out", "lse")),
    "paged_decode": _decode_op("paged_decode"),
    "paged_decode_sm100": _decode_op("paged_decode_sm100"),
}


# ----------------------------------------------------------------------------- prefill
def prefill_problem(*, dtype, head_dim_qk: int, head_dim_vo: int, group_size: int, page_size: int = 0,
                    causal: bool = False, use_window: bool = False, use_soft_cap: bool = False,
                    use_sinks: bool = False, use_custom_mask: bool = False, pos_encoding_mode: str = "NONE",
                    score_mod=None, arch: str | None = None, kv_dtype="") -> PrefillProblem:
    """The :class:`~cutedsl_attn.planning.prefill.PrefillProblem` of a plan (``dtype`` / ``kv_dtype``: torch dtypes
    or names, ``kv_dtype`` ``""``: the cache is ``dtype``; ``arch`` None: the compile target,
    :func:`cutedsl_attn.compile.target_arch`).

    Raises TypeError / ValueError / NotImplementedError as ``PrefillProblem``."""
    return PrefillProblem(
        dtype=_dtype_name(dtype), head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, group_size=group_size,
        page_size=page_size, causal=causal, use_window=use_window, use_soft_cap=use_soft_cap, use_sinks=use_sinks,
        use_custom_mask=use_custom_mask, pos_encoding_mode=pos_encoding_mode, score_mod=score_mod,
        arch=arch or target_arch(), kv_dtype=_dtype_name(kv_dtype))


def prefill_choice(problem: PrefillProblem, *, positive_scale: bool = True, kernel: str = "auto") -> KernelChoice:
    """The prefill kernel and tiles for ``problem``.

    ``kernel``: ``"auto"`` (the choice below), ``"portable"`` (always the portable kernel), ``"sm90"`` /
    ``"sm100"`` (that kernel wherever it applies, unchecked, whatever ``CUTEDSL_ATTN_PREFILL_KERNEL`` says; the
    portable kernel where it does not -- callers check ``.name``).  ``positive_scale=False`` (a planned
    ``sm_scale <= 0``) keeps the portable kernel: the SM90 and SM100 kernels fold the softmax scale into the
    exponent after the row max of the raw logits, which needs a positive scale.

    On SM90 the TMA + wgmma kernel serves every problem its ``unsupported_reason`` accepts.  On SM100 / SM103
    the tcgen05 kernel serves the problems it accepts once it passes the first-use self-check on this GPU
    (:func:`cutedsl_attn.selfcheck.admit_prefill`, for the configuration and its sinks twin: ``run()`` with
    sinks launches that on the same work table); it is never chosen without a GPU of the problem's arch
    unless the check is off (``CUTEDSL_ATTN_SELFCHECK=0``) or the configuration is verified.  Everything
    else runs the portable kernel, an fp8 K/V cache (``problem.kv_dtype``) on every arch (the SM90 and SM100
    kernels read 16-bit K/V).  ``CUTEDSL_ATTN_PREFILL_KERNEL=portable`` forces the portable kernel
    (benchmarks compare both).  ``CUTEDSL_ATTN_PREFILL_TUNE`` (``"key=value,..."``, tuning
    experiments) overrides the SM90 kernel's default tiles for every SM90 problem of the process
    (``override_tiles`` of the kernel module).

    Raises ValueError for ``kernel`` outside the four names, for ``CUTEDSL_ATTN_PREFILL_KERNEL`` other than
    ``auto`` / ``portable``, for a ``CUTEDSL_ATTN_PREFILL_TUNE`` item that is not ``key=value`` with a key in
    the SM90 kernel's ``TUNING_FIELDS`` (whichever kernel is picked) or a value / combination it refuses
    (naming the variable); NotImplementedError when no kernel serves the problem.
    """
    if kernel not in ("auto", "portable", "sm90", "sm100"):
        raise ValueError(f"kernel must be 'auto', 'portable', 'sm90' or 'sm100', got {kernel!r}")
    env = tuple(os.environ.get(v) for v in (PREFILL_KERNEL_ENV, PREFILL_TUNE_ENV, _verdicts.SELFCHECK_ENV))
    memo = None if problem.score_mod is not None else ("prefill", problem, positive_scale, kernel, env, num_sms())
    c = _CHOICES.get(memo) if memo is not None else None  # a score_mod's key is re-derived at every plan
    if c is None:
        c = _prefill_choice(problem, positive_scale, kernel)
        if memo is not None:
            _remember(memo, c)
    return c


_CHOICES: dict = {}  # (family, problem, options, environment) -> choice: plans of one shape share it (and its fn)


def _remember(memo, choice) -> None:
    if len(_CHOICES) >= 4096:
        _CHOICES.clear()
    _CHOICES[memo] = choice


def _prefill_choice(problem: PrefillProblem, positive_scale: bool, kernel: str) -> KernelChoice:
    env_kernel = os.environ.get(PREFILL_KERNEL_ENV, "auto") or "auto"
    if env_kernel not in ("auto", "portable"):
        raise ValueError(f"{PREFILL_KERNEL_ENV} must be 'auto' or 'portable', got {env_kernel!r}")
    tune = os.environ.get(PREFILL_TUNE_ENV, "")
    items = _parse_tune(PREFILL_TUNE_ENV, tune, _prefill_sm90.TUNING_FIELDS) if tune.strip() else {}
    if kernel == "auto" and env_kernel == "portable":
        kernel = "portable"
    if (kernel in ("auto", "sm100") and positive_scale and not problem.kv_fp8
            and _prefill_sm100.unsupported_reason(problem) is None):
        c = KernelChoice(_prefill_sm100, problem, _prefill_sm100.default_tiles(problem, num_sms=num_sms()))
        # auto takes it only where the first-use check can build the problem's features (or the check is off)
        checkable = not _verdicts.enabled() or _selfcheck.prefill_refusal(problem) is None
        if kernel == "sm100" or (checkable and _first_use_passed(c)):
            return c
    if kernel in ("auto", "sm90") and positive_scale and _prefill_sm90.unsupported_reason(problem) is None:
        m = _prefill_sm90
        tiles = m.default_tiles(problem, num_sms=num_sms())
        if items:
            tiles = _override(m, PREFILL_TUNE_ENV, tune, tiles, items)
        try:
            return KernelChoice(m, problem, tiles)
        except ValueError as e:
            if items:
                raise ValueError(f"{e} (with {PREFILL_TUNE_ENV}={tune!r})") from None
            raise
    return _portable_choice(problem)


def _portable_choice(problem: PrefillProblem) -> KernelChoice:
    m = _prefill_portable
    reason = m.unsupported_reason(problem)
    if reason is not None:
        raise NotImplementedError(reason)
    return KernelChoice(m, problem, m.default_tiles(problem, num_sms=num_sms()))


_UNCHECKED_WARNED: set = set()


def _first_use_passed(choice: KernelChoice, admit=None, portable=None) -> bool:
    """The SM100 choice and its sinks twin pass the first-use self-check (``admit``: the family's
    ``selfcheck.admit_*``, ``portable``: problem -> the portable kernel's choice; prefill's by default; checked
    here only on a GPU of the problem's arch, outside CUDA-graph capture; elsewhere only a known verdict admits
    it)."""
    if not _verdicts.enabled():
        if choice.name not in _UNCHECKED_WARNED:  # trusted unchecked: say so once a kernel
            _UNCHECKED_WARNED.add(choice.name)
            warnings.warn(f"{_verdicts.SELFCHECK_ENV}=0: {choice.name} (never run on hardware by this package's "
                          "tests) is used without its first-use self-check; unset it, or set "
                          "CUTEDSL_ATTN_PREFILL_KERNEL / CUTEDSL_ATTN_DECODE_KERNEL=portable for verified kernels only",
                          RuntimeWarning, stacklevel=3)
        return True
    admit = admit or _selfcheck.admit_prefill
    portable = portable or _portable_choice
    here = device_arch() == choice.problem.arch and not torch.cuda.is_current_stream_capturing()
    return all(admit(c, portable(c.problem) if here else None) for c in (choice, choice.with_sinks()))


# ----------------------------------------------------------------------------- decode
def decode_problem(*, dtype, head_dim: int, page_size: int, group_size: int, pos_encoding_mode: str = "NONE",
                   use_soft_cap: bool = False, use_sinks: bool = False, kv_dtype="",
                   arch: str | None = None) -> DecodeProblem:
    """The :class:`~cutedsl_attn.planning.decode.DecodeProblem` of a decode plan (``dtype`` / ``kv_dtype`` torch
    dtypes or names, ``kv_dtype`` ``""``: the cache is ``dtype``; ``arch`` None: the compile target).  Raises
    TypeError / ValueError / NotImplementedError as ``DecodeProblem``."""
    return DecodeProblem(dtype=_dtype_name(dtype), head_dim=head_dim, page_size=page_size, group_size=group_size,
                         pos_encoding_mode=pos_encoding_mode, use_soft_cap=use_soft_cap, use_sinks=use_sinks,
                         kv_dtype=_dtype_name(kv_dtype), arch=arch or target_arch())


def decode_choice(problem: DecodeProblem, *, split: bool = False, kernel: str = "auto") -> KernelChoice:
    """The paged-decode kernel and tiles for ``problem``; ``split``: the plan splits requests (split-KV).

    ``kernel``: ``"auto"`` (the choice below), ``"portable"`` (always the portable kernel), ``"sm100"`` (the
    tcgen05 kernel wherever it applies, unchecked, whatever ``CUTEDSL_ATTN_DECODE_KERNEL`` says; the portable
    kernel where it does not -- callers check ``.name``).  On SM100 / SM103 the tcgen05 kernel
    (``cutedsl_attn.sm100.decode``) serves the problems it accepts once it and its sinks twin pass the first-use
    self-check on this GPU (:func:`cutedsl_attn.selfcheck.admit_decode`); never without a GPU of the problem's
    arch unless the check is off (``CUTEDSL_ATTN_SELFCHECK=0``) or the configuration is verified.  Everything
    else runs the portable kernel.  ``CUTEDSL_ATTN_DECODE_KERNEL=portable`` forces the portable kernel.
    ``CUTEDSL_ATTN_DECODE_TUNE`` (``"key=value,..."`` or ``"warps,stages"``, tuning experiments) overrides the
    portable kernel's default tiles (and keeps that kernel).  Raises ValueError for ``kernel`` outside the three
    names, for ``CUTEDSL_ATTN_DECODE_KERNEL`` other than ``auto`` / ``portable``, naming the variable for a tuning
    item it cannot parse or the kernel refuses; NotImplementedError when no kernel serves the problem."""
    if kernel not in ("auto", "portable", "sm100"):
        raise ValueError(f"kernel must be 'auto', 'portable' or 'sm100', got {kernel!r}")
    env = tuple(os.environ.get(v) for v in (DECODE_KERNEL_ENV, DECODE_TUNE_ENV, _verdicts.SELFCHECK_ENV))
    memo = ("decode", problem, split, kernel, env, num_sms())
    c = _CHOICES.get(memo)
    if c is None:
        c = _decode_choice(problem, split, kernel)
        _remember(memo, c)
    return c


def _decode_choice(problem: DecodeProblem, split: bool, kernel: str) -> KernelChoice:
    env_kernel = os.environ.get(DECODE_KERNEL_ENV, "auto") or "auto"
    if env_kernel not in ("auto", "portable"):
        raise ValueError(f"{DECODE_KERNEL_ENV} must be 'auto' or 'portable', got {env_kernel!r}")
    if kernel == "auto" and (env_kernel == "portable" or os.environ.get(DECODE_TUNE_ENV, "").strip()):
        kernel = "portable"  # a tuning hook names the portable kernel's fields: it keeps that kernel
    if kernel in ("auto", "sm100") and _decode_sm100.unsupported_reason(problem) is None:
        m = _decode_sm100
        c = KernelChoice(m, problem, m.default_tiles(problem, num_sms=num_sms(), split=split))
        if kernel == "sm100" or _first_use_passed(c, _selfcheck.admit_decode,
                                                   lambda p: _portable_decode_choice(p, split)):
            return c
    return _portable_decode_choice(problem, split)


def _portable_decode_choice(problem: DecodeProblem, split: bool) -> KernelChoice:
    m = _paged_decode
    reason = m.unsupported_reason(problem)
    if reason is not None:
        raise NotImplementedError(reason)
    tiles = m.default_tiles(problem, num_sms=num_sms(), split=split)
    tune = os.environ.get(DECODE_TUNE_ENV, "")
    if tune.strip():
        if "=" not in tune:  # the short form "warps,stages"
            parts = [x.strip() for x in tune.split(",")]
            if len(parts) != 2:
                raise ValueError(f"{DECODE_TUNE_ENV}: {tune!r} is neither 'warps,stages' nor key=value items")
            items = {"num_warps": parts[0], "num_stages": parts[1]}
        else:
            items = _parse_tune(DECODE_TUNE_ENV, tune, getattr(m, "TUNING_FIELDS", ("num_warps", "num_stages")))
        tiles = _override(m, DECODE_TUNE_ENV, tune, tiles, items)
    return KernelChoice(m, problem, tiles)


def _decode_work(choice: KernelChoice, kv_lens, page_offsets, *, num_kv_heads, page_size, window_left,
                 fixed_split_tokens, disable_split_kv, cuda_graph, device_index, min_waves):
    cfg = choice.cfg
    sms = num_sms(device_index)
    per_sm = occupancy(cfg.smem_bytes, cfg.num_threads)
    return plan_paged_decode(
        kv_lens, page_offsets, num_kv_heads=num_kv_heads, page_size=page_size, window_left=window_left,
        num_sms=sms, ctas_per_sm=per_sm, fixed_split_tokens=fixed_split_tokens, disable_split_kv=disable_split_kv,
        num_rows=max_items(int(kv_lens.numel()), num_kv_heads, sms * per_sm) if cuda_graph else None,
        max_splits_per_request=cfg.max_splits_per_request, min_waves=min_waves)


def decode_schedule(problem: DecodeProblem, kv_lens, page_offsets, *, num_kv_heads: int, window_left: int = -1,
                    fixed_split_tokens: int | None = None, disable_split_kv: bool = False, cuda_graph: bool = False,
                    device_index: int | None = None):
    """``(choice, work_plan)`` of a decode batch: the kernel (:func:`decode_choice`) and its work table
    (:func:`cutedsl_attn.planning.decode.plan_paged_decode`, sized for the device's SMs and the kernel's
    occupancy; ``cuda_graph``: padded to the fixed row count of CUDA-graph mode).  A plan that splits
    requests re-plans with the split-KV tiles (fewer, wider CTAs keep more chunks in flight); not in
    CUDA-graph mode, where a captured graph keeps the kernel and buffer sizes of its capture.

    ``CUTEDSL_ATTN_DECODE_MIN_WAVES`` (a float, tuning experiments) only accepts splits giving that many
    waves of CTAs.  Raises ValueError from the planner (a CUDA-graph table too small, too many pieces)."""
    text = os.environ.get(DECODE_MIN_WAVES_ENV, "0") or "0"
    try:
        min_waves = float(text)
    except ValueError:
        raise ValueError(f"{DECODE_MIN_WAVES_ENV} must be a number, got {text!r}") from None
    kw = dict(num_kv_heads=num_kv_heads, page_size=problem.page_size, window_left=window_left,
              fixed_split_tokens=fixed_split_tokens, disable_split_kv=disable_split_kv, cuda_graph=cuda_graph,
              device_index=device_index, min_waves=min_waves)
    choice = decode_choice(problem)
    wp = _decode_work(choice, kv_lens, page_offsets, **kw)
    if wp.split_tokens > 0 and not cuda_graph:
        alt = decode_choice(problem, split=True)
        if alt != choice:
            choice, wp = alt, _decode_work(alt, kv_lens, page_offsets, **kw)
    return choice, wp


# the delta-rule family and MLA: their own modules, re-exported here (dispatch stays the one place a kernel is chosen)
from .gdn import gdn_arch, gdn_choice, gdn_launch  # noqa: E402
from .mla import (  # noqa: E402
    FP8_SM90_MIN_HEADS, MLA_KERNEL_ENV, MLA_TUNE_ENV, SMALL_PAGE_SM90_MIN_HEADS, SWAP_AB_MAX_ROWS, mla_choice,
    mla_launch, mla_limits, mla_problem,
)

