"""Peak memory per rank at real size, on a CPU, before any GPU: will this run fit on 80 GB or 141 GB GPUs?

    python tools/estimate_memory.py --model flux --nproc 8 --rollout-ranks 4                     # LoRA r64
    python tools/estimate_memory.py --model flux --nproc 8 --rollout-ranks 4 --fsdp --no-lora    # full fine-tuning
    python tools/estimate_memory.py --model wan --pretrained-config /models/Wan2.1-T2V-14B-Diffusers --fsdp --no-lora
    python tools/estimate_memory.py --table                  # the README's table: 4 families x {LoRA, FSDP} x {8, 16}

The real-size transformer of the family (FLUX.1-dev 11.9B, Qwen-Image 20.4B, Wan2.1-T2V-14B 14.3B, HunyuanVideo
12.8B, SD3.5-Medium 2.2B) is built from its diffusers config (written below as data, or read from --pretrained-config DIR's
transformer/config.json; no weights) under FakeTensorMode: tensors with shapes and dtypes but no storage. A fake
process group of the asked world size (torch.testing._internal.distributed.fake_pg) stands in for the ranks. Then
the project's own code runs, as torchtitan's scripts/estimate/estimation.py does for its models:
- rollout rank: models.Policy (bf16, LoRA adapters when on) and one denoising forward (Policy.velocity) of one
  forward batch (--sample-batch-size samples, the family's published one by default, at most a fragment of
  --fragment-groups x --group-size; true CFG doubles the batch), then the VAE decode of such a batch (the
  family's released VAE, built from its config) while the transformer stays loaded: the larger of the two;
- trainer rank: models.add_lora or models.enable_full_training (fp32 masters), infra.fsdp.shard_for_fsdp over the
  K = nproc - rollout_ranks trainers (with --fsdp), trainer.Trainer (its optimizer, its KL reference), then two
  training packs of --tsp-pack pairs: Trainer.pair_loss, backward, Trainer.all_reduce_gradients, gradient clip,
  the AdamW step (the second pack runs with the optimizer state the first created).
torch's own trackers (torch.distributed._tools.mem_tracker.MemTracker, fsdp2_mem_tracker.FSDPMemTracker) count
every tensor's bytes by category; their peak plus the components every rank also holds whole in bf16 (text
encoders, VAE: parameter counts below, counted from their configs on the meta device) is the rank's peak.
Not counted: the CUDA context and NCCL buffers (about 1-3 GiB), allocator fragmentation, and the reward model.
`fits` keeps RESERVE_GIB of headroom for them.

Departures: tensors are on the CPU under FakeTensorMode (a CPU-only torch cannot fake CUDA tensors), so an op
whose CPU and CUDA kernels keep different temporaries is counted as on CPU; attention is SDPA's fused kernel
on both (no [S, S] matrix). A fake tensor has no values, so the scalar bookkeeping of Trainer.step and
Trainer.accumulate (metrics as Python floats) is left out; the tensors they touch are the same.
Measured on 2 CPU cores: one full-size FLUX row takes about a minute (a forward of the 57 blocks is ~13 s of
fake dispatch); --table about 20 minutes. tests/test_memory.py runs it at reduced depth against hand arithmetic.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402
from fragment import Fragment  # noqa: E402
from infra.fsdp import shard_for_fsdp  # noqa: E402
from trainer import TrainConfig, Trainer  # noqa: E402
from tools.real_models import FAMILIES  # noqa: E402
from tools.rehearsal import tensors  # noqa: E402
from tsp import gather_pairs  # noqa: E402

GIB = 2**30
GPUS = {"80 GB": 81559 * 2**20, "141 GB": 143771 * 2**20}  # what nvidia-smi reports for H100 80GB, H200
RESERVE_GIB = 4.0  # CUDA context, NCCL, allocator fragmentation: not tracked

def transformer_config(model: str, pretrained_config: str | None, depth: float) -> dict:
    config = dict(FAMILIES[model]["config"])
    if pretrained_config:
        with open(os.path.join(pretrained_config, "transformer", "config.json")) as f:
            config = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    for key in FAMILIES[model]["blocks"]:  # --depth < 1: fewer blocks, the same code path (tests only)
        config[key] = max(1, round(config[key] * depth))
    return config


def _stub_pipe(model: str, transformer):
    """What the family code (models/<family>.py) reads of a pipeline, with text encoding faked to the real shapes."""
    from diffusers import FluxPipeline

    info = FAMILIES[model]

    def encode_prompt(prompt, device=None, max_sequence_length=512, **_):
        b, dim = len(prompt), info["text"]["dim"]
        length = info["text"].get("clip_tokens", 0) + max_sequence_length  # SD3: 77 CLIP tokens, then T5's
        embeds = torch.zeros(b, length, dim, dtype=torch.bfloat16)
        pooled = torch.zeros(b, info["text"].get("pooled", 1), dtype=torch.bfloat16)
        mask = torch.ones(b, max_sequence_length, dtype=torch.long)
        return {"flux": (embeds, pooled, None), "qwenimage": (embeds, mask), "wan": (embeds, None),
                "hunyuanvideo": (embeds, pooled, mask), "sd3": (embeds, None, pooled, None)}[model]

    return types.SimpleNamespace(
        transformer=transformer, encode_prompt=encode_prompt, tokenizer_max_length=1024,
        vae_scale_factor=info["vae_spatial"], vae_scale_factor_spatial=info["vae_spatial"],
        vae_scale_factor_temporal=4, scheduler=types.SimpleNamespace(config=types.SimpleNamespace(
            num_train_timesteps=1000)),
        _prepare_latent_image_ids=FluxPipeline._prepare_latent_image_ids, _pack_latents=FluxPipeline._pack_latents)


def build_policy(model: str, config: dict, args) -> models.Policy:
    """A models.Policy whose transformer is on the meta device (no memory), in bf16, as torchtitan builds its
    models; LoRA, fp32 masters and checkpointing are applied there, then `materialize` makes it fake."""
    import diffusers

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            transformer = getattr(diffusers, FAMILIES[model]["cls"])(**config).requires_grad_(False)
    finally:
        torch.set_default_dtype(torch.float32)
    return models.Policy(models.get_family(model), _stub_pipe(model, transformer), args.device, torch.bfloat16,
                         args.resolution, args.width, args.frames, max_sequence_length=args.text_len)


def add_lora_on_meta(policy, rank: int, targets: str = "flow_grpo", bf16_adapters: bool = False) -> None:
    with torch.device("meta"):  # peft creates the adapters on the default device
        models.add_lora(policy, rank, 2 * rank, targets)
    if bf16_adapters:  # not what digenrl trains (fp32 adapters): only to compare with bf16-adapter measurements
        for p in policy.transformer.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)


def materialize(module: torch.nn.Module, device: str = "cpu") -> None:
    """Meta parameters and buffers -> fake CPU tensors of the same shapes and dtypes (call inside FakeTensorMode;
    Module.to_empty would swap tensors, which fake ones refuse). Outside it (--measure) the same call allocates
    real tensors on `device`, filled with small values so that the forward stays finite."""
    done = {}
    for sub in module.modules():
        for table, wrap in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    fake = torch.empty(t.shape, dtype=t.dtype, device=device)
                    if not isinstance(fake, torch._subclasses.fake_tensor.FakeTensor):
                        fake.normal_(0.0, 0.02)
                    done[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) if wrap else fake
                table[name] = done[id(t)]


def _tracker(module=None, optimizer=None):
    """torch's MemTracker (FSDPMemTracker for an FSDP module) with two changes: after each op only the global
    peak is updated (torch also updates every active module's own peak: quadratic in modules x ops, 67 s instead
    of 2 s for a FLUX forward, and unused here), and gradients are hooked only on parameters that get one
    (register_hook refuses a frozen one: the LoRA base, a rollout model)."""
    import copy

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class PeakOnly:
        def mark_gradients(self, params) -> None:
            """Trainer.all_reduce_gradients replaces the gradients by views of one flat buffer: count it as such."""
            for q in params:
                if q.grad is not None and not hasattr(q.grad, "to_local"):
                    self._update_and_maybe_create_winfos(q.grad, _MemRefType.GRAD)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = copy.deepcopy(snap)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            for param in module.parameters():
                if install_grad_hooks and param.requires_grad and param not in self._param_to_grad_hook_handles:
                    def grad_hook(grad):
                        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(grad_hook),
                        param.register_post_accumulate_grad_hook(lambda p: grad_hook(p.grad)))
            return sizes

    if module is not None:
        return type("FSDPTracker", (PeakOnly, FSDPMemTracker), {})(module, optimizer)
    return type("Tracker", (PeakOnly, MemTracker), {})()


def _cond(policy, m: int) -> dict:
    return policy.encode_prompts([f"prompt {i}" for i in range(m)])


def forward_samples(args) -> int:
    """Trajectories per rollout forward: the sample batch size, within a fragment (0: the whole fragment)."""
    fragment = args.fragment_groups * args.group_size
    return min(args.sample_batch_size or fragment, fragment)


class _Decode(torch.nn.Module):
    """vae.decode as a module's forward (what MemTracker tracks)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, z):
        return self.vae.decode(z, return_dict=False)[0]


def decode_peak(model: str, args) -> dict:
    """The VAE decode of one forward batch on a rollout rank (rollout.decode_and_score: the family's decode, a
    batch at a time), bf16: the VAE's weights and the decoder's activations, tracked."""
    import diffusers

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    name, kwargs = FAMILIES[model]["vae"]
    torch.set_default_dtype(torch.bfloat16)
    try:  # on the meta device, outside FakeTensorMode: its init ops are not worth faking (seconds each)
        with unset_fake_temporarily(), torch.device("meta"):
            vae = getattr(diffusers, name)(**kwargs).requires_grad_(False)
    finally:
        torch.set_default_dtype(torch.float32)
    materialize(vae, args.device)
    f = FAMILIES[model]["vae_spatial"]
    h, w = args.resolution // f, args.width // f
    frames = 1 + (args.frames - 1) // 4 if model in ("wan", "hunyuanvideo") else None  # causal video VAEs
    channels = 16
    shape = (channels, h, w) if name == "AutoencoderKL" else (channels, frames or 1, h, w)
    z = torch.zeros(forward_samples(args), *shape, dtype=torch.bfloat16, device=args.device)
    decode = _Decode(vae)  # the video VAEs call their decoder once per latent frame: inside a module's forward,
    tracker = _tracker()   # MemTracker takes repeated calls (from the top level it refuses them)
    tracker.track_external(decode)
    with tracker, torch.no_grad(), _allocator_peak(args.device) as allocator:
        decode(z)
    return {"peak": tracker.get_tracker_snapshot("peak"), "allocator_peak": allocator.get("peak"),
            "vae_bytes": sum(p.numel() * p.element_size() for p in vae.parameters())}


def rollout_peak(model: str, config: dict, args) -> dict:
    """One denoising forward of a batch of --sample-batch-size trajectories on a rollout rank (bf16 weights, fp32
    LoRA adapters)."""
    policy = build_policy(model, config, args)
    if args.lora:
        add_lora_on_meta(policy, args.lora_rank, args.lora_targets, args.bf16_adapters)
    materialize(policy.transformer, args.device)
    m = forward_samples(args)
    x = torch.randn(m, *policy.latent_shape(), device=args.device)  # [m, ...] float32 latents, as the sampler keeps
    cond = {k: v.to(args.device) for k, v in _cond(policy, m).items()}
    tracker = _tracker()
    tracker.track_external(policy.transformer)
    with tracker, torch.no_grad(), _allocator_peak(args.device) as allocator:
        policy.velocity(x, torch.full((m,), 0.5, device=args.device), cond)
    return {"peak": tracker.get_tracker_snapshot("peak"), "samples": m, "allocator_peak": allocator.get("peak"),
            "params": sum(p.numel() for p in policy.transformer.parameters())}


@contextlib.contextmanager
def _allocator_peak(device: str):
    """The CUDA caching allocator's own peak over the block (what --measure compares the tracker with): bytes
    allocated at the peak, including what was already alive before it. Nothing on a CPU (the tracker counts)."""
    out = {}
    if not str(device).startswith("cuda"):
        yield out
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield out
    torch.cuda.synchronize(device)
    out["peak"] = torch.cuda.max_memory_allocated(device)


def _sde_step_stand_in(v, x, sigma, sigma_next, noise_level, prev_sample):
    """grpo.sde_step_with_logprob's shapes and autograd path (it branches on std == 0, a value a fake tensor has
    not): float32 tensors of the latents' size, a few of them, as there."""
    dt = (sigma_next - sigma).view(-1, *[1] * (x.ndim - 1))  # [p, 1, ...]
    mean = x + v * dt  # [p, *latent]
    std = torch.ones_like(dt) * noise_level
    logp = -(((prev_sample - mean) / std) ** 2).mean(dim=tuple(range(1, x.ndim)))  # [p]
    return prev_sample, logp, mean, std


def trainer_peak(model: str, config: dict, args, compute_group) -> dict:
    """Two training packs on a trainer rank through the project's Trainer (and shard_for_fsdp under --fsdp)."""
    policy = build_policy(model, config, args)
    n_params = sum(p.numel() for p in policy.transformer.parameters())
    if args.lora:
        add_lora_on_meta(policy, args.lora_rank, args.lora_targets, args.bf16_adapters)
    else:
        models.enable_full_training(policy, fp32_master=True)
    if args.grad_ckpt:
        policy.transformer.enable_gradient_checkpointing()
    materialize(policy.transformer, args.device)
    if args.fsdp:
        shard_for_fsdp(policy, compute_group, keep_reference=args.beta > 0 and not args.lora)
    trainer = Trainer(policy, TrainConfig(lr=1e-4, beta=args.beta, noise_level=0.7), compute_group=compute_group,
                      sharded=args.fsdp)
    trainer.step_fn = _sde_step_stand_in
    p = args.tsp_pack
    shape = policy.latent_shape()
    cond = {k: v.to(args.device) for k, v in _cond(policy, p).items()}
    def randn(*size):
        return torch.randn(*size, device=args.device)
    fragment = Fragment(step=0, first_group=0, policy_version=0, producer=0, group_size=p,
                        prompt_ids=torch.arange(p), cond=cond, latents=randn(p, 1, *shape),
                        next_latents=randn(p, 1, *shape), timestep_index=torch.zeros(p, 1, dtype=torch.long),
                        sigmas=torch.full((p, 1), 0.5), sigmas_next=torch.full((p, 1), 0.4),
                        log_probs=torch.zeros(p, 1), rewards=torch.zeros(p), reward_parts=torch.zeros(p, 1),
                        advantages=randn(p))
    batch = gather_pairs(fragment, [(i, 0) for i in range(p)])
    weights = torch.full((p,), 1.0 / p, device=args.device)
    tracker = _tracker(policy.transformer, trainer.optimizer) if args.fsdp else _tracker()
    if not args.fsdp:
        tracker.track_external(policy.transformer, trainer.optimizer)
    after_step = None
    with tracker, _allocator_peak(args.device) as allocator:
        for _ in range(2):  # the second pack runs with the AdamW state the first step created
            loss, _, _ = trainer.pair_loss(batch, weights, recorded=False)
            loss.backward()
            del loss
            trainer.all_reduce_gradients()
            tracker.mark_gradients(trainer.params)
            torch.nn.utils.clip_grad_norm_(trainer.params, 1.0)
            trainer.optimizer.step()
            after_step = tracker.get_tracker_snapshot()  # weights, gradients and AdamW state all alive
            trainer.optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()  # per-module stats only (FSDPMemTracker needs it between iterations)
    trainable = sum(q.numel() for q in trainer.params)  # global sizes (DTensors report the whole)
    # the KL reference (full fine-tuning, --beta > 0) exists before the tracker starts and is none of its
    # module's: its bytes held on this rank (its shards under FSDP) are added by hand from its tensors
    reference = policy.reference_transformer
    held = sum(t.numel() * t.element_size() for t in ((q.to_local() if hasattr(q, "to_local") else q)
                                                     for q in reference.parameters())) if reference else 0
    return {"peak": tracker.get_tracker_snapshot("peak"), "after_step": after_step, "params": n_params,
            "allocator_peak": allocator.get("peak"),
            "trainable": trainable, "reference_bytes": held}


def hand_bytes(n_params: int, n_trainable: int, lora: bool, fsdp: bool, trainers: int, beta: float = 0.0) -> float:
    """Weights + gradients + AdamW state of one trainer, by hand: LoRA keeps the bf16 base whole (2 B) and fp32
    adapters (4 weight + 4 gradient + 8 AdamW); full fine-tuning fp32 masters, gradients and AdamW (16 B), plus a
    bf16 KL reference (2 B) with --beta > 0, all / K under FSDP."""
    if lora:
        return 2 * n_params + 16 * n_trainable
    return (16 + 2 * (beta > 0)) * n_params / (trainers if fsdp else 1)


def _total(snapshot: dict) -> int:
    return sum(v["Total"] for v in snapshot.values())


def _part(snapshot: dict, *names) -> int:
    return sum(v for device in snapshot.values() for k, v in device.items() if str(k).rsplit(".", 1)[-1] in names)


def _init_world(args, backend: str, store):
    """One process stands in for rank `rollout_ranks` of `nproc`; the compute group is the K trainers."""
    import torch.distributed as dist

    if dist.is_initialized():  # a previous row of --table: another world size
        dist.destroy_process_group()
    fake = backend == "fake"
    rank, world = (args.rollout_ranks, args.nproc) if fake else (0, 1)
    dist.init_process_group(backend, rank=rank, world_size=world, store=store)
    compute = dist.new_group(list(range(args.rollout_ranks, args.nproc)) if fake else [0])
    if args.fsdp:  # outside FakeTensorMode, as torchtitan's estimation.py builds its mesh
        from torch.distributed.device_mesh import DeviceMesh
        compute = DeviceMesh.from_group(compute, "cpu" if fake else args.device.split(":")[0])
    return compute


def _both_roles(args, compute) -> tuple:
    config = transformer_config(args.model, args.pretrained_config, args.depth)
    rollout = rollout_peak(args.model, config, args)
    rollout["decode"] = decode_peak(args.model, args) if args.decode else None
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the rollout policy is gone: the trainer's peak starts from nothing
    train = trainer_peak(args.model, config, args, compute)
    ckpt = trainer_peak(args.model, config, argparse.Namespace(**{**vars(args), "grad_ckpt": True}), compute) \
        if args.ckpt_too and not args.grad_ckpt else None
    return rollout, train, ckpt


def estimate(args) -> dict:
    """Both roles of one configuration: GiB by role and whether each fits."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    args = argparse.Namespace(**{**vars(args), "device": "cpu"})
    trainers = args.nproc - args.rollout_ranks
    compute = _init_world(args, "fake", FakeStore())
    others = sum(FAMILIES[args.model]["others"].values()) * 2  # bf16, whole on every rank
    # allow_non_fake_inputs: the policy's empty-prompt encoding is a real tensor
    with FakeTensorMode(allow_non_fake_inputs=True), tensors.sharding_propagation_apart():
        rollout, train, ckpt = _both_roles(args, compute)
    states = _part(train["after_step"], "PARAM", "GRAD", "OPT", "SHARDED_PARAM", "SHARDED_GRAD") \
        + train["reference_bytes"]
    hand = hand_bytes(train["params"], train["trainable"] if args.lora else train["params"], args.lora,
                      args.fsdp, trainers, args.beta)
    forward = _total(rollout["peak"]) + others
    decode = rollout["decode"]
    if decode is not None:  # the transformer stays loaded while its batch is decoded (the VAE is in `others`)
        weights = _part(rollout["peak"], "PARAM", "BUFFER")
        decode_total = weights + others - decode["vae_bytes"] + _total(decode["peak"])
    out = {"model": args.model, "nproc": args.nproc, "trainers": trainers, "lora": args.lora, "fsdp": args.fsdp,
           "lora_rank": args.lora_rank, "resolution": args.resolution, "width": args.width, "frames": args.frames,
           "group_size": args.group_size, "tsp_pack": args.tsp_pack,
           "params_b": train["params"] / 1e9, "fragment_samples": args.fragment_groups * args.group_size,
           "forward_samples": rollout["samples"],
           "rollout_forward_gib": forward / GIB,
           "rollout_decode_gib": None if decode is None else decode_total / GIB,
           "rollout_gib": max(forward, decode_total if decode is not None else 0) / GIB,
           "trainer_gib": (_total(train["peak"]) + train["reference_bytes"] + others) / GIB, "others_gib": others / GIB,
           "trainer_states_gib": states / GIB, "hand_states_gib": hand / GIB,
           "rollout_peak_by_kind_gib": _kinds(rollout["peak"]), "trainer_peak_by_kind_gib": _kinds(train["peak"]),
           "trainer_after_step_by_kind_gib": _kinds(train["after_step"]), "grad_ckpt": args.grad_ckpt}
    if ckpt is not None:
        out["trainer_ckpt_gib"] = (_total(ckpt["peak"]) + ckpt["reference_bytes"] + others) / GIB
    for gpu, capacity in GPUS.items():
        trainer = min(out["trainer_gib"], out.get("trainer_ckpt_gib", out["trainer_gib"]))
        out[f"fits_{gpu}"] = max(out["rollout_gib"], trainer) + RESERVE_GIB <= capacity / GIB
    return out


def measure(args) -> dict:
    """The same two roles with real tensors on `args.measure` (one process: K = 1 trainer, a real one-rank
    group, gloo on a CPU, nccl on a GPU), to check the estimate against memory actually allocated: the tracker's
    peak (counted the same way as under fake tensors) and, on CUDA, the caching allocator's own peak. The text
    encoders and VAE are not built here either (the estimate adds them by hand); neither is the KL reference."""
    import tempfile

    import torch.distributed as dist

    args = argparse.Namespace(**{**vars(args), "device": args.measure, "nproc": 2, "rollout_ranks": 1,
                                 "ckpt_too": False})
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    store = dist.FileStore(tempfile.mktemp(prefix="estimate_memory_store_"), 1)
    compute = _init_world(args, "nccl" if args.device.startswith("cuda") else "gloo", store)
    rollout, train, _ = _both_roles(args, compute)
    out = {"device": args.device, "rollout_tracked_gib": _total(rollout["peak"]) / GIB,
           "trainer_tracked_gib": (_total(train["peak"]) + train["reference_bytes"]) / GIB}
    for role, r in (("rollout", rollout), ("trainer", train)):
        if r["allocator_peak"] is not None:
            out[f"{role}_allocator_gib"] = r["allocator_peak"] / GIB
    dist.destroy_process_group()
    return out


def _kinds(snapshot: dict) -> dict:
    kinds = {}
    for device in snapshot.values():
        for k, v in device.items():
            name = str(k).rsplit(".", 1)[-1]
            if name != "Total" and v:
                kinds[name] = round(kinds.get(name, 0.0) + v / GIB, 2)
    return kinds


def _row(r: dict) -> str:
    lora = f"LoRA r{r.get('lora_rank', 64)}"
    mode = (lora if r["lora"] else "full, FSDP" if r["fsdp"] else "full") + (", ckpt" if r["grad_ckpt"] else "")
    fits = " / ".join("yes" if r[f"fits_{g}"] else "no" for g in GPUS)
    ckpt = f"{r['trainer_ckpt_gib']:.1f}" if "trainer_ckpt_gib" in r else "-"
    return (f"| {r['model']} ({r['params_b']:.1f}B) | {mode} | {r['nproc']} (K={r['trainers']}) | "
            f"{r['rollout_gib']:.1f} | {r['trainer_gib']:.1f} | {ckpt} | {r['trainer_states_gib']:.1f} "
            f"({r['hand_states_gib']:.1f}) | {fits} |")


HEADER = ("| model | training | ranks | rollout rank GiB | trainer rank GiB | with --grad-ckpt | trainer "
          "weights+grads+AdamW GiB (by hand) | fits 80 GB / 141 GB |\n|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="flux", choices=sorted(FAMILIES))
    p.add_argument("--pretrained-config", default=None, help="a diffusers pipeline folder (configs suffice)")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--rollout-ranks", type=int, default=None, help="default: half the ranks")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--lora", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--lora-targets", default="flow_grpo", help="as main.py --lora-targets")
    p.add_argument("--bf16-adapters", action="store_true", help="LoRA adapters in bf16 (digenrl trains fp32 ones): "
                   "to compare with tools/profiles/h200_flux1dev_12b.json, measured with bf16 adapters")
    p.add_argument("--resolution", type=int, default=0, help="0 = the family's native size (flowgrpo/presets.py)")
    p.add_argument("--width", type=int, default=0)
    p.add_argument("--frames", type=int, default=0, help="0 = the published setting (flowgrpo/presets.py)")
    p.add_argument("--group-size", type=int, default=0, help="0 = the published setting (flowgrpo/presets.py)")
    p.add_argument("--fragment-groups", type=int, default=1)
    p.add_argument("--sample-batch-size", type=int, default=0,
                   help="trajectories per rollout forward and decode (main.py's); 0 = the published setting "
                        "(flowgrpo/presets.py), at most the fragment")
    p.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                   help="count the VAE decode of a forward batch on the rollout rank")
    p.add_argument("--tsp-pack", type=int, default=4)
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--ckpt-too", action="store_true", help="also measure the trainer with --grad-ckpt (--table does)")
    p.add_argument("--depth", type=float, default=1.0, help="share of the blocks built (tests only; 1 = real size)")
    p.add_argument("--table", action="store_true", help="the README table: 4 families x {LoRA, FSDP} x {8, 16}")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--measure", default=None, metavar="DEVICE",
                   help="also run both roles with real tensors on DEVICE (cuda, cuda:1, cpu) at K = 1 and print the "
                        "measured peaks beside the estimate (one trainer: use --depth < 1 for a model that fits)")
    p.add_argument("--no-estimate", action="store_true", help="with --measure: skip the fake-tensor estimate")
    args = p.parse_args(argv)
    if args.measure:
        return _measure_main(args)
    runs = []
    if args.table:
        for model in FAMILIES:
            for lora in (True, False):
                for nproc in (8, 16):
                    runs.append(argparse.Namespace(**{**vars(args), "model": model, "lora": lora, "fsdp": not lora,
                                                      "nproc": nproc, "rollout_ranks": nproc // 2,
                                                      "ckpt_too": True}))
    else:
        runs.append(args)
    print(HEADER, flush=True)
    rows = []
    for run in runs:
        resolve_sizes(run)
        rows.append(estimate(run))
        print(_row(rows[-1]), flush=True)
    if not args.table:
        r = rows[0]
        decode = "" if r["rollout_decode_gib"] is None else (
            f"; their VAE decode with the transformer loaded {r['rollout_decode_gib']:.1f} GiB")
        print(f"rollout rank: one denoising forward of {r['forward_samples']} samples (a fragment holds "
              f"{r['fragment_samples']}) {r['rollout_forward_gib']:.1f} GiB{decode}; tracked forward peak by kind "
              f"(GiB) {r['rollout_peak_by_kind_gib']} + {r['others_gib']:.1f} GiB of text encoders and VAE\n"
              f"trainer rank: two packs of {args.tsp_pack} pairs; tracked peak by kind (GiB) "
              f"{r['trainer_peak_by_kind_gib']} + {r['others_gib']:.1f} GiB of text encoders and VAE\n"
              f"trainer after an optimizer step, by kind (GiB): {r['trainer_after_step_by_kind_gib']}\n"
              f"trainer weights + gradients + AdamW: {r['trainer_states_gib']:.2f} GiB tracked, "
              f"{r['hand_states_gib']:.2f} GiB by hand (reserve {RESERVE_GIB:g} GiB for what is not tracked)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _measure_main(args) -> int:
    """--measure: the estimate at K = 1 (unless --no-estimate) and the measurement, side by side, in GiB (the
    estimate's columns without the text encoders and VAE, which neither side builds)."""
    import time

    resolve_sizes(args)
    args.nproc, args.rollout_ranks = 2, 1
    args.decode = False  # the forward and the training packs are what --measure compares
    rows = {}
    if not args.no_estimate:
        start = time.perf_counter()
        r = estimate(args)
        rows["estimate (fake tensors)"] = (r["rollout_gib"] - r["others_gib"], r["trainer_gib"] - r["others_gib"],
                                           time.perf_counter() - start)
    start = time.perf_counter()
    m = measure(args)
    seconds = time.perf_counter() - start
    rows[f"tracked, real tensors on {m['device']}"] = (m["rollout_tracked_gib"], m["trainer_tracked_gib"], seconds)
    if "trainer_allocator_gib" in m:
        rows[f"CUDA allocator peak on {m['device']}"] = (m["rollout_allocator_gib"], m["trainer_allocator_gib"],
                                                         seconds)
    print(f"{args.model} depth {args.depth:g}, {'LoRA r%d' % args.lora_rank if args.lora else 'full'}"
          f"{', FSDP' if args.fsdp else ''}, K = 1, {args.resolution}x{args.width}, fragment "
          f"{args.fragment_groups}x{args.group_size}, pack {args.tsp_pack}{', grad-ckpt' if args.grad_ckpt else ''}")
    print("| source | rollout rank GiB | trainer rank GiB | seconds |\n|---|---|---|---|")
    for name, (rollout, trainer, seconds) in rows.items():
        print(f"| {name} | {rollout:.3f} | {trainer:.3f} | {seconds:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: dict(zip(("rollout_gib", "trainer_gib", "seconds"), v)) for name, v in rows.items()},
                      f, indent=1)
    return 0


def resolve_sizes(run) -> None:
    """Unset sizes take the family's native resolution and published frames / group size (flowgrpo/presets.py)."""
    from flowgrpo import presets

    values = presets.for_run(run.model, True, "flow_grpo").values
    if not run.resolution and not run.width:
        run.resolution, run.width = values["resolution"].value, values["width"].value
    run.width = run.width or run.resolution
    run.frames = run.frames or (values["frames"].value if "frames" in values else 1)
    run.group_size = run.group_size or values["group_size"].value
    run.sample_batch_size = run.sample_batch_size or values["sample_batch_size"].value
    run.rollout_ranks = run.rollout_ranks if run.rollout_ranks is not None else run.nproc // 2


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
