"""CPU tests of the inspection command line on the SM100 tcgen05 kernels: ``python -m cutedsl_attn ptx / sass /
resources OP --arch sm_100a --kernel sm100`` for prefill and decode, run in-process through the command line's
``main`` (the three commands of an op share one cross-compile, :mod:`_builds`; no GPU; ``test_ptx.py`` runs
``python -m cutedsl_attn`` itself as a subprocess).  The PTX has tcgen05 instructions, the SASS the UTC*MMA
tensor-core ops, and ``resources`` reports no stack (no spills) for every kernel, with the config's shared memory,
TMEM columns and role budgets."""

import contextlib
import functools
import io
import re

import pytest

from cutedsl_attn import __main__ as cli
from cutedsl_attn.inspect import _find_tool

OPS = ("prefill", "decode")
SM100 = ["--arch", "sm_100a", "--kernel", "sm100"]


@functools.lru_cache(maxsize=None)
def run(command, op):
    """(exit status, stdout, stderr) of ``python -m cutedsl_attn COMMAND OP --arch sm_100a --kernel sm100``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([command, op, *SM100])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("op", OPS)
def test_ptx_has_tcgen05(op):
    rc, out, err = run("ptx", op)
    assert rc == 0, err
    assert ".target sm_100a" in out and "tcgen05.mma" in out and "tcgen05.alloc" in out
    assert "wgmma" not in out and "mma.sync" not in out
    assert "config: cutedsl_attn.sm100." in err  # the chosen config goes to stderr, stdout is the PTX


@pytest.mark.parametrize("op", OPS)
def test_sass_has_the_tcgen05_mma(op):
    if _find_tool("cuobjdump") is None and _find_tool("nvdisasm") is None:
        pytest.skip("no cuobjdump / nvdisasm (the test extra installs nvidia-cuda-cuobjdump)")
    rc, out, err = run("sass", op)
    assert rc == 0, err
    assert re.search(r"\bUTC\w*MMA\b", out), "no UTC*MMA in the SASS"
    assert not re.search(r"\bHGMMA\b", out) and not re.search(r"\bHMMA\b", out)


@pytest.mark.parametrize("op", OPS)
def test_resources_report_no_stack_and_the_plan(op):
    rc, out, err = run("resources", op)
    assert rc == 0, err
    fields = dict(re.findall(r"^(\w[\w ]*): (\d+)$", out, flags=re.M))
    assert fields["stack_bytes"] == "0", out
    assert 0 < int(fields["registers"]) <= 255
    assert 0 < int(fields["smem_bytes"]) <= 227 * 1024 and int(fields["tmem_cols"]) in (32, 64, 128, 256, 512)
    kernels = re.findall(r"^  (\S+): registers (\d+), stack_bytes (\d+)$", out, flags=re.M)
    assert kernels and all(stack == "0" for _, _, stack in kernels), out
    assert max(int(r) for _, r, _ in kernels) == int(fields["registers"])
    if op == "prefill":  # the warp roles' setmaxnreg budgets fit the register file
        budgets = {role: int(n) for role, n in re.findall(r"^setmaxnreg (\w+): (\d+)$", out, flags=re.M)}
        assert set(budgets) == {"softmax", "correction", "other"}
        softmax_groups = int(fields["threads"]) // 128 - 2  # (the correction warpgroup and the MMA / load one)
        assert softmax_groups in (1, 2)
        assert 128 * (softmax_groups * budgets["softmax"] + budgets["correction"] + budgets["other"]) <= 64 * 1024


def test_resources_refuses_flags_before_compiling(capsys):
    assert cli.main(["resources", "mla", "--kernel", "sm100"]) == 2
    assert "--kernel" in capsys.readouterr().err
    assert cli.main(["resources", "decode", "--summary", "--arch", "sm_100a", "--kernel", "sm100"]) == 2
    assert "--summary applies to ptx only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["resources", "nosuchop"])
