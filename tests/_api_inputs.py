"""Host-tensor arguments of each softmax-attention entry point, shared by the CPU tests of its checks
(``test_api_devices_cpu``: the device refusal, ``test_api_error_order``: which error comes first), and a compiled
kernel stand-in whose entry refuses host tensors."""

import torch

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


def single_decode_args():
    return dict(q=torch.randn(8, 64).to(BF16), k=torch.randn(40, 2, 64).to(BF16), v=torch.randn(40, 2, 64).to(BF16))


def single_prefill_args():
    return dict(q=torch.randn(5, 8, 64).to(BF16), k=torch.randn(40, 2, 64).to(BF16), v=torch.randn(40, 2, 64).to(BF16))


def trtllm_args(B=2, ps=16, hkv=2, d=64, pages=6, hq=8, q_rows=None):
    return dict(query=torch.randn(q_rows or B, hq, d).to(BF16), kv_cache=torch.randn(pages, 2, hkv, ps, d).to(BF16),
                workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8),
                block_tables=torch.arange(B * 3, dtype=torch.int32).view(B, 3),
                seq_lens=torch.tensor([20, 33], dtype=torch.int32), max_seq_len=48, bmm1_scale=0.125)


def context_args():
    a = trtllm_args()
    a.pop("max_seq_len")
    a.update(query=torch.randn(7, 8, 64).to(BF16), max_q_len=4, max_kv_len=33, bmm2_scale=1.0, batch_size=2,
             cum_seq_lens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
             cum_seq_lens_kv=torch.tensor([0, 20, 53], dtype=torch.int32))
    return a


def xqa_args(B=2, ps=16, hkv=2, d=64, pages=6, q_seq_len=1):
    qs = (B, 1, 8, d) if q_seq_len == 1 else (B, 1, q_seq_len, 8, d)
    return dict(q=torch.randn(qs).to(BF16), k_cache=torch.randn(pages, ps, hkv, d).to(BF16),
                v_cache=torch.randn(pages, ps, hkv, d).to(BF16),
                page_table=torch.arange(B * 3, dtype=torch.int32).view(B, 3),
                seq_lens=torch.tensor([[20], [33]], dtype=torch.int32), output=torch.empty(qs, dtype=BF16),
                workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8), semaphores=torch.zeros(8, dtype=torch.int32),
                num_kv_heads=hkv, page_size=ps, q_seq_len=q_seq_len)


def prims_ts_args(B=2, ps=16, hkv=2, d=64, pages=6):
    return dict(q=torch.randn(B, 8, d).to(BF16), paged_kv_cache=torch.randn(pages, 2, hkv, ps, d).to(BF16),
                block_tables=torch.arange(B * 3, dtype=torch.int32).view(B, 3),
                seq_lens_kv=torch.tensor([20, 33], dtype=torch.int32))


def trtllm_mla_args(B=2, ps=32, pages=4):
    return dict(query=torch.randn(B, 1, 16, 576).to(BF16), kv_cache=torch.randn(pages, ps, 576).to(BF16),
                workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8), qk_nope_head_dim=128, kv_lora_rank=512,
                qk_rope_head_dim=64, block_tables=torch.arange(B * 2, dtype=torch.int32).view(B, 2),
                seq_lens=torch.tensor([20, 33], dtype=torch.int32), max_seq_len=64)


def xqa_mla_args(B=2, ps=32, pages=4):
    k_cache = torch.randn(pages, ps, 576).to(E4M3)
    return dict(q=torch.randn(B, 1, 128, 576).to(E4M3), k_cache=k_cache, v_cache=k_cache[..., :512],
                page_table=torch.arange(B * 2, dtype=torch.int32).view(B, 2),
                seq_lens=torch.tensor([[20], [33]], dtype=torch.int32),
                output=torch.empty(B, 1, 128, 512, dtype=BF16), workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8),
                semaphores=torch.zeros(8, dtype=torch.int32), page_size=ps)


class EntryRefusesDevice:
    """A compiled kernel whose tvm-ffi entry refuses the host q (the disk-cache load's message)."""

    def __call__(self, *a):
        raise ValueError("Mismatched Tensor on argument #0 when calling: `__call__(mQ: Tensor, mK: Tensor)`, "
                         "expected device_type=cuda")
