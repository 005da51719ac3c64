"""CPU tests of ``python -m cutedsl_attn selfcheck`` (``cutedsl_attn.selfcheck_cli``): the no-GPU cross-compile
report, the GPU matrix's rows and order (kernels stubbed), ``--only`` and ``--no-peers``, and the peer column
(FlashInfer and FA4 stand-ins: guarded imports, the same inputs, a raising peer reported, not fatal)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from cutedsl_attn import dispatch
from cutedsl_attn import selfcheck as sc
from cutedsl_attn.compile.selfcheck import Verdict

BF16 = torch.bfloat16
PASS = Verdict(True, "matches the oracle", candidate_err=2e-3, reference_err=2e-3, tolerance=1e-2)

pytestmark = pytest.mark.usefixtures("selfcheck_isolated")  # tests/conftest.py: a fresh cache, no verdicts


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

    monkeypatch.setattr(selfcheck_cli, "installed_peers", lambda: {})
    monkeypatch.setattr(selfcheck_cli, "_prefill_rows", lambda arch, k, peers=None: iter([
        selfcheck_cli.Row("prefill", f"prefill_{k}", arch, "pass")]))
    monkeypatch.setattr(selfcheck_cli, "_decode_rows", rows("decode", "paged_decode"))
    monkeypatch.setattr(selfcheck_cli, "_gdn_rows", rows("gdn", "gdn_recurrent"))
    monkeypatch.setattr(selfcheck_cli, "_kda_rows", rows("gdn", "kda_chunked"))

    def raises():
        raise RuntimeError("no MLA here")
        yield  # a generator

    monkeypatch.setattr(selfcheck_cli, "_mla_rows", raises)
    got = list(selfcheck_cli.gpu_matrix())
    assert [r.kernel for r in got] == ["prefill_portable", "paged_decode", "gdn_recurrent", "kda_chunked",
                                       "mla_decode_portable", "prefill_sm100"]
    assert got[4].status == "error" and "no MLA here" in got[4].note and got[-1].case == "sm_100a"
    assert [r.kernel for r in selfcheck_cli.gpu_matrix(only="prefill")] == ["prefill_portable", "prefill_sm100"]
    # the peers are imported once per matrix, only when a prefill or decode row runs, and reach those rows
    imported, given = [], []
    monkeypatch.setattr(selfcheck_cli, "installed_peers", lambda: imported.append(1) or {"fa4": "module"})
    monkeypatch.setattr(selfcheck_cli, "_decode_rows", lambda peers=None: given.append(peers) or iter(()))
    list(selfcheck_cli.gpu_matrix(only="gdn"))
    assert imported == [] and given == []
    list(selfcheck_cli.gpu_matrix(only="decode"))
    assert imported == [1] and given[0].modules == {"fa4": "module"}
    list(selfcheck_cli.gpu_matrix(only="decode", peers=False))
    assert imported == [1] and given[1] is None
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA B200")
    monkeypatch.setattr(selfcheck_cli, "gpu_matrix", lambda only="", peers=True: seen.append(peers) or iter([
        selfcheck_cli.Row("decode", "paged_decode", "case", "pass", peers="flashinfer 3.0")]))
    assert selfcheck_cli.main(["--no-peers"]) == 0 and selfcheck_cli.main([]) == 0 and seen == [False, True]


# ----------------------------------------------------------------------------- selfcheck: peer timings
class FakeFlashInfer:
    """A stand-in ``flashinfer`` module: its prefill / decode wrappers record ``plan`` and ``run`` (``fail``: the
    run raises)."""

    def __init__(self, fail=False):
        self.calls, fake = [], self

        class Wrapper:
            def __init__(self, workspace, layout):
                assert workspace.dtype == torch.uint8 and layout == "NHD"

            def plan(self, *args, **kw):
                fake.calls.append((type(self).__name__, "plan", args, kw))

            def run(self, *tensors):
                fake.calls.append((type(self).__name__, "run", tuple(t.shape for t in tensors), {}))
                if fail:
                    raise RuntimeError("peer boom")

        self.BatchPrefillWithRaggedKVCacheWrapper = type("BatchPrefillWithRaggedKVCacheWrapper", (Wrapper,), {})
        self.BatchDecodeWithPagedKVCacheWrapper = type("BatchDecodeWithPagedKVCacheWrapper", (Wrapper,), {})


class FakeFA4:
    """A stand-in ``flash_attn.cute``: its varlen forward records its keyword arguments."""

    def __init__(self):
        self.calls = []

    def flash_attn_varlen_func(self, q, k, v, **kw):
        self.calls.append(((q.shape, k.shape, v.shape), kw))
        return q


@pytest.fixture
def timed_once(monkeypatch):
    """``_call_us`` without CUDA events: one call, 7.5 us."""
    from cutedsl_attn import selfcheck_cli

    def call_us(fn, reps=10):
        fn()
        return 7.5

    monkeypatch.setattr(selfcheck_cli, "_call_us", call_us)
    return selfcheck_cli


def test_installed_peers_imports_guarded(monkeypatch):
    import sys

    from cutedsl_attn import selfcheck_cli

    fi = types.ModuleType("flashinfer")
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # an import of it raises ImportError
    assert selfcheck_cli.installed_peers() == {"flashinfer": fi}
    real = selfcheck_cli.importlib.import_module

    def broken(name, *a):
        if name == "flash_attn.cute":
            raise OSError("libcuda.so: cannot open")
        return real(name, *a)

    monkeypatch.setattr(selfcheck_cli.importlib, "import_module", broken)
    found = selfcheck_cli.installed_peers()
    assert found["flashinfer"] is fi and isinstance(found["fa4"], OSError)  # a broken install is reported


def test_prefill_peers_time_the_checks_inputs_and_fill_the_column(timed_once):
    sc_cli = timed_once
    fi, fa4 = FakeFlashInfer(), FakeFA4()
    p = dispatch.prefill_problem(dtype=BF16, head_dim_qk=128, head_dim_vo=128, group_size=4, causal=True,
                                 arch="sm_100a")
    cell, note = sc_cli._peer_cell(sc_cli._prefill_peer_makers({"flashinfer": fi, "fa4": fa4}, p, "cpu"))
    assert (cell, note) == ("flashinfer 7.5 fa4 7.5", "")
    case = sc._prefill_case(p, 0)
    tq, tk = case["total_q"], sum(sc._KV_LENS)
    (name, what, args, kw), run = fi.calls[0], fi.calls[1]
    assert name == "BatchPrefillWithRaggedKVCacheWrapper" and what == "plan"
    assert args[0].tolist() == sc._indptr(sc._QO_LENS).tolist() and args[1].tolist() == sc._indptr(sc._KV_LENS).tolist()
    assert args[2:] == (8, 2, 128) and kw["head_dim_vo"] == 128 and kw["causal"] is True
    assert kw["sm_scale"] == case["sm_scale"] and kw["q_data_type"] == BF16
    assert run[2] == ((tq, 8, 128), (tk, 2, 128), (tk, 2, 128))  # the check's q, K / V without the spare rows
    (shapes, fkw), = fa4.calls
    assert shapes == run[2] and fkw["causal"] is True and "learnable_sink" not in fkw
    assert fkw["max_seqlen_q"] == max(sc._QO_LENS) and fkw["max_seqlen_k"] == max(sc._KV_LENS)
    # sinks: FlashInfer's ragged wrapper has no sink argument (n/a), FA4 gets them
    ps = dataclasses.replace(p, use_sinks=True)
    cell, _ = sc_cli._peer_cell(sc_cli._prefill_peer_makers({"flashinfer": fi, "fa4": fa4}, ps, "cpu"))
    assert cell == "flashinfer n/a fa4 7.5" and fa4.calls[-1][1]["learnable_sink"].shape == (8,)
    row = sc_cli.Row("prefill", "prefill_sm100", "bf16 d128 G4 causal", "pass", 1e-3, 2.0, 9.0, "", cell)
    table = sc_cli.format_table([row, sc_cli.Row("gdn", "gdn_chunked", "c", "pass")])
    head, line, gdn = table.splitlines()
    assert "peers us / call" in head and "flashinfer n/a fa4 7.5" in line
    assert head.index("peers us / call") == line.index("flashinfer")  # aligned under its header
    assert "n/a" not in gdn and "-" not in gdn.split()  # GDN / MLA rows time no peer


def test_decode_peer_plans_with_the_rows_arguments(timed_once):
    sc_cli = timed_once
    fi = FakeFlashInfer()
    q, cache = torch.zeros(3, 8, 64), torch.zeros(10, 2, 16, 2, 64)
    plan_args = (torch.tensor([0, 1]), torch.tensor([4]), torch.tensor([5]), 8, 2, 64, 16)
    kw = dict(q_data_type=BF16, kv_data_type=BF16)
    assert sc_cli._peer_cell(sc_cli._decode_peer_makers({"flashinfer": fi}, plan_args, kw, q, cache)) == (
        "flashinfer 7.5", "")
    assert fi.calls[0][1:] == ("plan", plan_args, kw) and fi.calls[1][2] == (q.shape, cache.shape)
    # no peer installed (FA4 alone times no decode): "-"
    assert sc_cli._peer_cell(sc_cli._decode_peer_makers({}, plan_args, kw, q, cache)) == ("-", "")
    assert sc_cli._peer_cell(sc_cli._decode_peer_makers({"fa4": FakeFA4()}, plan_args, kw, q, cache)) == ("-", "")


def test_a_peer_that_raises_is_reported_not_fatal(timed_once, monkeypatch):
    sc_cli = timed_once
    cell, note = sc_cli._peer_cell(sc_cli._decode_peer_makers(
        {"flashinfer": FakeFlashInfer(fail=True)}, (), {}, torch.zeros(1), torch.zeros(1)))
    assert cell == "flashinfer error" and note == "peer flashinfer: RuntimeError: peer boom"
    cell, note = sc_cli._peer_cell(sc_cli._decode_peer_makers(
        {"flashinfer": OSError("broken install")}, (), {}, torch.zeros(1), torch.zeros(1)))
    assert cell == "flashinfer error" and "OSError: broken install" in note
    # in the rows: the kernel's verdict stands, the peer's error joins the note, each case is timed once
    made = []

    def makers(modules, problem, dev):
        made.append(problem)

        def boom():
            raise RuntimeError("fa4 cannot")

        return {"fa4": boom, "flashinfer": lambda: (lambda: None)}

    monkeypatch.setattr(sc_cli, "_prefill_peer_makers", makers)
    monkeypatch.setattr(dispatch, "prefill_choice", lambda p, kernel: types.SimpleNamespace(
        name=f"prefill_{kernel}", fn=None, problem=p))

    def check(cand, ref, timings):
        timings["candidate_us"] = 5.0
        return PASS

    monkeypatch.setattr(sc, "check_prefill", check)
    peers = sc_cli.Peers({"fa4": FakeFA4()})
    rows = [r for k in ("portable", "sm100") for r in sc_cli._prefill_rows("sm_100a", k, peers)]
    assert len(rows) == 2 * len(sc_cli.PREFILL_CASES) and len(made) == len(sc_cli.PREFILL_CASES)
    for r in rows:
        assert r.status == "pass" and r.call_us == 5.0
        assert r.peers == "fa4 error flashinfer 7.5" and r.note == "peer fa4: RuntimeError: fa4 cannot"
    assert all(r.peers == "" for r in sc_cli._prefill_rows("sm_100a", "portable"))  # peers off: no column text
