"""FLUX.1 family: FluxPipeline (CLIP + T5 text encoders, FluxTransformer2DModel, AutoencoderKL).

FLUX-dev is guidance-distilled: one forward per step with a guidance embedding, no true CFG.
Latents are 2x2-packed tokens [B, (H/2)(W/2), 4C]; we reuse the pipeline's own pack/unpack.
"""
from __future__ import annotations

import torch

from .base import Family
from .tiny_text import clip_tokenizer, t5_tokenizer


class FluxFamily(Family):
    name = "flux"
    pipeline_class_name = "FluxPipeline"
    pipeline_module = "diffusers.pipelines.flux.pipeline_flux"
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "scheduler")
    # The `attention` preset: every attention projection of both streams (and, by suffix, of the single blocks).
    # Flow-GRPO's own FLUX list also adapts the feed-forward layers: models/lora.py FLOW_GRPO.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    default_guidance = 3.5

    def build_tiny(self, path: str, seed: int = 0, pretrain_config=None) -> None:
        """Build the tiny pipeline and save it. pretrain_config: None = $DIGENRL_TINY_PRETRAIN's variant (full unless
        set), False = random weights, or a models.pretrain.PretrainConfig."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        torch.manual_seed(seed)
        tokenizer, tokenizer_2 = clip_tokenizer(32), t5_tokenizer(16)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=32, projection_dim=32,
            bos_token_id=0, eos_token_id=1, pad_token_id=1))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        # 1 double + 1 single block, 4 heads of 16; in_channels = 4 latent channels x (2 x 2 packing).
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6))
        # 4x downsampling: 32 px -> 8 x 8 latents -> 16 tokens. Pre-training (models/pretrain.py) makes the
        # normalised latent a 4x4-block average of the colours; scaling 1, shift 0 is then already normalised.
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            norm_num_groups=4, sample_size=32, scaling_factor=1.0, shift_factor=0.0,
            use_quant_conv=False, use_post_quant_conv=False)
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
            base_shift=0.5, max_shift=1.15)
        pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                            text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
        from .pretrain import pretrain_for_build  # synthetic images -> structured samples (README, the demo)
        pretrain_for_build(self, pipe, pretrain_config, seed, max_sequence_length=tokenizer_2.model_max_length)
        pipe.save_pretrained(path)

    def encode(self, pipe, prompts, device, max_sequence_length):
        with torch.no_grad():
            prompt_embeds, pooled, _text_ids = pipe.encode_prompt(
                prompt=prompts, prompt_2=None, device=device, max_sequence_length=max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}  # [B, L, D], [B, Dp]

    def latent_shape(self, pipe, height, width, frames):
        h = 2 * (height // (pipe.vae_scale_factor * 2))
        w = 2 * (width // (pipe.vae_scale_factor * 2))
        channels = pipe.transformer.config.in_channels  # = 4 * latent channels (2x2 packing)
        return ((h // 2) * (w // 2), channels)

    def sample_noise(self, pipe, generator, height, width, frames):
        # Drawn in the VAE layout and packed, exactly as FluxPipeline.prepare_latents does.
        c = pipe.transformer.config.in_channels // 4
        h = 2 * (height // (pipe.vae_scale_factor * 2))
        w = 2 * (width // (pipe.vae_scale_factor * 2))
        noise = torch.randn((1, c, h, w), generator=generator)  # [1, C, h, w]
        return pipe._pack_latents(noise, 1, c, h, w)[0]  # [(h/2)(w/2), 4C]

    def forward(self, pipe, transformer, latents, sigma, cond, guidance, negative_cond=None,
                detach_uncond=False):
        b, n_tokens, _ = latents.shape
        side = int(round(n_tokens**0.5))  # square images
        img_ids = pipe._prepare_latent_image_ids(b, side, side, latents.device, latents.dtype)  # [n, 3]
        txt_ids = torch.zeros(cond["prompt_embeds"].shape[1], 3, device=latents.device, dtype=latents.dtype)
        guidance_vec = None
        if transformer.config.guidance_embeds:
            guidance_vec = torch.full((b,), guidance, device=latents.device, dtype=torch.float32)
        return transformer(
            hidden_states=latents, timestep=sigma.to(latents.dtype), guidance=guidance_vec,  # timestep = sigma = t/1000
            pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]  # [B, n, 4C]

    # --- pre-training hooks (models/pretrain.py) ---------------------------------------------
    def latent_layout(self, pipe):
        """(latent channels, pixels per latent pixel, colour sub-grid) of pretrain.latent_target."""
        return pipe.vae.config.latent_channels, pipe.vae_scale_factor, 1

    def denormalise(self, pipe, latents):
        """Normalised latents [B, C, h, w] -> what the VAE decodes (as FluxPipeline does before vae.decode)."""
        return latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor

    def pack(self, pipe, latents):
        b, c, h, w = latents.shape
        return pipe._pack_latents(latents, b, c, h, w)  # [B, (h/2)(w/2), 4C]

    def decode(self, pipe, latents, height, width, frames):
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)  # [B, C, h, w]
        latents = self.denormalise(pipe, latents)
        image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]  # [B, 3, H, W] in ~[-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1)
