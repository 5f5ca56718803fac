"""The released pipelines at real size, without weights: what `models.load` returns in a rehearsal.

The transformer (tools/real_models.py's released config) and the VAE (its released config: the
parameter counts below are checked against real_models' counts by tests/test_rehearse.py) are built
on the meta device; `to_device` turns them into fake tensors on the stand-in GPU once LoRA, full
training and checkpointing are applied (runtime.load_policy's order). The text encoders are not
built: their bf16 weights are one device allocation of their parameter count (they stay on every
rank's GPU), and `encode_prompt` returns embeddings of the released shapes on the device; encoding
activations are not counted (a few hundred MB per prompt batch at most). The schedulers are the
released configs (as models/<family>.py builds them for the tiny pipelines): only the sigmas come
from them.
"""
from __future__ import annotations

import threading
import types

import torch

from tools.real_models import FAMILIES

_BUILDING = threading.Lock()  # torch's default dtype is the process's: one build at a time

SCHEDULER = {
    "flux": dict(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                 max_image_seq_len=4096, base_shift=0.5, max_shift=1.15),
    "qwenimage": dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                      base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                      max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential"),
    "wan": dict(shift=3.0),
    "hunyuanvideo": dict(shift=7.0),
    "sd3": dict(num_train_timesteps=1000, shift=3.0),
}
PIPELINE = {"flux": "FluxPipeline", "qwenimage": "QwenImagePipeline", "wan": "WanPipeline",
            "hunyuanvideo": "HunyuanVideoPipeline", "sd3": "StableDiffusion3Pipeline"}


def transformer_config(model: str, depth: float = 1.0) -> dict:
    """The released config; depth < 1 keeps that share of the blocks (tests only)."""
    config = dict(FAMILIES[model]["config"])
    for key in FAMILIES[model]["blocks"]:
        config[key] = max(1, round(config[key] * depth))
    return config


def classes(model: str) -> tuple:
    """The family's transformer, VAE and pipeline classes (import them before the ranks' threads:
    diffusers' lazy module is not thread-safe)."""
    import diffusers

    return (getattr(diffusers, FAMILIES[model]["cls"]), getattr(diffusers, FAMILIES[model]["vae"][0]),
            getattr(diffusers, PIPELINE[model]))


def build_vae(model: str):
    """The released VAE on the meta device, in bf16 (outside any FakeTensorMode: meta tensors)."""
    from torch.utils._python_dispatch import _disable_current_modes

    _, cls, _ = classes(model)
    with _disable_current_modes(), torch.device("meta"):
        return cls(**FAMILIES[model]["vae"][1]).to(torch.bfloat16).requires_grad_(False).eval()


def text_encoder_params(model: str) -> int:
    return sum(n for name, n in FAMILIES[model]["others"].items() if name != "VAE")


def stub_pipe(model: str, transformer, vae, device, dtype):
    """What models/<family>.py reads of a pipeline, at the released sizes."""
    import diffusers

    info = FAMILIES[model]
    _, _, cls = classes(model)
    text = info["text"]

    def encode_prompt(prompt, device=None, max_sequence_length=512, **_):
        b = len(prompt)
        length = text.get("clip_tokens", 0) + max_sequence_length  # SD3: 77 CLIP tokens, then T5's
        embeds = torch.zeros(b, length, text["dim"], dtype=dtype, device=device)  # [B, L, D]
        pooled = torch.zeros(b, text.get("pooled", 1), dtype=dtype, device=device)  # [B, P]
        mask = torch.ones(b, max_sequence_length, dtype=torch.long, device=device)  # [B, L]
        return {"flux": (embeds, pooled, None), "qwenimage": (embeds, mask),
                "wan": (embeds, None), "hunyuanvideo": (embeds, pooled, mask),
                "sd3": (embeds, None, pooled, None)}[model]

    # the text encoders' bf16 weights, resident on the device (not built: their count)
    encoders = torch.empty(text_encoder_params(model) * 2, dtype=torch.uint8, device=device)
    return types.SimpleNamespace(
        transformer=transformer, vae=vae, encode_prompt=encode_prompt, text_encoders=encoders,
        tokenizer_max_length=1024, vae_scale_factor=info["vae_spatial"],
        vae_scale_factor_spatial=info["vae_spatial"], vae_scale_factor_temporal=4,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER[model]),
        prompt_template_encode=None, prompt_template_encode_start_idx=0,
        _prepare_latent_image_ids=getattr(cls, "_prepare_latent_image_ids", None),
        _pack_latents=getattr(cls, "_pack_latents", None),
        _unpack_latents=getattr(cls, "_unpack_latents", None),
        components={"transformer": transformer, "vae": vae})


def build_transformer(model: str, depth: float):
    """The released transformer on the meta device, in bf16 (as torchtitan builds its models)."""
    from torch.utils._python_dispatch import _disable_current_modes

    cls, _, _ = classes(model)
    with _BUILDING, _disable_current_modes():
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                return cls(**transformer_config(model, depth)).requires_grad_(False).eval()
        finally:
            torch.set_default_dtype(torch.float32)


def to_device(module: torch.nn.Module, device) -> None:
    """Every parameter and buffer not on `device` (meta: built without memory; CPU: peft's
    adapters) becomes a fake tensor there of the same shape and dtype (call under the rank's
    FakeTensorMode). Shared tensors stay shared."""
    done = {}
    for sub in module.modules():
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in list(table.items()):
                if t is None or t.device == torch.device(device):
                    continue
                if id(t) not in done:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    done[id(t)] = (torch.nn.Parameter(new, requires_grad=t.requires_grad)
                                   if is_param else new)
                table[name] = done[id(t)]
