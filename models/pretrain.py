"""Offline pre-training of the tiny pipelines on synthetic images, so the RL demo starts from a base model
that draws structured images (a disc on a background) of random colours, whatever the prompt says.

Called from each family's `build_tiny` (seeded, nothing downloaded, tens of seconds on one CPU thread); the
result is saved with the pipeline's own `save_pretrained`. Two stages, trained together:

  1. The VAE. A randomly initialised diffusers VAE learns slowly and unreliably to autoencode flat colours
     (its GroupNorms remove absolute colour levels; measured: 1 seed in 3 stuck at L1 ~0.5 after 200 steps).
     So we give the latent a meaning: the normalised latent of an image is its block-averaged colours,
     `latent_target` (a low-resolution copy, pixel-unshuffled into the latent channels). The decoder learns
     latent -> image and the encoder image -> latent, two well-posed regressions (L1).
  2. The transformer learns rectified flow on those latents, x_s = (1 - s) x0 + s eps, v = eps - x0
     (grpo.py's convention), through the family's own `encode`/`forward`, with captions drawn
     *independently* of the images: it learns to draw discs of random colours, but not to follow the colour
     word. Reinforcement learning with the colour reward then has something to teach (README, "The demo").

    python -c "import models; models.tiny_pipeline_path('flux')"    # builds (and pre-trains) once
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.nn.functional as F

# The 8 corners of the RGB cube. The set is closed under permuting channels, so a model that draws them
# regardless of the prompt has expected colour reward 0 for every colour word.
PALETTE = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]],
                       dtype=torch.float32)
# Captions seen in pre-training, drawn independently of the image, except that a colour caption gets an image with
# that background colour with probability caption_match (0.1): the base model follows the colour word only faintly
# (its eval_reward before RL is ~0.0x). Measured: with fully independent captions the tiny video models took 120 to
# 200+ RL steps before they started to tell the prompts apart. "" trains the true-CFG families' unconditional branch.
CAPTIONS = ["", "an image", "a picture", "a red image", "a green image", "a blue image",
            "a picture that is all red", "a picture that is all green", "a picture that is all blue"]
CAPTION_BACKGROUND = [-1, -1, -1, 1, 2, 3, -1, -1, -1]  # PALETTE index a caption may pull the background to;
# the phrasings of the held-out eval prompts never do, so that the base model never saw them follow a colour.


@dataclasses.dataclass
class PretrainConfig:
    vae_steps: int = 250
    vae_batch: int = 16
    flow_steps: int = 1000
    flow_batch: int = 64
    vae_lr: float = 2e-3
    flow_lr: float = 2e-3
    caption_match: float = 0.1  # fraction of colour captions whose image gets that background colour (see CAPTIONS)
    sigma_shift: float = 1.0  # sigma = shift u / (1 + (shift - 1) u), u uniform: > 1 trains high noise more
    latent_noise: float = 0.05  # std of the noise added to the decoder's input: robust to imperfect latents
    threads: int = 1  # seeded results depend on the thread count; one thread is also fastest on a busy machine
    log: bool = True  # one line before and after (the first build of a tiny pipeline takes tens of seconds)
    log_every: int = 0  # also print the losses every N steps (0 = never)


# DIGENRL_TINY_PRETRAIN picks how much pre-training `models.tiny_pipeline_path` does (and which cache folder it
# uses): "full" (the default, what the demo needs), "quick" (a few steps: exercises the code, draws nothing useful;
# the test suite uses it to stay fast), "none" (random weights, as before pre-training existed).
VARIANTS = {"full": {}, "quick": {"vae_steps": 10, "flow_steps": 20}, "none": None}


def variant_from_env() -> str:
    variant = os.environ.get("DIGENRL_TINY_PRETRAIN", "full")
    if variant not in VARIANTS:
        raise ValueError(f"DIGENRL_TINY_PRETRAIN={variant!r} is not one of {', '.join(VARIANTS)}")
    return variant


def variant_config(family, variant: str):
    """The PretrainConfig of a variant for `family` (its own `pretrain_overrides` first), or False for "none"."""
    if VARIANTS[variant] is None:
        return False
    return PretrainConfig(**{**getattr(family, "pretrain_overrides", {}), **VARIANTS[variant]})


def pretrain_for_build(family, pipe, config, seed: int, frames: int = 1, max_sequence_length: int = 32):
    """What `build_tiny` calls: config None = the variant $DIGENRL_TINY_PRETRAIN names ("full" unless set),
    False = no pre-training (random weights), a PretrainConfig = exactly that."""
    if config is None:
        config = variant_config(family, variant_from_env())
    if config is False:
        return None
    return pretrain(family, pipe, config, seed=seed, frames=frames, max_sequence_length=max_sequence_length)


def synthetic_images(n: int, generator: torch.Generator, size: int, frames: int = 1,
                     background: torch.Tensor | None = None) -> torch.Tensor:
    """n images [n, 3, H, W] (frames > 1: videos [n, F, 3, H, W], the disc moving on a straight line) in [0, 1]:
    a disc of one palette colour on a background of another, at a random place and size (anti-aliased edge).
    background: [n] palette indices to use instead of random ones where >= 0."""
    bg = torch.randint(0, len(PALETTE), (n,), generator=generator)
    if background is not None:
        bg = torch.where(background >= 0, background, bg)
    fg = (bg + torch.randint(1, len(PALETTE), (n,), generator=generator)) % len(PALETTE)  # never the background
    start = (torch.rand(n, 2, generator=generator) * 0.5 + 0.25) * size  # [n, (y, x)] pixels
    velocity = (torch.rand(n, 2, generator=generator) - 0.5) * 0.5 * size / max(frames - 1, 1)  # pixels per frame
    radius = (torch.rand(n, generator=generator) * 0.15 + 0.15) * size  # [n]
    grid = torch.arange(size, dtype=torch.float32) + 0.5
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")  # [H, W]
    out = []
    for f in range(frames):
        centre = start + f * velocity  # [n, 2]
        dist = ((yy - centre[:, 0, None, None]) ** 2 + (xx - centre[:, 1, None, None]) ** 2).sqrt()  # [n, H, W]
        mask = (radius[:, None, None] - dist + 0.5).clamp(0, 1)[:, None]  # [n, 1, H, W] coverage of each pixel
        out.append(PALETTE[bg][:, :, None, None] * (1 - mask) + PALETTE[fg][:, :, None, None] * mask)
    return out[0] if frames == 1 else torch.stack(out, dim=1)  # [n, 3, H, W] or [n, F, 3, H, W]


def latent_target(images: torch.Tensor, channels: int, spatial: int, subgrid: int = 1,
                  temporal: int = 4) -> torch.Tensor:
    """The normalised latent an image should have: its colours in [-1, 1] averaged over blocks of
    (spatial / subgrid)^2 pixels, pixel-unshuffled into 3 subgrid^2 channels (the other channels zero).
    Images [B, 3, H, W] -> [B, C, H/s, W/s]; videos [B, F, 3, H, W] -> [B, C, F', H/s, W/s] with latent frame k
    = frame temporal * k (the causal video VAEs' frame 0, then one latent frame per 4 frames)."""
    if 3 * subgrid**2 > channels or spatial % subgrid:
        raise ValueError(f"a {subgrid}x{subgrid} colour sub-grid needs {3 * subgrid**2} of the {channels} latent "
                         f"channels and must divide the spatial factor {spatial}")
    if images.ndim == 5:  # [B, F, 3, H, W]
        keep = images[:, ::temporal]  # [B, F', 3, H, W]
        b, f = keep.shape[:2]
        flat = latent_target(keep.flatten(0, 1), channels, spatial, subgrid)  # [B F', C, h, w]
        return flat.unflatten(0, (b, f)).transpose(1, 2)  # [B, C, F', h, w]
    low = F.avg_pool2d(images * 2 - 1, spatial // subgrid)  # [B, 3, H sub/s, W sub/s]
    code = F.pixel_unshuffle(low, subgrid) if subgrid > 1 else low  # [B, 3 sub^2, H/s, W/s]
    return F.pad(code, (0, 0, 0, 0, 0, channels - code.shape[1]))  # [B, C, H/s, W/s]


def decode_unclamped(vae, latents: torch.Tensor) -> torch.Tensor:
    """vae.decode without the final clamp to [-1, 1] that the Wan and Qwen-Image VAEs apply: a pixel clamped on the
    wrong side gets no gradient and stays wrong. We keep the decoder module's own outputs (one call per latent
    frame for the causal video VAEs, concatenated along time)."""
    outputs = []
    handle = vae.decoder.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        vae.decode(latents)
    finally:
        handle.remove()
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [B, 3, (F,) H, W]


def _tail(values: list[float], n: int = 20) -> float:
    tail = values[-n:]
    return sum(tail) / max(len(tail), 1)


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pretrain(family, pipe, cfg: PretrainConfig | None = None, seed: int = 0, frames: int = 1,
             max_sequence_length: int = 32) -> dict[str, list[float]]:
    """Pre-train the VAE (decoder and encoder), then the transformer of `pipe`, in place; returns the losses.

    The family provides `latent_layout(pipe)` -> (latent channels, spatial factor, colour sub-grid),
    `images_to_vae` / `vae_to_images` (pixel layouts), `denormalise(pipe, z)` (normalised -> raw VAE latents,
    what its `decode` applies) and `pack(pipe, z)` (normalised VAE latents -> the transformer's layout)."""
    cfg = cfg or PretrainConfig()
    if cfg.log:
        print(f"[pretrain] {family.name}: pre-training the tiny pipeline on synthetic images ({cfg.vae_steps} VAE "
              f"+ {cfg.flow_steps} transformer steps, once; it is cached)", flush=True)
    start, cpu0 = time.perf_counter(), time.process_time()
    generator = torch.Generator().manual_seed(seed)
    with _threads(cfg.threads):
        losses = train_vae(family, pipe, cfg, generator, frames)
        vae_cpu_s = time.process_time() - cpu0
        losses["flow_mse"] = train_flow(family, pipe, cfg, generator, frames, max_sequence_length)
    if cfg.log:
        print(f"[pretrain] {family.name}: done in {time.perf_counter() - start:.1f} s (CPU "
              f"{time.process_time() - cpu0:.1f} s, VAE {vae_cpu_s:.1f} s); final losses: decoder L1 "
              f"{_tail(losses['decoder_l1']):.3f}, encoder L1 {_tail(losses['encoder_l1']):.3f}, flow MSE "
              f"{_tail(losses['flow_mse']):.3f}", flush=True)
    return losses


def train_vae(family, pipe, cfg: PretrainConfig, generator, frames: int) -> dict[str, list[float]]:
    """Decoder: latent_target (+ a little noise) -> the image; encoder: the image -> latent_target (L1 both)."""
    channels, spatial, subgrid = family.latent_layout(pipe)
    vae = pipe.vae.train().requires_grad_(True)
    opt = torch.optim.Adam(vae.parameters(), lr=cfg.vae_lr)
    losses = {"decoder_l1": [], "encoder_l1": []}
    for _ in range(cfg.vae_steps):
        images = synthetic_images(cfg.vae_batch, generator, family.tiny_resolution, frames)
        raw = family.denormalise(pipe, latent_target(images, channels, spatial, subgrid))  # [B, C, (F',) h, w]
        noisy = raw + cfg.latent_noise * torch.randn(raw.shape, generator=generator)
        decoded = family.vae_to_images(decode_unclamped(vae, noisy))  # the images' layout, ~[-1, 1]
        decoder_l1 = (decoded - (images * 2 - 1)).abs().mean()
        encoder_l1 = (vae.encode(family.images_to_vae(images)).latent_dist.mean - raw).abs().mean()
        opt.zero_grad(set_to_none=True)
        (decoder_l1 + encoder_l1).backward()
        opt.step()
        losses["decoder_l1"].append(float(decoder_l1.detach()))
        losses["encoder_l1"].append(float(encoder_l1.detach()))
    vae.eval().requires_grad_(False)
    return losses


def train_flow(family, pipe, cfg: PretrainConfig, generator, frames: int, max_sequence_length: int) -> list[float]:
    """Rectified flow on latent_target: x_s = (1 - s) x0 + s eps, target v = eps - x0 (grpo.py's convention),
    through the family's own `encode` and `forward` (the conditional branch), captions independent of images."""
    channels, spatial, subgrid = family.latent_layout(pipe)
    conds = family.encode(pipe, CAPTIONS, "cpu", max_sequence_length)  # [n_captions, ...] each
    transformer = pipe.transformer.train().requires_grad_(True)
    opt = torch.optim.AdamW(transformer.parameters(), lr=cfg.flow_lr, weight_decay=0.0)
    losses = []
    named = torch.tensor(CAPTION_BACKGROUND)
    for step in range(cfg.flow_steps):
        pick = torch.randint(0, len(CAPTIONS), (cfg.flow_batch,), generator=generator)
        follow = torch.rand(cfg.flow_batch, generator=generator) < cfg.caption_match
        background = torch.where(follow, named[pick], torch.full_like(pick, -1))  # [B] -1 = random
        images = synthetic_images(cfg.flow_batch, generator, family.tiny_resolution, frames, background)
        x0 = family.pack(pipe, latent_target(images, channels, spatial, subgrid))  # [B, ...] transformer layout
        eps = torch.randn(x0.shape, generator=generator)
        u = torch.rand(cfg.flow_batch, generator=generator)  # [B] uniform in (0, 1)
        sigma = cfg.sigma_shift * u / (1 + (cfg.sigma_shift - 1) * u)  # [B] (SD3's shifted schedule)
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        cond = {k: c[pick] for k, c in conds.items()}
        v = family.forward(pipe, transformer, (1 - s) * x0 + s * eps, sigma, cond, family.default_guidance)
        loss = ((v.float() - (eps - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if cfg.log_every and step % cfg.log_every == 0:
            print(f"[pretrain] {family.name} flow step {step}: MSE {losses[-1]:.4f}", flush=True)
    transformer.eval().requires_grad_(False)
    return losses
