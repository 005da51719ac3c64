"""Chunked per-channel-decay delta rule prefill (KDA ``recurrent_kda``, GDN-2 ``chunk_gated_delta_rule2``) on
SM80-class instructions (``cp.async``, ``ldmatrix``, ``mma.sync``), so it runs on SM90 and SM100 alike.

Per token (V-major state ``H [V, K]``, ``D(x) = Diag(x)``), with the erase key ``e_t`` and written value
``x_t`` (KDA: ``beta_t k_t``, ``beta_t v_t``; GDN-2: ``b_t * k_t``, ``w_t * v_t``)::

    u_t = x_t - H_{t-1} D(exp g_t) e_t,      H_t = H_{t-1} D(exp g_t) + u_t k_t^T,      o_t = scale H_t q_t

Per chunk of ``C = 64`` tokens (``G`` the cumulative log2 decay per key channel from the chunk's start)::

    V'  = U - W S^T        O = scale Qg S^T + Aqk V'        S <- S D(2^G_last) + V'^T Kd

One launch of :func:`compile`'s function runs two kernels on the stream:

* **prep** (:mod:`cutedsl_attn.common.kda_prep`), one CTA per (chunk, output head): the intra-chunk products
  ``A`` and ``Aqk`` by 16-token sub-chunks with the per-channel decay factored into the operands against the
  later sub-chunk's start (every factor ``<= 1``; a diagonal 16 x 16 block whose factor would pass the io
  dtype's range is computed directly in fp32), ``T = (I + A)^-1`` by 16 x 16 blocks, ``W = T (e 2^G)``,
  ``U = T x``, ``Qg = q 2^G``, ``Kd = k 2^(G_last - G)`` and the per-channel chunk decay ``2^G_last``, in
  one of two shared-memory layouts (``Tiles.prep_ctas``: 2 or, KDA only, 3 CTAs an SM);
* **main**: the chunked GDN main kernel (:mod:`cutedsl_attn.portable.gdn_chunked`) with its per-channel branch
  (``Qg`` / ``Kd`` in place of q / k, the state decayed per K column).

Exact for any gate the API accepts (``g <= 0``, ``-inf`` included): no factor ever exceeds the io dtype's
range, so no ``inf * 0``; strongly negative gates only underflow to 0.  A sequence of length 0 writes its
initial state (zeros without one) as its final state; each main CTA reads its state slice before it writes it
and no two CTAs share one, so an in-place pool update is race-free.  Served: per-channel log gates (KDA's
scalar beta, or GDN-2's erase / write gates), K and V in 64 / 128, a V-major fp32 / bf16 state, prefill (the
decode step runs the recurrent kernel).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.kda_prep import (
    DIAG_LIMIT, IO_MAX, PREP_SMEM_CARVEOUT, PREP_THREADS, KdaPrep, check_prep_ctas, check_prep_rolled,
    default_prep_ctas, prep_smem_bytes,
)
from ..common.gdn_launch import compile_kda_kernel
from ..common.gdn_launch import kda_launch as launch, kda_launch_tensors as launch_tensors  # noqa: F401
from ..compile.tiles import override_int_fields
from ..planning.gdn import CHUNK, GdnProblem
from . import gdn_chunked as _gdn

NAME = "kda_chunked"


@dataclass(frozen=True)
class Tiles:
    """What the kernel chooses: the main kernel's ``tile_v`` and ``num_warps`` (as
    :class:`cutedsl_attn.portable.gdn_chunked.Tiles`, whose checks apply) and ``prep_ctas``, the prep kernel's
    shared-memory layout by the CTAs an SM it fits (:data:`~cutedsl_attn.common.kda_prep.PREP_LAYOUTS`: 2, every
    operand in a buffer of its own; 3, the compact layout, KDA only) and ``prep_rolled``: 1 (the default) runs
    the prep's column-block and Qg / Kd phases as run-time loops, 0 unrolls them, 2 rolls the prep's other long
    phases as well (as :class:`cutedsl_attn.sm90.kda_chunked.Tiles`).

    Raises TypeError for a non-int field, ValueError for another value.
    """

    tile_v: int = 64
    num_warps: int = 8
    prep_ctas: int = 2
    prep_rolled: int = 1

    def __post_init__(self):
        _gdn.Tiles(tile_v=self.tile_v, num_warps=self.num_warps)  # the main kernel's checks
        check_prep_ctas(self.prep_ctas)
        check_prep_rolled(self.prep_rolled)


TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tiles))


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text) replaced; ValueError naming the key
    for an unknown field or a non-integer value, and the Tiles checks for a refused value."""
    return override_int_fields(tiles, items)


def unsupported_reason(problem: GdnProblem) -> str | None:
    """Why the chunked per-channel kernel cannot serve ``problem``, or None.  It serves KDA and GDN-2 prefill
    (``gate_per_channel``, with or without ``erase_write_gates``) with a V-major state; scalar gates run the
    chunked GDN kernel, the decode step and a K-major state the recurrent kernel.

    Raises TypeError when ``problem`` is not a GdnProblem.
    """
    if not isinstance(problem, GdnProblem):
        raise TypeError(f"problem must be a GdnProblem, got {type(problem).__name__}")
    if not problem.gate_per_channel:
        return "the chunked per-channel kernel serves KDA and GDN-2 (per-channel gates) only"
    if problem.gate_domain != "log":
        return "the chunked per-channel kernel takes log gates (KDA, GDN-2) only"
    if problem.state_k_major:
        return "the chunked per-channel kernel reads and writes a V-major state only"
    if problem.decode:
        return "the decode step (a few tokens a sequence) runs the recurrent kernel"
    if problem.head_dim_k not in (64, 128) or problem.head_dim_v not in (64, 128):
        return f"head dims {problem.head_dim_k}/{problem.head_dim_v}: served K, V in 64, 128"
    return None


@dataclass(frozen=True)
class Config:
    """The chunked per-channel kernel's compile key: ``Config(problem, tiles)``.

    Raises TypeError for a ``tiles`` of another type, ValueError with :func:`unsupported_reason`'s reason or
    when ``tile_v`` does not divide ``head_dim_v``.
    """

    problem: GdnProblem
    tiles: Tiles

    def __post_init__(self):
        if not isinstance(self.tiles, Tiles):
            raise TypeError(f"tiles must be a kda_chunked Tiles, got {type(self.tiles).__name__}")
        reason = unsupported_reason(self.problem)
        if reason is not None:
            raise ValueError(f"the chunked KDA / GDN-2 kernel cannot serve this problem: {reason}")
        if self.problem.head_dim_v % self.tiles.tile_v:
            raise ValueError(f"tile_v {self.tiles.tile_v} must divide head_dim_v {self.problem.head_dim_v}")
        check_prep_ctas(self.tiles.prep_ctas, self.problem.erase_write_gates)

    @property
    def arch(self) -> str:
        return self.problem.arch

    # 16-byte row pads: conflict-free ldmatrix
    @property
    def row_k(self) -> int:
        return 2 * self.problem.head_dim_k + 16

    @property
    def row_v(self) -> int:
        return 2 * self.problem.head_dim_v + 16

    @property
    def row_c(self) -> int:
        return 2 * CHUNK + 16

    @property
    def row_bv(self) -> int:
        return 2 * self.tiles.tile_v + 16

    @property
    def row_a(self) -> int:
        return 4 * (CHUNK + 4)

    @property
    def f_bytes(self) -> int:
        """Bytes of a chunk's row factors: ``scale`` and 1 per token, ``2^G_last`` per key channel."""
        return (2 * CHUNK + self.problem.head_dim_k) * 4

    @property
    def prep_smem_bytes(self) -> int:
        return prep_smem_bytes(self.problem.head_dim_k, self.problem.head_dim_v, self.tiles.prep_ctas)

    @property
    def stage_bytes(self) -> int:
        c = CHUNK
        return 3 * c * self.row_k + c * self.row_bv + c * self.row_c + self.f_bytes

    @property
    def main_smem_bytes(self) -> int:
        return 2 * self.stage_bytes + self.tiles.tile_v * self.row_k + 2 * CHUNK * self.row_bv


def default_tiles(problem: GdnProblem, *, num_sms: int, chains: int | None = None) -> Tiles:
    """The chunked GDN kernel's defaults (the same main kernel): 64 state rows x 4 warps when ``chains`` =
    N * HO fill the SMs, 32 x 8 for few chains; the rolled prep in the layout
    :func:`~cutedsl_attn.common.kda_prep.default_prep_ctas` picks (as the SM90 kernel)."""
    t = _gdn.default_tiles(problem, num_sms=num_sms, chains=chains)
    return Tiles(tile_v=t.tile_v, num_warps=t.num_warps, prep_ctas=default_prep_ctas(problem))


class KdaChunkedKernel(KdaPrep, _gdn.GdnChunkedKernel):
    """CuTe DSL chunked KDA / GDN-2 (the per-channel prep + the chunked GDN main kernel); see the module
    docstring.  Build with :func:`compile`."""

    def __init__(self, cfg: Config):
        _gdn.GdnChunkedKernel.__init__(self, cfg)
        p = cfg.problem
        self.per_channel = True
        self.F_BYTES = cfg.f_bytes
        self.erase_write = p.erase_write_gates
        self.diag_limit = DIAG_LIMIT[p.dtype]
        self.io_max = IO_MAX[p.dtype]
        self.compact = cfg.tiles.prep_ctas == 3
        self.rolled = cfg.tiles.prep_rolled  # the level (KdaPrepRolled.rolled)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mChunks: cute.Tensor, mChunkOff: cute.Tensor, mH0: cute.Tensor,
                 mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor, mO: cute.Tensor, mQg: cute.Tensor,
                 mKd: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mAqk: cute.Tensor, mF: cute.Tensor,
                 scale: Float32, q_group: Int32, k_group: Int32, v_group: Int32, flags: Int32, stream):
        prep = self.prep(mQ, mK, mV, mG, mBeta, mChunks, mQg, mKd, mW, mU, mAqk, mF, scale, q_group, k_group,
                         v_group, flags)
        if const_expr(self.compact):  # three CTAs an SM: <= 168 registers and the most shared memory
            prep.launch(grid=(mChunks.shape[0], mO.shape[1], 1), block=(PREP_THREADS, 1, 1),
                        smem=self.cfg.prep_smem_bytes, stream=stream, min_blocks_per_mp=3,
                        preferred_smem_carveout=PREP_SMEM_CARVEOUT)
        else:
            prep.launch(grid=(mChunks.shape[0], mO.shape[1], 1), block=(PREP_THREADS, 1, 1),
                        smem=self.cfg.prep_smem_bytes, stream=stream)
        # Qg / Kd are per output head already: group 1
        self.main(mQg, mKd, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, Int32(1), Int32(1),
                  flags).launch(grid=(self.NVB * mO.shape[1], mCu.shape[0] - 1, 1), block=(self.NT, 1, 1),
                                smem=self.cfg.main_smem_bytes, stream=stream)


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`KdaChunkedKernel` (both kernels, one function) for ``cfg`` from fake tensors (no GPU
    needed).  Returns the tvm-ffi callable; call it through :func:`launch`.  Raises ValueError for
    ``keep_cubin`` without a ``keep_ptx_dir``.
    """
    return compile_kda_kernel(KdaChunkedKernel(cfg), cfg.problem, keep_ptx_dir, keep_cubin)
