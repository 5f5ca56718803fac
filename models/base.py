"""The model-family interface: what the RL loop needs from a diffusers pipeline, and nothing more.

A family (flux, qwenimage, wan, hunyuanvideo, sd3) is a small stateless object; `models.load` turns a
directory into a `Policy` that rollout and trainer use. Adding a family = one file with a subclass
of `Family` registered in models/__init__.py.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch


class Family:
    name: str = ""
    pipeline_class_name: str = ""  # the diffusers pipeline that loads this family
    pipeline_module: str = ""  # where it lives: CPU ranks' forkserver imports it once (infra/rank_server.py)
    required_components: tuple[str, ...] = ()  # subfolders a pretrained directory must have
    lora_targets: tuple[str, ...] = ()  # the `attention` preset: attention projections (Flow-GRPO's: models/lora.py)
    uses_true_cfg = False  # Qwen-Image, Wan: conditional and unconditional branches in one batch
    is_video = False
    tiny_resolution = 32  # pixels of the tiny pipeline's images (height = width)
    tiny_frames = 1
    default_guidance = 3.5  # embedded guidance (FLUX, HunyuanVideo) or true-CFG scale (Qwen, Wan)
    sequence_tokenizer = "tokenizer_2"  # whose model_max_length caps max_sequence_length (else "tokenizer")
    temporal_compression = 4  # video VAEs (Wan, HunyuanVideo) keep frame 0 and compress the rest 4x (causal)

    def pipeline_class(self):
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    # --- building and loading -------------------------------------------------------------
    def build_tiny(self, path: str, seed: int = 0) -> None:
        """Build a tiny pipeline of the real classes fully offline and `save_pretrained` it to `path`."""
        raise NotImplementedError

    def check_pretrained(self, path: str) -> None:
        """Raise FileNotFoundError naming the first missing component of a pretrained directory."""
        if not os.path.isdir(path):
            raise FileNotFoundError(f"pretrained directory {path!r} does not exist")
        index = os.path.join(path, "model_index.json")
        if not os.path.isfile(index):
            raise FileNotFoundError(f"{path!r} has no model_index.json: not a diffusers pipeline directory "
                                    f"(expected components: {', '.join(self.required_components)})")
        with open(index) as f:
            listed = json.load(f)
        for component in self.required_components:
            folder = os.path.join(path, component)
            if component not in listed or listed[component] in (None, [None, None]) or not os.path.isdir(folder):
                raise FileNotFoundError(f"pretrained directory {path!r} is missing the component {component!r} "
                                        f"(required for {self.name}: {', '.join(self.required_components)})")
            if not os.listdir(folder):
                raise FileNotFoundError(f"component {component!r} in {path!r} is an empty folder")

    def check_frames(self, frames: int | None) -> None:
        """Raise ValueError for a video length the VAE cannot represent exactly (unset = the family default).

        The causal video VAEs map F = 1 + 4k frames to 1 + k latent frames; any other F would silently decode
        to fewer frames than asked for (the diffusers pipelines round it down with a warning)."""
        if not self.is_video or not frames:
            return
        step = self.temporal_compression
        if frames < 1 or (frames - 1) % step:
            raise ValueError(f"--frames {frames} is not valid for {self.name}: the video VAE needs 1 + {step}k frames "
                             f"(1, {1 + step}, {1 + 2 * step}, ...)")

    # --- what the RL loop calls -----------------------------------------------------------
    def encode(self, pipe, prompts: list[str], device, max_sequence_length: int) -> dict[str, torch.Tensor]:
        """Per-sample conditioning tensors (batch first) through the pipeline's own `encode_prompt`."""
        raise NotImplementedError

    def latent_shape(self, pipe, height: int, width: int, frames: int) -> tuple[int, ...]:
        """Shape of one sample's latents in the layout the transformer consumes."""
        raise NotImplementedError

    def sample_noise(self, pipe, generator: torch.Generator, height: int, width: int, frames: int) -> torch.Tensor:
        """One sample's standard normal latents in transformer layout (default: drawn in that layout)."""
        return torch.randn(self.latent_shape(pipe, height, width, frames), generator=generator)

    def sigmas(self, pipe, num_steps: int, height: int, width: int, frames: int) -> torch.Tensor:
        """The pipeline's sigma schedule for `num_steps` steps, [num_steps + 1] float32, from ~1 down to 0."""
        scheduler = pipe.scheduler
        base = np.linspace(1.0, 1.0 / num_steps, num_steps)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self.shift_mu(pipe, height, width, frames)
        scheduler.set_timesteps(num_steps, sigmas=base, device="cpu", **kwargs)
        return scheduler.sigmas.to(torch.float32).clone()

    def shift_mu(self, pipe, height, width, frames) -> float:
        """Resolution-dependent shift (FLUX's `calculate_shift`), used when the scheduler shifts dynamically."""
        seq_len = int(np.prod(self.latent_shape(pipe, height, width, frames)[:-1]))
        cfg = pipe.scheduler.config
        base_len, max_len = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
        base_shift, max_shift = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
        m = (max_shift - base_shift) / (max_len - base_len)
        return seq_len * m + (base_shift - m * base_len)

    def forward(self, pipe, transformer, latents, sigma, cond, guidance: float, negative_cond=None,
                detach_uncond: bool = False) -> torch.Tensor:
        """Velocity for latents [B, ...] at per-sample sigma [B]; true CFG in one batch where the family uses it.
        detach_uncond: the unconditional branch without gradient, v_u.detach() + s (v_c - v_u.detach())
        (Flow-GRPO's scripts/train_sd3.py compute_log_prob, line 190)."""
        raise NotImplementedError

    def decode(self, pipe, latents, height: int, width: int, frames: int) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] (video: [B, F, 3, H, W]) float32 in [0, 1]."""
        raise NotImplementedError

    # --- pre-training hooks (models/pretrain.py) ---------------------------------------------
    def images_to_vae(self, images: torch.Tensor) -> torch.Tensor:
        """Pixels in [0, 1] -> the VAE's input in [-1, 1]: images stay [B, 3, H, W]; videos [B, F, 3, H, W] become
        the video VAEs' [B, 3, F, H, W]."""
        x = images * 2 - 1
        return x.permute(0, 2, 1, 3, 4) if self.is_video else x

    def vae_to_images(self, decoded: torch.Tensor) -> torch.Tensor:
        """The VAE's output layout -> the images' ([B, 3, F, H, W] -> [B, F, 3, H, W] for videos)."""
        return decoded.permute(0, 2, 1, 3, 4) if self.is_video else decoded
