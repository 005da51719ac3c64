"""Fixtures shared by the CPU API tests: a cross-compile target or none, the stubbed kernel launches, a compile
that fails the test; and one compile per kernel configuration for the session (:mod:`_builds`)."""

import pytest

import _builds
from _kernel_stubs import Recorder  # pytest puts tests/ on sys.path


@pytest.fixture(scope="session", autouse=True)
def shared_inspect_builds():
    """``cutedsl_attn.inspect``'s compiles go through :func:`_builds.build`, shared with the tests' own compiles."""
    with pytest.MonkeyPatch.context() as mp:
        _builds.share_inspect_compiles(mp)
        yield


@pytest.fixture
def cross_compile_sm90(monkeypatch):
    """Plans build for sm_90a without a GPU (``CUTEDSL_ATTN_ARCH``); use with ``pytest.mark.usefixtures``."""
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")


@pytest.fixture
def no_target(monkeypatch):
    """No CUTEDSL_ATTN_ARCH: host tensors are refused (on a machine without a GPU and on a GPU one alike)."""
    monkeypatch.delenv("CUTEDSL_ATTN_ARCH", raising=False)


@pytest.fixture
def no_compile(monkeypatch):
    """Any compile is a test failure (every check comes before planning)."""
    from cutedsl_attn import dispatch

    def refuse(name, cfg, build):
        raise AssertionError(f"compiled {name} before the checks")

    monkeypatch.setattr(dispatch, "get_compiled", refuse)


@pytest.fixture
def rec(monkeypatch):
    """Every kernel launch recorded instead of run (:class:`_kernel_stubs.Recorder`)."""
    return Recorder().install(monkeypatch)


@pytest.fixture
def selfcheck_isolated(monkeypatch, tmp_path):
    """A fresh disk cache, no self-check verdict or kernel choice left from another test, the check on."""
    from cutedsl_attn import dispatch
    from cutedsl_attn.compile import selfcheck as verdicts

    monkeypatch.setenv("CUTEDSL_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", raising=False)
    monkeypatch.delenv("CUTEDSL_ATTN_SELFCHECK", raising=False)
    monkeypatch.delenv("CUTEDSL_ATTN_PREFILL_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    verdicts.clear_verdicts()
    yield
    verdicts.clear_verdicts()
