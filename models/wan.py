"""Wan2.1 text-to-video family: WanPipeline (UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan).

Wan uses true CFG (v_u + s (v_c - v_u), no rescale), both branches in one batch here. Latents are video
latents [B, C, F', h, w] (F' = (F - 1) / 4 + 1, h = H / 8) that the transformer patchifies itself; the
timestep is t = sigma * 1000. Released checkpoints ship a UniPCMultistepScheduler with flow sigmas
(`flow_shift`); the tiny pipeline uses FlowMatchEulerDiscreteScheduler(shift=3). RL only needs the sigma
schedule: `sigmas` gives UniPC's flow schedule from either scheduler (see there).
Prompt embeddings are zero-padded to max_sequence_length by the pipeline itself (no mask).
"""
from __future__ import annotations

import numpy as np
import torch
from einops import rearrange

from .base import Family
from .tiny_text import t5_tokenizer


class WanFamily(Family):
    name = "wan"
    pipeline_class_name = "WanPipeline"
    pipeline_module = "diffusers.pipelines.wan.pipeline_wan"
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # Self-attention (attn1) and text cross-attention (attn2) projections of every block (Flow-GRPO's Wan LoRA);
    # the image cross-attention's add_k_proj/add_v_proj exist only in image-to-video checkpoints.
    lora_targets = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
    uses_true_cfg = True
    is_video = True
    tiny_frames = 5  # (frames - 1) % 4 == 0: 5 frames -> 2 latent frames
    pretrain_overrides = {"vae_batch": 8, "vae_steps": 200}  # models/pretrain.py: a video VAE step costs ~8x an image's
    default_guidance = 5.0  # WanPipeline's guidance_scale default

    def build_tiny(self, path: str, seed: int = 0, pretrain_config=None) -> None:
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        torch.manual_seed(seed)
        tokenizer = t5_tokenizer(32)  # Wan's umt5-xxl tokenizer is a T5 (Unigram) tokenizer too
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        # Head dim 12: Wan's 3-D rope splits it into (t, h, w) = (4, 4, 4).
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=256, ffn_dim=64, num_layers=1, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
        # Spatial 4x, temporal 4x (causal): 5 x 32 x 32 px -> 2 x 8 x 8 latents; the released latents_mean/std (16
        # channels). Measured: base_dim 3 learned only two colours in pre-training; z_dim 4 with mean 0 / std 1 stayed
        # grey (decoder L1 0.55); this one reaches L1 0.20 in 200 steps.
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[True, True], scale_factor_spatial=4, scale_factor_temporal=4)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                           transformer=transformer)
        from .pretrain import pretrain_for_build  # synthetic videos -> structured samples (README, the demo)
        pretrain_for_build(self, pipe, pretrain_config, seed, frames=self.tiny_frames,
                           max_sequence_length=tokenizer.model_max_length)
        pipe.save_pretrained(path)

    def encode(self, pipe, prompts, device, max_sequence_length):
        with torch.no_grad():
            embeds, _ = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False, device=device,
                                           max_sequence_length=max_sequence_length)
        return {"prompt_embeds": embeds}  # [B, L, D], zero rows after each prompt's tokens

    def latent_shape(self, pipe, height, width, frames):
        c = pipe.transformer.config.in_channels
        f = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        return (c, f, height // pipe.vae_scale_factor_spatial, width // pipe.vae_scale_factor_spatial)  # [C, F', h, w]
    # sample_noise: the base default (randn in latent_shape) is exactly WanPipeline.prepare_latents.

    def sigmas(self, pipe, num_steps, height, width, frames):
        # Released Wan: UniPC with use_flow_sigmas, whose default schedule is shift(linspace(1, 1/1000, T + 1)[:-1])
        # then 0. We pass those base sigmas explicitly, so FlowMatchEuler(shift) (the tiny pipeline) gives the same
        # schedule; left to itself FlowMatchEuler would end with a tiny sigma (about 0.009 for T = 4, shift 3).
        n_train = pipe.scheduler.config.num_train_timesteps
        base = np.linspace(1.0, 1.0 / n_train, num_steps + 1)[:-1]
        pipe.scheduler.set_timesteps(num_steps, sigmas=base, device="cpu")
        return pipe.scheduler.sigmas.to(torch.float32).clone()  # [num_steps + 1], ~1 (UniPC: 1 - 1e-6) down to 0

    def forward(self, pipe, transformer, latents, sigma, cond, guidance, negative_cond=None,
                detach_uncond=False):
        b = latents.shape[0]
        cfg = negative_cond is not None and guidance > 1.0
        # WanPipeline passes scheduler.timesteps = sigma * num_train_timesteps (UniPC rounds them to integers;
        # we keep them continuous so that any sigma, e.g. of packed training pairs, is valid).
        t = sigma.to(torch.float32) * pipe.scheduler.config.num_train_timesteps  # [B]
        x, embeds = latents, cond["prompt_embeds"]
        if cfg:  # [cond; uncond] in one batch
            x, t = torch.cat([x, x]), torch.cat([t, t])  # [2B, C, F', h, w], [2B]
            embeds = torch.cat([embeds, negative_cond["prompt_embeds"].expand(b, -1, -1)])  # [2B, L, D]
        v = transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]
        if not cfg:
            return v  # [B, C, F', h, w]
        v_cond, v_uncond = v.chunk(2)
        if detach_uncond:
            v_uncond = v_uncond.detach()
        return v_uncond + guidance * (v_cond - v_uncond)

    # --- pre-training hooks (models/pretrain.py) ---------------------------------------------
    def latent_layout(self, pipe):
        """(latent channels, pixels per latent pixel, colour sub-grid) of pretrain.latent_target."""
        return pipe.vae.config.z_dim, pipe.vae_scale_factor_spatial, 1

    def denormalise(self, pipe, latents):
        """Normalised latents [B, C, F', h, w] -> what the VAE decodes (WanPipeline: x / (1 / std) + mean)."""
        vae = pipe.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return latents / inv_std + mean

    def pack(self, pipe, latents):
        return latents  # the transformer patchifies [B, C, F', h, w] itself

    def decode(self, pipe, latents, height, width, frames):
        vae = pipe.vae
        video = vae.decode(self.denormalise(pipe, latents.to(vae.dtype)), return_dict=False)[0]  # [B, 3, F, H, W]
        video = (video.float() / 2 + 0.5).clamp(0, 1)
        return rearrange(video, "b c f h w -> b f c h w")  # [B, F, 3, H, W]
