"""``flashinfer.xqa``'s path: ``cutedsl_attn.xqa.xqa`` (see :mod:`cutedsl_attn.api.trtllm`)."""

from .api.trtllm import xqa

__all__ = ["xqa"]
