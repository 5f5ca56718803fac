"""GPU check: our rollout and training code paths vs the bare FLUX transformer at the same batch, random weights.

    python bench.py --device cuda --size flux-12b      # FLUX.1-dev size (11.9B) on a GPU; writes profiles/gpu_check_<gpu>.json
    python gpu_check.py --size tiny --device cpu       # the same measurement on a tiny config, anywhere

(a) one denoising step of rollout.sample_trajectories (Policy.velocity + grpo SDE step + per-trajectory
noise) vs the bare transformer forward; (b) Trainer.accumulate on one packed TSP pass (gather_pairs +
pair_loss + backward) vs a bare LoRA-r32 forward+backward. Targets: overhead < 5% (rollout), < 10% (training).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))


def gpu_sizes() -> dict:
    """FluxTransformer2DModel configs: FLUX.1-dev's size, and a tiny one to try the check on a CPU."""
    return {"flux-12b": dict(config=dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                                         joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64,
                                         guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
                         res=512, vae_scale=8, text_len=512),
            "tiny": dict(config=dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                     joint_attention_dim=32, pooled_projection_dim=32, in_channels=16, guidance_embeds=True,
                                     axes_dims_rope=(4, 6, 6)), res=32, vae_scale=2, text_len=16)}


def _timed(fn, reps: int, sync) -> float:
    """Median seconds of fn() over reps runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpu_check(size: str, device_name: str, out_dir: str) -> int:
    """(a) bare forward vs our rollout loop per denoising step, (b) bare LoRA fwd+bwd vs Trainer.accumulate, batch 4."""
    import torch
    if device_name == "cuda" and not torch.cuda.is_available():
        print(f"error: --device cuda was asked for but torch {torch.__version__} sees no CUDA device; run the GPU check "
              "on a machine with a GPU (or try it here with --size tiny --device cpu)", file=sys.stderr)
        return 2
    if size == "flux-12b" and device_name != "cuda":
        print("error: --size flux-12b needs --device cuda (a 12B transformer on a CPU would take hours)", file=sys.stderr)
        return 2
    # lazy: GPU machines may carry diffusers as a wheel
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    import models
    import rollout
    import tsp
    from fragment import Fragment
    from trainer import TrainConfig, Trainer
    spec, device, batch, t_steps = gpu_sizes()[size], torch.device(device_name), 4, 8
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # docs/DESIGN.md section 7: cuDNN SDPA backward crashed on H200
    start = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with device:  # weights are initialised on the device, in the run dtype
        transformer = FluxTransformer2DModel(**spec["config"]).eval()
    torch.set_default_dtype(torch.float32)
    init_s = time.perf_counter() - start

    class Pipe:  # what FluxFamily needs from a FluxPipeline: no text encoders, no VAE
        _pack_latents = staticmethod(FluxPipeline._pack_latents)
        _prepare_latent_image_ids = staticmethod(FluxPipeline._prepare_latent_image_ids)
    pipe = Pipe()
    pipe.transformer, pipe.vae_scale_factor = transformer.requires_grad_(False), spec["vae_scale"]
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                                     max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    policy = models.Policy(models.get_family("flux"), pipe, device, dtype, spec["res"], spec["res"], 1, spec["text_len"])
    cfg = spec["config"]
    cond = {"prompt_embeds": torch.randn(batch, spec["text_len"], cfg["joint_attention_dim"], device=device, dtype=dtype),
            "pooled_prompt_embeds": torch.randn(batch, cfg["pooled_projection_dim"], device=device, dtype=dtype)}
    x = torch.randn(batch, *policy.latent_shape(), device=device, dtype=dtype)  # [4, tokens, channels]
    sigma = torch.full((batch,), 0.7, device=device)
    side = int(round(x.shape[1] ** 0.5))
    kwargs = dict(hidden_states=x, timestep=sigma.to(dtype), guidance=torch.full((batch,), 3.5, device=device),
                  pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=cond["prompt_embeds"],
                  txt_ids=torch.zeros(spec["text_len"], 3, device=device, dtype=dtype),
                  img_ids=FluxPipeline._prepare_latent_image_ids(batch, side, side, device, dtype), return_dict=False)
    sampling = rollout.SamplingConfig(num_steps=t_steps, noise_level=0.7)
    t_train = rollout.num_train_timesteps(sampling)
    keep = [list(range(t_train))] * batch
    seeds = list(range(batch))
    ours = lambda: rollout.sample_trajectories(policy, cond, seeds, [100 + s for s in seeds], sampling, keep)  # noqa: E731
    out = {}
    with torch.no_grad():
        out["bare_forward_s"] = _timed(lambda: transformer(**kwargs), 5, sync)
    out["ours_rollout_step_s"] = _timed(ours, 2, sync) / t_steps
    models.add_lora(policy, 32, 64.0, "attention")  # attention projections; adapters in float32 (as training uses them)
    lora = [p for p in transformer.parameters() if p.requires_grad]
    out["ours_rollout_step_lora_fp32_s"] = _timed(ours, 2, sync) / t_steps

    def bare_train():
        transformer(**kwargs)[0].float().square().mean().backward()
    for p in lora:
        p.data = p.data.to(dtype)
    out["bare_lora_fwd_bwd_s"] = _timed(bare_train, 5, sync)
    for p in lora:
        p.data = p.data.float()
        p.grad = None
    out["bare_lora_fp32_fwd_bwd_s"] = _timed(bare_train, 5, sync)
    trainer = Trainer(policy, TrainConfig())
    _, (x_t, x_next, logp, t_idx, sigmas) = ours()
    fragment = Fragment(step=0, first_group=0, policy_version=0, producer=0, group_size=batch,
                        prompt_ids=torch.zeros(batch, dtype=torch.long), cond=cond, latents=x_t, next_latents=x_next,
                        timestep_index=t_idx, sigmas=sigmas[t_idx], sigmas_next=sigmas[t_idx + 1], log_probs=logp,
                        rewards=torch.randn(batch), reward_parts=torch.randn(batch, 1), advantages=torch.randn(batch))
    fragment = fragment.to(device)
    packs, masks = tsp.tsp_packs(batch, t_train, 0, 1, batch)  # packed pairs, per-sample timesteps, one pass = 4 pairs
    out["ours_train_pack_s"] = _timed(lambda: trainer.accumulate(fragment, packs[:1], masks[:1], batch * t_train), 5, sync)
    out["rollout_overhead"] = out["ours_rollout_step_s"] / out["bare_forward_s"] - 1
    out["rollout_overhead_with_lora_fp32"] = out["ours_rollout_step_lora_fp32_s"] / out["bare_forward_s"] - 1
    out["train_overhead"] = out["ours_train_pack_s"] / out["bare_lora_fwd_bwd_s"] - 1
    out["train_overhead_vs_fp32_lora"] = out["ours_train_pack_s"] / out["bare_lora_fp32_fwd_bwd_s"] - 1
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    import diffusers
    import peft
    result = {"about": f"bench.py --size {size} --device {device_name}: our rollout loop (rollout.sample_trajectories: "
                       "velocity + grpo.sde_step_with_logprob + per-trajectory CPU noise) per denoising step vs the bare "
                       "transformer forward, and Trainer.accumulate on one packed pass (tsp.gather_pairs + pair_loss + backward) "
                       "vs a bare LoRA r32 forward+backward; random weights and embeddings, batch 4; medians after warm-up.",
              "gpu": gpu, "torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "size": size, "dtype": str(dtype), "resolution": spec["res"],
              "tokens": x.shape[1], "text_len": spec["text_len"], "batch": batch, "sampling_steps": t_steps,
              "lora": "r32 alpha 64, attention targets (models.FluxFamily.lora_targets)", "init_s": init_s,
              "targets": {"rollout_overhead": "< 5%", "train_overhead": "< 10%"},
              "note": "rollout_overhead: no LoRA on either side. models.add_lora keeps the adapters in float32; the *_lora_fp32 "
                      "figures separate that choice from the loop's own overhead (train_overhead_vs_fp32_lora).", **out}
    name = "gpu_check_" + "".join(c if c.isalnum() else "_" for c in gpu.lower()).strip("_") + ".json"
    for folder in ([os.path.join(HERE, "profiles")] if size != "tiny" else []) + [out_dir]:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name), "w") as fh:
            json.dump(result, fh, indent=1)
    for key, value in out.items():
        print(f"{key:<34} {value * (100 if 'overhead' in key else 1e3):9.2f} {'%' if 'overhead' in key else 'ms'}")
    print(f"[bench] {gpu}: wrote {name} (init {init_s:.0f} s)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="flux-12b", choices=sorted(gpu_sizes()))
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--out", default=os.path.join("bench_runs", "gpu_check"), help="also write the JSON here")
    args = p.parse_args(argv)
    return gpu_check(args.size, args.device, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
