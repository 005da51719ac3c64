"""``flashinfer.xqa``'s path: ``cutedsl_attn.xqa.xqa`` (see :mod:`cutedsl_attn.api.trtllm`) and ``xqa_mla`` (see
:mod:`cutedsl_attn.api.mla_trtllm`)."""

from .api.mla_trtllm import xqa_mla
from .api.trtllm import xqa

__all__ = ["xqa", "xqa_mla"]
