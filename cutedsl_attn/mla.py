"""``flashinfer.mla``'s path: ``cutedsl_attn.mla.BatchMLAPagedAttentionWrapper`` (see :mod:`cutedsl_attn.api.mla`)."""

from .api.mla import BatchMLAPagedAttentionWrapper

__all__ = ["BatchMLAPagedAttentionWrapper"]
