"""GPU tests of the decode first-use self-check (run on an H200): the portable decode kernel stands in for the
candidate that has never run (on a Blackwell GPU: the SM100 tcgen05 decode kernel) and is the reference.

* the stand-in passes on 16-bit and fp8 caches, split and unsplit, with sinks and odd page sizes;
* broken stand-ins (output scaled by 1.05; the last work item skipped; the split-KV counters left non-zero)
  fail, and through ``admit_decode`` warn once naming the configuration.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn import dispatch  # noqa: E402
from cutedsl_attn import selfcheck as sc  # noqa: E402
from cutedsl_attn.compile import device_arch  # noqa: E402
from cutedsl_attn.compile import selfcheck as verdicts  # noqa: E402
from cutedsl_attn.planning.decode import W_BATCH  # noqa: E402

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTEDSL_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("CUTEDSL_ATTN_DISABLE_DISK_CACHE", "CUTEDSL_ATTN_SELFCHECK", "CUTEDSL_ATTN_DECODE_KERNEL",
                "CUTEDSL_ATTN_DECODE_TUNE", "CUTEDSL_ATTN_ARCH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    verdicts.clear_verdicts()
    yield
    verdicts.clear_verdicts()


def portable(**kw):
    p = dispatch.decode_problem(**dict(dict(dtype=BF16, head_dim=128, page_size=16, group_size=4,
                                            arch=device_arch()), **kw))
    return dispatch.decode_choice(p, kernel="portable")


class Broken:
    """A candidate that launches ``choice`` wrongly (``how``: ``"scale"``, ``"skip"``, ``"counters"``)."""

    def __init__(self, choice, how):
        self.choice, self.how = choice, how
        self.name = f"{choice.name}_broken_{how}"
        self.cfg, self.problem = choice.cfg, choice.problem

    def launch(self, args):
        if self.how == "skip":
            work = args.work.clone()
            work[-1, W_BATCH] = -1
            args = args._replace(work=work)
        self.choice.launch(args)
        if self.how == "scale":
            args.out.mul_(1.05)
        if self.how == "counters":
            args.counters.add_(1)


@pytest.mark.parametrize("kw", [dict(), dict(use_sinks=True, page_size=1), dict(page_size=3, group_size=5),
                                dict(head_dim=64, dtype=torch.float16, page_size=64, group_size=8),
                                dict(kv_dtype="float8_e4m3fn", use_sinks=True)])
def test_the_portable_stand_in_passes(kw):
    c = portable(**kw)
    v = sc.check_decode(c, c)
    assert v.passed, v.detail
    assert v.candidate_err <= v.tolerance and "split-KV" in v.detail


@pytest.mark.parametrize("how", ["scale", "skip", "counters"])
def test_broken_stand_ins_fail_and_warn_once(how):
    c = portable(use_sinks=True)
    v = sc.check_decode(Broken(c, how), c)
    assert not v.passed and "portable kernel also" not in v.detail
    b = Broken(c, how)
    with pytest.warns(RuntimeWarning, match="failed its first-use self-check"):
        assert not sc.admit_decode(b, c)
    assert not sc.admit_decode(b, c)  # remembered: no second warning, no second check
