"""LoRA on the transformer: target presets per family, attaching adapters, the diffusers LoRA file (save, read, init).

    targets = resolve_targets(policy.transformer, policy.family, "all-linear")
    add_lora(policy, rank=64, alpha=128, targets="flow_grpo")     # the family's published Flow-GRPO setting
    state, meta = lora_state_for_diffusers(transformer), lora_metadata(transformer)
    FluxPipeline.save_lora_weights(folder, transformer_lora_layers=state, transformer_lora_adapter_metadata=meta)
    load_init_lora(policy.transformer, "runs/x/checkpoints/step_000010")   # --init-lora

Presets (`--lora-targets`): `flow_grpo` (the published list, with its rank and alpha as the defaults of
--lora-rank / --lora-alpha), `attention` (every attention projection of the family), `all-linear` (every
nn.Linear inside the transformer's blocks), or a comma list of module names (peft suffix matching).

The saved file keeps B unscaled and carries the adapter config (rank, alpha, targets) as diffusers' LoRA
metadata, so `pipe.load_lora_weights` rebuilds the same scale alpha / rank. Files without metadata (other tools,
or older digenrl checkpoints, which folded alpha / rank into B) load with alpha = rank, diffusers' convention.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

import torch

PRESET_NAMES = ("flow_grpo", "attention", "all-linear")
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"  # what save_lora_weights writes
PEFT_FILE, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PeftModel.save_pretrained (Flow-GRPO)


@dataclasses.dataclass(frozen=True)
class Preset:
    targets: tuple[str, ...]
    rank: int
    alpha: float
    source: str


_FLUX_ATTN = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
              "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out")
FLOW_GRPO = {
    # Flow-GRPO scripts/train_flux.py: attention of both streams AND both feed-forwards,
    # LoraConfig(r=64, lora_alpha=128).
    "flux": Preset(_FLUX_ATTN + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
                   64, 128.0, "Flow-GRPO scripts/train_flux.py"),
    # Flow-GRPO scripts/train_qwenimage_edit_plus.py (their Qwen-Image script): the same attention list plus the
    # image and text MLPs, r=64, alpha=128.
    "qwenimage": Preset(_FLUX_ATTN + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
                        64, 128.0, "Flow-GRPO scripts/train_qwenimage_edit_plus.py"),
    # Flow-GRPO scripts/train_wan2_1.py: bare names, i.e. attn1 (self) and attn2 (text cross) projections; add_*
    # only exist in image-to-video checkpoints. No feed-forward. r=32, alpha=64.
    "wan": Preset(("add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "to_k", "to_out.0", "to_q", "to_v"),
                  32, 64.0, "Flow-GRPO scripts/train_wan2_1.py"),
    # Flow-GRPO scripts/train_sd3.py: the joint attention of both streams, no feed-forward and not SD3.5's second
    # image self-attention (attn2); LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian").
    "sd3": Preset(("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                   "attn.to_out.0", "attn.to_q", "attn.to_v"), 32, 64.0, "Flow-GRPO scripts/train_sd3.py"),
    # Neither Flow-GRPO nor DanceGRPO publishes a HunyuanVideo LoRA: DanceGRPO fine-tunes HunyuanVideo fully
    # (use --no-lora for that). HunyuanVideo's dual-stream blocks name their layers as FLUX's do, so we use
    # Flow-GRPO's FLUX list and r=64, alpha=128.
    "hunyuanvideo": Preset(_FLUX_ATTN + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
                           64, 128.0, "Flow-GRPO's FLUX setting (no published HunyuanVideo LoRA)"),
}


def preset(family_name: str) -> Preset:
    return FLOW_GRPO[family_name]


def check_targets_spec(spec: str) -> None:
    """Syntax of --lora-targets: a preset name or a comma list of dotted module names."""
    if spec in PRESET_NAMES:
        return
    names = [n.strip() for n in spec.split(",")]
    if not spec.strip() or not all(re.fullmatch(r"[A-Za-z_][\w]*(\.\w+)*", n) for n in names):
        raise ValueError(f"--lora-targets {spec!r} is not one of {', '.join(PRESET_NAMES)} nor a comma list of "
                         "module names (e.g. attn.to_q,attn.to_v,ff.net.2)")


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # peft's rule for a list of target names


def resolve_targets(transformer, family, spec: str | list | tuple | None):
    """The peft `target_modules` for a preset name / comma list / explicit list; checked against the model.

    all-linear is a regex over the blocks (`...blocks.<i>.<path>`): a list of last name components would also name
    `0` / `2` (from `to_out.0`, `ff.net.2`), which match whole blocks, and `proj_out` would catch the output head."""
    linear = {n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    in_blocks = re.compile(r"^(.*?blocks\.\d+)\.(.+)$")
    if spec is None or spec == "flow_grpo":
        targets = list(preset(family.name).targets)
    elif spec == "attention":
        targets = list(family.lora_targets)
    elif spec == "all-linear":
        paths = sorted({in_blocks.match(n).group(2) for n in linear if in_blocks.match(n)})
        if not paths:
            raise ValueError(f"{family.name}: no nn.Linear inside blocks found for --lora-targets all-linear")
        regex = r".*blocks\.\d+\.(?:" + "|".join(re.escape(p) for p in paths) + ")"
        picked = {n for n, _ in transformer.named_modules() if re.fullmatch(regex, n)}
        wanted = {n for n in linear if in_blocks.match(n)}
        assert picked == wanted, sorted(picked ^ wanted)  # exactly the block linears, nothing else
        return regex
    else:
        targets = [t.strip() for t in spec.split(",")] if isinstance(spec, str) else list(spec)
    for target in targets:
        hits = [n for n, _ in transformer.named_modules() if _matches(n, target)]
        bad = [n for n in hits if n not in linear]
        if bad:
            kind = type(transformer.get_submodule(bad[0])).__name__
            raise ValueError(f"LoRA target {target!r} names {bad[0]!r}, which is a {kind}, not an nn.Linear; give "
                             "module names that end at a linear layer")
    if not any(_matches(n, t) for n in linear for t in targets):
        raise ValueError(f"LoRA targets {targets} match no linear layer of the {family.name} transformer")
    return targets


def add_lora(policy, rank: int, alpha: float, targets=None) -> None:
    """Attach a LoRA adapter (peft) to the transformer; only its weights train. Trainable params in float32.
    `targets`: None (the family's Flow-GRPO preset), a preset name, a comma list, or a list of module names."""
    from peft import LoraConfig

    transformer = policy.transformer
    transformer.requires_grad_(False)
    target_modules = resolve_targets(transformer, policy.family, targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=target_modules)
    transformer.add_adapter(config)
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # bf16 base, fp32 adapters: updates of size lr*grad survive rounding


def lora_state_for_diffusers(transformer, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """LoRA weights in the layout `pipe.load_lora_weights` accepts (peft state dict keys), B NOT scaled: save them with
    `lora_metadata` so the loader knows alpha. `weights` (name -> whole tensor) replaces the module's own, e.g. the
    gathered weights of an FSDP-sharded model."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(transformer, state_dict=weights)
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def lora_metadata(transformer) -> dict:
    """The adapter's LoraConfig as a JSON-able dict: diffusers' `transformer_lora_adapter_metadata`."""
    meta = transformer.peft_config["default"].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in meta.items()}


# --- reading a LoRA file (--init-lora) ------------------------------------------------------------
@dataclasses.dataclass
class LoraFile:
    path: str
    state: dict[str, torch.Tensor]  # module path + ".lora_A.weight" / ".lora_B.weight"
    rank: int
    alpha: float
    alpha_source: str  # "metadata" or "assumed = rank (no metadata)"
    target_modules: list[str] | None = None  # the adapter config's list (peft adapter_config.json or metadata)

    @property
    def modules(self) -> set[str]:
        return {k.rsplit(".lora_", 1)[0] for k in self.state}


def read_lora_file(path: str, tensors: bool = True) -> LoraFile:
    """A diffusers LoRA file (or its folder), or a peft adapter folder (Flow-GRPO's `save_pretrained`)."""
    from safetensors import safe_open

    file, peft_config = path, None
    if os.path.isdir(path):
        for name in (DIFFUSERS_FILE, PEFT_FILE):
            if os.path.isfile(os.path.join(path, name)):
                file = os.path.join(path, name)
                break
        else:
            raise ValueError(f"--init-lora {path!r} holds neither {DIFFUSERS_FILE} (diffusers save_lora_weights) nor "
                             f"{PEFT_FILE} (peft save_pretrained)")
        if file.endswith(PEFT_FILE) and os.path.isfile(os.path.join(path, PEFT_CONFIG)):
            with open(os.path.join(path, PEFT_CONFIG)) as f:
                peft_config = json.load(f)
    if not os.path.isfile(file):
        raise ValueError(f"--init-lora {path!r} does not exist (give a .safetensors LoRA file or its folder)")
    try:
        with safe_open(file, framework="pt") as f:
            header = f.metadata() or {}
            keys = list(f.keys())
            state = {k: (f.get_tensor(k) if tensors else f.get_slice(k).get_shape()) for k in keys}
    except Exception as exc:  # noqa: BLE001  (any unreadable file is a bad value)
        raise ValueError(f"--init-lora {file!r} is not a readable safetensors file: {exc}") from exc
    meta = peft_config
    if meta is None and header.get("lora_adapter_metadata"):
        packed = json.loads(header["lora_adapter_metadata"])
        meta = {k.split(".", 1)[1]: v for k, v in packed.items() if k.startswith("transformer.")} or None
    out = {}
    for key, value in state.items():
        short = key.removeprefix("transformer.").removeprefix("base_model.model.")
        short = short.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        if ".lora_A." in short or ".lora_B." in short:
            out[short] = value
    if not out:
        raise ValueError(f"--init-lora {file!r} holds no LoRA weights (no *.lora_A.* / *.lora_B.* keys)")
    ranks = {tuple(v.shape if tensors else v)[0] for k, v in out.items() if ".lora_A." in k}
    if len(ranks) != 1:
        raise ValueError(f"--init-lora {file!r} mixes LoRA ranks {sorted(ranks)}; one rank per file is supported")
    rank = ranks.pop()
    targets = meta.get("target_modules") if meta else None
    targets = sorted(targets) if isinstance(targets, (list, tuple)) and targets else None  # a regex string: no list
    if meta and meta.get("lora_alpha") is not None:
        return LoraFile(file, out, int(meta.get("r", rank)), float(meta["lora_alpha"]), "metadata", targets)
    return LoraFile(file, out, rank, float(rank), "assumed = rank (no metadata)", targets)


def load_init_lora(transformer, path: str) -> LoraFile:
    """Copy a LoRA file's A and B into the adapter `add_lora` attached; the adapted modules must be the same."""
    lora = read_lora_file(path)
    params = dict(transformer.named_parameters())
    ours = {n.replace(".default.", "."): n for n in params if ".lora_A.default." in n or ".lora_B.default." in n}
    missing, unexpected = sorted(set(ours) - set(lora.state)), sorted(set(lora.state) - set(ours))
    if missing or unexpected:
        raise ValueError(f"--init-lora {lora.path!r} adapts other modules than --lora-targets: the file lacks "
                         f"{missing[:4]}{'...' if len(missing) > 4 else ''} and has {unexpected[:4]}"
                         f"{'...' if len(unexpected) > 4 else ''}; pick the --lora-targets the file was trained with")
    with torch.no_grad():
        for key, name in ours.items():
            if params[name].shape != lora.state[key].shape:
                raise ValueError(f"--init-lora {lora.path!r}: {key} has shape {tuple(lora.state[key].shape)}, "
                                 f"the adapter {tuple(params[name].shape)} (rank {lora.rank} in the file)")
            params[name].copy_(lora.state[key])
    return lora


# --- before any rank starts (config.resolve / cli.validate) ------------------------------------
def default_rank_alpha(family_name: str, init_lora: str | None = None) -> tuple[int, float]:
    """--lora-rank / --lora-alpha when unset: --init-lora's (if readable), else the family's Flow-GRPO preset."""
    if init_lora is not None:
        try:
            lora = read_lora_file(init_lora, tensors=False)
            return lora.rank, lora.alpha
        except ValueError:
            pass  # cli.validate reports the unreadable file
    p = preset(family_name)
    return p.rank, p.alpha


def default_targets(init_lora: str | None) -> str:
    """--lora-targets when unset: --init-lora's target_modules as a comma list (Flow-GRPO's peft folders list them in
    adapter_config.json), else the flow_grpo preset (cli.validate then checks the file against it)."""
    if init_lora is not None:
        try:
            lora = read_lora_file(init_lora, tensors=False)
        except ValueError:
            return "flow_grpo"  # cli.validate reports the unreadable file
        if lora.target_modules and all(re.fullmatch(r"[A-Za-z_][\w]*(\.\w+)*", t) for t in lora.target_modules):
            return ",".join(lora.target_modules)
    return "flow_grpo"


def adapted_modules(transformer, target_modules) -> set[str]:
    """The module names peft adapts for `target_modules` (a list: suffix match; a string: regex full match)."""
    names = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    if isinstance(target_modules, str):
        return {n for n in names if re.fullmatch(target_modules, n)}
    return {n for n in names if any(_matches(n, t) for t in target_modules)}


def meta_transformer(family, pipeline_path: str):
    """The pipeline's transformer built from its config on the meta device: module names, no weights, no memory."""
    import diffusers

    with open(os.path.join(pipeline_path, "model_index.json")) as f:
        cls = getattr(diffusers, json.load(f)["transformer"][1])
    with torch.device("meta"):
        return cls.from_config(cls.load_config(pipeline_path, subfolder="transformer"))


def check_init_lora(path: str, lora_on: bool, rank: int | None, alpha: float | None, family=None,
                    pipeline_path: str | None = None, targets_spec: str | None = None) -> LoraFile:
    """--init-lora's file must be readable, LoRA must be on, rank / alpha must agree with the file, and (given the
    pipeline) the file must adapt exactly the modules --lora-targets selects."""
    if not lora_on:
        raise ValueError(f"--init-lora {path!r} starts a LoRA, but LoRA is off (--no-lora)")
    lora = read_lora_file(path, tensors=False)
    if rank is not None and rank != lora.rank:
        raise ValueError(f"--lora-rank {rank} differs from --init-lora {lora.path!r}'s rank {lora.rank}")
    if alpha is not None and alpha != lora.alpha:
        raise ValueError(f"--lora-alpha {alpha:g} differs from --init-lora {lora.path!r}'s alpha {lora.alpha:g} "
                         f"({lora.alpha_source}); its B only means what was trained with that scale")
    if family is not None and pipeline_path is not None:
        transformer = meta_transformer(family, pipeline_path)
        wanted = adapted_modules(transformer, resolve_targets(transformer, family, targets_spec))
        if wanted != lora.modules:
            lacks, extra = sorted(wanted - lora.modules), sorted(lora.modules - wanted)
            raise ValueError(f"--init-lora {lora.path!r} adapts other modules than --lora-targets {targets_spec}: "
                             f"the file lacks {lacks[:3]}{'...' if len(lacks) > 3 else ''} and has "
                             f"{extra[:3]}{'...' if len(extra) > 3 else ''}; pick the --lora-targets it was trained "
                             "with")
    return lora
