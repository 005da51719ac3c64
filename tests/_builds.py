"""One cross-compile per kernel configuration for the whole test session, shared by every CPU test that inspects
a kernel's PTX, cubin or SASS.

A kernel module's ``compile(cfg, keep_ptx_dir=..., keep_cubin=...)`` costs 1-13 s on the CI machine; many test
files check the same configuration (the SM90 GDN plain launch against its split entries, an inspect config against
the module's own checks, a test's base problem against another test's entry).  :func:`build` compiles each
``(compile_fn, cfg)`` once, keeping both the PTX and the cubin: the DSL assembles the cubin on every compile, so
keeping it costs no compile time and a PTX-only test can share a build with a cubin one.

:func:`share_inspect_compiles` (called by ``conftest.py``) routes :mod:`cutedsl_attn.inspect`'s two in-process
memos (a PTX one and a separate PTX + cubin one, which compiled a config twice when a test asked for both) to
:func:`build`, so ``ci.ptx`` / ``ci.resources`` / ``ci.sass`` and the tests' direct compiles share one build.
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import tempfile
from typing import NamedTuple

_DUMP = tempfile.TemporaryDirectory(prefix="cutedsl_attn_test_builds_")


class Build(NamedTuple):
    """The artifacts of one compile: ``ptx`` (text), ``cubin`` (ELF bytes), and the files in ``dump_dir``."""

    ptx: str
    cubin: bytes
    ptx_path: str
    cubin_path: str

    @property
    def dump_dir(self) -> str:
        return os.path.dirname(self.ptx_path)


@functools.lru_cache(maxsize=None)
def build(compile_fn, cfg) -> Build:
    """The PTX and cubin of ``compile_fn(cfg)`` (a kernel module's ``compile`` / ``compile_prep`` /
    ``compile_main``), compiled once per session.  ``cfg`` is the module's frozen Config (its compile key), so
    two test parametrisations that reach the same Config share the build.  Asserts the compile wrote exactly one
    PTX file and one cubin (one module per compile)."""
    d = tempfile.mkdtemp(dir=_DUMP.name)
    compile_fn(cfg, keep_ptx_dir=d, keep_cubin=True)
    (ptx_path,) = glob.glob(os.path.join(d, "*.ptx"))
    (cubin_path,) = glob.glob(os.path.join(d, "*.cubin"))
    with open(ptx_path) as f:
        ptx = f.read()
    with open(cubin_path, "rb") as f:
        cubin = f.read()
    return Build(ptx, cubin, ptx_path, cubin_path)


@functools.lru_cache(maxsize=None)
def sass(compile_fn, cfg) -> str:
    """``cuobjdump --dump-sass`` of :func:`build`'s cubin (memoised); skips the test without cuobjdump."""
    import pytest

    from cutedsl_attn.inspect import _find_tool

    tool = _find_tool("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not found (the test extra installs nvidia-cuda-cuobjdump)")
    return subprocess.run([tool, "--dump-sass", build(compile_fn, cfg).cubin_path], check=True, capture_output=True,
                          text=True).stdout


def _inspect_artifacts(cfg) -> tuple[str, bytes]:
    from cutedsl_attn import inspect as ci

    b = build(ci._builder(cfg), cfg)
    return b.ptx, b.cubin


def _inspect_ptx(cfg) -> str:
    return _inspect_artifacts(cfg)[0]


def share_inspect_compiles(monkeypatch) -> None:
    """Point ``cutedsl_attn.inspect``'s PTX memo and PTX + cubin memo at :func:`build` (its builder is the
    config's kernel module ``compile``, as inspect's own).  ``ci.ptx`` of one config still returns the same
    string object each call.  inspect's compile-and-read step itself is tested directly
    (``test_ptx.py::test_inspect_compile_artifacts``)."""
    from cutedsl_attn import inspect as ci

    monkeypatch.setattr(ci, "_ptx_cached", _inspect_ptx)
    monkeypatch.setattr(ci, "_artifacts_cached", _inspect_artifacts)
