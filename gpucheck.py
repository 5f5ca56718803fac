"""GPU check: our rollout and training code paths vs the bare transformer, at FLUX.1-dev size, random weights.

    python gpucheck.py --size flux-12b            # or: python bench.py --device cuda --size flux-12b

Measures, at the same batch, (a) the bare FluxTransformer2DModel forward vs one denoising step of our
rollout loop (rollout.sample_trajectories: Policy.velocity + per-trajectory noise + grpo SDE step), and
(b) the bare LoRA-r32 forward+backward vs our trainer's pass (tsp.gather_pairs + Trainer.pair_loss +
backward) on a pack of the same size. Targets: overhead < 5 % (rollout) and < 10 % (training).
Writes profiles/gpu_check_<gpu>.json with provenance. Needs CUDA; diffusers and peft are imported lazily.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
import types

import torch

SIZES = {  # FluxTransformer2DModel configs
    "flux-12b": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                     axes_dims_rope=(16, 56, 56)),
    "flux-small": dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
                       num_attention_heads=8, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                       axes_dims_rope=(16, 56, 56)),
}


def timed(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="flux-12b", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6, help="denoising steps of the timed rollout loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="profiles")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpucheck needs a CUDA device (torch.cuda.is_available() is False)")
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    import models
    import tsp
    from gap import Fragment
    from rollout import SamplingConfig, sample_trajectories
    from trainer import TrainConfig, Trainer

    torch.backends.cuda.enable_cudnn_sdp(False)  # DESIGN.md section 7
    dev, dtype, b = torch.device("cuda"), torch.bfloat16, args.batch
    t0 = time.perf_counter()
    with torch.device(dev):
        transformer = FluxTransformer2DModel(**SIZES[args.size]).to(dtype)
    transformer.requires_grad_(False).eval()
    init_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in transformer.parameters())
    pipe = types.SimpleNamespace(  # only what FluxFamily uses: no text encoders or VAE at this size
        transformer=transformer, vae_scale_factor=8,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        _pack_latents=FluxPipeline._pack_latents, _prepare_latent_image_ids=FluxPipeline._prepare_latent_image_ids)
    family = models.get_family("flux")
    policy = models.Policy(family, pipe, dev, dtype, args.resolution, args.resolution, 1, args.text_len, 3.5)
    g = torch.Generator(device=dev).manual_seed(0)
    cond = {"prompt_embeds": torch.randn(b, args.text_len, 4096, device=dev, generator=g, dtype=dtype),
            "pooled_prompt_embeds": torch.randn(b, 768, device=dev, generator=g, dtype=dtype)}
    shape = policy.latent_shape()
    x = torch.randn(b, *shape, device=dev, generator=g, dtype=dtype)
    sigma = torch.full((b,), 0.7, device=dev)
    report = {"about": f"gpucheck.py on {torch.cuda.get_device_name()}, torch {torch.version.__version__}, "
                       f"{datetime.date.today().isoformat()}, random weights, bf16, batch {b}, {args.resolution} px "
                       f"({shape[0]} tokens), text {args.text_len}; medians of {args.repeats} after warm-up",
              "size": args.size, "params": n_params, "init_s": round(init_s, 1)}

    # (a) rollout: bare forward vs our denoising step
    with torch.no_grad():
        bare_fwd = timed(lambda: family.forward(pipe, transformer, x, sigma, cond, 3.5), args.repeats)
        sampling = SamplingConfig(num_steps=args.steps, noise_level=0.7)
        seeds = list(range(b))
        keep = [list(range(args.steps - 1))] * b
        ours = timed(lambda: sample_trajectories(policy, cond, seeds, seeds, sampling, keep), max(2, args.repeats // 2), 1)
    report["rollout_bare_forward_s"] = bare_fwd
    report["rollout_our_step_s"] = ours / args.steps
    report["rollout_overhead_pct"] = 100 * (ours / args.steps / bare_fwd - 1)

    # (b) training: bare LoRA fwd+bwd vs our pair loss + backward on a pack of b pairs
    models.add_lora(policy, 32, 32.0)
    params = [p for p in transformer.parameters() if p.requires_grad]

    def bare_train():
        out = family.forward(pipe, transformer, x, sigma, cond, 3.5)
        out.float().square().mean().backward()

    bare_fb = timed(bare_train, args.repeats)
    for p in params:
        p.grad = None
    _, (x_t, x_next, logp, t_idx, sigmas) = sample_trajectories(policy, cond, seeds, seeds, sampling, keep)
    fragment = Fragment(step=0, index=0, policy_version=0, producer=0, group_size=b,
                        prompt_ids=torch.arange(b), cond=cond, latents=x_t, next_latents=x_next, timestep_index=t_idx,
                        sigmas=sigmas[t_idx].to(dev), sigmas_next=sigmas[t_idx + 1].to(dev), log_probs=logp,
                        rewards=torch.zeros(b), reward_parts=torch.zeros(b, 1), advantages=torch.randn(b, device=dev))
    trainer = Trainer(policy, TrainConfig(noise_level=0.7, clip_range=1e-4))
    packs, _ = tsp.tsp_packs(b, len(keep[0]), 0, 1, b)
    weights = torch.full((b,), 1.0 / (b * len(keep[0])), device=dev)

    def our_train():
        batch = tsp.gather_pairs(fragment, packs[0])
        loss, _, _ = trainer.pair_loss(batch, weights, stale=False)
        loss.backward()

    ours_fb = timed(our_train, args.repeats)
    report["train_bare_fwd_bwd_s"] = bare_fb
    report["train_our_pass_s"] = ours_fb
    report["train_overhead_pct"] = 100 * (ours_fb / bare_fb - 1)
    report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    os.makedirs(args.out, exist_ok=True)
    name = torch.cuda.get_device_name().replace(" ", "_").lower()
    with open(os.path.join(args.out, f"gpu_check_{name}_{args.size}.json"), "w") as f:
        json.dump(report, f, indent=1)
    for k, v in report.items():
        print(f"{k:>26}: {v:.4f}" if isinstance(v, float) else f"{k:>26}: {v}")
    return report


if __name__ == "__main__":
    main()
