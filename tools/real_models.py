"""The released checkpoints of the families as data, for tools/estimate_memory.py: each transformer's
diffusers config (its transformer/config.json on the Hugging Face Hub) and the parameter counts of what else every
rank loads whole (text encoders, VAE), counted from their configs on the meta device (2026-12-01, diffusers
0.42.1, transformers 5.23.0). No weights: building these on the meta device or under FakeTensorMode takes no memory.

    from tools.real_models import FAMILIES
    FAMILIES["flux"]["config"]          # FluxTransformer2DModel(**config) is FLUX.1-dev's 11.9B transformer
"""
from __future__ import annotations

# The VAEs (class, config): FLUX.1-dev's and SD3.5's vae/config.json (the same architecture); the others are their
# diffusers classes' defaults, which are the released ones (each builds the parameter count of "others" below).
_FLUX_VAE = dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                 up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=16, layers_per_block=2,
                 use_quant_conv=False, use_post_quant_conv=False, sample_size=1024,
                 scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1-dev's latent scale and shift
_SD3_VAE = {**_FLUX_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}  # SD3.5's

# diffusers transformer configs of the released checkpoints (their transformer/config.json), and what else each
# rank loads whole in bf16: parameter counts from the components' configs, built on the meta device.
FAMILIES = {
    "flux": dict(cls="FluxTransformer2DModel", source="black-forest-labs/FLUX.1-dev transformer/config.json",
                 config=dict(attention_head_dim=128, guidance_embeds=True, in_channels=64, joint_attention_dim=4096,
                             num_attention_heads=24, num_layers=19, num_single_layers=38, patch_size=1,
                             pooled_projection_dim=768, axes_dims_rope=(16, 56, 56)),
                 blocks=("num_layers", "num_single_layers"),
                 others={"T5-XXL encoder": 4_762_310_656, "CLIP-L text": 123_060_480, "VAE": 83_819_683},
                 text=dict(dim=4096, pooled=768), vae_spatial=8, vae=("AutoencoderKL", _FLUX_VAE)),
    "qwenimage": dict(cls="QwenImageTransformer2DModel", source="Qwen/Qwen-Image transformer/config.json",
                      config=dict(attention_head_dim=128, axes_dims_rope=(16, 56, 56), guidance_embeds=False,
                                  in_channels=64, joint_attention_dim=3584, num_attention_heads=24, num_layers=60,
                                  out_channels=16, patch_size=2),
                      blocks=("num_layers",),
                      others={"Qwen2.5-VL-7B": 8_292_166_656, "VAE": 126_892_531},
                      text=dict(dim=3584), vae_spatial=8, vae=("AutoencoderKLQwenImage", {})),
    "wan": dict(cls="WanTransformer3DModel", source="Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json",
                config=dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                            out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
                blocks=("num_layers",),
                others={"UMT5-XXL encoder": 5_680_910_336, "VAE": 126_892_531},
                text=dict(dim=4096), vae_spatial=8, vae=("AutoencoderKLWan", {})),
    "hunyuanvideo": dict(cls="HunyuanVideoTransformer3DModel",
                         source="hunyuanvideo-community/HunyuanVideo transformer/config.json",
                         config=dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
                                     num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0,
                                     patch_size=2, patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True,
                                     text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
                                     rope_axes_dim=(16, 56, 56)),
                         blocks=("num_layers", "num_single_layers"),
                         others={"Llama-3-8B text (llava)": 7_505_186_816, "CLIP-L text": 123_060_480,
                                 "VAE": 246_478_803},
                         text=dict(dim=4096, pooled=768), vae_spatial=8,
                         vae=("AutoencoderKLHunyuanVideo", {})),
    # SD3.5-Medium: 24 MMDiT-X blocks (the first 13 with a second image self-attention), 2.24B parameters; its text
    # sequence is 77 CLIP tokens followed by the T5 tokens (models/sd3.py), hence clip_tokens.
    "sd3": dict(cls="SD3Transformer2DModel", source="stabilityai/stable-diffusion-3.5-medium transformer/config.json",
                config=dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                            dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
                blocks=("num_layers",),
                others={"T5-XXL encoder": 4_762_310_656, "CLIP-G text (projection)": 694_659_840,
                        "CLIP-L text (projection)": 123_650_304, "VAE": 83_819_683},
                text=dict(dim=4096, pooled=2048, clip_tokens=77), vae_spatial=8, vae=("AutoencoderKL", _SD3_VAE)),
}
