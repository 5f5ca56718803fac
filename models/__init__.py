"""Model families and the `Policy`: one loaded diffusers pipeline plus what RL needs from it.

    from models import load, tiny_pipeline_path
    policy = load("flux", tiny_pipeline_path("flux"), device="cpu", dtype=torch.float32)
    cond = policy.encode_prompts(["a red image"])            # cached per prompt
    x = policy.initial_noise([0])                             # [1, tokens, channels]
    v = policy.velocity(x, torch.ones(1), cond)               # [1, tokens, channels]

`load` is the one loading path for tiny and real weights (`Pipeline.from_pretrained`); a missing
component is named in the error. LoRA comes from peft through diffusers' `add_adapter`; the
reference policy is the same transformer with adapters disabled.
"""
from __future__ import annotations

import contextlib
import copy
import os

import torch

from .base import Family
from .flux import FluxFamily

FAMILIES: dict[str, Family] = {"flux": FluxFamily()}
try:  # the other families live in their own files; they register here when present
    from .qwenimage import QwenImageFamily
    from .wan import WanFamily
    from .hunyuanvideo import HunyuanVideoFamily

    FAMILIES.update(qwenimage=QwenImageFamily(), wan=WanFamily(), hunyuanvideo=HunyuanVideoFamily())
except ImportError:
    pass


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown --model {name!r}; known models: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def default_cache_dir() -> str:
    return os.environ.get("DIGENRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "digenrl"))


def tiny_pipeline_path(name: str, cache_dir: str | None = None) -> str:
    """Build the tiny pipeline of a family once into the cache folder; return its path.

    It is pre-trained on synthetic images (models/pretrain.py) unless $DIGENRL_TINY_PRETRAIN says otherwise."""
    from . import pretrain

    family = get_family(name)
    variant = pretrain.variant_from_env()
    # v3: pre-trained on synthetic images (faint caption match, wider video models); bump whenever what build_tiny makes changes.
    suffix = "" if variant == "full" else f"-{variant}"
    path = os.path.join(cache_dir or default_cache_dir(), f"tiny-{name}-v3{suffix}")
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        tmp = f"{path}.tmp{os.getpid()}"  # build aside, then rename: concurrent ranks never see half a pipeline
        family.build_tiny(tmp, pretrain_config=pretrain.variant_config(family, variant))
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race; its copy is complete
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


class Policy:
    """A pipeline on a device, with cached prompt encodings and the RL-facing calls."""

    def __init__(self, family: Family, pipe, device, dtype, height: int, width: int, frames: int = 1,
                 max_sequence_length: int = 512, guidance: float | None = None):
        self.family, self.pipe, self.device, self.dtype = family, pipe, torch.device(device), dtype
        self.height, self.width, self.frames = height, width, frames
        tok = getattr(pipe, family.sequence_tokenizer, None) or getattr(pipe, "tokenizer", None)
        self.max_sequence_length = min(max_sequence_length, getattr(tok, "model_max_length", max_sequence_length))
        self.guidance = family.default_guidance if guidance is None else guidance
        self._prompt_cache: dict[str, dict[str, torch.Tensor]] = {}
        self.negative_cond = self.encode_prompts([""]) if family.uses_true_cfg else None
        self.reference_transformer = None  # a frozen copy, only for full fine-tuning with a KL term

    @property
    def transformer(self):
        return self.pipe.transformer

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning for `prompts`; each distinct prompt is encoded once and cached."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._prompt_cache]
        if missing:
            encoded = self.family.encode(self.pipe, missing, self.device, self.max_sequence_length)
            for i, prompt in enumerate(missing):
                self._prompt_cache[prompt] = {k: v[i : i + 1].detach() for k, v in encoded.items()}
        keys = self._prompt_cache[prompts[0]].keys()
        return {k: torch.cat([self._prompt_cache[p][k] for p in prompts]) for k in keys}

    def latent_shape(self) -> tuple[int, ...]:
        return self.family.latent_shape(self.pipe, self.height, self.width, self.frames)

    def noise(self, generator: torch.Generator) -> torch.Tensor:
        """One sample's standard normal latents from a CPU generator (same on every device and rank)."""
        return self.family.sample_noise(self.pipe, generator, self.height, self.width, self.frames)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return self.family.sigmas(self.pipe, num_steps, self.height, self.width, self.frames)

    def velocity(self, latents, sigma, cond, transformer=None) -> torch.Tensor:
        """v(latents, sigma | cond) in float32 [B, ...]; sigma is per-sample [B]."""
        transformer = transformer if transformer is not None else self.transformer
        cond = {k: v.to(self.device, self.dtype) for k, v in cond.items()}
        neg = None if self.negative_cond is None else {k: v.to(self.device, self.dtype) for k, v in self.negative_cond.items()}
        out = self.family.forward(self.pipe, transformer, latents.to(self.device, self.dtype),
                                  sigma.to(self.device, torch.float32), cond, self.guidance, neg)
        return out.to(torch.float32)

    @contextlib.contextmanager
    def reference(self):
        """Yield the reference transformer: adapters disabled (LoRA) or the frozen initial copy."""
        if has_lora(self.transformer):
            self.transformer.disable_adapters()
            try:
                yield self.transformer
            finally:
                self.transformer.enable_adapters()
        else:
            if self.reference_transformer is None:
                self.reference_transformer = copy.deepcopy(self.transformer).requires_grad_(False)
            yield self.reference_transformer

    @torch.no_grad()
    def decode(self, latents) -> torch.Tensor:
        images = self.family.decode(self.pipe, latents.to(self.device), self.height, self.width, self.frames)
        return images.float().cpu()


def load(name: str, path: str, device="cpu", dtype=torch.float32, height: int | None = None,
         width: int | None = None, frames: int | None = None, max_sequence_length: int = 512,
         guidance: float | None = None) -> Policy:
    """Load a pipeline directory (tiny or real weights) through the family's `from_pretrained`."""
    family = get_family(name)
    family.check_pretrained(path)
    family.check_frames(frames)
    _quiet_libraries()
    pipe = family.pipeline_class().from_pretrained(path, dtype=dtype)
    pipe.to(device)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False).eval()
    height = height or family.tiny_resolution
    return Policy(family, pipe, device, dtype, height, width or height, frames or family.tiny_frames,
                  max_sequence_length, guidance)


def _quiet_libraries() -> None:
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.set_verbosity_error()
        lib.utils.logging.disable_progress_bar()


def has_lora(transformer) -> bool:
    return bool(getattr(transformer, "peft_config", None))


def add_lora(policy: Policy, rank: int, alpha: float, targets: tuple[str, ...] | None = None) -> None:
    """Attach a LoRA adapter (peft) to the transformer; only its weights train. Trainable params in float32."""
    from peft import LoraConfig

    transformer = policy.transformer
    transformer.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                        target_modules=list(targets or policy.family.lora_targets))
    transformer.add_adapter(config)
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # bf16 base, fp32 adapters: updates of size lr*grad survive rounding


def enable_full_training(policy: Policy) -> None:
    policy.transformer.requires_grad_(True)


def trainable_state(transformer) -> dict[str, torch.Tensor]:
    """name -> tensor of the trainable weights (LoRA only when LoRA is on), in a fixed order."""
    return {n: p for n, p in transformer.named_parameters() if p.requires_grad}


def lora_state_for_diffusers(transformer, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """LoRA weights in the layout `pipe.load_lora_weights` accepts (peft state dict keys).

    `weights` (name -> whole tensor) replaces the module's own, e.g. the gathered weights of an FSDP-sharded model.

    The file carries no alphas, so loaders (diffusers included) assume lora_alpha = rank, i.e. scale 1. We fold
    each layer's scale (alpha / rank) into its B matrix, so the loaded LoRA computes what we trained."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(transformer, state_dict=weights)
    scale = {name: module.scaling["default"] for name, module in transformer.named_modules()
             if isinstance(module, LoraLayer)}
    out = {}
    for key, value in state.items():
        value = value.detach().cpu()
        if ".lora_B." in key:
            value = value * scale[key.split(".lora_B.")[0]]
        out[key] = value.contiguous()
    return out
