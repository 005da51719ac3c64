"""End-to-end demo of the decode and prefill APIs: ``python -m cutedsl_attn demo``.

On a CUDA GPU (SM90 / SM100 class):

(a) **Llama-3-8B decode step.**  32 layers, 32 query / 8 kv heads, head_dim 128,
    page size 16, bf16; 48 requests whose lengths are drawn log-uniformly between
    100 and 8000 tokens, pages scattered through a random permutation of a pool,
    one KV cache per layer.  One ``BatchDecodeWithPagedKVCacheWrapper.plan()``
    for the batch, then one ``run()`` per layer.  A subset of requests of three
    layers is checked against the float64 oracle
    (:func:`cutedsl_attn.ref.attention.paged_decode`; relative Frobenius error of
    O <= 1e-2, base-2 LSE within 2e-2).  The 32-layer step is timed with CUDA
    events after an L2 flush (median of ``--reps``), eagerly and replayed from a
    CUDA graph, and reported as K+V bytes / time next to a plain device read
    (``x.sum()`` over 4 GiB) measured in the same run.
(b) **Real activations, decode.**  For every layer of the packaged all-MiniLM-L6-v2
    fixture (:mod:`cutedsl_attn._demo.realmodel`), each sentence's last-token query is
    run through the decode wrapper over the paged bf16 cache and compared with the
    model's own attention output (relative error <= 1e-2 per layer).
(c) **Real activations, prefill.**  Every layer of the same fixture (all tokens of
    8 real sentences, non-causal) is run through
    ``BatchPrefillWithRaggedKVCacheWrapper`` (bf16, NHD, one plan for all layers)
    and compared with the model's own attention output
    (:func:`cutedsl_attn._demo.realmodel.run_prefill_check`: relative error <= 1e-2 per
    layer and per sentence, base-2 LSE within 2e-2 of the float64 oracle).

Without a GPU (or with ``--cpu``): says so, cross-compiles the Llama-shaped decode
kernel for ``sm_90a`` and ``sm_100a`` and prints an instruction summary of each PTX
(:func:`cutedsl_attn.inspect.instruction_summary`), cross-compiles the prefill kernel the
dispatch layer picks for each (SM90 TMA + wgmma on ``sm_90a``, portable on ``sm_100a``)
and checks its PTX, and shows the split-KV plan the
wrapper would make for the batch of (a); the real-model sections (b) and (c) are
skipped with a message (they need a GPU).

Prints ``PASS``/``FAIL`` lines; the exit status is 0 when everything passed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from cutedsl_attn.timing import KernelTimer, read_bandwidth

from .realmodel import rel_err  # the one definition (float64, ||x - ref|| / ||ref||)

HQ, HKV, HEAD_DIM, PAGE_SIZE, NUM_LAYERS = 32, 8, 128, 16, 32
DTYPE = torch.bfloat16
O_TOL = 1e-2
LSE_TOL = 2e-2


# ----------------------------------------------------------------------------- helpers
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cutedsl_attn demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="take the no-GPU path (cross-compile) even with a GPU")
    ap.add_argument("--requests", type=int, default=48, help="decode requests in the batch (default 48)")
    ap.add_argument("--min-len", type=int, default=100, help="shortest request, tokens (default 100)")
    ap.add_argument("--max-len", type=int, default=8000, help="longest request, tokens (default 8000)")
    ap.add_argument("--layers", type=int, default=NUM_LAYERS, help="layers (default 32)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def request_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """``n`` lengths drawn log-uniformly in ``[lo, hi]`` (deterministic in ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    lens = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))).round().clamp(lo, hi)
    return [int(x) for x in lens.tolist()]


def page_table(lens: list[int], page_size: int, seed: int = 0, spare_frac: float = 0.05):
    """Scattered CSR page table: (indptr, indices, last_page_len, num_pages), int32 CPU tensors."""
    gen = torch.Generator().manual_seed(seed + 1)
    npages = [-(-L // page_size) for L in lens]
    used = sum(npages)
    pool = used + max(8, int(used * spare_frac))
    indices = torch.randperm(pool, generator=gen)[:used].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([L - (n - 1) * page_size if n else 0 for L, n in zip(lens, npages)], dtype=torch.int32)
    return indptr, indices, last, pool


class _Report:
    def __init__(self):
        self.results: list[tuple[str, bool, str]] = []

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append((name, bool(ok), detail))
        print(f"{'PASS' if ok else 'FAIL'}: {name}{(' -- ' + detail) if detail else ''}", flush=True)

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(ok for _, ok, _ in self.results)


# ----------------------------------------------------------------------------- GPU path
def _gpu_info(dev) -> str:
    p = torch.cuda.get_device_properties(dev)
    return (f"{p.name} (compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
            f"{p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}")


def _llama_step(args, rep: _Report, timer: KernelTimer, dev, read_bw: float) -> None:
    import cutedsl_attn as ca
    from cutedsl_attn import ref

    L = args.layers
    lens = request_lengths(args.requests, args.min_len, args.max_len, args.seed)
    indptr, indices, last, pool = page_table(lens, PAGE_SIZE, args.seed)
    B, tokens = len(lens), sum(lens)
    kv_bytes_layer = 2 * tokens * HKV * HEAD_DIM * DTYPE.itemsize
    cache_bytes = L * pool * 2 * PAGE_SIZE * HKV * HEAD_DIM * DTYPE.itemsize
    print(f"\n(a) Llama-3-8B decode step: {L} layers, {HQ} q / {HKV} kv heads, head_dim {HEAD_DIM}, "
          f"page {PAGE_SIZE}, bf16")
    print(f"    {B} requests, lengths log-uniform in [{args.min_len}, {args.max_len}]: min {min(lens)}, "
          f"median {int(statistics.median(lens))}, max {max(lens)}, total {tokens} tokens; "
          f"{pool} pages per layer (scattered); KV caches {cache_bytes / 2**30:.2f} GiB")

    g = torch.Generator(device=dev).manual_seed(args.seed)
    caches = torch.empty((L, pool, 2, PAGE_SIZE, HKV, HEAD_DIM), dtype=DTYPE, device=dev)
    caches.normal_(generator=g)
    q = torch.randn((L, B, HQ, HEAD_DIM), dtype=DTYPE, device=dev, generator=g)
    out = torch.full((L, B, HQ, HEAD_DIM), float("nan"), dtype=DTYPE, device=dev)
    lse = torch.full((L, B, HQ), float("nan"), dtype=torch.float32, device=dev)

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    indptr_d, indices_d, last_d = indptr.to(dev), indices.to(dev), last.to(dev)
    t0 = time.perf_counter()
    w.plan(indptr_d, indices_d, last_d, HQ, HKV, HEAD_DIM, PAGE_SIZE, q_data_type=DTYPE)
    plan_ms = (time.perf_counter() - t0) * 1e3
    p = getattr(w, "_plan", None) or {}
    print(f"    plan(): {plan_ms:.1f} ms host; {p.get('num_work', '?')} work items, "
          f"split {p.get('split_tokens', '?')} tokens")

    def step():
        for layer in range(L):
            w.run(q[layer], caches[layer], out=out[layer], lse=lse[layer])

    t0 = time.perf_counter()
    w.run(q[0], caches[0], out=out[0], lse=lse[0])
    torch.cuda.synchronize()
    print(f"    first run() (kernel compile or disk-cache load included): {time.perf_counter() - t0:.2f} s")
    step()
    torch.cuda.synchronize()

    # --- correctness against the float64 oracle: a spread of requests in three layers
    order = sorted(range(B), key=lambda b: lens[b])
    nsel = min(8, B)
    sel = sorted({order[round(i * (B - 1) / max(1, nsel - 1))] for i in range(nsel)})
    sub_ptr = [0]
    sub_idx = []
    for b in sel:
        pages = indices[int(indptr[b]): int(indptr[b + 1])]
        sub_idx.append(pages)
        sub_ptr.append(sub_ptr[-1] + pages.numel())
    sub_ptr = torch.tensor(sub_ptr, dtype=torch.int32)
    sub_idx = torch.cat(sub_idx)
    sub_last = last[sel]
    worst_o, worst_lse = 0.0, 0.0
    check_layers = sorted({0, L // 2, L - 1})
    for layer in check_layers:
        o_ref, lse_ref = ref.paged_decode(q[layer, sel], caches[layer, :, 0], caches[layer, :, 1],
                                          sub_ptr, sub_idx, sub_last, kv_layout="NHD")
        e = rel_err(out[layer, sel], o_ref)
        d = (lse[layer, sel].double() - lse_ref).abs().max().item()
        worst_o, worst_lse = max(worst_o, e), max(worst_lse, d)
        print(f"    layer {layer:2d}: requests {sel} (lengths {[lens[b] for b in sel]}): "
              f"O rel err {e:.2e}, LSE max abs err {d:.2e}")
    finite = bool(torch.isfinite(out).all().item()) and bool(torch.isfinite(lse).all().item())
    rep.add("Llama-3-8B step: every output written and finite", finite)
    rep.add(f"Llama-3-8B step vs float64 oracle (layers {check_layers}, {len(sel)} requests each)",
            worst_o <= O_TOL and worst_lse <= LSE_TOL,
            f"worst O rel err {worst_o:.2e} (<= {O_TOL:g}), worst LSE abs err {worst_lse:.2e} (<= {LSE_TOL:g})")

    # --- timing
    t_eager = timer(step, reps=args.reps)
    host = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) / L)
    torch.cuda.synchronize()
    bw = kv_bytes_layer * L / t_eager
    print(f"    32-layer step, eager: {t_eager * 1e6:.0f} us ({t_eager * 1e6 / L:.1f} us/layer), "
          f"{bw / 1e12:.2f} TB/s K+V = {100 * bw / read_bw:.0f}% of the plain read "
          f"({read_bw / 1e12:.2f} TB/s); host {min(host) * 1e6:.1f} us per run()")
    try:
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            step()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        e = rel_err(out[check_layers[0], sel], ref.paged_decode(
            q[check_layers[0], sel], caches[check_layers[0], :, 0], caches[check_layers[0], :, 1],
            sub_ptr, sub_idx, sub_last)[0])
        rep.add("Llama-3-8B step replayed from a CUDA graph", e <= O_TOL and bool(torch.isfinite(out).all()),
                f"O rel err {e:.2e}")
        t_graph = timer(graph.replay, reps=args.reps)
        bwg = kv_bytes_layer * L / t_graph
        print(f"    32-layer step, CUDA graph: {t_graph * 1e6:.0f} us ({t_graph * 1e6 / L:.1f} us/layer), "
              f"{bwg / 1e12:.2f} TB/s K+V = {100 * bwg / read_bw:.0f}% of the plain read")
    except Exception as exc:  # noqa: BLE001 - report, keep going
        rep.add("Llama-3-8B step replayed from a CUDA graph", False, f"{type(exc).__name__}: {exc}")
    del caches, q, out, lse
    torch.cuda.empty_cache()


def _real_model(rep: _Report, dev) -> None:
    import cutedsl_attn as ca
    from .realmodel import decode_cases, load_minilm_fixture

    fx = load_minilm_fixture()
    meta = fx["meta"]
    nl, t, h, d = fx["q"].shape
    print(f"\n(b) real activations, decode: {meta['model_name']}, {nl} layers, "
          f"{len(meta['sentences'])} sentences ({t} tokens; each sentence's last token is the query), "
          f"{h} heads x {d}, bf16 paged cache (page 16)")
    ws = torch.zeros(16 << 20, dtype=torch.uint8, device=dev)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    planned = False
    worst = 0.0
    n = 0
    for case in decode_cases(fx, page_size=16, dtype=torch.bfloat16, device=dev):
        if not planned:  # one page table for every layer, as in a server
            w.plan(case["kv_indptr"], case["kv_indices"], case["kv_last_page_len"], case["num_qo_heads"],
                   case["num_kv_heads"], case["head_dim"], case["page_size"], q_data_type=torch.bfloat16,
                   sm_scale=case["sm_scale"])
            planned = True
        o = w.run(case["q"], case["paged_kv_cache"])
        torch.cuda.synchronize()
        exp = case["expected"]
        e = rel_err(o, exp)
        per_req = max(rel_err(o[i], exp[i]) for i in range(o.shape[0]))
        worst = max(worst, e)
        n += 1
        print(f"    layer {case['layer']}: rel err {e:.2e} (worst request {per_req:.2e})")
    rep.add(f"real-model decode, {n} layers vs the model's own attention output", n > 0 and worst <= O_TOL,
            f"worst layer rel err {worst:.2e} (<= {O_TOL:g})")


def _real_model_prefill(rep: _Report, dev) -> None:
    from .realmodel import load_minilm_fixture, run_prefill_check

    fx = load_minilm_fixture()
    meta = fx["meta"]
    nl, t, h, d = fx["q"].shape
    print(f"\n(c) real activations, prefill: {meta['model_name']}, {nl} layers, {len(meta['sentences'])} sentences "
          f"(token counts {meta['token_counts']}, {t} tokens), {h} heads x {d}, non-causal, bf16 ragged NHD "
          "through BatchPrefillWithRaggedKVCacheWrapper")
    res = run_prefill_check(fx, dtype=torch.bfloat16, device=dev)
    for r in res["layers"]:
        print(f"    layer {r['layer']}: rel err {r['rel_err']:.2e} (worst sentence {r['worst_sentence_rel_err']:.2e}; "
              f"bf16 rounding floor {r['floor_rel_err']:.2e}), LSE max abs err {r['lse_max_abs_err']:.2e}"
              f"{'' if r['finite'] else ', NOT FINITE'} -- {'PASS' if r['ok'] else 'FAIL'}")
    rep.add(f"real-model prefill, {len(res['layers'])} layers vs the model's own attention output", res["ok"],
            f"worst layer rel err {res['worst_rel_err']:.2e} (<= {res['tol']:g} per layer and sentence), "
            f"worst LSE abs err {res['worst_lse_abs_err']:.2e} (<= {res['lse_tol']:g})")


def _gpu_main(args) -> int:
    from cutedsl_attn.compile import device_arch, target_arch

    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"GPU: {_gpu_info(dev)}")
    try:
        arch = target_arch(dev)
    except (NotImplementedError, ValueError) as e:
        print(f"FAIL: this GPU cannot run cutedsl_attn kernels: {e}")
        return 1
    if arch != device_arch(dev):
        print(f"FAIL: CUTEDSL_ATTN_ARCH selects {arch} but the GPU is {device_arch(dev)}; unset it to run")
        return 1
    print(f"kernels compiled for {arch}")
    rep = _Report()
    timer = KernelTimer(dev, sleep_cycles=4_000_000)  # ~2 ms: the host queues all 32 layers first
    t0 = time.perf_counter()
    read_bw = read_bandwidth(timer)
    print(f"plain device read (4 GiB x.sum()): {read_bw / 1e12:.2f} TB/s")
    for name, part in (("Llama-3-8B decode step", lambda: _llama_step(args, rep, timer, dev, read_bw)),
                       ("real-model decode", lambda: _real_model(rep, dev)),
                       ("real-model prefill", lambda: _real_model_prefill(rep, dev))):
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - report and continue with the next part
            import traceback

            traceback.print_exc()
            rep.add(name, False, f"raised {type(exc).__name__}: {exc}")
    print(f"\nran on {torch.cuda.get_device_name(dev)} in {time.perf_counter() - t0:.1f} s")
    print("ALL PASS" if rep.ok else "SOME CHECKS FAILED")
    return 0 if rep.ok else 1


# ----------------------------------------------------------------------------- CPU path
def _cpu_main(args, reason: str) -> int:
    from cutedsl_attn import dispatch
    from cutedsl_attn import inspect as ci

    print(f"{reason}: no kernel can run here. Cross-compiling the Llama-3-8B decode and prefill kernels "
          f"instead (bf16, head_dim {HEAD_DIM}, page {PAGE_SIZE}, group {HQ // HKV}).")
    rep = _Report()
    summaries = {}
    for arch in ("sm_90a", "sm_100a"):
        t0 = time.perf_counter()
        try:
            text = ci.ptx("decode", arch, dtype="bfloat16", head_dim=HEAD_DIM, page_size=PAGE_SIZE,
                          group_size=HQ // HKV)
        except Exception as exc:  # noqa: BLE001
            rep.add(f"cross-compile for {arch}", False, f"{type(exc).__name__}: {exc}")
            continue
        dt = time.perf_counter() - t0
        s = summaries[arch] = ci.instruction_summary(text)
        ok = f".target {arch}" in text and s["mma.sync.bf16"] > 0 and s["ld.local"] + s["st.local"] == 0
        rep.add(f"cross-compile for {arch}", ok,
                f"{len(text) / 1024:.0f} KiB PTX in {dt:.1f} s; .target {arch}; "
                f"{s['mma.sync.bf16']} mma.sync bf16, {s['ld.local'] + s['st.local']} local-memory ops")
    if summaries:
        archs = list(summaries)
        keys = [k for k in ci.SUMMARY_KEYS if any(summaries[a][k] for a in archs) or k in (
            "wgmma", "tcgen05", "cp.async.bulk.tensor", "ld.local", "st.local")]
        print("\nPTX instruction summary (static counts):")
        print("  " + f"{'instruction':<24}" + "".join(f"{a:>10}" for a in archs))
        for k in keys:
            print("  " + f"{k:<24}" + "".join(f"{summaries[a][k]:>10}" for a in archs))
        if not any(summaries[a][k] for a in archs for k in ("wgmma", "tcgen05", "cp.async.bulk.tensor")):
            print("  (the portable decode kernel: SM80-class mma.sync / ldmatrix / cp.async on every target; on a "
                  "Blackwell GPU the tcgen05 decode kernel replaces it once its first-use self-check passes)")

    # the prefill kernels the GPU demo's section (c) would dispatch to, at a Llama-3-8B prefill shape:
    # SM90 TMA + wgmma kernel on sm_90a, the portable one on sm_100a
    for arch, want in (("sm_90a", "wgmma"), ("sm_100a", "mma.sync")):
        t0 = time.perf_counter()
        try:
            pcfg = ci.config("prefill", arch, head_dim_qk=HEAD_DIM, group_size=HQ // HKV, causal=True)
            kind = dispatch.kernel_module(pcfg).NAME
            s = ci.instruction_summary(ci.ptx("prefill", arch, head_dim_qk=HEAD_DIM, group_size=HQ // HKV,
                                              causal=True))
        except Exception as exc:  # noqa: BLE001
            rep.add(f"cross-compile prefill for {arch}", False, f"{type(exc).__name__}: {exc}")
            continue
        ok = s[want] > 0 and s["ld.local"] + s["st.local"] == 0 and (want != "wgmma" or s["cp.async.bulk.tensor"] > 0)
        rep.add(f"cross-compile prefill for {arch}", ok,
                f"{kind} in {time.perf_counter() - t0:.1f} s; {s[want]} {want}, {s['cp.async.bulk.tensor']} TMA "
                f"copies, {s['ld.local'] + s['st.local']} local-memory ops")

    lens = request_lengths(args.requests, args.min_len, args.max_len, args.seed)
    indptr, _, last, _ = page_table(lens, PAGE_SIZE, args.seed)
    problem = ci.config("decode", "sm_90a", dtype="bfloat16", head_dim=HEAD_DIM, page_size=PAGE_SIZE,
                        group_size=HQ // HKV).problem
    # the plan() of the decode wrapper, for a 132-SM H200 (the SM count dispatch assumes without a GPU)
    choice, wp = dispatch.decode_schedule(problem, torch.tensor(lens), indptr[:-1], num_kv_heads=HKV)
    print(f"\nsplit-KV plan for the Llama-3-8B batch of the GPU demo ({len(lens)} requests, {sum(lens)} tokens, "
          f"lengths {min(lens)}..{max(lens)}) on a 132-SM H200: {wp.num_work} work items x "
          f"{HKV} kv heads, split {wp.split_tokens} tokens, {wp.num_partials} partials ({choice.name}, "
          f"{choice.tiles})")
    print(f"\n(b) real-model decode and (c) real-model prefill (all-MiniLM-L6-v2 layers through the decode and "
          f"ragged prefill wrappers): SKIPPED -- {reason}; they run the kernels, so they need a CUDA GPU.")
    print("\nALL PASS" if rep.ok else "\nSOME CHECKS FAILED")
    return 0 if rep.ok else 1


# ----------------------------------------------------------------------------- entry point
def main(argv=None) -> int:
    """Run the demo; returns the exit status (0: every check passed, 1: a check failed, 2: bad options)."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.requests < 1 or args.layers < 1 or args.reps < 1:
        ap.error("--requests, --layers and --reps must be >= 1")
    if not 1 <= args.min_len <= args.max_len:
        ap.error(f"need 1 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    if args.cpu:
        return _cpu_main(args, "--cpu given")
    if not torch.cuda.is_available():
        return _cpu_main(args, f"No CUDA GPU available (torch {torch.__version__})")
    return _gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
