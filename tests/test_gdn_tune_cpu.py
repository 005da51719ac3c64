"""``CUTEDSL_ATTN_GDN_TUNE`` applies each item to the delta-rule kernels whose tiles have its field and leaves the
others untouched (:func:`cutedsl_attn.dispatch.gdn.gdn_tuned_tiles`); a field no kernel has raises."""

import pytest

pytest.importorskip("cutlass")

from cutedsl_attn.dispatch import gdn as dg  # noqa: E402
from cutedsl_attn.dispatch import gdn_choice  # noqa: E402
from cutedsl_attn.planning.gdn import GdnProblem  # noqa: E402
from cutedsl_attn.portable import gdn_chunked as chk  # noqa: E402
from cutedsl_attn.portable import gdn_recurrent as rec  # noqa: E402
from cutedsl_attn.portable import kda_chunked as kda  # noqa: E402
from cutedsl_attn.sm90 import gdn_chunked as chk90  # noqa: E402
from cutedsl_attn.sm90 import kda_chunked as kda90  # noqa: E402

TUNE = "CUTEDSL_ATTN_GDN_TUNE"
CHAINS = 1000  # a full launch: the default tiles of many chains


def _problem(**kw):
    return GdnProblem(**{**dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128, arch="sm_90a"), **kw})


#: one problem a kernel of the auto choice (on sm_90a and sm_100a) and the recurrent kernel
PROBLEMS = {
    "gdn_sm90": (_problem(), chk90),
    "gdn_portable": (_problem(arch="sm_100a"), chk),
    "kda_sm90": (_problem(gate_per_channel=True, gate_domain="log"), kda90),
    "kda_portable": (_problem(gate_per_channel=True, gate_domain="log", arch="sm_100a"), kda),
    "gdn2_sm90": (_problem(gate_per_channel=True, gate_domain="log", erase_write_gates=True), kda90),
    "decode": (_problem(decode=True), rec),
}


def _tiles(monkeypatch, tune, name):
    problem, module = PROBLEMS[name]
    monkeypatch.delenv(TUNE, raising=False)
    chosen, cfg = gdn_choice(problem, chains=CHAINS)
    assert chosen is module, name
    monkeypatch.setenv(TUNE, tune)
    return cfg.tiles, gdn_choice(problem, chains=CHAINS)[1].tiles


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("CUTEDSL_ATTN_GDN_KERNEL", raising=False)


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_a_field_only_some_kernels_have_leaves_the_others_untouched(monkeypatch, name):
    default, tuned = _tiles(monkeypatch, "persistent=1", name)  # the SM90 chunked GDN kernel's only
    assert tuned == (chk90.Tiles(**{**default.__dict__, "persistent": 1}) if name == "gdn_sm90" else default)
    if name == "gdn2_sm90":  # KDA's kernel, whose compact prep layout GDN-2's erase gates refuse
        with pytest.raises(ValueError, match=f"prep_ctas 3.*{TUNE}"):
            _tiles(monkeypatch, "prep_ctas=3", name)
        return
    default, tuned = _tiles(monkeypatch, "prep_ctas=3", name)  # the per-channel (KDA / GDN-2) kernels' only
    if name in ("kda_sm90", "kda_portable"):
        assert tuned.prep_ctas == 3 and tuned.tile_v == default.tile_v
    else:
        assert tuned == default


def test_items_apply_field_by_field(monkeypatch):
    # tile_v is every kernel's, num_stages the SM90 kernels', persistent the SM90 GDN kernel's, prep_ctas KDA's
    tune = "tile_v=64,num_stages=3,persistent=1,prep_ctas=3"
    assert _tiles(monkeypatch, tune, "gdn_sm90")[1] == chk90.Tiles(tile_v=64, num_stages=3, persistent=1, prep=1)
    assert _tiles(monkeypatch, tune, "kda_sm90")[1] == kda90.Tiles(tile_v=64, num_stages=3, prep_ctas=3)
    default, tuned = _tiles(monkeypatch, tune, "kda_portable")
    assert tuned == kda.Tiles(tile_v=64, num_warps=default.num_warps, prep_ctas=3)
    default, tuned = _tiles(monkeypatch, tune, "gdn_portable")
    assert tuned == chk.Tiles(tile_v=64, num_warps=default.num_warps)
    default, tuned = _tiles(monkeypatch, "num_warps=8,prefetch=2", "decode")  # the recurrent kernel's fields
    assert tuned.num_warps == 8 and tuned.prefetch == 2 and tuned.tile_v == default.tile_v


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("tune", ["bogus=1", "tile_v=64,bogus=1", "tile_v"])
def test_a_field_no_kernel_has_or_a_malformed_item_raises(monkeypatch, name, tune):
    problem, _ = PROBLEMS[name]
    monkeypatch.setenv(TUNE, tune)
    with pytest.raises(ValueError, match=f"{TUNE}.*(persistent|prep_ctas).*(persistent|prep_ctas)"):
        gdn_choice(problem, chains=CHAINS)  # the message lists every kernel's fields, e.g. both of these


def test_a_value_the_kernel_refuses_names_the_variable(monkeypatch):
    monkeypatch.setenv(TUNE, "tile_v=48")
    with pytest.raises(ValueError, match=TUNE):
        gdn_choice(_problem(), chains=CHAINS)
    monkeypatch.setenv(TUNE, "prep_ctas=4")  # a field of KDA's, refused by its value: raises there, not for GDN
    with pytest.raises(ValueError, match=f"prep_ctas.*{TUNE}"):
        gdn_choice(PROBLEMS["kda_sm90"][0], chains=CHAINS)
    assert gdn_choice(_problem(), chains=CHAINS)[1].tiles == chk90.default_tiles(_problem(), num_sms=132,
                                                                                 chains=CHAINS)


def test_the_fields_are_every_kernels(monkeypatch):
    # a kernel listed later (as test_gdn_fused_sm90_cpu lists one) brings its fields: they are read per call
    class Extra:
        TUNING_FIELDS = ("only_here",)

    monkeypatch.setitem(dg._FORCED, "extra", Extra)
    monkeypatch.setenv(TUNE, "only_here=1")
    assert gdn_choice(_problem(), chains=CHAINS)[1].tiles == chk90.default_tiles(_problem(), num_sms=132,
                                                                                 chains=CHAINS)
