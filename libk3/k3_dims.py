"""The released Kimi K3's architecture: the one place its dimensions are written.

Owns: ``REAL``, the flat config of the released model (formats/model/model.md §2, §3.5), and
``real_config()``, the same as a checked ``K3Config``; ``DSPARK``, the config.json of the
DSpark draft published for it (formats/model/dspark.md §2.1); ``VISION`` and ``MEDIA_PROC``, the
published ``vision_config`` and ``preprocessor_config.json`` (formats/model/vision.md §2). Used by k3-doctor's machine-only
report, the synthetic checkpoints (``libk3.synth.presets`` derives every size preset
from it), the synthetic traces' defaults and the tools' defaults for foreign traces.
Does not own: reading a model's own config (``libk3.config``).
"""

from __future__ import annotations

from .config import K3Config, config_from_dict

REAL = dict(
    hidden_size=7168, num_hidden_layers=93, vocab_size=163840, rms_norm_eps=1e-5,
    tie_word_embeddings=False, kda_num_heads=96, kda_head_dim=128, short_conv_kernel_size=4,
    gate_lower_bound=-5.0, num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=True,
    num_experts=896, num_experts_per_token=16, num_shared_experts=2,
    routed_expert_hidden_size=3584, moe_intermediate_size=3072, routed_scaling_factor=1.0,
    moe_renormalize=True, latent_moe_use_norm=True, first_k_dense_replace=1,
    intermediate_size=33792, attn_res_block_size=12, situ_beta=4.0, situ_linear_beta=25.0,
    full_attn_layers=[4 * i for i in range(1, 23)] + [92, 93],
)


# The published vision_config, all 25 keys (formats/model/vision.md §2.1), and the root key that
# names the image placeholder token (<|media_pad|>, special slot 21 of the vocabulary).
VISION = dict(
    vt_num_hidden_layers=27, vt_hidden_size=1024, vt_num_attention_heads=12,
    qkv_hidden_size=1536, vt_intermediate_size=4096, patch_size=14, init_pos_emb_height=64,
    init_pos_emb_width=64, init_pos_emb_time=4, pos_emb_type="divided_fixed",
    pos_emb_interpolation_mode="bilinear", norm_type="rmsnorm", attn_bias=False,
    linear_bias=False, patch_embed_proj_bias=False, mlp_type="mlp2",
    activation_func="gelu_pytorch_tanh", merge_kernel_size=[2, 2], merge_type="sd2_tpool",
    mm_projector_type="patchmergerv2", mm_hidden_size=1024, text_hidden_size=7168,
    projector_hidden_act="gelu", projector_ln_eps=1e-05,
    _attn_implementation="flash_attention_2",
)
MEDIA_PLACEHOLDER_SLOT = 21
# The published preprocessor_config.json's media_proc_cfg (formats/model/vision.md §2.2).
MEDIA_PROC = dict(
    patch_size=14, merge_kernel_size=2, in_patch_limit=65536, patch_limit_on_one_side=512,
    fixed_output_tokens=None, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    transparent_bg_config={"pattern": "chessboard", "chessboard_square_size": 8,
                           "chessboard_square_on_top_left": True,
                           "chessboard_white_value": 255, "chessboard_gray_value": 180},
    transparent_bg_fill_stage="after_resize", in_patch_limit_each_frame=16384,
    sample_fps=8.0, temporal_merge_kernel_size=4,
    config_type="media_proc.processors.moonvit.MoonViTMediaProcessorConfig",
)

# The published DSpark draft's config.json (dspark.md §2.1): the synthetic drafts derive
# from it as the synthetic targets derive from REAL.
DSPARK = dict(
    architectures=["K3DSparkModel"], model_type="k3_dspark", hidden_size=7168,
    intermediate_size=14336, num_hidden_layers=5, num_attention_heads=64, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    vocab_size=163840, rms_norm_eps=1e-5, max_position_embeddings=1048576, hidden_act="silu",
    rope_parameters=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=32768,
                         beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                         rope_theta=50000.0),
    target_layer_ids=[2, 23, 47, 71, 89], num_target_layers=5, target_hidden_size=7168,
    target_num_hidden_layers=93, mask_token_id=163837, markov_rank=256,
    markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
)


def real_config() -> K3Config:
    """``REAL`` as a checked K3Config (every derived size, e.g. ``expert_bytes``)."""
    return config_from_dict(dict(REAL), source="<Kimi K3 reference>")


# The routing shape of a real trace (the defaults of synthetic and imported traces) and
# the bytes of one routed expert (the disk probe's random read), derived from REAL.
N_LAYERS = REAL["num_hidden_layers"]
N_EXPERTS = REAL["num_experts"]
TOP_K = REAL["num_experts_per_token"]
EXPERT_BYTES = real_config().expert_bytes
