"""cuDNN frontend graph builders (``backend="cudnn"``; the bottom of the import graph: this package imports nothing
above it), and ``flashinfer.cudnn``'s path: the FlashInfer entry points ``cudnn_batch_decode_with_kv_cache``,
``cudnn_batch_prefill_with_kv_cache``, ``cudnn_chunk_gated_delta_rule``, ``cudnn_chunk_gated_delta_rule2``,
``cudnn_chunk_gated_delta_product`` and ``cudnn_recurrent_kda`` are defined in the API layer and attached
to this package by ``cutedsl_attn/__init__.py`` (which every import of ``cutedsl_attn.cudnn`` runs first), so
``from cutedsl_attn.cudnn import cudnn_recurrent_kda`` works with the layering kept (the upper layer adds them;
nothing here imports it)."""
