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
