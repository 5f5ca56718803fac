"""HunyuanVideo family: HunyuanVideoPipeline (Llama text encoder + CLIP pooled text encoder,
HunyuanVideoTransformer3DModel, AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler).

HunyuanVideo is guidance-distilled like FLUX: one forward per step with an embedded guidance scale
(the pipeline passes guidance * 1000), no true CFG. Latents are video latents [B, C, F', h, w]
(F' = (F - 1) / 4 + 1, h = H / 8) scaled by the VAE's scaling_factor; the timestep is t = sigma * 1000.
Prompt encoding wraps the prompt in a chat template, pads the Llama tokens to crop_start (95) +
max_sequence_length, takes the third-to-last hidden layer and crops the template: prompt_embeds
[B, L, D] and a right-padded mask [B, L] of fixed length; CLIP's pooled output [B, Dp] is the global vector.
"""
from __future__ import annotations

import torch
from einops import rearrange

from .base import Family
from .tiny_text import clip_tokenizer, llama3_tokenizer


class HunyuanVideoFamily(Family):
    name = "hunyuanvideo"
    pipeline_class_name = "HunyuanVideoPipeline"
    pipeline_module = "diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video"
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "scheduler")
    # Attention projections of the dual-stream blocks (image and text streams) and of the single-stream blocks
    # (which have no to_out; their output goes through proj_out with the MLP). "attn.*" also matches the small
    # token-refiner attention inside the context embedder.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    is_video = True
    tiny_frames = 5  # (frames - 1) % 4 == 0: 5 frames -> 2 latent frames
    # models/pretrain.py: a video VAE step costs ~8x an image's; half-size transformer batches keep the build ~1 min
    pretrain_overrides = {"vae_batch": 8, "vae_steps": 200, "flow_batch": 32}
    default_guidance = 6.0  # HunyuanVideoPipeline's guidance_scale default (embedded)
    sequence_tokenizer = "tokenizer"  # max_sequence_length counts Llama tokens; CLIP (tokenizer_2) is always 77

    def build_tiny(self, path: str, seed: int = 0, pretrain_config=None) -> None:
        from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
                               HunyuanVideoTransformer3DModel)
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
        from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

        torch.manual_seed(seed)
        # The template prefix must cost exactly crop_start tokens (BOS included), as with the real tokenizer.
        tokenizer = llama3_tokenizer(32, DEFAULT_PROMPT_TEMPLATE["template"], DEFAULT_PROMPT_TEMPLATE["crop_start"])
        tokenizer_2 = clip_tokenizer(77)  # the pipeline always pads CLIP to 77 tokens
        # Two layers: the pipeline takes hidden_states[-3] (skips the last two layers' outputs).
        text_encoder = LlamaModel(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))
        text_encoder_2 = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer_2), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=32,
            bos_token_id=0, eos_token_id=1, pad_token_id=1))
        # Head dim 16 = rope axes (4, 6, 6); spatial patch 2 like the real model: 2 x 8 x 8 latents -> 32 tokens.
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=32, pooled_projection_dim=32, rope_axes_dim=(4, 6, 6))
        # Spatial 4x (3 blocks; the real VAE has 8x), temporal 4x: 5 x 32 x 32 px -> 2 x 8 x 8 latents, so that the
        # pre-trained latent (4 x 4-pixel colour blocks) can hold a disc.
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(8, 8, 8), layers_per_block=1,
            act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=4,
            temporal_compression_ratio=4, mid_block_add_attention=True)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)  # HunyuanVideo's released scheduler
        pipe = HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                    scheduler=scheduler, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)
        from .pretrain import pretrain_for_build  # synthetic videos -> structured samples (README, the demo)
        pretrain_for_build(self, pipe, pretrain_config, seed, frames=self.tiny_frames,
                           max_sequence_length=tokenizer.model_max_length)
        pipe.save_pretrained(path)

    def encode(self, pipe, prompts, device, max_sequence_length):
        with torch.no_grad():
            embeds, pooled, mask = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=device,
                                                      max_sequence_length=max_sequence_length)
        return {"prompt_embeds": embeds,  # [B, L, D] (padded to max_sequence_length by the tokenizer)
                "pooled_prompt_embeds": pooled,  # [B, Dp] CLIP pooled
                "prompt_attention_mask": mask.float()}  # [B, L] 1 = token (right padding)

    def latent_shape(self, pipe, height, width, frames):
        c = pipe.transformer.config.in_channels
        f = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        return (c, f, height // pipe.vae_scale_factor_spatial, width // pipe.vae_scale_factor_spatial)  # [C, F', h, w]
    # sample_noise: the base default (randn in latent_shape) is exactly HunyuanVideoPipeline.prepare_latents.
    # sigmas: the base default; the pipeline passes linspace(1, 0, T + 1)[:-1] = linspace(1, 1/T, T), static shift.

    def forward(self, pipe, transformer, latents, sigma, cond, guidance, negative_cond=None,
                detach_uncond=False):
        b = latents.shape[0]
        guidance_vec = None
        if transformer.config.guidance_embeds:  # the pipeline passes guidance_scale * 1000
            guidance_vec = torch.full((b,), guidance * 1000.0, device=latents.device, dtype=latents.dtype)
        t = sigma.to(torch.float32) * pipe.scheduler.config.num_train_timesteps  # [B] t = sigma * 1000
        return transformer(
            hidden_states=latents, timestep=t, encoder_hidden_states=cond["prompt_embeds"],
            encoder_attention_mask=cond["prompt_attention_mask"], pooled_projections=cond["pooled_prompt_embeds"],
            guidance=guidance_vec, return_dict=False)[0]  # [B, C, F', h, w]

    # --- pre-training hooks (models/pretrain.py) ---------------------------------------------
    def latent_layout(self, pipe):
        """(latent channels, pixels per latent pixel, colour sub-grid) of pretrain.latent_target."""
        return pipe.vae.config.latent_channels, pipe.vae_scale_factor_spatial, 1

    def denormalise(self, pipe, latents):
        return latents / pipe.vae.config.scaling_factor  # as HunyuanVideoPipeline before vae.decode

    def pack(self, pipe, latents):
        return latents  # the transformer patchifies [B, C, F', h, w] itself

    def decode(self, pipe, latents, height, width, frames):
        vae = pipe.vae
        video = vae.decode(self.denormalise(pipe, latents.to(vae.dtype)), return_dict=False)[0]  # [B, 3, F, H, W]
        video = (video.float() / 2 + 0.5).clamp(0, 1)
        return rearrange(video, "b c f h w -> b f c h w")  # [B, F, 3, H, W]
