"""Size presets of synthetic K3 checkpoints (see formats/synthetic-checkpoint.md).

Owns: the architecture of each preset as a flat config dict, plus its tokenizer split and
shard layout. Does not own: writing files (``libk3.synth.checkpoint``).

Why these sizes:
* ``tiny``   the public oracle's dimensions (hidden 128, 13 layers, AttnRes block 3, so two
  blocks complete and a third runs; 8 experts top-2), except the expert width: the
  oracle's 48 is not a multiple of the MXFP4 group, so experts are 64 wide here.
* ``small``  hundreds of MB and 64 experts: cache pressure and streaming tests.
* ``medium`` about 5 GB on disk: memory-budget benchmarks (generate into an ignored dir).
* ``real-dims`` the real widths (``libk3.k3_dims``) (hidden 7168, 96 heads, 17,547,264-byte experts, the real
  vocabulary) with one layer of each kind (dense, KDA+MoE, MLA+MoE) and 32 experts.
* ``real-sparse`` the full released inventory (93 layers x 896 experts, 96 shards,
  497,220 tensors) with data left as sparse holes: apparent size ~1.5 TB, no disk used.
"""

from __future__ import annotations

from ..k3_dims import REAL

TINY = dict(
    REAL, hidden_size=128, num_hidden_layers=13, vocab_size=512, kda_num_heads=4,
    kda_head_dim=16, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
    qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
    num_experts_per_token=2, routed_expert_hidden_size=64, moe_intermediate_size=64,
    intermediate_size=96, attn_res_block_size=3, full_attn_layers=[4, 8, 12, 13],
)

SMALL = dict(
    TINY, hidden_size=512, vocab_size=4096, kda_num_heads=8, kda_head_dim=64,
    num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
    qk_rope_head_dim=32, v_head_dim=64, num_experts=64, num_experts_per_token=4,
    routed_expert_hidden_size=256, moe_intermediate_size=512, intermediate_size=1024,
)

MEDIUM = dict(
    SMALL, hidden_size=2048, vocab_size=32768, kda_num_heads=16, kda_head_dim=128,
    num_attention_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_experts=192, num_experts_per_token=8,
    routed_expert_hidden_size=1024, moe_intermediate_size=1024, intermediate_size=8192,
)

REAL_DIMS = dict(REAL, num_hidden_layers=3, num_experts=32, full_attn_layers=[3])

# name -> (flat config, special-token slots, sparse?, real shard layout?)
PRESETS = {
    "tiny": (TINY, 64, False, False),
    "small": (SMALL, 256, False, False),
    "medium": (MEDIUM, 256, False, False),
    "real-dims": (REAL_DIMS, 256, False, False),
    "real-sparse": (REAL, 256, True, True),
}
