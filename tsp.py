"""TSP, time-step parallelism: a fragment's (sample, timestep) pairs, packed and spread evenly over trainers.

Paper: DigenRL, "time-step parallelism" (DESIGN.md section 5). A diffusion trajectory is trained at
T_train timesteps, and each (sample, timestep) pair is an independent forward+backward: the policy
loss of one SDE step depends only on x_t, x_t+1, sigma_t and the sample's advantage. So a fragment's
m * T_train pairs can be packed `pack` at a time into one forward with per-sample timesteps, and
split evenly over the K trainer ranks. Every trainer works on every fragment (the tail shrinks
K-fold) and every rank runs the same number of passes, which FSDP requires.

Invariant: the summed gradient equals the per-timestep loop's (allclose in float32): packing only
changes which pairs share a forward, never a pair's loss or weight. Padding pairs (when K * pack does
not divide m * T_train) repeat a real pair with weight 0, so they cost compute but add nothing.

Departures from the paper: pairs are dealt round-robin (rank r gets pairs r, r+K, ...) rather than
by contiguous timestep ranges, which balances high- and low-noise steps across ranks.

Try it: `python main.py --placement disaggregated --gap --tsp --tsp-pack 4`. Without `--tsp`, whole
fragments are dealt to trainers and trained with the per-timestep loop (`per_timestep_packs`).
Only torch is imported: this file can be copied into another codebase as it is.
"""
from __future__ import annotations

import math

import torch

Pair = tuple[int, int]  # (sample index in the fragment, trained-timestep slot)


def per_timestep_packs(num_samples: int, num_train_timesteps: int) -> list[list[Pair]]:
    """The naive reference: one forward per trained timestep over all samples of the fragment."""
    return [[(i, j) for i in range(num_samples)] for j in range(num_train_timesteps)]


def tsp_packs(num_samples: int, num_train_timesteps: int, rank: int, world: int, pack: int) -> tuple[list[list[Pair]], list[list[float]]]:
    """This rank's packs of pairs and their validity masks (1 real, 0 padding).

    Every rank gets ceil(n / world) pairs rounded up to a multiple of `pack`, so all ranks run
    exactly the same number of forward/backward passes of the same size.
    """
    if pack < 1:
        raise ValueError(f"--tsp-pack must be >= 1, got {pack}")
    pairs = [(i, j) for j in range(num_train_timesteps) for i in range(num_samples)]  # timestep-major
    per_rank = math.ceil(len(pairs) / world)
    per_rank = math.ceil(per_rank / pack) * pack
    mine = pairs[rank::world]
    mask = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine = mine + [pairs[0]] * (per_rank - len(mine))  # weight-0 padding: same shape, no contribution
    packs = [mine[s:s + pack] for s in range(0, per_rank, pack)]
    masks = [mask[s:s + pack] for s in range(0, per_rank, pack)]
    return packs, masks


def gather_pairs(fragment, pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """Stack the tensors of `pairs` of a fragment into one batch (per-sample timesteps)."""
    samples = torch.tensor([i for i, _ in pairs], dtype=torch.long)
    slots = torch.tensor([j for _, j in pairs], dtype=torch.long)
    dev = fragment.latents.device
    samples, slots = samples.to(dev), slots.to(dev)
    return {
        "latents": fragment.latents[samples, slots],  # [p, *latent]
        "next_latents": fragment.next_latents[samples, slots],  # [p, *latent]
        "sigma": fragment.sigmas[samples, slots],  # [p] mixed timesteps in one forward
        "sigma_next": fragment.sigmas_next[samples, slots],  # [p]
        "old_log_prob": fragment.log_probs[samples, slots],  # [p]
        "advantages": fragment.advantages[samples],  # [p]
        "cond": {k: v[samples] for k, v in fragment.cond.items()},  # [p, ...]
    }


def num_passes(num_samples: int, num_train_timesteps: int, world: int, pack: int) -> int:
    """Forward/backward passes each trainer runs per fragment under TSP (the same on every rank)."""
    return math.ceil(math.ceil(num_samples * num_train_timesteps / world) / pack)
