"""The demo behind ``python -m cutedsl_attn demo`` and its real-model fixture (all-MiniLM-L6-v2 attention).

Shipped with the package but outside the library's import path: ``import cutedsl_attn`` does not import it.
:mod:`.demo` is the command, :mod:`.realmodel` loads the fixture ``data/minilm.pt`` and builds prefill and
decode cases from it.
"""
