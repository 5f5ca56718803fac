"""Model families and the `Policy`: one loaded diffusers pipeline plus what RL needs from it.

    from models import load, tiny_pipeline_path
    policy = load("flux", tiny_pipeline_path("flux"), device="cpu", dtype=torch.float32)
    cond = policy.encode_prompts(["a red image"])            # cached per prompt
    x = policy.noise(torch.Generator().manual_seed(0))[None]  # [1, tokens, channels]
    v = policy.velocity(x, torch.ones(1), cond)               # [1, tokens, channels]

`load` is the one loading path for tiny and real weights (`Pipeline.from_pretrained`); a missing
component is named in the error; a Hub id is resolved to its local snapshot by `resolve_pretrained`.
LoRA (models/lora.py) comes from peft through diffusers' `add_adapter`; the reference policy is the
same transformer with adapters disabled.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import re
import shutil

import torch

from .base import Family
from .flux import FluxFamily
from .lora import add_lora, load_init_lora, lora_metadata, lora_state_for_diffusers  # noqa: F401

FAMILIES: dict[str, Family] = {"flux": FluxFamily()}
try:  # the other families live in their own files; they register here when present
    from .qwenimage import QwenImageFamily
    from .wan import WanFamily
    from .hunyuanvideo import HunyuanVideoFamily
    from .sd3 import SD3Family

    FAMILIES.update(qwenimage=QwenImageFamily(), wan=WanFamily(), hunyuanvideo=HunyuanVideoFamily(), sd3=SD3Family())
except ImportError:
    pass


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown --model {name!r}; known models: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]



def family_of_pipeline(path: str | None) -> str | None:
    """The family whose pipeline a local diffusers directory's model_index.json names (None if
    unknown or remote): what --model defaults to with --pretrained."""
    index = os.path.join(path, "model_index.json") if path else ""
    if not os.path.isfile(index):
        return None
    try:
        with open(index) as f:
            named = json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return next((name for name, family in FAMILIES.items() if family.pipeline_class_name == named), None)

def default_cache_dir() -> str:
    return os.environ.get("DIGENRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "digenrl"))


# The demo's pipeline ships with the project (models/demo/, 1.5 MB): its pre-training takes ~200 s on a core, paid
# by every first `python main.py` and every fresh test cache. It is used only while the files that build it are
# unchanged (build_inputs_key); otherwise it is built as any other tiny pipeline. tools/build_demo_pipeline.py
# rebuilds it (and --check: a rebuild is the shipped files, byte for byte).
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
SHIPPED = ("flux",)
BUILD_SOURCES = ("pretrain.py", "tiny_text.py")  # + the family's own file


def build_inputs_key(name: str) -> str:
    """What a fully pre-trained tiny pipeline of `name` is made of: the files that build it (models/pretrain.py,
    models/tiny_text.py, the family's file) and the releases of the libraries whose classes and random streams
    build it. The same key builds the same files (tests/test_pretrain.py: seeded, file for file)."""
    import hashlib
    from importlib.metadata import version  # the installed releases, without importing the libraries

    release = torch.__version__.split("+")[0]  # a CUDA build's CPU kernels are the CPU build's
    digest = hashlib.sha256(f"{release} {version('diffusers')} {version('transformers')}".encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for source in (*BUILD_SOURCES, f"{name}.py"):
        with open(os.path.join(here, source), "rb") as f:
            digest.update(source.encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def shipped_pipeline_path(name: str) -> str | None:
    """The shipped pre-trained pipeline of `name` if there is one and it is what the current files build, else None."""
    path = os.path.join(SHIPPED_DIR, f"tiny-{name}-v3")
    try:
        with open(f"{path}.key") as f:
            shipped_key = f.read().strip()
    except OSError:
        return None
    ok = shipped_key == build_inputs_key(name) and os.path.isfile(os.path.join(path, "model_index.json"))
    return path if ok else None


def tiny_pipeline_cache_path(name: str, variant: str, cache_dir: str | None = None) -> str:
    """Where tiny_pipeline_path builds (or finds) the tiny pipeline of `name` and pre-training `variant`."""
    # v3: pre-trained on synthetic images (faint caption match, wider video models); bump whenever what
    # build_tiny makes changes.
    suffix = "" if variant == "full" else f"-{variant}"
    return os.path.join(cache_dir or default_cache_dir(), f"tiny-{name}-v3{suffix}")


def tiny_pipeline_path(name: str, cache_dir: str | None = None) -> str:
    """Build the tiny pipeline of a family once into the cache folder; return its path.

    It is pre-trained on synthetic images (models/pretrain.py) unless $DIGENRL_TINY_PRETRAIN says otherwise; the
    fully pre-trained demo pipeline is the shipped one while it is current (shipped_pipeline_path)."""
    from . import pretrain

    family = get_family(name)
    variant = pretrain.variant_from_env()
    if variant == "full" and name in SHIPPED and (shipped := shipped_pipeline_path(name)):
        return shipped
    path = tiny_pipeline_cache_path(name, variant, cache_dir)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    import fcntl  # here: POSIX only, as infra/runlock.py; the cached path above needs none

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.lock", "w") as lock:  # one builder at a time: the others wait, then find it built
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            tmp = f"{path}.tmp{os.getpid()}"  # build aside, then rename: no reader ever sees half a pipeline
            family.build_tiny(tmp, pretrain_config=pretrain.variant_config(family, variant))
            if os.path.isdir(path):  # a half copy from a builder killed before this lock existed
                shutil.rmtree(path)
            os.replace(tmp, path)
    return path


class Policy:
    """A pipeline on a device, with cached prompt encodings and the RL-facing calls."""

    def __init__(self, family: Family, pipe, device, dtype, height: int, width: int, frames: int = 1,
                 max_sequence_length: int = 512, guidance: float | None = None, prompt_cache_size: int = 64):
        self.family, self.pipe, self.device, self.dtype = family, pipe, torch.device(device), dtype
        self.height, self.width, self.frames = height, width, frames
        tok = getattr(pipe, family.sequence_tokenizer, None) or getattr(pipe, "tokenizer", None)
        self.max_sequence_length = min(max_sequence_length, getattr(tok, "model_max_length", max_sequence_length))
        self.guidance = family.default_guidance if guidance is None else guidance
        # prompt -> its conditioning on the device, least recently used first; at most prompt_cache_size prompts
        self._prompt_cache: collections.OrderedDict[str, dict[str, torch.Tensor]] = collections.OrderedDict()
        self.prompt_cache_size = prompt_cache_size
        self.negative_cond = self.encode_prompts([""]) if family.uses_true_cfg else None
        self.reference_transformer = None  # a frozen copy of the initial weights: full fine-tuning with a KL term
        self.autocast = False  # fp32 master weights with a bf16 policy: compute under bf16 autocast
        self.masters_pending = False  # fp32 masters left to infra.fsdp.shard_for_fsdp (enable_full_training)
        self.compute_dtype = dtype  # the autocast dtype (fp16 under compute_in_fp16)
        self.on_forward = lambda: None  # called after every transformer forward (main.py: liveness progress)

    @property
    def transformer(self):
        return self.pipe.transformer

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning for `prompts`; each distinct prompt is encoded once, then served from an
        LRU cache of at most `prompt_cache_size` prompts (so a run over many prompts keeps bounded memory)."""
        found = {}
        for prompt in dict.fromkeys(prompts):
            if prompt in self._prompt_cache:
                self._prompt_cache.move_to_end(prompt)  # most recently used
                found[prompt] = self._prompt_cache[prompt]
        missing = [p for p in dict.fromkeys(prompts) if p not in found]
        if missing:
            encoded = self.family.encode(self.pipe, missing, self.device, self.max_sequence_length)
            for i, prompt in enumerate(missing):
                # clone: a row view would keep the whole encoded batch alive for as long as one row is cached
                found[prompt] = {k: v[i : i + 1].detach().clone() for k, v in encoded.items()}
                if self.prompt_cache_size > 0:
                    self._prompt_cache[prompt] = found[prompt]
            while len(self._prompt_cache) > self.prompt_cache_size:
                self._prompt_cache.popitem(last=False)  # evict the least recently used
        keys = found[prompts[0]].keys()
        return {k: torch.cat([found[p][k] for p in prompts]) for k in keys}

    def latent_shape(self) -> tuple[int, ...]:
        return self.family.latent_shape(self.pipe, self.height, self.width, self.frames)

    def noise(self, generator: torch.Generator) -> torch.Tensor:
        """One sample's standard normal latents from a CPU generator (same on every device and rank)."""
        return self.family.sample_noise(self.pipe, generator, self.height, self.width, self.frames)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return self.family.sigmas(self.pipe, num_steps, self.height, self.width, self.frames)

    def velocity(self, latents, sigma, cond, transformer=None, cfg: bool = True,
                 detach_uncond: bool = False) -> torch.Tensor:
        """v(latents, sigma | cond) in float32 [B, ...]; sigma is per-sample [B]. cfg=False scores the
        conditional branch alone (Flow-GRPO's train.cfg = False; true-CFG families only);
        detach_uncond: the unconditional branch carries no gradient (Family.forward)."""
        transformer = transformer if transformer is not None else self.transformer
        cond = {k: v.to(self.device, self.dtype) for k, v in cond.items()}
        neg = None if self.negative_cond is None or not cfg else {
            k: v.to(self.device, self.dtype) for k, v in self.negative_cond.items()}
        amp = (torch.autocast(self.device.type, dtype=self.compute_dtype) if self.autocast
               else contextlib.nullcontext())
        with amp:  # fp32 master weights: matmuls run in the policy dtype, as on the rollout ranks
            out = self.family.forward(self.pipe, transformer, latents.to(self.device, self.dtype),
                                      sigma.to(self.device, torch.float32), cond, self.guidance, neg,
                                      detach_uncond=detach_uncond)
        self.on_forward()
        return out.to(torch.float32)

    def freeze_reference(self) -> None:
        """Full fine-tuning with a KL term: keep a frozen copy of the transformer *as it is now* as the reference.

        Call it once, on the initial weights: before a resumed checkpoint is loaded and before FSDP sharding
        (main.py and Trainer do). With LoRA nothing is copied: the reference is the base with adapters off.
        """
        if self.reference_transformer is None and not has_lora(self.transformer):
            # in the policy dtype: with fp32 master weights (enable_full_training) the values are bf16 ones anyway;
            # copied tensor by tensor, never a whole copy in the fp32 master dtype (infra/fsdp.py shards it)
            self.reference_transformer = frozen_copy(self.transformer, self.dtype)

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
            if self.reference_transformer is None:  # a lazy copy here would be of whatever weights we hold now
                raise RuntimeError("full fine-tuning with a KL term needs policy.freeze_reference() on the initial "
                                   "weights (before resuming or training)")
            yield self.reference_transformer

    @torch.no_grad()
    def decode(self, latents) -> torch.Tensor:
        images = self.family.decode(self.pipe, latents.to(self.device), self.height, self.width, self.frames)
        return images.float().cpu()


def frozen_copy(module: torch.nn.Module, dtype: torch.dtype, on_meta: bool = False) -> torch.nn.Module:
    """A frozen copy of `module` (requires_grad off) whose parameters are in `dtype`, copied one tensor at a time
    (buffers are copied as they are). `on_meta`: the parameters stay on the meta device, taking no memory, to be
    filled unit by unit with `fill_from` (infra.fsdp.shard_for_fsdp shards each unit as soon as it is filled)."""
    memo = {}
    for p in module.parameters():
        data = torch.empty_like(p, dtype=dtype, device="meta") if on_meta else p.detach().to(dtype, copy=True)
        memo[id(p)] = torch.nn.Parameter(data, requires_grad=False)
    return copy.deepcopy(module, memo)


def fill_from(copy_: torch.nn.Module, source: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give the meta-device parameters of `copy_` (a frozen_copy(on_meta=True) of `source` or of one of its
    submodules) the values of `source`'s same-named parameters, in `dtype`."""
    for name, p in list(copy_.named_parameters()):
        if p.is_meta:
            owner, _, leaf = name.rpartition(".")
            value = source.get_parameter(name).detach().to(dtype, copy=True)
            copy_.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


def load(name: str, path: str, device="cpu", dtype=torch.float32, height: int | None = None,
         width: int | None = None, frames: int | None = None, max_sequence_length: int = 512,
         guidance: float | None = None, prompt_cache_size: int = 64) -> Policy:
    """Load a pipeline directory or cached Hub id (tiny or real weights) through the family's `from_pretrained`."""
    family = get_family(name)
    path = resolve_pretrained(name, path, local_only=True)  # the launcher fetched it (cli.validate)
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
                  max_sequence_length, guidance, prompt_cache_size)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hugging Face Hub spells repository ids


def is_hub_id(path: str | None) -> bool:
    """--pretrained names a Hub repository (org/name) rather than a local directory."""
    return bool(path) and not os.path.exists(path) and bool(HUB_ID.fullmatch(path))


_RESOLVED: dict[tuple[str, str], str] = {}  # (family, Hub id) -> its local snapshot, once this process has it


def hub_download(name: str, repo_id: str, local_only: bool) -> str:
    """The pipeline's own `download` of a Hub id (what `from_pretrained` does with an id: only the files the
    pipeline needs) into the Hugging Face cache; the local snapshot. (tests/inject/fake_hub.py stands in for it.)"""
    return get_family(name).pipeline_class().download(repo_id, local_files_only=local_only)


def resolve_pretrained(name: str, path: str, local_only: bool = False) -> str:
    """--pretrained as a local directory (as is) or a Hub id: fetched into the Hugging Face cache (`hub_download`;
    `local_only`: from the cache alone) once per process; returns the local snapshot. Under torchrun one rank per
    node fetches (infra/node_fetch.py)."""
    if not is_hub_id(path):
        return path
    if (name, path) in _RESOLVED:
        return _RESOLVED[(name, path)]
    _quiet_libraries()
    try:
        _RESOLVED[(name, path)] = hub_download(name, path, local_only)
        return _RESOLVED[(name, path)]
    except Exception as exc:  # noqa: BLE001  (offline, unknown repo, gated repo, ... : all mean "not available")
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
        raise FileNotFoundError(
            f"--pretrained {path!r} is not a local directory, and as a Hugging Face Hub id it could not be fetched "
            f"({reason}). Download it where there is network (`huggingface-cli download {path} --local-dir DIR`) "
            "and pass --pretrained DIR, or set HF_HOME to a cache that holds it") from None


def _quiet_libraries() -> None:
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.set_verbosity_error()
        lib.utils.logging.disable_progress_bar()


def has_lora(transformer) -> bool:
    return bool(getattr(transformer, "peft_config", None))


def compute_in_fp16(policy: Policy) -> None:
    """Flow-GRPO's SD3 precision (config/base.py mixed_precision "fp16", scripts/train_sd3.py lines 401-415): the
    transformer's and the VAE's weights stay float32 (the policy dtype), the text encoders run in float16, and the
    transformer computes under float16 autocast, sampling and training alike (accelerate wraps its forward)."""
    for name, module in policy.pipe.components.items():
        if name.startswith("text_encoder") and isinstance(module, torch.nn.Module):
            module.to(torch.float16)
    policy._prompt_cache.clear()  # encodings of the float32 encoders
    policy.negative_cond = policy.encode_prompts([""]) if policy.family.uses_true_cfg else None
    policy.autocast, policy.compute_dtype = True, torch.float16


def enable_full_training(policy: Policy, fp32_master: bool = False, masters_after_sharding: bool = False) -> None:
    """Train every transformer weight. With `fp32_master` and a lower-precision policy (bf16 on GPUs), the
    trainable weights become float32 (so their gradients and AdamW state are float32 too) and the forward
    runs under autocast in the policy dtype: the mixed precision of Flow-GRPO (accelerate bf16) and
    DanceGRPO (fp32 master weights, FSDP bf16 compute). 16 bytes per parameter instead of 8, and an
    update far below half a bf16 ulp (lr 1e-5 on weights ~1e-2) accumulates instead of rounding away.
    Alternative not taken: bf16 weights with an fp32 copy held by the optimizer (~18 bytes per parameter,
    the trainer's forward then bit-equal to the rollout's) or bf16 with stochastic rounding (8 bytes,
    unbiased but noisy). Call it on trainer ranks only: rollout ranks keep the policy dtype.

    `masters_after_sharding` (--fsdp): the float32 copies are left to infra.fsdp.shard_for_fsdp, which makes them
    after cutting the weights, so each trainer converts only its shard. Made here, before sharding, the whole
    transformer sat in float32 on every trainer's device for a moment (4 bytes per parameter: 82 GB for
    Qwen-Image's 20.4B, beside its text encoder and VAE) where 2 + 4/K bytes are needed."""
    policy.transformer.requires_grad_(True)
    if fp32_master and policy.dtype != torch.float32:
        policy.autocast = True
        if masters_after_sharding:
            policy.masters_pending = True
        else:
            make_fp32_masters(policy.transformer)


def make_fp32_masters(module: torch.nn.Module) -> None:
    """The trainable parameters of `module` in float32, one tensor at a time; buffers keep their dtype. FSDP2
    shards are converted shard by shard: `_apply` is FSDP2's own path for a dtype change after fully_shard (it
    re-pads and re-registers each shard); a plain module's parameters get new data in place (`_apply` would
    swap them, which fake tensors refuse: tools/estimate_memory.py)."""
    from torch.distributed.fsdp import FSDPModule

    def trainable(t: torch.Tensor) -> bool:
        return isinstance(t, torch.nn.Parameter) and t.requires_grad and t.is_floating_point()

    if isinstance(module, FSDPModule):
        module._apply(lambda t: t.float() if trainable(t) else t)
    else:
        for p in module.parameters():
            if trainable(p):
                p.data = p.data.float()

