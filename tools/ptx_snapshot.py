"""Write the PTX of the default kernel configurations to a folder, kernel names normalised, for refactoring checks.

    python tools/ptx_snapshot.py /tmp/ptx_before      # before a change
    python tools/ptx_snapshot.py /tmp/ptx_after       # after it
    diff -r /tmp/ptx_before /tmp/ptx_after            # byte-identical where the change should not alter code

Each file is one configuration of ``cutedsl_attn.inspect.ptx`` (the dispatch layer's default tiles); the
kernel's entry name (which spells the module path and class name) is replaced by ``KERNEL`` so that moving a
kernel between modules does not show as a difference.  ``--only SUBSTR`` keeps the configurations whose name
contains it.  Needs no GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

SM90 = "sm_90a"

# (file name, op, arch, keyword arguments of cutedsl_attn.inspect.ptx)
CONFIGS = [
    ("sm90_d64_ragged", "prefill", SM90, dict(head_dim_qk=64, group_size=4)),
    ("sm90_d64_causal", "prefill", SM90, dict(head_dim_qk=64, group_size=4, causal=True)),
    ("sm90_d128_causal", "prefill", SM90, dict(head_dim_qk=128, group_size=4, causal=True)),
    ("sm90_d128_full", "prefill", SM90, dict(head_dim_qk=128, group_size=4)),
    ("sm90_d128_g1_causal", "prefill", SM90, dict(head_dim_qk=128, group_size=1, causal=True)),
    ("sm90_d256_causal", "prefill", SM90, dict(head_dim_qk=256, group_size=4, causal=True)),
    ("sm90_d192_128", "prefill", SM90, dict(head_dim_qk=192, head_dim_vo=128, group_size=1, causal=True)),
    ("sm90_d128_paged16", "prefill", SM90, dict(head_dim_qk=128, group_size=4, page_size=16, causal=True)),
    ("sm90_d128_paged64", "prefill", SM90, dict(head_dim_qk=128, group_size=4, page_size=64)),
    ("sm90_d128_paged1", "prefill", SM90, dict(head_dim_qk=128, group_size=4, page_size=1, causal=True)),
    ("sm90_d128_mask", "prefill", SM90, dict(head_dim_qk=128, group_size=4, use_custom_mask=True)),
    ("sm90_d128_window_cap_sinks", "prefill", SM90,
     dict(head_dim_qk=128, group_size=4, causal=True, use_window=True, use_soft_cap=True, use_sinks=True)),
    ("sm90_d64_window", "prefill", SM90, dict(head_dim_qk=64, group_size=8, causal=True, use_window=True)),
    ("portable_d128_rope", "prefill", SM90, dict(head_dim_qk=128, group_size=4, pos_encoding_mode="ROPE_LLAMA")),
    ("portable_d128_alibi_causal", "prefill", SM90,
     dict(head_dim_qk=128, group_size=4, causal=True, pos_encoding_mode="ALIBI")),
    ("portable_d32", "prefill", SM90, dict(head_dim_qk=32, group_size=4, causal=True)),
    ("portable_d128_paged_sm90", "prefill", SM90, dict(head_dim_qk=128, group_size=4, page_size=16, kernel="portable")),
    ("portable_d128_sm100", "prefill", "sm_100a", dict(head_dim_qk=128, group_size=4, causal=True)),
    ("portable_d256_mask_sm100", "prefill", "sm_100a", dict(head_dim_qk=256, group_size=2, use_custom_mask=True)),
    ("decode_d128_p16_g4", "decode", SM90, dict(head_dim=128, page_size=16, group_size=4)),
    ("decode_d128_p1_g8_cap_sinks", "decode", SM90,
     dict(head_dim=128, page_size=1, group_size=8, use_soft_cap=True, use_sinks=True)),
    ("decode_d64_rope", "decode", SM90, dict(head_dim=64, page_size=16, group_size=4, pos_encoding_mode="ROPE_LLAMA")),
    ("decode_d256_alibi", "decode", SM90, dict(head_dim=256, page_size=64, group_size=2, pos_encoding_mode="ALIBI")),
    ("decode_d128_sm100", "decode", "sm_100a", dict(head_dim=128, page_size=16, group_size=4)),
    ("portable_d128_paged16_fp8_causal", "prefill", SM90,
     dict(head_dim_qk=128, group_size=4, page_size=16, causal=True, kv_dtype="float8_e4m3fn")),
    ("mla_bf16_p64", "mla", SM90, dict()),
    ("mla_bf16_p1_causal", "mla", SM90, dict(page_size=1, causal=True)),
    ("mla_bf16_fp8kv_p64", "mla", SM90, dict(kv_dtype="float8_e4m3fn")),
    ("mla_fp8_p64_sm100", "mla", "sm_100a", dict(dtype="float8_e4m3fn", kv_dtype="float8_e4m3fn")),
    ("gdn_chunked_k128", "gdn", SM90, dict()),
    ("gdn_chunked_k128_l2norm_log_sm100", "gdn", "sm_100a", dict(use_qk_l2norm=True, gate_domain="log")),
    ("gdn_chunked_k64_few_chains", "gdn", SM90, dict(head_dim_k=64, head_dim_v=64, chains=4)),
]


def _score_mod_configs():
    def rel_bias(score, batch_idx, head_idx, q_idx, kv_idx):
        return score - 0.004 * (q_idx - kv_idx)

    return [
        ("sm90_d128_score_mod", "prefill", SM90, dict(head_dim_qk=128, group_size=4, causal=True, score_mod=rel_bias)),
        ("sm90_d64_score_mod", "prefill", SM90, dict(head_dim_qk=64, group_size=4, causal=True, score_mod=rel_bias)),
    ]


def normalise(text: str) -> str:
    """The PTX with every ``.entry`` name replaced by ``KERNEL``, ``KERNEL1``, ... (in order of appearance)."""
    names = re.findall(r"\.entry\s+([A-Za-z_$][\w$]*)", text)
    for i, name in enumerate(dict.fromkeys(names)):
        text = text.replace(name, "KERNEL" if i == 0 else f"KERNEL{i}")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    from cutedsl_attn import inspect as ci

    os.makedirs(args.out_dir, exist_ok=True)
    for name, op, arch, kw in CONFIGS + _score_mod_configs():
        if args.only not in name:
            continue
        try:
            text = normalise(ci.ptx(op, arch, **kw))
        except Exception as e:  # a configuration that no longer builds is a difference too
            text = f"ERROR {type(e).__name__}: {e}\n"
        with open(os.path.join(args.out_dir, name + ".ptx"), "w") as f:
            f.write(text)
        print(f"{name}: {len(text)} chars", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
