"""CPU tests of the first-use self-check (no GPU, no kernel launch).

The verdict store and decision logic (``cutedsl_attn.compile.selfcheck``): the record's place beside the compiled
artifact and its format, the ``CUTEDSL_ATTN_SELFCHECK`` switch, one check per configuration, one warning per
failed configuration, later processes reading the record.  The routing rule of ``dispatch.prefill_choice`` with
``device_arch`` patched to ``sm_100a`` and the check (``cutedsl_attn.selfcheck.check_prefill``) stubbed.  The
oracle comparison rules of ``cutedsl_attn.selfcheck.compare``.  The check's problem per feature (window, soft cap,
custom mask, ``score_mod``, paged K/V, head dims 256 and 192/128): ``check_prefill`` on the CPU with kernels
emulated from their ``PrefillArgs`` (``Emulated``), which pass, and a wrong reading of each feature, which fails.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import warnings

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import dispatch
from cutedsl_attn import selfcheck as sc
from cutedsl_attn.compile import cache as cache_mod
from cutedsl_attn.compile import config_key
from cutedsl_attn.compile import selfcheck as verdicts
from cutedsl_attn.compile.selfcheck import Verdict
from cutedsl_attn import ref
from cutedsl_attn.planning.prefill import W_BATCH, W_KV_START, W_MASK_OFF, W_ROW0
from cutedsl_attn.sm100 import prefill as sm100

from _kernel_stubs import Recorder  # pytest puts tests/ on sys.path

BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("selfcheck_isolated")  # tests/conftest.py: a fresh cache, no verdicts


def sm100_cfg(**kw):
    p = dispatch.prefill_problem(**dict(dict(dtype=BF16, head_dim_qk=128, head_dim_vo=128, group_size=4,
                                             causal=True, arch="sm_100a"), **kw))
    return sm100.Config(p, sm100.default_tiles(p, num_sms=148))


class Checks:
    """A stand-in check: returns ``verdict`` (or raises ``error``) and counts its calls."""

    def __init__(self, verdict=None, error=None):
        self.verdict, self.error, self.calls = verdict, error, 0

    def __call__(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.verdict


PASS = Verdict(True, "matches the oracle", candidate_err=2e-3, reference_err=2e-3, tolerance=1e-2)
FAIL = Verdict(False, "output rel err 0.05 > 0.01", candidate_err=0.05, reference_err=2e-3, tolerance=1e-2)


# ----------------------------------------------------------------------------- the record
def test_record_sits_beside_the_artifact_and_round_trips():
    cfg = sm100_cfg()
    path = verdicts.record_path("prefill_sm100", cfg)
    entry = cache_mod._make_entry("prefill_sm100", config_key(cfg), "sm_100a")  # where get_compiled puts the .o
    assert path.parent == entry.obj.parent and path.name == f"{entry.obj.stem}.selfcheck.json"
    assert verdicts.read_verdict("prefill_sm100", cfg) is None
    assert verdicts.write_verdict("prefill_sm100", cfg, FAIL) == path
    record = json.loads(path.read_text())
    assert record["format"] == 1 and record["name"] == "prefill_sm100" and record["arch"] == "sm_100a"
    assert record["key"] == config_key(cfg) and record["verdict"]["passed"] is False
    assert record["verdict"]["candidate_err"] == 0.05 and record["verdict"]["detail"] == FAIL.detail
    assert verdicts.read_verdict("prefill_sm100", cfg) == FAIL
    # another configuration has its own record; a record under another kernel name is another file
    assert verdicts.read_verdict("prefill_sm100", sm100_cfg(causal=False)) is None
    assert verdicts.record_path("prefill_other", cfg) != path


def test_unreadable_or_foreign_records_are_ignored():
    cfg = sm100_cfg()
    path = verdicts.record_path("prefill_sm100", cfg)
    path.write_text("{not json")
    assert verdicts.read_verdict("prefill_sm100", cfg) is None
    verdicts.write_verdict("prefill_sm100", cfg, PASS)
    record = json.loads(path.read_text())
    record["key"] = "another key"
    path.write_text(json.dumps(record))
    assert verdicts.read_verdict("prefill_sm100", cfg) is None
    record["key"], record["format"] = config_key(cfg), 99
    path.write_text(json.dumps(record))
    assert verdicts.read_verdict("prefill_sm100", cfg) is None


def test_without_the_disk_cache_verdicts_live_in_the_process(monkeypatch):
    monkeypatch.setenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", "1")
    cfg = sm100_cfg()
    assert verdicts.record_path("prefill_sm100", cfg) is None
    assert verdicts.write_verdict("prefill_sm100", cfg, PASS) is None
    check = Checks(PASS)
    assert verdicts.admitted("prefill_sm100", cfg, check) and verdicts.admitted("prefill_sm100", cfg, check)
    assert check.calls == 1


# ----------------------------------------------------------------------------- the decision
def test_a_pass_is_checked_once_and_read_back_by_later_processes():
    cfg = sm100_cfg()
    check = Checks(PASS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verdicts.admitted("prefill_sm100", cfg, check)
        assert verdicts.admitted("prefill_sm100", cfg, check)
    assert check.calls == 1 and verdicts.read_verdict("prefill_sm100", cfg) == PASS
    verdicts.clear_verdicts()  # a new process: the record decides, no check runs, even without a device
    assert verdicts.admitted("prefill_sm100", cfg, None)
    assert check.calls == 1


def test_a_mismatch_warns_once_names_the_configuration_and_is_recorded():
    cfg = sm100_cfg()
    check = Checks(FAIL)
    with pytest.warns(RuntimeWarning) as w:
        assert not verdicts.admitted("prefill_sm100", cfg, check)
        assert not verdicts.admitted("prefill_sm100", cfg, check)
    assert len(w) == 1 and check.calls == 1
    msg = str(w[0].message)
    assert "prefill_sm100" in msg and repr(cfg) in msg and "0.05" in msg and "portable" in msg
    assert str(verdicts.record_path("prefill_sm100", cfg)) in msg and "CUTEDSL_ATTN_SELFCHECK=0" in msg
    assert verdicts.read_verdict("prefill_sm100", cfg) == FAIL
    verdicts.clear_verdicts()  # a later process falls back without checking, and says so once
    with pytest.warns(RuntimeWarning, match="read from"):
        assert not verdicts.admitted("prefill_sm100", cfg, check)
    assert check.calls == 1


def test_a_check_that_raises_falls_back_for_this_process_only():
    cfg = sm100_cfg()
    check = Checks(error=RuntimeError("illegal instruction"))
    with pytest.warns(RuntimeWarning, match="RuntimeError: illegal instruction"):
        assert not verdicts.admitted("prefill_sm100", cfg, check)
    assert not verdicts.admitted("prefill_sm100", cfg, check) and check.calls == 1
    assert verdicts.read_verdict("prefill_sm100", cfg) is None  # perhaps transient: not recorded
    verdicts.clear_verdicts()
    assert verdicts.admitted("prefill_sm100", cfg, Checks(PASS))


def test_no_device_admits_only_a_known_verdict():
    cfg = sm100_cfg()
    assert not verdicts.admitted("prefill_sm100", cfg, None)
    assert verdicts.read_verdict("prefill_sm100", cfg) is None
    assert verdicts.admitted("prefill_sm100", cfg, Checks(PASS))


@pytest.mark.parametrize("value", ["0", "false", "No", " off "])
def test_the_switch_turns_the_check_off(monkeypatch, value):
    monkeypatch.setenv("CUTEDSL_ATTN_SELFCHECK", value)
    assert not verdicts.enabled()
    cfg = sm100_cfg()
    check = Checks(FAIL)
    assert verdicts.admitted("prefill_sm100", cfg, check) and verdicts.admitted("prefill_sm100", cfg, None)
    assert check.calls == 0 and verdicts.read_verdict("prefill_sm100", cfg) is None


@pytest.mark.parametrize("value", ["", "1", "yes", "on"])
def test_the_switch_on(monkeypatch, value):
    monkeypatch.setenv("CUTEDSL_ATTN_SELFCHECK", value)
    assert verdicts.enabled()


def test_a_verified_configuration_skips_the_check(monkeypatch):
    cfg = sm100_cfg()
    monkeypatch.setitem(verdicts.VERIFIED, "prefill_sm100", frozenset({config_key(cfg)}))
    check = Checks(FAIL)
    assert verdicts.admitted("prefill_sm100", cfg, check) and check.calls == 0
    assert not verdicts.admitted("prefill_sm100", sm100_cfg(causal=False), None)


# ----------------------------------------------------------------------------- the routing rule
class StubCheck:
    """Stands in for ``selfcheck.check_prefill``: a verdict per ``use_sinks`` of the candidate's problem."""

    def __init__(self, passed=True, sinks_passed=None):
        self.passed, self.sinks_passed, self.calls = passed, passed if sinks_passed is None else sinks_passed, []

    def __call__(self, candidate, reference):
        self.calls.append((candidate.name, candidate.problem.use_sinks, reference.name))
        assert reference.problem == candidate.problem
        ok = self.sinks_passed if candidate.problem.use_sinks else self.passed
        return PASS if ok else FAIL


@pytest.fixture
def on_b200(monkeypatch):
    """A B200 in the box: ``device_arch`` says sm_100a, plans target it, the check is a stub."""
    monkeypatch.setattr(dispatch, "device_arch", lambda device=None: "sm_100a")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_100a")

    def install(**kw):
        stub = StubCheck(**kw)
        monkeypatch.setattr(sc, "check_prefill", stub)
        return stub

    return install


def _rel_bias_dispatch(score, batch_idx, head_idx, q_idx, kv_idx):
    return score - 0.004 * (q_idx - kv_idx)


def choose(**kw):
    kernel = kw.pop("kernel", "auto")
    positive_scale = kw.pop("positive_scale", True)
    p = dispatch.prefill_problem(**dict(dict(dtype=BF16, head_dim_qk=128, head_dim_vo=128, group_size=4,
                                             causal=True), **kw))
    return dispatch.prefill_choice(p, kernel=kernel, positive_scale=positive_scale)


def test_sm100_serves_after_its_check_and_its_sinks_twin_pass(on_b200):
    stub = on_b200()
    c = choose()
    assert c.name == "prefill_sm100" and c.tile_m == c.cfg.tile_m == 128 and c.cfg.problem.arch == "sm_100a"
    assert stub.calls == [("prefill_sm100", False, "prefill_portable"), ("prefill_sm100", True, "prefill_portable")]
    assert choose().name == "prefill_sm100" and len(stub.calls) == 2  # remembered: no second check
    assert choose(use_sinks=True).name == "prefill_sm100" and len(stub.calls) == 2  # the twin's verdict is known


def test_a_failed_check_routes_to_the_portable_kernel(on_b200):
    stub = on_b200(passed=False)
    with pytest.warns(RuntimeWarning, match="prefill_sm100 failed its first-use self-check"):
        assert choose().name == "prefill_portable"
    assert stub.calls == [("prefill_sm100", False, "prefill_portable")]  # the twin is not checked after a failure
    dispatch._CHOICES.clear()
    assert choose().name == "prefill_portable" and len(stub.calls) == 1


def test_a_failed_sinks_twin_keeps_the_portable_kernel(on_b200):
    stub = on_b200(passed=True, sinks_passed=False)
    with pytest.warns(RuntimeWarning):
        assert choose().name == "prefill_portable"
    assert len(stub.calls) == 2


@pytest.mark.parametrize("kw", [dict(use_window=True), dict(use_soft_cap=True),
                                dict(use_custom_mask=True, causal=False), dict(score_mod=_rel_bias_dispatch),
                                dict(page_size=16),
                                dict(head_dim_qk=256, head_dim_vo=256), dict(head_dim_qk=192, head_dim_vo=128)],
                         ids=["window", "soft_cap", "custom_mask", "score_mod", "paged", "d256", "d192_128"])
def test_each_feature_sm100_serves_is_checked_then_routed_to_it(on_b200, kw):
    stub = on_b200()
    c = choose(**kw)
    assert c.name == "prefill_sm100" and c.problem == choose(kernel="sm100", **kw).problem
    assert stub.calls == [("prefill_sm100", False, "prefill_portable"), ("prefill_sm100", True, "prefill_portable")]


def test_a_failed_feature_check_keeps_that_feature_portable(on_b200):
    stub = on_b200(passed=False)
    with pytest.warns(RuntimeWarning, match="prefill_sm100 failed its first-use self-check"):
        assert choose(use_window=True, page_size=16).name == "prefill_portable"
    assert len(stub.calls) == 1


def test_a_problem_the_check_cannot_build_stays_portable_unchecked(on_b200, monkeypatch):
    stub = on_b200()
    monkeypatch.setattr(sc, "prefill_refusal", lambda p: "not built" if p.use_window else None)
    assert choose(use_window=True).name == "prefill_portable" and stub.calls == []
    assert choose().name == "prefill_sm100" and len(stub.calls) == 2


def test_the_portable_switch_and_problems_sm100_refuses_skip_the_check(on_b200, monkeypatch):
    stub = on_b200()
    assert choose(pos_encoding_mode="ROPE_LLAMA").name == "prefill_portable"  # sm100 refuses RoPE
    assert choose(pos_encoding_mode="ALIBI").name == "prefill_portable"
    assert choose(head_dim_qk=256, head_dim_vo=256, page_size=16).name == "prefill_portable"  # paged d256
    assert choose(positive_scale=False).name == "prefill_portable"
    assert choose(kernel="portable").name == "prefill_portable"
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_KERNEL", "portable")
    assert choose().name == "prefill_portable"
    assert stub.calls == []
    assert choose(kernel="sm100").name == "prefill_sm100" and stub.calls == []  # explicit: unchecked


def test_the_switch_off_routes_unchecked(on_b200, monkeypatch):
    stub = on_b200(passed=False)
    monkeypatch.setenv("CUTEDSL_ATTN_SELFCHECK", "0")
    monkeypatch.setattr(dispatch, "_UNCHECKED_WARNED", set())
    with pytest.warns(RuntimeWarning, match="never run on hardware") as w:  # said once, naming the kernel
        assert choose().name == "prefill_sm100" and stub.calls == []
        dispatch._CHOICES.clear()
        assert choose().name == "prefill_sm100"
    assert len(w) == 1 and "prefill_sm100" in str(w[0].message) and "=portable" in str(w[0].message)


def test_without_a_b200_only_a_recorded_verdict_admits_sm100(monkeypatch):
    monkeypatch.setattr(dispatch, "device_arch", lambda device=None: None)  # cross-compiling for sm_100a
    monkeypatch.setattr(sc, "check_prefill", StubCheck())
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_100a")
    assert choose().name == "prefill_portable" and sc.check_prefill.calls == []
    assert choose(kernel="sm100").name == "prefill_sm100"
    c = choose(kernel="sm100")
    for x in (c, c.with_sinks()):
        verdicts.write_verdict(x.name, x.cfg, PASS)  # as a check on a B200 sharing this cache left them
    dispatch._CHOICES.clear()
    verdicts.clear_verdicts()
    assert choose().name == "prefill_sm100"


def test_sm90_routing_is_unchanged(monkeypatch):
    monkeypatch.setattr(dispatch, "device_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(sc, "check_prefill", StubCheck())
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    assert choose().name == "prefill_sm90" and sc.check_prefill.calls == []
    assert choose(kernel="sm100").name == "prefill_portable"


def test_the_wrapper_plans_the_sm100_work_table(on_b200, monkeypatch):
    """The API plans with the chosen kernel's tile_m (128 packed rows) and its causal flag, and launches it."""
    on_b200()
    rec = Recorder().install(monkeypatch)
    qo, kv = [5, 200, 3], [9, 300, 0]
    ip = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8), "NHD")
    w.plan(ip(qo), ip(kv), 8, 2, 128, causal=True, q_data_type=BF16)
    q = torch.randn(sum(qo), 8, 128).to(BF16)
    k, v = (torch.randn(sum(kv), 2, 128).to(BF16) for _ in range(2))
    w.run(q, k, v)
    name, cfg, args = rec.calls[-1]
    assert name == "prefill_sm100" and cfg.tile_m == 128 and cfg.problem.causal
    rows = args.work[args.work[:, W_BATCH] >= 0]
    assert sorted(rows[:, W_ROW0].tolist()) == [0, 0, 0, 128, 256, 384, 512, 640, 768]  # 4 heads a token
    assert math.isclose(args.sm_scale, 128 ** -0.5, rel_tol=1e-6)


# ----------------------------------------------------------------------------- the oracle comparison
def test_compare_rules():
    g = torch.Generator().manual_seed(0)
    o_ref = torch.randn(6, 2, 8, generator=g, dtype=torch.float64)
    lse_ref = torch.randn(6, 2, generator=g, dtype=torch.float64)
    o_ref[0], lse_ref[0] = 0.0, float("-inf")  # a row that sees no key
    out, lse = o_ref.to(BF16), lse_ref.float()
    err, why = sc.compare(out, lse, o_ref, lse_ref, sc.TOL["bfloat16"])
    assert why is None and err < 1e-2
    assert "rel err" in sc.compare(out * 1.05, lse, o_ref, lse_ref, 1e-2)[1]
    bad = out.clone()
    bad[3, 1, 2] = float("nan")
    assert "NaN" in sc.compare(bad, lse, o_ref, lse_ref, 1e-2)[1]
    bad_lse = lse.clone()
    bad_lse[0] = 0.0
    assert "-inf pattern" in sc.compare(out, bad_lse, o_ref, lse_ref, 1e-2)[1]
    bad_lse = lse + 0.1
    bad_lse[0] = float("-inf")
    assert "LSE abs err" in sc.compare(out, bad_lse, o_ref, lse_ref, 1e-2)[1]
    bad = out.clone()
    bad[0] = 1e-3
    assert "no visible key" in sc.compare(bad, lse, o_ref, lse_ref, 1e-2)[1]


def test_check_prefill_refuses_problems_it_cannot_build_before_any_launch():
    for kw, what in ((dict(pos_encoding_mode="ROPE_LLAMA"), "ROPE_LLAMA"), (dict(pos_encoding_mode="ALIBI"), "ALIBI"),
                     (dict(page_size=16, kv_dtype="float8_e4m3fn"), "float8_e4m3fn")):
        p = dispatch.prefill_problem(dtype=BF16, head_dim_qk=128, head_dim_vo=128, group_size=4, arch="sm_90a", **kw)
        c = Emulated(p)
        with pytest.raises(NotImplementedError, match=what):
            sc.check_prefill(c, c, device="cpu")
        assert c.launches == 0
    other = dispatch.prefill_choice(dispatch.prefill_problem(dtype=BF16, head_dim_qk=64, head_dim_vo=64,
                                                             group_size=4, arch="sm_90a"), kernel="portable")
    c = dispatch.prefill_choice(dispatch.prefill_problem(dtype=BF16, head_dim_qk=128, head_dim_vo=128, group_size=4,
                                                         arch="sm_90a"), kernel="portable")
    with pytest.raises(ValueError, match="one problem"):
        sc.check_prefill(c, other)


def test_prefill_refusal_refuses_only_positional_encodings_and_dtypes():
    def refusal(**kw):
        return sc.prefill_refusal(dispatch.prefill_problem(**dict(dict(dtype=BF16, head_dim_qk=128, head_dim_vo=128,
                                                                       group_size=4, arch="sm_100a"), **kw)))

    for kw in FEATURES.values():
        assert refusal(**kw) is None, kw
    assert refusal(page_size=16, use_window=True, use_soft_cap=True, use_sinks=True) is None
    assert refusal(use_custom_mask=True, score_mod=_rel_bias, page_size=1, head_dim_qk=192) is None
    assert "RoPE / ALiBi" in refusal(pos_encoding_mode="ROPE_LLAMA")
    assert "RoPE / ALiBi" in refusal(pos_encoding_mode="ALIBI", use_window=True)
    assert "bfloat16 / float16" in refusal(page_size=16, kv_dtype="float8_e4m3fn")


# ----------------------------------------------------------------------------- the check's problem, per feature
def _rel_bias(score, batch_idx, head_idx, q_idx, kv_idx):
    """Python arithmetic only: a kernel traces it with the DSL's scalars, the oracle calls it on tensors."""
    return score - 0.004 * (q_idx - kv_idx) + 0.2 * head_idx - 0.5 * batch_idx


#: each feature the check builds, as ``prefill_problem`` keywords (on top of bf16 128/128, G4)
FEATURES = {
    "ragged": dict(causal=True),
    "window": dict(causal=True, use_window=True),
    "window_noncausal": dict(use_window=True, use_sinks=True),
    "soft_cap": dict(causal=True, use_soft_cap=True),
    "custom_mask": dict(use_custom_mask=True),
    "score_mod": dict(causal=True, score_mod=_rel_bias),
    "paged": dict(causal=True, page_size=16),
    "paged_one_token_pages": dict(page_size=1, use_sinks=True),
    "d256": dict(causal=True, head_dim_qk=256, head_dim_vo=256),
    "d192_128": dict(causal=True, head_dim_qk=192, head_dim_vo=128),
    "combined": dict(use_custom_mask=True, use_window=True, use_soft_cap=True, page_size=16, group_size=2),
}


def feature_problem(name, dtype=BF16):
    return dispatch.prefill_problem(**dict(dict(dtype=dtype, head_dim_qk=128, head_dim_vo=128, group_size=4,
                                                arch="sm_100a"), **FEATURES[name]))


class Emulated:
    """A prefill kernel choice emulated on the CPU from its ``PrefillArgs`` alone, as the kernel contract reads
    them: each work row ``[b, row0, qo_len, kv_len, q_start, kv_start_or_page_off, mask_off, _]`` writes the
    packed rows ``[row0, row0 + tile_m)`` (token ``r // G``, head ``kv_head * G + r % G``); paged K/V token ``t``
    at ``k[indices[page_off + t // page_size], t % page_size]``; mask bit ``mask_off + i * kv_len + j`` of the
    little-endian packed bytes; ``window_left`` / ``soft_cap`` / ``sm_scale`` / ``output_scale`` from the
    arguments, causal / sinks / ``score_mod`` from the problem.  ``wrong`` breaks one reading: ``"window"``
    ignores the window, ``"soft_cap"`` the cap, ``"mask"`` reads the bits big-endian, ``"paged"`` ignores the
    page table (page ids in order), ``"score_mod"`` ignores it, ``"dims"`` uses half of head_dim_qk in Q K^T,
    ``"scale"`` scales O by 1.05."""

    def __init__(self, problem, *, tile_m=64, wrong=None, name="prefill_emulated"):
        self.problem, self.tile_m, self.wrong, self.name = problem, tile_m, wrong, name
        self.cfg, self.launches, self.args = None, 0, []

    def _kv(self, a, kv0, kv):
        ps = self.problem.page_size
        if not ps:
            return a.k[kv0:kv0 + kv], a.v[kv0:kv0 + kv]
        tok = torch.arange(kv)
        pages = (kv0 + tok // ps) if self.wrong == "paged" else a.indices[kv0 + tok // ps].long()
        return a.k[pages, tok % ps], a.v[pages, tok % ps]

    def _mask(self, a, moff, qo, kv):
        if not self.problem.use_custom_mask:
            return None
        bit = moff + torch.arange(qo * kv)
        shift = 7 - bit % 8 if self.wrong == "mask" else bit % 8
        return ((a.mask[bit // 8].long() >> shift) & 1).bool().reshape(qo, kv)

    def launch(self, a):
        self.launches += 1
        self.args.append(a)
        p, G = self.problem, self.problem.group_size
        done = {}
        for b, row0, qo, kv, q0, kv0, moff, _ in a.work.tolist():
            if b < 0:
                continue
            if b not in done:
                k, v = self._kv(a, kv0, kv)
                q = a.q[q0:q0 + qo]
                if self.wrong == "dims":
                    q, k = q[..., :p.head_dim_qk // 2], k[..., :p.head_dim_qk // 2]
                done[b] = ref.attention(
                    q, k, v, causal=p.causal, sm_scale=a.sm_scale, sinks=a.sinks if p.use_sinks else None,
                    window_left=-1 if self.wrong == "window" else a.window_left,
                    logits_soft_cap=None if self.wrong == "soft_cap" else a.soft_cap,
                    custom_mask=self._mask(a, moff, qo, kv), batch_idx=b,
                    score_mod=None if self.wrong == "score_mod" else p.score_mod)
            o, lse = done[b]
            scale = a.output_scale * (1.05 if self.wrong == "scale" else 1.0)
            for r in range(row0, min(row0 + self.tile_m, qo * G)):
                t = r // G
                heads = torch.arange(a.q.shape[1] // G) * G + r % G
                a.out[q0 + t, heads] = (o[t, heads] * scale).to(a.out.dtype)
                a.lse[q0 + t, heads] = lse[t, heads].float()


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_feature_is_built_and_an_emulated_kernel_matches_the_oracle(feature):
    p = feature_problem(feature)
    cand, refc = Emulated(p, tile_m=128), Emulated(p, tile_m=64)
    v = sc.check_prefill(cand, refc, device="cpu")
    assert v.passed, v
    assert v.detail == "matches the oracle" and v.candidate_err < 1e-2 and v.reference_err < 1e-2
    assert cand.launches == refc.launches == 1
    a = cand.args[0]
    hq, tq = 2 * p.group_size, sum(sc._QO_LENS)
    assert a.q.shape == (tq, hq, p.head_dim_qk) and a.out.shape == (tq, hq, p.head_dim_vo)
    assert a.v.shape[-1] == p.head_dim_vo and a.k.shape[-1] == p.head_dim_qk
    assert a.window_left == (50 if p.use_window else -1)
    assert a.soft_cap == (9.0 if p.use_soft_cap else 0.0)
    assert a.output_scale == 0.75 and math.isclose(a.sm_scale, p.head_dim_qk ** -0.5)
    if p.use_soft_cap:  # q scaled up: logits the cap bends
        assert a.q.float().std() > 3
    work = a.work[a.work[:, W_BATCH] >= 0]
    if p.use_custom_mask:
        assert not p.causal
        n_elem = [x * y for x, y in zip(sc._QO_LENS, sc._KV_LENS)]
        starts = [0] + torch.tensor([(n + 7) // 8 * 8 for n in n_elem]).cumsum(0).tolist()
        for b, moff in work[:, [W_BATCH, W_MASK_OFF]].tolist():
            assert moff == starts[b]  # each request's mask starts on a byte, offsets in bits
        assert a.mask.dtype == torch.uint8 and a.mask.numel() == starts[-1] // 8
    else:
        assert (work[:, W_MASK_OFF] == 0).all()
    if p.page_size:
        ps = p.page_size
        n_pages = [-(-n // ps) for n in sc._KV_LENS]
        assert a.k.shape == (sum(n_pages) + 3, ps, 2, p.head_dim_qk) and a.indices.dtype == torch.int32
        ids = a.indices.tolist()
        assert len(ids) == sum(n_pages) and len(set(ids)) == len(ids) and ids != sorted(ids)  # shuffled pages
        live = torch.zeros(a.k.shape[:2], dtype=torch.bool)
        for b, n in enumerate(sc._KV_LENS):
            for t in range(n):
                live[ids[sum(n_pages[:b]) + t // ps], t % ps] = True
        assert torch.isnan(a.k[~live].float()).all() and torch.isnan(a.v[~live].float()).all()
        assert not torch.isnan(a.k[live].float()).any()
        offs = [0] + torch.tensor(n_pages).cumsum(0).tolist()
        assert sorted(work[:, W_KV_START].tolist()) == sorted(offs[b] for b in work[:, W_BATCH].tolist())
    else:
        assert torch.isnan(a.k[sum(sc._KV_LENS):].float()).all()  # spare rows past the batch


#: a wrong reading of each feature and the problem it breaks
WRONG = [("window", "window"), ("window_noncausal", "window"), ("soft_cap", "soft_cap"),
         ("custom_mask", "mask"), ("score_mod", "score_mod"), ("paged", "paged"),
         ("paged_one_token_pages", "paged"), ("d256", "dims"), ("d192_128", "dims"), ("combined", "mask"),
         ("combined", "window"), ("combined", "soft_cap"), ("combined", "paged"), ("ragged", "scale")]


@pytest.mark.parametrize("feature,wrong", WRONG)
def test_a_wrong_reading_of_each_feature_fails(feature, wrong):
    p = feature_problem(feature)
    v = sc.check_prefill(Emulated(p, tile_m=128, wrong=wrong), Emulated(p), device="cpu")
    assert not v.passed and v.detail and "also misses" not in v.detail, v
    assert v.reference_err < 1e-2


def test_fp16_and_the_seed():
    p = feature_problem("combined", dtype=torch.float16)
    v = sc.check_prefill(Emulated(p), Emulated(p), device="cpu", seed=3)
    assert v.passed and v.tolerance == sc.TOL["float16"] and v.candidate_err < 4e-3, v
    a, b = (Emulated(p) for _ in range(2))
    sc.check_prefill(a, a, device="cpu", seed=3)
    sc.check_prefill(b, b, device="cpu", seed=4)
    assert not torch.equal(a.args[0].q, b.args[0].q)


def test_persistent_candidate_is_checked_on_few_ctas():
    """A persistent-grid candidate runs the check on 3 CTAs (each crosses tile boundaries); others run as given."""
    import dataclasses as dc

    from cutedsl_attn import selfcheck

    @dc.dataclass(frozen=True)
    class T:
        num_ctas: int = 0

    class Choice:
        name = "prefill_sm100"

        def __init__(self, module, problem, tiles):
            self.module, self.problem, self.tiles = module, problem, tiles

    c = Choice("m", "p", T(num_ctas=148))
    few = selfcheck._few_ctas(c)
    assert few is not c and few.tiles == T(num_ctas=3) and (few.module, few.problem) == ("m", "p")
    for tiles in (T(num_ctas=0), T(num_ctas=2), None):
        c = Choice("m", "p", tiles)
        assert selfcheck._few_ctas(c) is c
    c = Choice("m", "p", T(num_ctas=132))
    c.name = "prefill_sm90"  # the SM90 stand-in of the GPU tests runs as chosen
    assert selfcheck._few_ctas(c) is c
