"""perf/sanitize.py's report parser, suppression matching and run verdict, on small synthetic compute-sanitizer
outputs (no GPU, no compute-sanitizer)."""

import fnmatch
import importlib.util
import os
import re
import sys

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf", "sanitize.py")
_spec = importlib.util.spec_from_file_location("perf_sanitize", _PATH)
san = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = san  # dataclasses resolve string annotations through the module's entry
_spec.loader.exec_module(san)

K = "kernel_cutlass_kernel_cutedsl_attnsm90prefillkernelSm90PrefillKernel_object_at__tensorptrbf16_gmem_0"
CUDNN = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0"


def _race_report(first, *others, kernel=K):
    """One racecheck report: ``first`` = (kind, offset), ``others`` = (kind, offset, hazards)."""
    lines = [f"========= Error: Race reported between {first[0]} access at {kernel}+{first[1]:#x}"]
    lines += [f"=========     and {kind} access at {kernel}+{off:#x} [{n} hazards]" for kind, off, n in others]
    return "\n".join(lines + ["========= "])


def _racecheck_log(*reports, summary=None):
    n = len(reports) if summary is None else summary
    return "\n".join(["========= COMPUTE-SANITIZER", *reports, "CHILD OK",
                      f"========= RACECHECK SUMMARY: {n} hazard{'s' if n != 1 else ''} displayed "
                      f"({n} errors, 0 warnings)"])


def test_reports_groups_indented_lines_and_skips_banners():
    log = _racecheck_log(_race_report(("Read", 0x1A30), ("Write", 0x920, 64), ("Write", 0x1860, 64)),
                         _race_report(("Write", 0x1860), ("Read", 0x8DA0, 56)))
    reps = san.reports(log)
    assert len(reps) == 2
    assert reps[0].splitlines()[0].startswith("Error: Race reported between Read access at")
    assert reps[0].count("\nand ") == 2 and reps[1].count("\nand ") == 1
    assert san.items(reps[0]) == [
        reps[0].splitlines()[0] + "\n" + reps[0].splitlines()[1],
        reps[0].splitlines()[0] + "\n" + reps[0].splitlines()[2],
    ]
    # a non-race report is one item, its backtrace included
    other = "Program hit CUDA_ERROR_INVALID_VALUE (error 1)\nSaved host backtrace up to driver entry point at error"
    assert san.items(other) == [other]


@pytest.mark.parametrize("case,log_reports", [
    ("prefill_sm90_ragged_causal", [_race_report(("Write", 0xF00), ("Read", 0x2090, 64))]),
    ("prefill_sm90_ragged", [_race_report(("Read", 0x1A30), ("Write", 0x920, 64), ("Write", 0x1860, 64)),
                             _race_report(("Write", 0x1860), ("Read", 0x8DA0, 56))]),
    ("prefill_sm90_paged_causal", [_race_report(("Read", 0x38E0), ("Write", 0x610, 64), ("Write", 0x3710, 64)),
                                   _race_report(("Write", 0x3710), ("Read", 0xBD40, 16))]),
    ("prefill_cudnn_ragged_causal", [_race_report(("Read", 0x1440), ("Write", 0x7520, 256), kernel=CUDNN)]),
])
def test_explained_pairs_count_zero(case, log_reports):
    log = _racecheck_log(*log_reports)
    n = len(log_reports)
    assert san.count(case, "racecheck", log, suppressions=()) == (n, n, 0)
    assert san.count(case, "racecheck", log) == (0, n, n)


KDA_PREP = ("kernel_cutlass_prep_cutedsl_attnsm90kda_chunkedKdaChunkedSm90Kernel_object_at__tensorptrbf16_gmem_align16_o_"
            "128i64_div8i64_div81_tensorpt_0")
MLA = ("kernel_cutlass_kernel_cutedsl_attnsm90mlakernelMlaSm90Kernel_object_at__tensorptrbf16_gmem_align16_o_512i64_"
       "div8i64_div81_tensorptrbf16_gm_0")
MLA_MERGE = MLA.replace("kernel_cutlass_kernel_", "kernel_cutlass_merge_")
# a report of the SM90 KDA prep's blockwise inverse from before its diagonal step's warp sync (no suppression
# covers it now) and the sweep's reports of the SM90 MLA epilogue, as racecheck groups them
_KDA_INVERSE_REPORT = _race_report(("Write", 0x20720), ("Read", 0x20860, 192), ("Read", 0x20880, 64),
                                   ("Read", 0x20890, 64), kernel=KDA_PREP)
_MLA_REPORTS = [_race_report(("Write", 0xB350), ("Read", 0xB4A0, 160), kernel=MLA),
                _race_report(("Write", 0xB370), ("Read", 0xEA30, 32), kernel=MLA)]
# the same epilogue pairs in the build with the merge kernel (merge_kernel 1), read from its SASS
_MLA_MERGE_KERNEL_REPORTS = [_race_report(("Write", 0xB2F0), ("Read", 0xB4B0, 160), kernel=MLA),
                             _race_report(("Write", 0xB320), ("Read", 0xEA20, 32), kernel=MLA)]


@pytest.mark.parametrize("case,log_reports", [
    ("mla_decode_sm90", _MLA_REPORTS),
    ("mla_decode_sm90", _MLA_MERGE_KERNEL_REPORTS),
])
def test_sm90_mla_epilogue_pairs_explained(case, log_reports):
    log = _racecheck_log(*log_reports)
    n = len(log_reports)
    assert san.count(case, "racecheck", log, suppressions=()) == (n, n, 0)
    assert san.count(case, "racecheck", log) == (0, n, n)


@pytest.mark.parametrize("log,case", [
    # the delta-rule preps' inverse has no suppression: its reports count in every KDA case
    *((_racecheck_log(_KDA_INVERSE_REPORT), case) for case in ("kda_prefill", "kda_prefill_sm90",
                                                               "kda_prefill_sm90_tma", "kda_prefill_recurrent")),
    # the MLA offsets in the merge kernel
    (_racecheck_log(_race_report(("Write", 0xB350), ("Read", 0xB4A0, 160), kernel=MLA_MERGE)), "mla_decode_sm90"),
    # a store paired with the other store's loads
    (_racecheck_log(_race_report(("Write", 0xB350), ("Read", 0xEA30, 32), kernel=MLA)), "mla_decode_sm90"),
    # one build's store with the other build's load
    (_racecheck_log(_race_report(("Write", 0xB2F0), ("Read", 0xB4A0, 160), kernel=MLA)), "mla_decode_sm90"),
    # the same reports in the cases of other builds (the tuned MLA schedule, small pages, fp8)
    (_racecheck_log(_MLA_REPORTS[0]), "mla_tuned_sm90"),
    (_racecheck_log(_MLA_REPORTS[0]), "mla_decode_sm90_small_pages"),
    (_racecheck_log(_MLA_REPORTS[0]), "mla_decode_sm90_fp8"),
])
def test_sm90_mla_suppressions_stay_narrow(log, case):
    assert san.count(case, "racecheck", log) == (1, 1, 0)


def test_pair_order_does_not_matter():
    log = _racecheck_log(_race_report(("Read", 0x2090), ("Write", 0xF00, 64)))
    assert san.count("prefill_sm90_ragged_causal", "racecheck", log) == (0, 1, 1)


@pytest.mark.parametrize("log,case", [
    # a neighbouring offset (and a longer one sharing the digits) is a new hazard
    (_racecheck_log(_race_report(("Write", 0xF10), ("Read", 0x2090, 64))), "prefill_sm90_ragged_causal"),
    (_racecheck_log(_race_report(("Write", 0xF00), ("Read", 0x20900, 64))), "prefill_sm90_ragged_causal"),
    # the same kinds swapped (a read at the store's offset)
    (_racecheck_log(_race_report(("Read", 0xF00), ("Write", 0x2090, 64))), "prefill_sm90_ragged_causal"),
    # an explained pair of another case
    (_racecheck_log(_race_report(("Write", 0x920), ("Read", 0x1A30, 64))), "prefill_sm90_ragged_causal"),
    (_racecheck_log(_race_report(("Write", 0xF00), ("Read", 0x2090, 64))), "prefill_portable_ragged_causal"),
    # the right offsets in another kernel
    (_racecheck_log(_race_report(("Write", 0xF00), ("Read", 0x2090, 64), kernel="some_other_kernel_0")),
     "prefill_sm90_ragged_causal"),
])
def test_unexplained_reports_still_count(log, case):
    assert san.count(case, "racecheck", log) == (1, 1, 0)


def test_report_with_one_unexplained_pair_counts():
    # an explained pair does not hide a new pair listed in the same report
    log = _racecheck_log(_race_report(("Read", 0x1A30), ("Write", 0x920, 64), ("Write", 0x1234, 8)))
    assert san.count("prefill_sm90_ragged", "racecheck", log) == (1, 1, 0)
    log = _racecheck_log(_race_report(("Read", 0x1A30), ("Write", 0x920, 64), ("Write", 0x1860, 64)),
                         _race_report(("Write", 0x4000), ("Read", 0x5000, 4)))
    assert san.count("prefill_sm90_ragged", "racecheck", log) == (1, 2, 1)


def test_unprinted_reports_count():
    # past --print-limit the summary counts reports that are not printed: they stay unexpected
    log = _racecheck_log(_race_report(("Write", 0xF00), ("Read", 0x2090, 64)), summary=3)
    assert san.count("prefill_sm90_ragged_causal", "racecheck", log) == (2, 3, 1)


def test_no_summary_is_none():
    assert san.count("decode_paged", "memcheck", "CHILD OK\n") is None


_API_ERR = ("========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to \"invalid argument\" on CUDA API call to "
            "cuGetProcAddress_v2.\n") + """=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: _driver in _device.py:31
========= """
_OOB = """========= Invalid __global__ read of size 4 bytes
=========     at kernel_x+0x120
=========     by thread (3,0,0) in block (0,0,0)
========= """


def _memcheck_log(*reports):
    return "\n".join(["========= COMPUTE-SANITIZER", *reports, "CHILD OK",
                      f"========= ERROR SUMMARY: {len(reports)} errors"])


def test_memcheck_api_probe_suppressed_for_cudnn_only():
    log = _memcheck_log(_API_ERR, _API_ERR, _API_ERR)
    assert san.count("prefill_cudnn_ragged_causal", "memcheck", log) == (0, 3, 3)
    assert san.count("prefill_sm90_ragged", "memcheck", log) == (3, 3, 0)
    # the same text under another tool is not suppressed; a device error next to it still counts
    assert san.count("prefill_cudnn_ragged_causal", "synccheck", log) == (3, 3, 0)
    assert san.count("prefill_cudnn_ragged_causal", "memcheck", _memcheck_log(_API_ERR, _OOB)) == (1, 2, 1)
    other_api = _API_ERR.replace("cuGetProcAddress_v2", "cuMemAlloc_v2")
    assert san.count("prefill_cudnn_ragged_causal", "memcheck", _memcheck_log(other_api)) == (1, 1, 0)


def test_suppressions_are_documented_and_well_formed():
    for s in san.SUPPRESSIONS:
        assert s.tool in san.TOOLS
        assert s.reason and "\n" not in s.reason
        re.compile(s.pattern)
        assert any(fnmatch.fnmatch(c.name, s.cases) for c in san.CASES), s.cases


def test_case_sanitizer_args():
    cudnn = next(c for c in san.CASES if c.name == "prefill_cudnn_ragged_causal")
    assert san.case_sanitizer_args(cudnn, "synccheck") == ["--num-cuda-barriers", "64"]
    assert san.case_sanitizer_args(cudnn, "racecheck") == []
    sm90 = next(c for c in san.CASES if c.name == "prefill_sm90_ragged")
    assert all(san.case_sanitizer_args(sm90, t) == [] for t in san.TOOLS)


def test_cases_are_runnable_and_distinct():
    """Every case names a problem function of the module, case names are unique, and no suppression written for
    one case's build reaches another by its glob (the SM90 offsets and cuDNN reports stay where they belong)."""
    names = [c.name for c in san.CASES]
    assert len(names) == len(set(names))
    for c in san.CASES:
        assert callable(getattr(san, c.run, None)), c.run
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in c.env), c.name
    for name in ("prefill_portable_multirow_fp8", "mla_decode_fp8", "gdn_prefill_chunked"):
        assert not any(fnmatch.fnmatch(name, s.cases) for s in san.SUPPRESSIONS), name


def test_gdn_cases_cover_both_kernels():
    # GDN prefill picks the chunked kernel by default; the recurrent one stays in the sweep by a forced choice
    by = {c.name: c for c in san.CASES}
    assert dict(by["gdn_prefill"].env) == {"CUTEDSL_ATTN_GDN_KERNEL": "recurrent"}
    assert "CUTEDSL_ATTN_GDN_KERNEL" not in dict(by["gdn_prefill_chunked"].env)
    assert "CUTEDSL_ATTN_PREFILL_KERNEL" not in dict(by["prefill_portable_multirow_fp8"].env)  # fp8: portable always


def test_sm90_tuning_variant_cases():
    # each SM90 tuning variant forces its knob alone; the gathered MLA path needs the forced kernel (auto keeps
    # pages below 64 on the portable kernel), the fp8 one does not (auto takes it at page 64 from 64 heads)
    by = {c.name: c for c in san.CASES}
    assert {n: dict(by[n].env) for n in ("gdn_prefill_sm90_persistent", "gdn_prefill_sm90_tma",
                                        "gdn_prefill_sm90_prep0", "kda_prefill_sm90_tma")} == {
        "gdn_prefill_sm90_persistent": {"CUTEDSL_ATTN_GDN_TUNE": "persistent=2"},
        "gdn_prefill_sm90_tma": {"CUTEDSL_ATTN_GDN_TUNE": "tma=1"},
        "gdn_prefill_sm90_prep0": {"CUTEDSL_ATTN_GDN_TUNE": "prep=0"},
        "kda_prefill_sm90_tma": {"CUTEDSL_ATTN_GDN_KERNEL": "kda_chunked_sm90", "CUTEDSL_ATTN_GDN_TUNE": "tma=1"},
    }
    assert dict(by["mla_decode_sm90_small_pages"].env) == {"CUTEDSL_ATTN_MLA_KERNEL": "sm90"}
    assert by["mla_decode_sm90_fp8"].env == ()


def test_mla_pool_poisons_unowned_slots(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(san, "_dev", lambda: torch.device("cpu"))
    lens, ps = (7, 100, 300), 16
    pool, kv_indptr, indices = san._mla_pool(lens, ps, torch.bfloat16)
    assert pool.shape == (1 + 7 + 19 + 2, ps, 576) and kv_indptr.tolist() == [0, 1, 8, 27]
    assert len(set(indices.tolist())) == indices.numel() == 27
    owned = torch.zeros(pool.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens):
        slots = torch.zeros((kv_indptr[b + 1] - kv_indptr[b]) * ps, dtype=torch.bool)
        slots[:n] = True
        owned[indices[kv_indptr[b]: kv_indptr[b + 1]].long()] = slots.view(-1, ps)
    assert torch.isfinite(pool[owned].float()).all()
    assert torch.isnan(pool[~owned].float()).all()


def test_block_table_from_csr(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(san, "_dev", lambda: torch.device("cpu"))
    table = san._block_table(torch.tensor([0, 2, 3, 3, 6]), torch.tensor([5, 1, 4, 7, 0, 2], dtype=torch.int32))
    assert table.dtype == torch.int32
    assert table.tolist() == [[5, 1, 0], [4, 0, 0], [0, 0, 0], [7, 0, 2]]


_LEAKS = """nanobind: leaked 15 instances!
 - leaked instance 0x7fa4ad0d9548 of type "cudnn._compiled_module.backend_graph"
nanobind: leaked 176 functions!
 - ... skipped remainder
nanobind: this is likely caused by a reference counting issue in the binding code.
See https://nanobind.readthedocs.io/en/latest/refleaks.html
"""


def test_run_ok():
    assert san.run_ok(0, "KERNEL x\nCHILD OK\n")
    assert not san.run_ok(0, "CHILD FAIL: non-finite output or NaN LSE\n")
    assert not san.run_ok(0, "CHILD OKAY\n")
    assert not san.run_ok(None, "CHILD OK\nTIMEOUT after 5 s")
    # non-zero only because of nanobind's leak report at interpreter exit: the case ran
    assert san.run_ok(1, "CHILD OK\n" + _LEAKS)
    # non-zero with a traceback, without the leak report, or by a signal: a failure
    assert not san.run_ok(1, "CHILD OK\n" + _LEAKS + "Traceback (most recent call last):\n  ...\nRuntimeError: x\n")
    assert not san.run_ok(1, "CHILD OK\n")
    assert not san.run_ok(-11, "CHILD OK\n" + _LEAKS)
    # a child that raised before CHILD OK, leaks or not
    assert not san.run_ok(1, "Traceback (most recent call last):\ntorch.AcceleratorError: CUDA error\n" + _LEAKS)
