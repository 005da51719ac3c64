"""GPU tests of the first-use self-check (run on an H200): the SM90 kernel stands in for the candidate that has never
run (on a Blackwell GPU: the SM100 tcgen05 kernel), the portable kernel is the reference.

* the SM90 kernel passes (both kernels within the oracle's tolerance), its verdict is recorded beside the
  compiled artifact and a later process reads the record instead of checking again;
* broken stand-ins (the SM90 launch with its output scaled by 1.05, or with one work-table tile skipped) fail
  with one warning naming the configuration and a recorded verdict;
* each feature the check builds (sliding window, soft cap, custom mask, ``score_mod``, paged K/V, head dims
  256/256 and 192/128, and a mix of them): the SM90 kernel passes, and a stand-in that launches the feature
  wrongly (no window, no cap, the mask's bits flipped, the page table rotated, no ``score_mod``, O scaled) fails;
* through ``dispatch.prefill_choice``: the SM90 kernel dressed as ``prefill_sm100`` (and the real SM90 path
  turned off, as on a Blackwell GPU) serves the plan after passing, a plan through the public wrapper runs
  it and matches the oracle; a broken one routes the problem to the portable kernel.
"""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import cutedsl_attn as ca  # noqa: E402
from cutedsl_attn import dispatch, ref  # noqa: E402
from cutedsl_attn import selfcheck as sc  # noqa: E402
from cutedsl_attn.compile import device_arch  # noqa: E402
from cutedsl_attn.compile import selfcheck as verdicts  # noqa: E402
from cutedsl_attn.planning.prefill import W_BATCH  # noqa: E402
from cutedsl_attn.sm90 import prefill as sm90  # noqa: E402
from _checks import check  # noqa: E402

BF16 = torch.bfloat16
DEV = torch.device("cuda")

if device_arch() != "sm_90a":
    pytest.skip("the SM90 kernel stands in for the candidate: needs an SM90 GPU", allow_module_level=True)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Fresh records (compiled kernels stay in this process's memory cache), the check on, no choice memo."""
    monkeypatch.setenv("CUTEDSL_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("CUTEDSL_ATTN_DISABLE_DISK_CACHE", "CUTEDSL_ATTN_SELFCHECK", "CUTEDSL_ATTN_PREFILL_KERNEL",
                "CUTEDSL_ATTN_PREFILL_TUNE", "CUTEDSL_ATTN_ARCH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    verdicts.clear_verdicts()
    yield
    verdicts.clear_verdicts()


def problem(**kw):
    return dispatch.prefill_problem(**dict(dict(dtype=BF16, head_dim_qk=128, head_dim_vo=128, group_size=4,
                                                causal=True, use_sinks=True), **kw))


def choices(p):
    return dispatch.prefill_choice(p, kernel="sm90"), dispatch.prefill_choice(p, kernel="portable")


class Broken:
    """A candidate that launches ``choice`` wrongly: ``"scale"`` multiplies its output by 1.05, ``"skip"`` marks
    the work table's last tile as padding (its rows are never written), ``"window"`` drops the window
    (``window_left`` -1), ``"soft_cap"`` the cap, ``"mask"`` flips every bit of the packed custom mask,
    ``"paged"`` rotates the page ids by one (each request reads another request's pages), ``"score_mod"``
    launches the kernel built without the problem's ``score_mod``."""

    def __init__(self, choice, how):
        self.choice, self.how = choice, how
        self.name = f"{choice.name}_broken_{how}"
        self.cfg, self.problem, self.tile_m = choice.cfg, choice.problem, choice.tile_m
        if how == "score_mod":
            self.choice = dispatch.prefill_choice(dataclasses.replace(choice.problem, score_mod=None),
                                                  kernel=choice.name.removeprefix("prefill_"))
            self.tile_m = self.choice.tile_m  # the plan follows the kernel that runs

    def launch(self, args):
        if self.how == "skip":
            work = args.work.clone()
            work[-1, W_BATCH] = -1  # as a padding row of a CUDA-graph table
            args = args._replace(work=work)
        elif self.how == "window":
            args = args._replace(window_left=-1)
        elif self.how == "soft_cap":
            args = args._replace(soft_cap=0.0)
        elif self.how == "mask":
            args = args._replace(mask=torch.bitwise_not(args.mask))
        elif self.how == "paged":
            args = args._replace(indices=args.indices.roll(1))
        self.choice.launch(args)
        if self.how == "scale":
            args.out.mul_(1.05)


def no_check(*a, **k):
    raise AssertionError("the recorded verdict should have been used")


# ----------------------------------------------------------------------------- the check itself
@pytest.mark.parametrize("causal", (True, False))
def test_sm90_passes_against_the_oracle(causal):
    cand, refc = choices(problem(causal=causal))
    assert cand.name == "prefill_sm90" and refc.name == "prefill_portable"
    v = sc.check_prefill(cand, refc)
    assert v.passed, v
    assert v.candidate_err < v.tolerance == sc.TOL["bfloat16"] and v.reference_err < v.tolerance
    assert v.detail == "matches the oracle" and v.device and v.seconds > 0


def test_a_pass_is_recorded_and_read_by_a_later_process(monkeypatch):
    cand, refc = choices(problem())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert sc.admit_prefill(cand, refc)
    assert not [x for x in w if "self-check" in str(x.message)]
    rec = verdicts.read_verdict(cand.name, cand.cfg)
    assert rec is not None and rec.passed and rec.candidate_err < rec.tolerance
    path = verdicts.record_path(cand.name, cand.cfg)
    assert path.exists() and path.parent.name == "prefill_sm90"
    verdicts.clear_verdicts()  # a later process
    monkeypatch.setattr(sc, "check_prefill", no_check)
    assert sc.admit_prefill(cand, refc)


@pytest.mark.parametrize("how,why", [("scale", "rel err"), ("skip", "NaN")])
def test_a_broken_candidate_fails_once_with_a_warning_and_a_record(monkeypatch, how, why):
    cand, refc = choices(problem())
    bad = Broken(cand, how)
    with pytest.warns(RuntimeWarning) as w:
        assert not sc.admit_prefill(bad, refc)
        assert not sc.admit_prefill(bad, refc)
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning) and "self-check" in str(x.message)]
    assert len(msgs) == 1 and bad.name in msgs[0] and repr(cand.cfg) in msgs[0] and why in msgs[0]
    rec = verdicts.read_verdict(bad.name, bad.cfg)
    assert rec is not None and not rec.passed and why in rec.detail
    assert rec.reference_err is not None and rec.reference_err < rec.tolerance  # the portable kernel was right
    if how == "scale":
        assert 0.03 < rec.candidate_err < 0.07
    verdicts.clear_verdicts()
    monkeypatch.setattr(sc, "check_prefill", no_check)
    with pytest.warns(RuntimeWarning, match="read from"):
        assert not sc.admit_prefill(bad, refc)


# ----------------------------------------------------------------------------- the check, per feature
def _rel_bias(score, batch_idx, head_idx, q_idx, kv_idx):
    """Python arithmetic only: the kernel traces it with the DSL's scalars, the oracle calls it on tensors."""
    return score - 0.004 * (q_idx - kv_idx) + 0.2 * head_idx - 0.5 * batch_idx


#: each feature the check builds, as ``problem`` keywords (causal with sinks, bf16 128/128 G4, unless said)
FEATURES = {
    "window": dict(use_window=True),
    "window_noncausal": dict(use_window=True, causal=False, use_sinks=False),
    "soft_cap": dict(use_soft_cap=True),
    "custom_mask": dict(use_custom_mask=True, causal=False),
    "score_mod": dict(score_mod=_rel_bias, use_sinks=False),
    "paged": dict(page_size=16),
    "paged_one_token_pages": dict(page_size=1, causal=False),
    "d256": dict(head_dim_qk=256, head_dim_vo=256),
    "d192_128": dict(head_dim_qk=192, head_dim_vo=128),
    "mixed": dict(use_window=True, use_soft_cap=True, use_custom_mask=True, causal=False, page_size=16,
                  group_size=2, dtype=torch.float16),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_sm90_passes_each_feature_against_the_oracle(feature):
    cand, refc = choices(problem(**FEATURES[feature]))
    assert cand.name == "prefill_sm90" and refc.name == "prefill_portable"
    assert sc.prefill_refusal(cand.problem) is None
    v = sc.check_prefill(cand, refc)
    assert v.passed, v
    assert v.candidate_err < v.tolerance and v.reference_err < v.tolerance and v.detail == "matches the oracle"


@pytest.mark.parametrize("feature,how", [("window", "window"), ("window_noncausal", "window"),
                                         ("soft_cap", "soft_cap"), ("custom_mask", "mask"), ("score_mod", "score_mod"),
                                         ("paged", "paged"), ("paged_one_token_pages", "paged"), ("d256", "scale"),
                                         ("d192_128", "scale"), ("mixed", "mask"), ("mixed", "paged"),
                                         ("mixed", "window"), ("mixed", "soft_cap")])
def test_a_stand_in_that_launches_a_feature_wrongly_fails(feature, how):
    cand, refc = choices(problem(**FEATURES[feature]))
    v = sc.check_prefill(Broken(cand, how), refc)
    assert not v.passed and "also misses" not in v.detail, v
    assert v.reference_err is not None and v.reference_err < v.tolerance  # the portable kernel was right


# ----------------------------------------------------------------------------- through dispatch
def as_sm100(monkeypatch, launch=sm90.launch):
    """The SM90 kernel dressed as the SM100 module (``launch`` possibly broken) and the SM90 path turned off."""
    standin = types.SimpleNamespace(NAME="prefill_sm100", Tiles=sm90.Tiles, Config=sm90.Config,
                                    unsupported_reason=sm90.unsupported_reason, default_tiles=sm90.default_tiles,
                                    override_tiles=sm90.override_tiles, compile=sm90.compile, launch=launch)
    off = types.SimpleNamespace(TUNING_FIELDS=sm90.TUNING_FIELDS,
                                unsupported_reason=lambda p: "turned off: the SM100 stand-in serves")
    monkeypatch.setattr(dispatch, "_prefill_sm100", standin)
    monkeypatch.setitem(dispatch.KERNEL_MODULES, "prefill_sm100", standin)
    monkeypatch.setattr(dispatch, "_prefill_sm90", off)
    return standin


def scaled_launch(fn, cfg, args):
    sm90.launch(fn, cfg, args)
    args.out.mul_(1.05)


def test_dispatch_routes_to_a_candidate_that_passes_and_the_api_runs_it(monkeypatch):
    as_sm100(monkeypatch)
    c = dispatch.prefill_choice(problem(use_sinks=False))
    assert c.name == "prefill_sm100" and isinstance(c.cfg, sm90.Config)
    for x in (c, c.with_sinks()):  # the plan's configuration and its sinks twin were both checked
        v = verdicts.read_verdict(x.name, x.cfg)
        assert v is not None and v.passed
    # the public wrapper plans and runs the admitted kernel (its tile_m, its work table)
    qo, kv = [37, 200, 1], [300, 180, 64]
    ip = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(qo), 8, 128, generator=g).to(BF16)
    k, v = (torch.randn(sum(kv), 2, 128, generator=g).to(BF16) for _ in range(2))
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=DEV), "NHD")
    w.plan(ip(qo), ip(kv), 8, 2, 128, causal=True, q_data_type=BF16)
    assert w._plan["choice"].name == "prefill_sm100" and w._plan["choice"].tile_m == c.tile_m
    out, lse = w.run(q.to(DEV), k.to(DEV), v.to(DEV), return_lse=True)
    o_ref, lse_ref = ref.ragged_prefill(q, k, v, ip(qo), ip(kv), causal=True)
    check(out, lse, o_ref, lse_ref, BF16, "prefill through the admitted stand-in")


def test_dispatch_falls_back_to_portable_for_a_candidate_that_fails(monkeypatch):
    as_sm100(monkeypatch, launch=scaled_launch)
    p = problem()
    with pytest.warns(RuntimeWarning, match="prefill_sm100 failed its first-use self-check"):
        c = dispatch.prefill_choice(p)
    assert c.name == "prefill_portable"
    cand = dispatch.prefill_choice(p, kernel="sm100")  # the candidate's configuration, unchecked
    v = verdicts.read_verdict(cand.name, cand.cfg)
    assert v is not None and not v.passed and "rel err" in v.detail
    # a later process: the record decides without a check; the portable switch needs no check at all
    verdicts.clear_verdicts()
    dispatch._CHOICES.clear()
    monkeypatch.setattr(sc, "check_prefill", no_check)
    with pytest.warns(RuntimeWarning, match="read from"):
        assert dispatch.prefill_choice(p).name == "prefill_portable"
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_KERNEL", "portable")
    assert dispatch.prefill_choice(problem(causal=False)).name == "prefill_portable"


@pytest.mark.parametrize("feature", ["window", "paged", "custom_mask"])
def test_dispatch_admits_a_feature_after_its_check_and_refuses_a_broken_one(monkeypatch, tmp_path, feature):
    as_sm100(monkeypatch)
    p = problem(**dict(FEATURES[feature], use_sinks=False))
    c = dispatch.prefill_choice(p)
    assert c.name == "prefill_sm100" and isinstance(c.cfg, sm90.Config)
    for x in (c, c.with_sinks()):
        v = verdicts.read_verdict(x.name, x.cfg)
        assert v is not None and v.passed, v
    verdicts.clear_verdicts()
    dispatch._CHOICES.clear()
    monkeypatch.setenv("CUTEDSL_ATTN_CACHE_DIR", str(tmp_path / "broken"))  # no record of the passing stand-in
    as_sm100(monkeypatch, launch=scaled_launch)
    with pytest.warns(RuntimeWarning, match="prefill_sm100 failed its first-use self-check"):
        assert dispatch.prefill_choice(p).name == "prefill_portable"


def test_the_switch_off_trusts_the_candidate(monkeypatch):
    as_sm100(monkeypatch, launch=scaled_launch)
    monkeypatch.setenv("CUTEDSL_ATTN_SELFCHECK", "0")
    monkeypatch.setattr(sc, "check_prefill", no_check)
    c = dispatch.prefill_choice(problem())
    assert c.name == "prefill_sm100" and verdicts.read_verdict(c.name, c.cfg) is None


# ----------------------------------------------------------------------------- python -m cutedsl_attn selfcheck
def test_cli_matrix_passes_on_this_gpu(monkeypatch):
    from cutedsl_attn import selfcheck_cli

    monkeypatch.delenv("CUTEDSL_ATTN_CACHE_DIR")  # the user's cache: the matrix's kernels are mostly built there
    rows = list(selfcheck_cli.gpu_matrix())
    table = selfcheck_cli.format_table(rows)
    print(table)
    assert {"prefill_sm90", "prefill_portable", "paged_decode", "gdn_chunked_sm90", "kda_chunked_sm90",
            "mla_decode_portable", "mla_decode_sm90"} <= {r.kernel for r in rows}, table
    assert all(r.status in ("pass", "skip") for r in rows), table
    assert all(r.call_us > 0 and r.first_s >= 0 for r in rows if r.status == "pass"), table
