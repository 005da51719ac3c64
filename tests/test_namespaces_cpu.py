"""FlashInfer's import paths for the functions this package serves: ``cutedsl_attn.<module>.<name>`` is the same
object as the package-level name wherever FlashInfer has ``flashinfer.<module>.<name>`` (the reference API notes),
and ``cutedsl_attn.cudnn`` carries FlashInfer's ``cudnn_*`` entry points while its own modules import nothing above
the bottom layer."""

import importlib
import pathlib
import subprocess
import sys

import pytest

import cutedsl_attn

# flashinfer.<module>: the names of it that this package serves (FlashInfer 0.7.2's paths)
PATHS = {
    "decode": ["single_decode_with_kv_cache", "BatchDecodeWithPagedKVCacheWrapper",
               "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "trtllm_batch_decode_with_kv_cache",
               "cudnn_batch_decode_with_kv_cache", "trtllm_batch_decode_with_kv_cache_mla"],
    "prefill": ["single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
                "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
                "trtllm_batch_context_with_kv_cache", "cudnn_batch_prefill_with_kv_cache"],
    "xqa": ["xqa", "xqa_mla"],
    "mla": ["BatchMLAPagedAttentionWrapper", "trtllm_batch_decode_with_kv_cache_mla", "xqa_mla"],
    "cudnn": ["cudnn_batch_decode_with_kv_cache", "cudnn_batch_prefill_with_kv_cache", "cudnn_chunk_gated_delta_rule",
              "cudnn_chunk_gated_delta_rule2", "cudnn_chunk_gated_delta_product", "cudnn_recurrent_kda"],
    "attention.prims_ts": ["BatchDecodePagedTSWrapper", "batch_decode_with_paged_kv_cache"],
    "gdn_prefill": ["chunk_gated_delta_rule"],
    "gdn_decode": ["gated_delta_rule_decode", "gated_delta_rule_decode_pretranspose"],
    "gdn2_prefill": ["chunk_gated_delta_rule2"],
    "gdp_prefill": ["chunk_gated_delta_product"],
    "kda": ["recurrent_kda"],
    "kda_decode": ["recurrent_kda"],
    "cascade": ["merge_state", "merge_state_in_place", "merge_states"],
    "quantization": ["packbits", "segment_packbits"],
}


@pytest.mark.parametrize("module", sorted(PATHS))
def test_flashinfer_paths(module):
    mod = importlib.import_module(f"cutedsl_attn.{module}")
    for name in PATHS[module]:
        assert hasattr(mod, name), f"cutedsl_attn.{module}.{name} is missing"
        if hasattr(cutedsl_attn, name) and callable(getattr(cutedsl_attn, name)):
            assert getattr(mod, name) is getattr(cutedsl_attn, name), name
        if hasattr(mod, "__all__"):
            assert name in mod.__all__, f"{name} not in cutedsl_attn.{module}.__all__"


def test_cudnn_entry_points_import_in_a_fresh_process():
    """``from cutedsl_attn.cudnn import ...`` as a process's first import (the package __init__ attaches them)."""
    code = ("from cutedsl_attn.cudnn import cudnn_batch_decode_with_kv_cache, cudnn_recurrent_kda, "
            "cudnn_chunk_gated_delta_rule, cudnn_chunk_gated_delta_rule2, cudnn_chunk_gated_delta_product, "
            "cudnn_batch_prefill_with_kv_cache; print(cudnn_recurrent_kda.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "cutedsl_attn.api.cudnn_linear"


def test_cudnn_package_source_imports_nothing_above():
    """The entry points are attached by the top layer: no dynamic import route in cudnn/ around the import
    statements tests/test_layering_cpu.py checks (importlib, __import__, a module __getattr__)."""
    pkg = pathlib.Path(cutedsl_attn.__file__).parent / "cudnn"
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        for route in ("import_module", "__import__", "def __getattr__", "importlib"):
            assert route not in text, f"{path.name} uses {route!r}"


def test_cudnn_graph_builder_modules_kept():
    import cutedsl_attn.cudnn as c

    assert {"decode", "prefill", "linear_attention"} <= set(vars(c))  # the submodules are still reachable
    assert sorted(c.__all__) == sorted(PATHS["cudnn"])
