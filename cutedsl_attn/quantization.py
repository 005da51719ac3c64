"""``flashinfer.quantization``'s path: ``packbits`` / ``segment_packbits`` (see :mod:`cutedsl_attn.api.quantization`)."""

from .api.quantization import packbits, segment_packbits

__all__ = ["packbits", "segment_packbits"]
