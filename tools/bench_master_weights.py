"""bench_master_weights.py: memory and step time of full fine-tuning with a bf16 policy, pure bf16 vs fp32 masters.

    python tools/bench_master_weights.py                    # tiny FLUX on the CPU, 10 timed steps each
    python tools/bench_master_weights.py --device cuda --steps 20

For each way of keeping the trainable weights it builds the policy at --dtype bfloat16, generates one fragment
with a pure-bf16 copy (the rollout side), and times full training steps (Trainer.accumulate + Trainer.step,
AdamW) on it. It prints a table: bytes held by weights, gradients and AdamW state (summed over the tensors),
the peak device memory on CUDA, the median step time, the fraction of weights one step at --lr changed, and
the log-prob gap between the trainer's forward and the rollout's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import models  # noqa: E402
import rewards  # noqa: E402
import tsp  # noqa: E402
from fragment import fragment_spec  # noqa: E402
from rollout import SamplingConfig, generate_fragment  # noqa: E402
from trainer import TrainConfig, Trainer  # noqa: E402


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(fp32_master: bool, args) -> dict:
    path = models.tiny_pipeline_path("flux")
    rollout = models.load("flux", path, args.device, torch.bfloat16, height=args.resolution or None)
    models.enable_full_training(rollout)
    spec = fragment_spec(0, 0, 0, args.groups, 3, args.groups, args.group_size)
    fragment = generate_fragment(rollout, spec, rewards.color_prompts("train"), SamplingConfig(num_steps=args.num_steps),
                                 rewards.build_reward("color"), version=0, producer=0).to(args.device)
    del rollout
    policy = models.load("flux", path, args.device, torch.bfloat16, height=args.resolution or None)
    models.enable_full_training(policy, fp32_master=fp32_master)
    trainer = Trainer(policy, TrainConfig(lr=args.lr, noise_level=0.7))
    m, t_train = fragment.latents.shape[:2]
    packs = tsp.per_timestep_packs(m, t_train)
    masks = [[1.0] * len(p) for p in packs]
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, changed, state, gap_value = [], None, 0, 0.0
    for step in range(args.steps + 1):  # step 0 warms up (allocations, AdamW state) and is not timed
        before = [p.detach().clone() for p in trainer.params] if step == 0 else None
        trainer.version = fragment.policy_version  # train the same fragment, on-policy
        start = time.perf_counter()
        trainer.accumulate(fragment, packs, masks, m * t_train)
        if step == 0:
            state = nbytes(p.grad for p in trainer.params)
        metrics = trainer.step(["color"])
        if cuda:
            torch.cuda.synchronize()
        if step == 0:
            total = sum(p.numel() for p in trainer.params)
            changed = sum(int((b != p.detach()).sum()) for b, p in zip(before, trainer.params)) / total
            gap_value = metrics["logprob_gap"]
        else:
            times.append(time.perf_counter() - start)
    optimizer_bytes = nbytes(v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return {"weights": "fp32 masters" if fp32_master else "pure bf16", "param_MB": nbytes(trainer.params) / 2**20,
            "grad_MB": state / 2**20, "adam_MB": optimizer_bytes / 2**20,
            "peak_MB": torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan"),
            "step_ms": statistics.median(times) * 1e3, "changed": changed, "logprob_gap": gap_value}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode (after one warm-up step)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--resolution", type=int, default=0, help="0 = the tiny default (32 px)")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=6, help="T (T_train = int(0.99 T))")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(False, args), measure(True, args)]
    print(f"\nfull fine-tuning, tiny FLUX, bf16 policy on {args.device}, lr {args.lr}, "
          f"{args.groups}x{args.group_size} trajectories x T_train pairs per step\n")
    print(f"{'weights':<14}{'params MB':>10}{'grads MB':>10}{'AdamW MB':>10}{'peak MB':>9}{'step ms':>9}"
          f"{'changed by 1 step':>19}{'logprob gap':>13}")
    for r in rows:
        print(f"{r['weights']:<14}{r['param_MB']:>10.3f}{r['grad_MB']:>10.3f}{r['adam_MB']:>10.3f}{r['peak_MB']:>9.1f}"
              f"{r['step_ms']:>9.1f}{r['changed']:>18.1%} {r['logprob_gap']:>12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
