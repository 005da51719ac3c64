"""Which backend serves a request (part of :mod:`cutedsl_attn.dispatch`, which re-exports its public names):
``prefill_backend`` maps the wrappers' ``backend`` names, ``decode_backend`` holds the decode wrapper's one
``backend="auto"`` rule (cuDNN's graph or this package's kernel), with its measured thresholds in
:data:`DECODE_AUTO_CUDNN`."""

from __future__ import annotations

from ..compile import target_arch

PREFILL_BACKENDS = ("auto", "cute")
DECODE_BACKENDS = ("auto", "cute")
_FLASHINFER_PREFILL_BACKENDS = ("fa2", "fa3", "cudnn", "trtllm-gen", "cute-dsl", "cute-dsl-prims", "cutlass",
                                "fmha_v2", "cutile")
_FLASHINFER_DECODE_BACKENDS = ("fa2", "fa3", "trtllm-gen", "cute-dsl", "cudnn", "cutile", "prims-ts", "xqa")


def prefill_backend(backend: str) -> str:
    """``"cute"`` (the CuTe DSL kernels: ``"auto"``, ``"cute"``) or ``"cudnn"`` (cuDNN frontend graphs).

    Raises NotImplementedError for FlashInfer's other backend names, ValueError for an unknown name."""
    if backend == "cudnn":
        return "cudnn"
    if backend not in PREFILL_BACKENDS:
        if backend in _FLASHINFER_PREFILL_BACKENDS:
            raise NotImplementedError(
                f"backend={backend!r} is not available in cutedsl_attn; supported: {PREFILL_BACKENDS + ('cudnn',)}")
        raise ValueError(f"unknown backend {backend!r}; supported: {PREFILL_BACKENDS + ('cudnn',)}")
    return "cute"


# Where backend="auto" of the decode wrapper takes cuDNN's one-row decode graph: only where its kernel measured
# faster than ours and long enough to hide its host path (about 0.2 ms a call, near constant in the batch): at 1 GiB
# of K/V (0.26 ms kernels, batch 64) cuDNN was 1.03-1.04x faster end to end and on the device, below that its host
# path dominates (perf/RESULTS.md, "Decode" and "cuDNN backend"; measured on SM90 at head_dim 128 only).
# unserved: plan features cuDNN's decode graph does not serve or that were not measured.
DECODE_AUTO_CUDNN = dict(min_batch=16, min_max_kv_len=4096, min_kv_bytes=1 << 30, head_dims=(128,),
                         archs=("sm_90a",),
                         unserved=("rope", "alibi", "soft_cap", "fp8_kv", "sinks", "window", "empty_request"))


def decode_backend(backend: str, *, batch_size: int | None = None, max_kv_len: int = 0, kv_bytes: int = 0,
                   head_dim: int = 0, q_len_per_req: int = 1, features=(), keep_split_controls: bool = False,
                   cuda_graph: bool = False, caller_block_table: bool = False, cudnn_importable: bool | None = None,
                   arch: str | None = None) -> str:
    """The decode wrapper's backend: ``"cute"`` (this package's decode kernels) or ``"cudnn"`` (cuDNN's graph).

    Without ``batch_size`` (the constructor): the name is checked and mapped, ``"auto"`` / ``"cute"`` -> ``"cute"``,
    ``"cudnn"`` -> ``"cudnn"``.  With ``batch_size`` (a plan), the rule, written only here:

    * ``keep_split_controls`` (the plan passed ``fixed_split_size`` or ``disable_split_kv``, batch-invariance
      controls cuDNN has no equivalent of): ``"cute"`` for every name, as FlashInfer keeps fa2 for them.
    * ``"cute"`` -> ``"cute"``; ``"cudnn"`` -> ``"cudnn"`` (the wrapper refuses what cuDNN does not serve).
    * ``"auto"`` -> ``"cudnn"`` only when every condition of :data:`DECODE_AUTO_CUDNN` holds: one query row per
      request (cuDNN's multi-row graph reads K/V slots past a request's length, never taken implicitly), none of
      ``features`` in its ``unserved``, the cuDNN frontend importable, the compile target in
      ``archs``, ``head_dim`` in ``head_dims``, ``batch_size >= min_batch``, ``max_kv_len >= min_max_kv_len``,
      ``kv_bytes`` (the K/V bytes the batch reads) ``>= min_kv_bytes``, and outside CUDA-graph mode or with a
      caller-owned block table (a table built from CSR cannot grow once captured).  Otherwise ``"cute"``.

    ``cudnn_importable`` None: tried (``import cudnn``).  ``arch`` None: the compile target.

    Raises NotImplementedError for FlashInfer's other backend names, ValueError for an unknown name.
    """
    if backend != "cudnn" and backend not in DECODE_BACKENDS:
        if backend in _FLASHINFER_DECODE_BACKENDS:
            raise NotImplementedError(
                f"backend={backend!r} is not available in cutedsl_attn; supported: {DECODE_BACKENDS + ('cudnn',)}")
        raise ValueError(f"unknown backend {backend!r}; supported: {DECODE_BACKENDS + ('cudnn',)}")
    if batch_size is None:
        return "cudnn" if backend == "cudnn" else "cute"
    if keep_split_controls or backend == "cute":
        return "cute"
    if backend == "cudnn":
        return "cudnn"
    r = DECODE_AUTO_CUDNN
    if (q_len_per_req != 1 or set(features) & set(r["unserved"]) or (cuda_graph and not caller_block_table)
            or head_dim not in r["head_dims"] or batch_size < r["min_batch"] or max_kv_len < r["min_max_kv_len"]
            or kv_bytes < r["min_kv_bytes"]):
        return "cute"
    if arch is None:
        try:
            arch = target_arch()
        except (RuntimeError, NotImplementedError):  # no GPU and no CUTEDSL_ATTN_ARCH: nothing measured
            return "cute"
    if arch not in r["archs"]:
        return "cute"
    if cudnn_importable is None:
        from ..cudnn.prefill import cudnn_available  # noqa: PLC0415 -- the optional frontend, tried only here

        cudnn_importable = cudnn_available()
    return "cudnn" if cudnn_importable else "cute"
