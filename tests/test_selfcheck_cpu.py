"""CPU tests of the first-use self-check (no GPU, no kernel launch).

The verdict store and decision logic (``cutedsl_attn.compile.selfcheck``): the record's place beside the compiled
artifact and its format, the ``CUTEDSL_ATTN_SELFCHECK`` switch, one check per configuration, one warning per
failed configuration, later processes reading the record.  The routing rule of ``dispatch.prefill_choice`` with
``device_arch`` patched to ``sm_100a`` and the check (``cutedsl_attn.selfcheck.check_prefill``) stubbed.  The
oracle comparison rules of ``cutedsl_attn.selfcheck.compare``.
"""

from __future__ import annotations

import json
import math
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
from cutedsl_attn.planning.prefill import W_BATCH, W_ROW0
from cutedsl_attn.sm100 import prefill as sm100

from _kernel_stubs import Recorder  # pytest puts tests/ on sys.path

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """A fresh disk cache, no verdict or choice left from another test, the check on."""
    monkeypatch.setenv("CUTEDSL_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", raising=False)
    monkeypatch.delenv("CUTEDSL_ATTN_SELFCHECK", raising=False)
    monkeypatch.delenv("CUTEDSL_ATTN_PREFILL_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    verdicts.clear_verdicts()
    yield
    verdicts.clear_verdicts()


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


def test_the_portable_switch_and_problems_sm100_refuses_skip_the_check(on_b200, monkeypatch):
    stub = on_b200()
    assert choose(use_window=True).name == "prefill_portable"  # served by sm100, not built by the check: portable
    assert choose(pos_encoding_mode="ROPE_LLAMA").name == "prefill_portable"  # sm100 refuses RoPE
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
    p = dispatch.prefill_problem(dtype=BF16, head_dim_qk=128, head_dim_vo=128, group_size=4, page_size=16,
                                 arch="sm_90a")
    c = dispatch.prefill_choice(p, kernel="portable")
    with pytest.raises(NotImplementedError, match="paged K/V"):
        sc.check_prefill(c, c)
    other = dispatch.prefill_choice(dispatch.prefill_problem(dtype=BF16, head_dim_qk=64, head_dim_vo=64,
                                                             group_size=4, arch="sm_90a"), kernel="portable")
    with pytest.raises(ValueError, match="one problem"):
        sc.check_prefill(c, other)


# ----------------------------------------------------------------------------- python -m cutedsl_attn selfcheck
def test_cli_without_a_gpu_cross_compiles_and_reports(monkeypatch, capsys):
    from cutedsl_attn import __main__ as cli
    from cutedsl_attn import selfcheck_cli

    seen = []

    def fake_matrix(arch, only=""):
        seen.append((arch, only))
        yield selfcheck_cli.Row("prefill", "prefill_sm100", "bf16 d128 G4 causal", "built", first_s=1.5)

    monkeypatch.setattr(selfcheck_cli, "cross_compile_matrix", fake_matrix)
    assert cli.main(["selfcheck", "--arch", "blackwell", "--only", "sm100"]) == 0
    out = capsys.readouterr().out
    assert seen == [("sm_100a", "sm100")] and "no CUDA GPU" in out and "prefill_sm100" in out and "built" in out

    def failing(arch, only=""):
        yield selfcheck_cli.Row("decode", "paged_decode", "bf16", "error", note="RuntimeError: boom")

    monkeypatch.setattr(selfcheck_cli, "cross_compile_matrix", failing)
    assert cli.main(["selfcheck"]) == 1 and "RuntimeError: boom" in capsys.readouterr().out
    assert cli.main(["selfcheck", "--arch", "sm_77"]) == 2
    monkeypatch.setattr(selfcheck_cli, "cross_compile_matrix", lambda arch, only="": iter(()))
    assert cli.main(["selfcheck", "--only", "nosuchkernel"]) == 2  # an empty selection is not a pass
    assert "no case matches" in capsys.readouterr().err


def test_cli_gpu_matrix_runs_every_kernel_and_sm100_last(monkeypatch):
    from cutedsl_attn import compile as compile_pkg
    from cutedsl_attn import selfcheck_cli

    monkeypatch.setattr(compile_pkg, "device_arch", lambda device=None: "sm_100a")

    def rows(op, kernel):
        return lambda *a: iter([selfcheck_cli.Row(op, kernel, "case", "pass")])

    monkeypatch.setattr(selfcheck_cli, "_prefill_rows", lambda arch, k: iter([
        selfcheck_cli.Row("prefill", f"prefill_{k}", arch, "pass")]))
    monkeypatch.setattr(selfcheck_cli, "_decode_rows", rows("decode", "paged_decode"))
    monkeypatch.setattr(selfcheck_cli, "_gdn_rows", rows("gdn", "gdn_recurrent"))

    def raises():
        raise RuntimeError("no MLA here")
        yield  # a generator

    monkeypatch.setattr(selfcheck_cli, "_mla_rows", raises)
    got = list(selfcheck_cli.gpu_matrix())
    assert [r.kernel for r in got] == ["prefill_portable", "paged_decode", "gdn_recurrent", "mla_decode_portable",
                                       "prefill_sm100"]
    assert got[3].status == "error" and "no MLA here" in got[3].note and got[-1].case == "sm_100a"
    assert [r.kernel for r in selfcheck_cli.gpu_matrix(only="prefill")] == ["prefill_portable", "prefill_sm100"]
