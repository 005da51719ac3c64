"""Command line of cutedsl_attn (``python -m cutedsl_attn`` or the ``cutedsl-attn`` script).

Subcommands::

    ptx  decode [--head-dim 128 --page-size 16 --group-size 4 --dtype bfloat16 --arch sm_90a ...]
         print the PTX of a kernel config, cross-compiled for --arch (no GPU needed)
    sass decode [same options]
         print its SASS (needs cuobjdump or nvdisasm from a CUDA toolkit)
    resources decode [same options]
         print its resources: registers and stack bytes per thread of each kernel in its cubin (the DSL's own
         assembler; no GPU, no CUDA toolkit), the shared memory and TMEM columns its config plans with the CTAs
         an SM each kernel is planned for, and the setmaxnreg budget of each warp role where the kernel
         rebalances registers
    demo [--cpu] [...]
         run the demo (cutedsl_attn._demo: Llama-3-8B-shaped decode step + real-model check on a
         GPU; cross-compile + instruction summary without one)
    selfcheck [--only TEXT] [--arch sm_100a]
         run every kernel of this GPU against the float64 oracle on a short matrix (pass/fail table with
         timings; exit 1 on a failure); without a GPU, say so and cross-compile the matrix for --arch
"""

from __future__ import annotations

import argparse
import os
import sys


def _add_kernel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("op", choices=["decode", "prefill", "mla", "gdn"],
                   help="kernel family (decode: the paged-decode kernel, see --kernel; prefill: the prefill kernel "
                        "dispatch picks for --arch, see --kernel; mla: the MLA decode kernel dispatch picks (on "
                        "sm_90a the SM90 one at page size 64, fp8 caches included, and for 16-bit caches at the "
                        "page sizes dividing 64 (the choice for 64 heads and more), else the portable one; CUTEDSL_ATTN_MLA_KERNEL=portable|sm90 forces one); gdn: the GDN prefill kernel dispatch picks (on "
                        "sm_90a the SM90 chunked one; other GDN problems through cutedsl_attn.inspect's keywords))")
    p.add_argument("--arch", default=os.environ.get("CUTEDSL_ATTN_ARCH") or "sm_90a",
                   help="target architecture: sm_90a, sm_100a, sm_103a, hopper, blackwell (default: "
                        "$CUTEDSL_ATTN_ARCH when set, else sm_90a)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float16 (mla: also fp8)")
    p.add_argument("--kv-dtype", default=None,
                   help="decode / prefill / mla: the cache dtype, fp8 (float8_e4m3fn) or the q dtype (default)")
    p.add_argument("--head-dim", type=int, default=128,
                   help="decode: 32, 64, 128 (default) or 256; prefill: head_dim_qk 32/64/128/192/256")
    p.add_argument("--head-dim-vo", type=int, default=None,
                   help="prefill: head_dim_vo (default: --head-dim; 128 when --head-dim is 192)")
    p.add_argument("--causal", action="store_true",
                   help="prefill, mla: the bottom-right causal variant (mla: of multi-token rows)")
    p.add_argument("--window", action="store_true", help="prefill: window_left variant")
    p.add_argument("--custom-mask", action="store_true", help="prefill: packed custom-mask variant")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (decode default 16; prefill default 0 = ragged KV; mla default 64, "
                        "1..64)")
    p.add_argument("--group-size", type=int, default=4, help="query heads per kv head, 1..16 (default 4)")
    p.add_argument("--pos-encoding-mode", default="NONE", choices=["NONE", "ROPE_LLAMA", "ALIBI"])
    p.add_argument("--soft-cap", action="store_true", help="compile the logits soft-cap variant")
    p.add_argument("--sinks", action="store_true", help="compile the attention-sink variant")
    p.add_argument("--num-warps", type=int, default=None, help="warps per CTA (default: dispatch's choice)")
    p.add_argument("--num-stages", type=int, default=None, help="cp.async ring depth (default: dispatch's choice)")
    p.add_argument("--kernel", default=None, choices=["auto", "portable", "sm90", "sm100"],
                   help="prefill: auto (default: the SM90 TMA+wgmma kernel on sm_90a where it applies), portable, "
                        "sm90 or sm100 (the tcgen05 kernel, sm_100a / sm_103a); decode: auto, portable or sm100")
    p.add_argument("--summary", action="store_true",
                   help="print an instruction summary instead of the full text (ptx only)")
    p.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m cutedsl_attn",
        description="cutedsl_attn tools: inspect compiled kernels (ptx, sass, resources) and run the demo.",
    )
    sub = ap.add_subparsers(dest="command", metavar="{ptx,sass,resources,demo,selfcheck}")
    sub.required = True
    p = sub.add_parser("ptx", help="print the PTX of a kernel config (cross-compiles; no GPU needed)",
                       description="Print the PTX of a kernel config compiled for --arch (no GPU needed).")
    _add_kernel_args(p)
    s = sub.add_parser("sass", help="print the SASS of a kernel config (needs cuobjdump/nvdisasm)",
                       description="Print the SASS of a kernel config (cuobjdump/nvdisasm on its cubin).")
    _add_kernel_args(s)
    r = sub.add_parser("resources", help="print the registers, stack, shared memory and TMEM of a kernel config",
                       description="Print the resources of a kernel config compiled for --arch (no GPU needed): "
                                   "registers and stack bytes per thread of each kernel of its cubin, the shared "
                                   "memory and TMEM columns its config plans and the CTAs an SM each kernel is "
                                   "planned for, its warp roles' setmaxnreg budgets.")
    _add_kernel_args(r)
    sub.add_parser("demo", help="run the demo (GPU: Llama-3-8B decode step + real-model check; "
                                "no GPU: cross-compile and summarise the PTX)", add_help=False)
    sub.add_parser("selfcheck", help="run every kernel of this GPU against the oracle (pass/fail table with "
                                     "timings; no GPU: cross-compile the matrix)", add_help=False)
    return ap


def _kernel_config(args) -> dict:
    if args.op in ("mla", "gdn"):
        # flags another op reads: refused here rather than silently ignored
        unused = dict(num_warps=args.num_warps, num_stages=args.num_stages, kernel=args.kernel,
                      head_dim_vo=args.head_dim_vo, window=args.window, custom_mask=args.custom_mask,
                      soft_cap=args.soft_cap, sinks=args.sinks, group_size=args.group_size != 4,
                      pos_encoding_mode=args.pos_encoding_mode != "NONE")
        if args.op == "mla":
            unused["head_dim"] = args.head_dim != 128  # MLA's head dims are fixed (512 + 64)
        else:
            unused.update(causal=args.causal, page_size=args.page_size is not None, kv_dtype=args.kv_dtype)
        bad = sorted("--" + k.replace("_", "-") for k, v in unused.items() if v)
        if bad:
            verb = "does" if len(bad) == 1 else "do"
            raise ValueError(f"{args.op}: {', '.join(bad)} {verb} not apply to this op")
        if args.op == "mla":
            return dict(dtype=args.dtype, kv_dtype=args.kv_dtype or "",
                        page_size=64 if args.page_size is None else args.page_size, causal=args.causal)
        return dict(dtype=args.dtype, head_dim_k=args.head_dim, head_dim_v=args.head_dim)
    if args.op == "prefill":
        if args.num_warps or args.num_stages:
            raise ValueError("prefill: --num-warps and --num-stages apply to decode only; the prefill kernels' tiles "
                             "come from the dispatch layer (its tuning hooks: see cutedsl_attn.dispatch)")
        return dict(
            dtype=args.dtype, head_dim_qk=args.head_dim,
            # head_dim_vo defaults to head_dim, except 192 (the DeepSeek MLA prefill shape 192/128)
            head_dim_vo=args.head_dim_vo or (128 if args.head_dim == 192 else args.head_dim), group_size=args.group_size,
            page_size=args.page_size or 0, causal=args.causal, use_window=args.window,
            use_soft_cap=args.soft_cap, use_sinks=args.sinks, use_custom_mask=args.custom_mask,
            pos_encoding_mode=args.pos_encoding_mode, kernel=args.kernel or "auto", kv_dtype=args.kv_dtype or "",
        )
    if args.head_dim_vo or args.causal or args.window or args.custom_mask or args.kernel in ("sm90",):
        raise ValueError("decode: --head-dim-vo, --causal, --window, --custom-mask and --kernel sm90 apply to "
                         "prefill only")
    return dict(
        dtype=args.dtype, head_dim=args.head_dim, page_size=16 if args.page_size is None else args.page_size,
        group_size=args.group_size,
        pos_encoding_mode=args.pos_encoding_mode, use_soft_cap=args.soft_cap, use_sinks=args.sinks,
        num_warps=args.num_warps, num_stages=args.num_stages, kv_dtype=args.kv_dtype or "",
        kernel=args.kernel or "auto",
    )


def _emit(text: str, output) -> None:
    if output:
        with open(output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def format_resources(op: str, arch: str, **config_kw) -> str:
    """The text ``resources`` prints: :func:`cutedsl_attn.inspect.resources` (the largest over the cubin's kernels;
    zero ``stack_bytes`` = no spills; the shared memory per CTA, static from the cubin plus the dynamic the config
    plans, :func:`cutedsl_attn.inspect.shared_memory`), each kernel's registers and stack, and from the config
    the TMEM columns (``tmem_cols``) and per-role ``setmaxnreg`` budgets where it has them.
    Raises as :func:`cutedsl_attn.inspect.resources`."""
    from . import inspect as ci

    cfg = ci.config(op, arch, **config_kw)
    res = ci.resources(op, arch, **config_kw)
    lines = [f"{k}: {v}" for k, v in res.items()]
    if "smem_bytes" not in res:
        lines.append("smem_bytes: unknown (the kernel declares dynamic shared memory its config does not plan)")
    tmem = getattr(cfg, "tmem_cols", None)
    if isinstance(tmem, int):
        lines.append(f"tmem_cols: {tmem}")
    roles = getattr(cfg, "roles", None)
    budgets = getattr(roles, "registers", None)
    if isinstance(budgets, dict):  # the SM100 prefill kernel's setmaxnreg per warp role
        lines += [f"setmaxnreg {role}: {n}" for role, n in budgets.items()]
    if roles is not None and hasattr(roles, "num_threads"):
        lines.append(f"threads: {roles.num_threads}")
    lines.append("kernels:")
    per = ci.cubin_kernel_resources(ci._cubin_cached(cfg))  # (the cubin resources() compiled, memoised)
    lines += [f"  {sym}: registers {v['registers']}, stack_bytes {v['stack_bytes']}" for sym, v in per.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Entry point; returns the process exit status (0 ok, 1 demo failure, 2 usage/tool error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    # `demo` forwards everything after it to the demo's own parser (its --help too); imported only here
    if argv and argv[0] == "demo":
        from ._demo import demo

        return int(demo.main(argv[1:]) or 0)
    if argv and argv[0] == "selfcheck":  # its own parser, as demo's
        from . import selfcheck_cli

        return selfcheck_cli.main(argv[1:])
    args = ap.parse_args(argv)
    from . import inspect as ci

    try:
        _kernel_config(args)  # validates the flags for the op
        if args.command in ("sass", "resources") and args.summary:
            raise ValueError(f"--summary applies to ptx only ({args.command} prints its own report)")
        # the kernel and tiles the dispatch layer chose, on stderr (stdout stays the PTX / SASS)
        cfg = ci.config(args.op, args.arch, **_kernel_config(args))
        print(f"config: {type(cfg).__module__} {cfg!r}", file=sys.stderr)  # the module names the kernel
        if args.command == "ptx":
            text = ci.ptx(args.op, args.arch, **_kernel_config(args))
            if args.summary:
                text = ci.format_summary(ci.instruction_summary(text), nonzero_only=True)
            _emit(text, args.output)
        elif args.command == "resources":
            _emit(format_resources(args.op, args.arch, **_kernel_config(args)), args.output)
        else:  # sass
            _emit(ci.sass(args.op, args.arch, **_kernel_config(args)), args.output)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
