"""Numeric constants shared by every kernel and host helper of the package (one home)."""

import math

LOG2E = 1.4426950408889634  # log2(e): natural-log logits to the base-2 units the kernels' ex2 works in
LN2 = math.log(2.0)  # base-2 LSE to natural log (FlashInfer's lse_base="ln")
NEG_INF = float("-inf")
