"""CPU tests of the decode routing to the SM100 tcgen05 kernel (no GPU, no kernel launch): ``dispatch.decode_choice``
with ``device_arch`` patched to ``sm_100a`` and the check (``cutedsl_attn.selfcheck.check_decode``) stubbed, the
``CUTEDSL_ATTN_DECODE_KERNEL`` switch, and the decode wrapper planning and launching the chosen kernel."""

from __future__ import annotations

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import dispatch
from cutedsl_attn import selfcheck as sc
from cutedsl_attn.compile import selfcheck as verdicts
from cutedsl_attn.compile.selfcheck import Verdict

from _kernel_stubs import Recorder  # pytest puts tests/ on sys.path

BF16 = torch.bfloat16
PASS = Verdict(True, "matches the oracle", candidate_err=2e-3, reference_err=2e-3, tolerance=1e-2)
FAIL = Verdict(False, "output rel err 0.05 > 0.01", candidate_err=0.05, reference_err=2e-3, tolerance=1e-2)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTEDSL_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", raising=False)
    for v in ("CUTEDSL_ATTN_SELFCHECK", "CUTEDSL_ATTN_DECODE_KERNEL", "CUTEDSL_ATTN_DECODE_TUNE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    verdicts.clear_verdicts()
    yield
    verdicts.clear_verdicts()


class StubCheck:
    """Stands in for ``selfcheck.check_decode``: a verdict per ``use_sinks`` of the candidate's problem."""

    def __init__(self, passed=True, sinks_passed=None):
        self.passed, self.sinks_passed, self.calls = passed, passed if sinks_passed is None else sinks_passed, []

    def __call__(self, candidate, reference):
        self.calls.append((candidate.name, candidate.problem.use_sinks, reference.name))
        assert reference.problem == candidate.problem
        return PASS if (self.sinks_passed if candidate.problem.use_sinks else self.passed) else FAIL


@pytest.fixture
def on_b200(monkeypatch):
    monkeypatch.setattr(dispatch, "device_arch", lambda device=None: "sm_100a")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_100a")

    def install(**kw):
        stub = StubCheck(**kw)
        monkeypatch.setattr(sc, "check_decode", stub)
        return stub

    return install


def choose(split=False, kernel="auto", **kw):
    p = dispatch.decode_problem(**dict(dict(dtype=BF16, head_dim=128, page_size=16, group_size=4), **kw))
    return dispatch.decode_choice(p, split=split, kernel=kernel)


def test_sm100_serves_decode_after_its_check_and_its_sinks_twin_pass(on_b200):
    stub = on_b200()
    c = choose()
    assert c.name == "paged_decode_sm100" and c.cfg.problem.arch == "sm_100a"
    assert stub.calls == [("paged_decode_sm100", False, "paged_decode"), ("paged_decode_sm100", True, "paged_decode")]
    assert choose().name == "paged_decode_sm100" and len(stub.calls) == 2
    assert choose(split=True).name == "paged_decode_sm100" and len(stub.calls) == 2  # one config for both
    assert choose(kv_dtype="float8_e4m3fn").name == "paged_decode_sm100"


def test_a_failed_decode_check_routes_to_the_portable_kernel(on_b200):
    on_b200(passed=False)
    with pytest.warns(RuntimeWarning, match="paged_decode_sm100 failed its first-use self-check"):
        assert choose().name == "paged_decode"


def test_the_decode_switch_and_refused_problems_keep_the_portable_kernel(on_b200, monkeypatch):
    stub = on_b200()
    assert choose(use_soft_cap=True).name == "paged_decode"
    assert choose(pos_encoding_mode="ALIBI").name == "paged_decode"
    assert choose(head_dim=256).name == "paged_decode"
    monkeypatch.setenv("CUTEDSL_ATTN_DECODE_TUNE", "4,3")  # the portable kernel's fields
    assert choose().name == "paged_decode"
    monkeypatch.delenv("CUTEDSL_ATTN_DECODE_TUNE")
    monkeypatch.setenv("CUTEDSL_ATTN_DECODE_KERNEL", "portable")
    assert choose().name == "paged_decode" and choose(kernel="portable").name == "paged_decode"
    assert stub.calls == []
    assert choose(kernel="sm100").name == "paged_decode_sm100" and stub.calls == []  # explicit: unchecked
    with pytest.raises(ValueError, match="kernel must be"):
        choose(kernel="sm90")
    monkeypatch.setenv("CUTEDSL_ATTN_DECODE_KERNEL", "sm100")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_DECODE_KERNEL"):
        choose()


def test_without_a_b200_only_a_recorded_verdict_admits_the_decode_kernel(monkeypatch):
    monkeypatch.setattr(dispatch, "device_arch", lambda device=None: None)
    monkeypatch.setattr(sc, "check_decode", StubCheck())
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_100a")
    assert choose().name == "paged_decode" and sc.check_decode.calls == []
    monkeypatch.setenv("CUTEDSL_ATTN_SELFCHECK", "0")
    assert choose().name == "paged_decode_sm100"


def test_sm90_decode_routing_is_unchanged(monkeypatch):
    monkeypatch.setattr(dispatch, "device_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(sc, "check_decode", StubCheck())
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    assert choose().name == "paged_decode" and sc.check_decode.calls == []


def test_the_decode_wrapper_plans_and_launches_the_sm100_kernel(on_b200, monkeypatch):
    on_b200()
    rec = Recorder().install(monkeypatch)
    kvl, ps, hkv, hq, d = [300, 1, 5000], 16, 2, 8, 128
    npages = [-(-n // ps) for n in kvl]
    indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    indices = torch.arange(int(indptr[-1]), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(kvl, npages)], dtype=torch.int32)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(32 << 20, dtype=torch.uint8), "NHD")
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=BF16)
    cache = torch.randn(int(indptr[-1]), 2, ps, hkv, d).to(BF16)
    w.run(torch.randn(len(kvl), hq, d).to(BF16), cache)
    name, cfg, args = rec.calls[-1]
    assert name == "paged_decode_sm100" and cfg.problem.group_size == 4
    assert args.counters.numel() >= len(kvl) * hkv
