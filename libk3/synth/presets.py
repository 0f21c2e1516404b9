"""Size presets of synthetic K3 checkpoints (see formats/synthetic-checkpoint.md).

Owns: the architecture of each preset as a flat config dict, plus its tokenizer split and
shard layout; the dimensions of each preset's DSpark draft (``DRAFTS``) and image tower
(``VISIONS``). Does not own:
writing files (``libk3.synth.checkpoint``, ``libk3.synth.draft``).

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

Why the drafts' sizes: each is the published draft (``k3_dims.DSPARK``) shrunk with its
target, small enough to commit (tiny's, well under 1 MB, most of it the target's embedding
copy and the five-tap context projection), with every width distinct from the others it
could be confused with (q_lora vs kv_lora + rope, nope vs v, the MLP vs the attention
output), so a swapped or misread shape is an error rather than a silent transpose.
"""

from __future__ import annotations

from ..k3_dims import REAL, VISION

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

# The DSpark draft of each preset (formats/synthetic-checkpoint.md, "Drafts"), as overrides of
# the published draft's config. The target fixes the rest (libk3.synth.draft): hidden_size
# and target_hidden_size, vocab_size, target_num_hidden_layers, mask_token_id. Taps: five
# ascending 0-based layers mixing KDA and MLA layers (tiny, small and medium share the layer
# map KKKMKKKMKKKMM: taps 3 and 12 are MLA, 1, 6 and 9 KDA); real-dims has only three
# layers, so its draft taps all three; real-sparse taps the published layers.
_SMALL_TAPS = [1, 3, 6, 9, 12]
DRAFT_TINY = dict(
    intermediate_size=40, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=20,
    qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16, markov_rank=16,
    target_layer_ids=_SMALL_TAPS,
)
DRAFT_SMALL = dict(
    intermediate_size=384, num_attention_heads=8, q_lora_rank=128, kv_lora_rank=64,
    qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32, markov_rank=32,
    target_layer_ids=_SMALL_TAPS,
)
DRAFT_MEDIUM = dict(
    intermediate_size=4096, num_attention_heads=16, q_lora_rank=512, kv_lora_rank=256,
    qk_nope_head_dim=96, qk_rope_head_dim=32, v_head_dim=64, markov_rank=64,
    target_layer_ids=_SMALL_TAPS,
)

# preset name -> overrides of k3_dims.DSPARK
DRAFTS = {
    "tiny": DRAFT_TINY,
    "small": DRAFT_SMALL,
    "medium": DRAFT_MEDIUM,
    "real-dims": dict(target_layer_ids=[0, 1, 2]),
    "real-sparse": {},
}

# The image tower of each preset (formats/model/vision.md §3.3), as the published vision_config
# with these widths; text_hidden_size is the preset's hidden_size. Smaller presets keep
# every width apart from the ones it could be mistaken for (D, the attention width, its
# triple, the MLP, the merged row 4 D, the language model's hidden), a head width that is a
# multiple of 4 and not D / heads, and a position table with odd, unequal sides (a patch
# grid is always even, so the table is always resized).
_VISION_SHRUNK = {
    "tiny": dict(vt_hidden_size=40, vt_num_attention_heads=2, qkv_hidden_size=48,
                 vt_num_hidden_layers=2, vt_intermediate_size=88, init_pos_emb_height=5,
                 init_pos_emb_width=7),
    "small": dict(vt_hidden_size=96, vt_num_attention_heads=4, qkv_hidden_size=144,
                  vt_num_hidden_layers=3, vt_intermediate_size=224, init_pos_emb_height=11,
                  init_pos_emb_width=15),
    "medium": dict(vt_hidden_size=256, vt_num_attention_heads=8, qkv_hidden_size=384,
                   vt_num_hidden_layers=4, vt_intermediate_size=640, init_pos_emb_height=23,
                   init_pos_emb_width=31),
    "real-dims": {},
    "real-sparse": {},
}
VISIONS = {
    name: dict(VISION, **over, mm_hidden_size=over.get("vt_hidden_size", VISION["vt_hidden_size"]),
               text_hidden_size=PRESETS[name][0]["hidden_size"])
    for name, over in _VISION_SHRUNK.items()
}
