"""Fixtures shared by the CPU API tests: a cross-compile target and the stubbed kernel launches."""

import pytest

from _kernel_stubs import Recorder  # pytest puts tests/ on sys.path


@pytest.fixture
def cross_compile_sm90(monkeypatch):
    """Plans build for sm_90a without a GPU (``CUTEDSL_ATTN_ARCH``); use with ``pytest.mark.usefixtures``."""
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")


@pytest.fixture
def rec(monkeypatch):
    """Every kernel launch recorded instead of run (:class:`_kernel_stubs.Recorder`)."""
    return Recorder().install(monkeypatch)
