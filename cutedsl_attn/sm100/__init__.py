"""Blackwell (SM100 / SM103) kernels: tcgen05 MMAs with tensor-memory accumulators (cross-compiled and checked on
the CPU; see each package for what has run on hardware)."""
