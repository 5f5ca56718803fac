"""Qwen-Image family: QwenImagePipeline (Qwen2.5-VL text encoder, QwenImageTransformer2DModel MMDiT,
AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler with resolution-dependent shift).

Qwen-Image is not guidance-distilled: it uses true CFG, a conditional and an unconditional ("") branch
combined as v_u + s (v_c - v_u) and then rescaled per token to the conditional branch's norm (the pipeline's
`true_cfg_scale` path). We run both branches in one batch (one transformer call).
Latents are 2x2-packed tokens [B, (h/2)(w/2), 4C] like FLUX; the VAE is a (single-frame) video VAE with
per-channel latents_mean/std. The pipeline timestep is sigma (t / 1000), like FLUX.
Prompt encoding wraps the prompt in a chat template and drops the template's first 34 tokens; its output
is trimmed to the batch's longest prompt, so `encode` pads to a fixed length with a float mask.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import Family
from .tiny_text import qwen2_tokenizer

# QwenImagePipeline.prompt_template_encode (set in its __init__); build_tiny checks it is still the same.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_START_IDX = 34  # QwenImagePipeline.prompt_template_encode_start_idx


class QwenImageFamily(Family):
    name = "qwenimage"
    pipeline_class_name = "QwenImagePipeline"
    pipeline_module = "diffusers.pipelines.qwenimage.pipeline_qwenimage"
    required_components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    # The `attention` preset: every attention projection of the MMDiT blocks, image and text streams. Flow-GRPO's
    # Qwen-Image list also adapts img_mlp / txt_mlp: models/lora.py FLOW_GRPO.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    uses_true_cfg = True
    default_guidance = 4.0  # the pipeline's true_cfg_scale default

    def build_tiny(self, path: str, seed: int = 0, pretrain_config=None) -> None:
        """Build the tiny pipeline (random weights: unlike flux, wan and hunyuanvideo it is not pre-trained, so
        it serves the plumbing tests, not the visible demo) and save it; pretrain_config is accepted and ignored."""
        from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                               QwenImageTransformer2DModel)
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        torch.manual_seed(seed)
        tokenizer = qwen2_tokenizer(32, PROMPT_TEMPLATE, TEMPLATE_START_IDX)  # 32 prompt tokens after the template
        n_vocab = len(tokenizer)
        # Qwen2.5-VL: text tower hidden 32 (mrope sections sum to head_dim / 2 = 8), a one-block vision tower that
        # text-only prompts never run; image/video special ids point past the tiny vocabulary's real tokens.
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(vocab_size=n_vocab + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                             rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
                             bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                             pad_token_id=tokenizer.pad_token_id),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                               fullatt_block_indexes=[0]),
            image_token_id=n_vocab, video_token_id=n_vocab + 1, vision_start_token_id=n_vocab + 2,
            vision_end_token_id=n_vocab + 3))
        # in_channels = 4 * z_dim (2x2 packing); rope axes (4, 6, 6) sum to the head dim 16.
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
        # Two spatial downsamplings (vae_scale_factor 4): 32 px -> 8x8 latents -> 16 tokens. Non-trivial
        # latents_mean/std so that decode's de-normalisation is exercised.
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0])
        # Qwen-Image's released scheduler config (exponential dynamic shift, terminal sigma 0.02).
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
        pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                 transformer=transformer)
        if (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx) != (PROMPT_TEMPLATE, TEMPLATE_START_IDX):
            raise RuntimeError("QwenImagePipeline's prompt template changed; update PROMPT_TEMPLATE in models/qwenimage.py")
        pipe.save_pretrained(path)

    def encode(self, pipe, prompts, device, max_sequence_length):
        length = min(max_sequence_length, pipe.tokenizer_max_length)  # the pipeline rejects more than 1024
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt(prompt=prompts, device=device, max_sequence_length=length)
        b, n, _ = embeds.shape  # [B, n, D], n = the batch's longest prompt (<= length)
        mask = torch.ones(b, n, device=embeds.device) if mask is None else mask.float()  # None = no padding
        # Pad to a fixed length so rows cached per prompt concatenate; padded tokens are masked out of attention.
        return {"prompt_embeds": F.pad(embeds, (0, 0, 0, length - n)),  # [B, L, D]
                "prompt_embeds_mask": F.pad(mask, (0, length - n))}  # [B, L] float, 1 = token

    def _latent_hw(self, pipe, height, width):
        return 2 * (height // (pipe.vae_scale_factor * 2)), 2 * (width // (pipe.vae_scale_factor * 2))

    def latent_shape(self, pipe, height, width, frames):
        h, w = self._latent_hw(pipe, height, width)
        return ((h // 2) * (w // 2), pipe.transformer.config.in_channels)  # [(h/2)(w/2), 4C]

    def sample_noise(self, pipe, generator, height, width, frames):
        # Exactly QwenImagePipeline.prepare_latents: [1, 1, C, h, w] (a one-frame video latent), then packed.
        c = pipe.transformer.config.in_channels // 4
        h, w = self._latent_hw(pipe, height, width)
        noise = torch.randn((1, 1, c, h, w), generator=generator)  # [1, 1, C, h, w]
        return pipe._pack_latents(noise, 1, c, h, w)[0]  # [(h/2)(w/2), 4C]

    def forward(self, pipe, transformer, latents, sigma, cond, guidance, negative_cond=None,
                detach_uncond=False):
        b, n_tokens, _ = latents.shape
        side = math.isqrt(n_tokens)  # square images (like flux.py): the packed layout does not carry h and w
        if side * side != n_tokens:
            raise ValueError(f"qwenimage forward expects square latents, got {n_tokens} tokens")
        cfg = negative_cond is not None and guidance > 1.0
        x, t = latents, sigma.to(latents.dtype)  # the pipeline passes timestep / 1000 = sigma
        embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
        if cfg:  # [cond; uncond] in one batch; the "" encoding (batch 1) is expanded to the batch
            neg = {k: v.expand(b, *v.shape[1:]) for k, v in negative_cond.items()}
            x, t = torch.cat([x, x]), torch.cat([t, t])  # [2B, n, 4C], [2B]
            embeds = torch.cat([embeds, neg["prompt_embeds"]])  # [2B, L, D]
            mask = torch.cat([mask, neg["prompt_embeds_mask"]])  # [2B, L]
        v = transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                        img_shapes=[[(1, side, side)]] * x.shape[0], return_dict=False)[0]  # [(2)B, n, 4C]
        if not cfg:
            return v
        v_cond, v_uncond = v.chunk(2)  # [B, n, 4C] each
        if detach_uncond:
            v_uncond = v_uncond.detach()
        combined = v_uncond + guidance * (v_cond - v_uncond)
        # The pipeline's norm rescale: each token keeps the conditional prediction's norm.
        return combined * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode(self, pipe, latents, height, width, frames):
        vae = pipe.vae
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(vae.dtype)  # [B, C, 1, h, w]
        # De-normalise exactly as the pipeline does (x / (1 / std) + mean).
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        image = vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]  # [B, 3, H, W] in ~[-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1)
