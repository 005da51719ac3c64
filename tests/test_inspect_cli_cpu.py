"""``cutedsl_attn.inspect`` and the command line: a forced kernel that cannot serve a config is an error naming the
reason (never the portable kernel's PTX under the forced name), the shared memory of every op is reported, and the
documented kernel names, custom ops and flags match what the package registers."""

import pathlib
import re

import pytest
import torch

import cutedsl_attn
from cutedsl_attn import __main__ as cli
from cutedsl_attn import inspect as ci

README = pathlib.Path(cutedsl_attn.__file__).resolve().parent.parent / "README.md"


# ----------------------------------------------------------------------------- forced kernels
@pytest.mark.parametrize("keys,reason", [
    (dict(head_dim_qk=32), "head_dim_qk/head_dim_vo must be one of"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), "positional encodings"),
    (dict(kv_dtype="fp8", page_size=16), "fp8 K/V cache"),
])
def test_sm100_prefill_refusal_names_the_reason(keys, reason):
    with pytest.raises(ValueError, match=rf"^the SM100 prefill kernel cannot serve this config: .*{reason}"):
        ci.config("prefill", "sm_100a", kernel="sm100", **keys)


def test_sm100_prefill_on_sm90_refused():
    with pytest.raises(ValueError, match="SM100 prefill kernel cannot serve this config: .*sm_100a / sm_103a only"):
        ci.config("prefill", "sm_90a", kernel="sm100")
    assert type(ci.config("prefill", "sm_100a", kernel="sm100")).__module__.startswith("cutedsl_attn.sm100.")


def test_cli_sm100_prefill_on_sm90_exits_2(capsys):
    assert cli.main(["ptx", "prefill", "--kernel", "sm100", "--arch", "sm_90a"]) == 2
    captured = capsys.readouterr()
    assert "SM100 prefill kernel cannot serve this config" in captured.err and captured.out == ""


# ----------------------------------------------------------------------------- shared memory of every op
@pytest.mark.parametrize("op,arch,keys", [
    ("gdn", "sm_90a", dict(decode=True)),  # the recurrent kernel: no shared memory, no smem field on its config
    ("gdn", "sm_100a", {}),                # the portable chunked prep + main kernels: two planned figures
    ("mla", "sm_90a", dict(page_size=16)),  # the portable MLA kernel
])
def test_resources_report_shared_memory(op, arch, keys):
    cfg = ci.config(op, arch, **keys)
    res = ci.resources(op, arch, **keys)
    static = max(ci.cubin_static_shared(ci._cubin_cached(cfg)).values(), default=0)
    assert res["static_smem_bytes"] == static
    planned = [getattr(cfg, n) for n in ci.SMEM_FIELDS if isinstance(getattr(cfg, n, None), int)]
    assert res["smem_bytes"] == static + max(planned, default=0)
    if op == "gdn" and keys.get("decode"):
        assert not planned and res["smem_bytes"] == 0
    if op == "gdn" and not keys:
        assert res["prep_smem_bytes"] == cfg.prep_smem_bytes and res["main_smem_bytes"] == cfg.main_smem_bytes
        assert res["smem_bytes"] > 64 * 1024
    text = cli.format_resources(op, arch, **keys)
    assert re.search(rf"^smem_bytes: {res['smem_bytes']}$", text, flags=re.M), text
    assert re.search(rf"^static_smem_bytes: {static}$", text, flags=re.M), text


def test_resources_report_the_sm90_gdn_prep_next_to_the_main_kernel():
    """The SM90 chunked GDN launches a prep kernel (the SM90 one, ``Tiles.prep = 1``, the default) then the main
    kernel: each kernel's dynamic shared memory and the CTAs an SM it is planned for, in that order."""
    from cutedsl_attn.common.gdn_prep import PREP_CTAS_PER_SM
    from cutedsl_attn.sm90.gdn_prep import SMEM_PER_SM, prep_sm90_smem_bytes

    cfg = ci.config("gdn", "sm_90a")
    assert type(cfg).__module__ == "cutedsl_attn.sm90.gdn_chunked" and cfg.tiles.prep == 1
    res = ci.resources("gdn", "sm_90a")
    assert res["prep_smem_bytes"] == prep_sm90_smem_bytes(128, 128)
    assert res["prep_ctas_per_sm"] == PREP_CTAS_PER_SM == 4
    assert PREP_CTAS_PER_SM * (res["prep_smem_bytes"] + 1024) <= SMEM_PER_SM  # the planned count fits an SM
    assert res["main_smem_bytes"] == cfg.main_smem_bytes and res["main_ctas_per_sm"] == cfg.main_ctas_per_sm
    assert res["smem_bytes"] == res["static_smem_bytes"] + max(res["prep_smem_bytes"], res["main_smem_bytes"])
    keys = list(res)
    i = keys.index("prep_smem_bytes")
    assert keys[i:i + 4] == ["prep_smem_bytes", "prep_ctas_per_sm", "main_smem_bytes", "main_ctas_per_sm"]
    text = cli.format_resources("gdn", "sm_90a")  # the compile is memoised: no second build
    lines = text.splitlines()
    want = [f"prep_smem_bytes: {res['prep_smem_bytes']}", f"prep_ctas_per_sm: {PREP_CTAS_PER_SM}",
            f"main_smem_bytes: {cfg.main_smem_bytes}", f"main_ctas_per_sm: {cfg.main_ctas_per_sm}"]
    i = lines.index(want[0])
    assert lines[i:i + 4] == want, text
    assert len([ln for ln in lines if ln.startswith("  ") and "prep" in ln]) == 1  # the cubin has the prep kernel


def test_prep_plan_of_every_chunked_kernel():
    """:func:`inspect.prep_plan` (no compile): the prep each chunked kernel's launch plans."""
    import dataclasses

    from cutedsl_attn.common import gdn_prep, kda_prep

    cfg = ci.config("gdn", "sm_90a")
    shared = dataclasses.replace(cfg, tiles=dataclasses.replace(cfg.tiles, prep=0))  # the shared mma.sync prep
    assert ci.prep_plan(shared) == {"prep_smem_bytes": gdn_prep.prep_smem_bytes(128, 128), "prep_ctas_per_sm": 4}
    small = ci.config("gdn", "sm_90a", head_dim_k=64, head_dim_v=64)
    assert ci.prep_plan(small)["prep_smem_bytes"] < ci.prep_plan(cfg)["prep_smem_bytes"]
    for arch in ("sm_90a", "sm_100a"):  # the per-channel kernels: the layout of Tiles.prep_ctas
        kda = ci.config("gdn", arch, gate_per_channel=True)  # bf16 KDA: the compact layout on both kernels
        assert ci.prep_plan(kda) == {"prep_smem_bytes": kda.prep_smem_bytes,
                                     "prep_ctas_per_sm": kda.tiles.prep_ctas}
        assert kda.tiles.prep_ctas == 3
        wide = dataclasses.replace(kda, tiles=dataclasses.replace(kda.tiles, prep_ctas=2))
        assert ci.prep_plan(wide) == {"prep_smem_bytes": kda_prep.prep_smem_bytes(128, 128, 2),
                                      "prep_ctas_per_sm": 2}
        compact = dataclasses.replace(kda, tiles=dataclasses.replace(kda.tiles, prep_ctas=3))
        assert ci.prep_plan(compact) == {"prep_smem_bytes": kda_prep.prep_smem_bytes(128, 128, 3),
                                         "prep_ctas_per_sm": 3}
        assert "main_ctas_per_sm" not in ci.ctas_per_sm(kda)  # its config plans none
    portable = ci.config("gdn", "sm_100a")  # its prep launch plans no CTA count
    assert ci.prep_plan(portable) == {"prep_smem_bytes": portable.prep_smem_bytes}
    assert ci.ctas_per_sm(portable) == {}
    assert ci.prep_plan(ci.config("gdn", "sm_90a", decode=True)) == {}  # the recurrent kernel: no prep
    assert ci.prep_plan(ci.config("mla", "sm_90a")) == {} and ci.ctas_per_sm(ci.config("decode")) == {}
    assert ci.ctas_per_sm(cfg) == {"prep_ctas_per_sm": 4, "main_ctas_per_sm": cfg.main_ctas_per_sm}


# ----------------------------------------------------------------------------- documentation matches the code
def test_package_docstring_lists_every_custom_op():
    registered = {n for n in dir(torch.ops.cutedsl_attn) if not n.startswith("_") and n != "name"}
    doc = cutedsl_attn.__doc__
    listed = set(re.findall(r"``(?:cutedsl_attn::)?([a-z0-9_]+)``", doc.split("torch custom op", 1)[1]))
    assert registered <= listed, sorted(registered - listed)


def test_gdn_kernel_values_documented():
    from cutedsl_attn.dispatch.gdn import _GDN_KERNELS

    doc = cutedsl_attn.chunk_gated_delta_rule.__doc__
    part = " ".join(doc.split("``CUTEDSL_ATTN_GDN_KERNEL`` forces", 1)[1].split("see :mod:")[0].split())
    listed = set(re.findall(r"``([a-z0-9_]+)``", part))
    assert listed == set(_GDN_KERNELS), (sorted(listed), _GDN_KERNELS)


def test_inspect_docstring_names_the_current_choices():
    doc = " ".join(ci.config.__doc__.split())
    assert "CUTEDSL_ATTN_MLA_KERNEL=sm90" not in doc and "CUTEDSL_ATTN_MLA_KERNEL=portable" in doc
    assert '``kernel="sm100"``' in doc and '"sm100"``' in doc


def test_cli_texts():
    ap = cli.build_parser()
    ptx = next(a for a in ap._subparsers._group_actions[0].choices["ptx"]._actions if a.dest == "op")
    assert ptx.help.count("(") == ptx.help.count(")"), ptx.help
    acts = {a.dest: a for a in ap._subparsers._group_actions[0].choices["ptx"]._actions}
    assert "mla" in acts["causal"].help and "mla default 64" in acts["page_size"].help


def test_cli_refusal_grammar(capsys):
    assert cli.main(["ptx", "mla", "--window"]) == 2
    assert "mla: --window does not apply to this op" in capsys.readouterr().err
    assert cli.main(["ptx", "gdn", "--window", "--sinks"]) == 2
    assert "gdn: --sinks, --window do not apply to this op" in capsys.readouterr().err


def test_readme_inspect_examples_import_the_submodule():
    """``import cutedsl_attn`` does not load ``cutedsl_attn.inspect``: every README python block using it imports it."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    using = [b for b in blocks if "cutedsl_attn.inspect." in b]
    assert using
    for b in using:
        assert re.search(r"^import cutedsl_attn\.inspect\b", b, flags=re.M), b
