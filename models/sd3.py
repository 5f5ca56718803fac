"""Stable Diffusion 3.5 family: StableDiffusion3Pipeline (two CLIP text encoders + T5, SD3Transformer2DModel MMDiT(-X),
AutoencoderKL with 16 latent channels, FlowMatchEulerDiscreteScheduler with a fixed shift of 3).

SD3.5 is the model behind Flow-GRPO's published recipes (config/grpo.py: pickscore_sd3, geneval_sd3, ...). It uses
true CFG (v_u + s (v_c - v_u), no rescale), both branches in one batch as the pipeline does ([uncond; cond]).
Latents stay in the VAE layout [B, C, h, w] (h = H / 8): the transformer patchifies them itself (patch 2).
The timestep is t = sigma * 1000 (the pipeline passes `scheduler.timesteps`, which are sigmas x 1000).
The schedule is the pipeline's own: `set_timesteps(T)` without explicit sigmas, i.e. linspace(1, sigma_min, T)
shifted by 3, then a terminal 0 (not the 1 .. 1/T of FLUX), which `sigmas` reproduces.
Prompt encoding (the pipeline's `encode_prompt`): the two CLIP penultimate hidden states concatenated on the
feature axis and zero-padded to T5's width, then T5's tokens appended on the sequence axis; the pooled vector is the
two CLIP projections concatenated. The real checkpoint: stabilityai/stable-diffusion-3.5-medium (2.5B transformer,
24 MMDiT-X blocks of which the first 13 carry a second image self-attention `attn2`).
"""
from __future__ import annotations

import torch

from .base import Family
from .tiny_text import clip_tokenizer, t5_tokenizer


class SD3Family(Family):
    name = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    pipeline_module = "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3"
    required_components = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer",
                           "tokenizer_2", "tokenizer_3", "scheduler")
    # The `attention` preset: the joint attention of both streams (Flow-GRPO's SD3 list, models/lora.py FLOW_GRPO)
    # plus SD3.5's second image self-attention (attn2) of the MMDiT-X blocks, which Flow-GRPO leaves frozen.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
    uses_true_cfg = True
    default_guidance = 4.5  # Flow-GRPO's SD3 recipes' sample.guidance_scale (the pipeline's own default is 7.0)
    sequence_tokenizer = "tokenizer_3"  # T5 caps max_sequence_length (the pipeline refuses more than 512)

    def build_tiny(self, path: str, seed: int = 0, pretrain_config=None) -> None:
        """Build the tiny pipeline of the real classes offline, pre-train it (models/pretrain.py) and save it."""
        from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                               StableDiffusion3Pipeline)
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

        torch.manual_seed(seed)
        tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(32), clip_tokenizer(32), t5_tokenizer(16)

        def clip(hidden):  # two layers: the pipeline reads the penultimate hidden state (hidden_states[-2])
            return CLIPTextModelWithProjection(CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=32, projection_dim=hidden,
                bos_token_id=0, eos_token_id=1, pad_token_id=1))

        # CLIP-L and CLIP-G stand-ins (16 + 32 = 48 features, zero-padded to T5's 64 as 768 + 1280 are to 4096).
        text_encoder, text_encoder_2 = clip(16), clip(32)
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_3), d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        # 2 blocks of 4 heads x 16: block 0 is an MMDiT-X block (attn2, as SD3.5-Medium's first 13), the last one is
        # context_pre_only as in every SD3; rms qk-norm as SD3.5. pos_embed_max_size 16 patches: up to 128 px.
        transformer = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=48,
            pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")
        # 4x downsampling: 32 px -> 8 x 8 latents -> 16 patches. SD3.5's own scaling and shift factors, so that
        # decode's de-normalisation is exercised (pre-training trains the VAE through `denormalise`).
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            norm_num_groups=4, sample_size=32, scaling_factor=1.5305, shift_factor=0.0609,
            use_quant_conv=False, use_post_quant_conv=False)
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3.5-Medium's config
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
            text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, text_encoder_3=text_encoder_3,
            tokenizer_3=tokenizer_3)
        from .pretrain import pretrain_for_build  # synthetic images -> structured samples (README, the demo)
        pretrain_for_build(self, pipe, pretrain_config, seed, max_sequence_length=tokenizer_3.model_max_length)
        pipe.save_pretrained(path)

    def encode(self, pipe, prompts, device, max_sequence_length):
        with torch.no_grad():
            embeds, _, pooled, _ = pipe.encode_prompt(
                prompt=prompts, prompt_2=None, prompt_3=None, device=device, do_classifier_free_guidance=False,
                max_sequence_length=max_sequence_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}  # [B, L_clip + L_t5, D], [B, Dp]

    def latent_shape(self, pipe, height, width, frames):
        f = pipe.vae_scale_factor
        return (pipe.transformer.config.in_channels, height // f, width // f)  # [C, h, w]
    # sample_noise: the base default (randn in latent_shape) is exactly StableDiffusion3Pipeline.prepare_latents.

    def sigmas(self, pipe, num_steps, height, width, frames):
        # StableDiffusion3Pipeline: retrieve_timesteps(scheduler, T, sigmas=None[, mu]): the scheduler's own
        # linspace(t(sigma_max), t(sigma_min), T) / 1000, shifted, then 0. mu only for a dynamically shifting config
        # (SD3.5's is not), computed as the pipeline does (its own max_shift default 1.16, patch tokens).
        scheduler = pipe.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            patch = pipe.transformer.config.patch_size
            _, h, w = self.latent_shape(pipe, height, width, frames)
            cfg = scheduler.config
            kwargs["mu"] = calculate_shift((h // patch) * (w // patch), cfg.get("base_image_seq_len", 256),
                                           cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                           cfg.get("max_shift", 1.16))
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler.sigmas.to(torch.float32).clone()  # [num_steps + 1], 1 down to 0

    def forward(self, pipe, transformer, latents, sigma, cond, guidance, negative_cond=None,
                detach_uncond=False):
        b = latents.shape[0]
        cfg = negative_cond is not None and guidance > 1.0  # the pipeline's do_classifier_free_guidance
        x = latents
        # [B] t = 1000 sigma in float32, as the pipeline passes scheduler.timesteps whatever the model dtype (the
        # transformer's sinusoidal embedding takes it in float32; a bf16 t would be off by up to 2 at t ~ 750)
        t = sigma.to(torch.float32) * pipe.scheduler.config.num_train_timesteps
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if cfg:  # [uncond; cond] in one batch, the pipeline's order; the "" encoding (batch 1) expanded to B
            neg = {k: v.expand(b, *v.shape[1:]) for k, v in negative_cond.items()}
            x, t = torch.cat([x, x]), torch.cat([t, t])  # [2B, C, h, w], [2B]
            embeds = torch.cat([neg["prompt_embeds"], embeds])  # [2B, L, D]
            pooled = torch.cat([neg["pooled_prompt_embeds"], pooled])  # [2B, Dp]
        v = transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled,
                        return_dict=False)[0]  # [(2)B, C, h, w]
        if not cfg:
            return v
        v_uncond, v_cond = v.chunk(2)
        if detach_uncond:  # Flow-GRPO's train_sd3.py line 190: the gradient is guidance * dv_cond
            v_uncond = v_uncond.detach()
        return v_uncond + guidance * (v_cond - v_uncond)

    # --- pre-training hooks (models/pretrain.py) ---------------------------------------------
    def latent_layout(self, pipe):
        """(latent channels, pixels per latent pixel, colour sub-grid) of pretrain.latent_target."""
        return pipe.vae.config.latent_channels, pipe.vae_scale_factor, 1

    def denormalise(self, pipe, latents):
        """Normalised latents [B, C, h, w] -> what the VAE decodes (as the pipeline does before vae.decode)."""
        return latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor

    def pack(self, pipe, latents):
        return latents  # the transformer consumes the VAE layout [B, C, h, w]

    def decode(self, pipe, latents, height, width, frames):
        latents = self.denormalise(pipe, latents)
        image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]  # [B, 3, H, W] in ~[-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1)

