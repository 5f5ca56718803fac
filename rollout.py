"""Rollout: generate one fragment (whole groups) -> SDE sampling, behaviour log-probs, decode, reward, advantages;
and the rollout rank's loop.

`generate_fragment` is the one generation path, used by rollout ranks, by colocated ranks and by an
idle trainer under TAG, so every producer makes the same trajectories from the same FragmentSpec.
`run_rollout_rank` is the rollout rank in the disaggregated placement (docs/DESIGN.md section 4): per
step, wait for the step's weights, then claim, generate and stream fragments (GAP, gap.produce), and
with TCSS generate ahead into the next step (async_policy.generate_ahead). Fragments leave through a
background sender thread, so the next generation starts at once.
"""
from __future__ import annotations

import dataclasses
import queue as queue_lib
import threading
import time
from collections.abc import Callable

import torch

import async_policy
import gap
import grpo
from gap import Fragment, FragmentSpec


@dataclasses.dataclass
class SamplingConfig:
    num_steps: int = 6  # T
    noise_level: float = 0.7  # Flow-GRPO's a (or DanceGRPO's eta)
    timestep_fraction: float = 0.99  # trained share of the T steps: see num_train_timesteps
    algo: str = "flow_grpo"  # or "dance_grpo"
    adv_clip: float = 5.0


def step_fn(algo: str):
    return grpo.dance_sde_step_with_logprob if algo == "dance_grpo" else grpo.sde_step_with_logprob


def num_train_timesteps(cfg: SamplingConfig) -> int:
    """T_train, by each reference's own formula; a fraction that gives 0 steps is a ValueError.

    Flow-GRPO (scripts/train_flux.py): int(T * timestep_fraction); its configs use 0.99, i.e. all but
    the last step. DanceGRPO (train_grpo_flux.py): int((T - 1) * timestep_fraction), since it never
    trains the last step.
    """
    trainable = cfg.num_steps - 1 if cfg.algo == "dance_grpo" else cfg.num_steps
    t_train = int(trainable * cfg.timestep_fraction)
    if t_train < 1:
        raise ValueError(f"--timestep-fraction {cfg.timestep_fraction} with --num-steps {cfg.num_steps} trains no step "
                         f"({cfg.algo}: int({trainable} * {cfg.timestep_fraction}) = 0); raise either")
    return t_train


def train_slots(cfg: SamplingConfig, noise_seed: int) -> list[int]:
    """Which sampling steps of one trajectory are trained (sorted; step 0 is the first, pure-noise step)."""
    t_train = num_train_timesteps(cfg)
    if cfg.algo == "dance_grpo":  # a random per-sample subset of steps 0..T-2, reproducible from the seed
        gen = torch.Generator().manual_seed(noise_seed + 7)
        return sorted(torch.randperm(cfg.num_steps - 1, generator=gen)[:t_train].tolist())
    return list(range(t_train))  # Flow-GRPO: the first T_train (high-noise) steps, 0..T_train-1


@torch.no_grad()
def sample_trajectories(policy, cond, init_seeds, noise_seeds, cfg: SamplingConfig, keep: list[list[int]] | None = None,
                        transformer=None):
    """SDE sampling of len(seeds) trajectories in one batch.

    Returns final latents [m, ...] and, for each trajectory's `keep` slots, (x_t, x_t+1, logp_t)
    stacked as [m, T_train, ...]. Noise comes from per-trajectory CPU generators, so a trajectory is
    the same in any batch and on any rank.
    """
    m = len(init_seeds)
    x = torch.stack([policy.noise(torch.Generator().manual_seed(s)) for s in init_seeds]).to(policy.device)  # [m, ...]
    generators = [torch.Generator().manual_seed(s) for s in noise_seeds]
    sigmas = policy.sigmas(cfg.num_steps).to(policy.device)  # [T + 1]
    step = step_fn(cfg.algo)
    kept_x, kept_next, kept_logp = {}, {}, {}
    wanted = set(t for slots in (keep or []) for t in slots)
    for t in range(cfg.num_steps):
        sigma = sigmas[t].expand(m)  # [m]
        v = policy.velocity(x, sigma, cond, transformer)  # [m, ...] float32
        noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in generators]).to(x.device)  # [m, ...]
        x_next, logp, _, _ = step(v, x, sigma, sigmas[t + 1].expand(m), cfg.noise_level, noise=noise)
        if t in wanted:
            kept_x[t], kept_next[t], kept_logp[t] = x, x_next, logp
        x = x_next
    if keep is None:
        return x, None
    rows = range(m)
    stack = lambda store: torch.stack([torch.stack([store[t][i] for t in keep[i]]) for i in rows])  # noqa: E731
    timestep_index = torch.tensor(keep, dtype=torch.long)  # [m, T_train]
    return x, (stack(kept_x), stack(kept_next), stack(kept_logp), timestep_index, sigmas.cpu())


def generate_fragment(policy, spec: FragmentSpec, prompts: list[str], cfg: SamplingConfig, reward_fn,
                      version: int, producer: int, transformer=None) -> Fragment:
    """Generate, score and package one fragment of whole groups (see module docstring)."""
    prompt_text = [prompts[i] for i in spec.prompt_ids]
    cond = policy.encode_prompts(prompt_text)  # [m, ...]
    keep = [train_slots(cfg, s) for s in spec.noise_seeds]
    final, (x_t, x_next, logp, t_idx, sigmas) = sample_trajectories(
        policy, cond, spec.init_seeds, spec.noise_seeds, cfg, keep, transformer)
    images = policy.decode(final)  # [m, 3, H, W] (video [m, F, 3, H, W]) in [0, 1]
    scores = reward_fn(images, prompt_text, prompt_ids=spec.prompt_ids)  # name -> [m]; metadata looked up by prompt id
    total = scores["total"].to(torch.float32)
    parts = torch.stack([scores[k].to(torch.float32) for k in scores if k != "total"], dim=1)  # [m, n_rewards]
    advantages = grpo.group_advantages(total, spec.group_size, clip=cfg.adv_clip)  # [m]
    cpu = lambda t: t.detach().to("cpu")  # noqa: E731  (fragments travel and wait on the host)
    return Fragment(
        step=spec.step, first_group=spec.first_group, policy_version=version, producer=producer,
        group_size=spec.group_size,
        prompt_ids=torch.tensor(spec.prompt_ids, dtype=torch.long),
        cond={k: cpu(v) for k, v in cond.items()},
        latents=cpu(x_t), next_latents=cpu(x_next), timestep_index=t_idx,
        sigmas=sigmas[t_idx], sigmas_next=sigmas[t_idx + 1], log_probs=cpu(logp),
        rewards=cpu(total), reward_parts=cpu(parts), advantages=cpu(advantages))


# Evaluation seeds sit far above the training ones (gap.fragment_spec numbers them from (seed, step, index) upwards
# from 0), so evaluation never replays a trajectory the policy was trained on.
EVAL_SEED = 2**62


@torch.no_grad()
def evaluate(policy, prompts: list[str], cfg: SamplingConfig, reward_fn, seed: int = EVAL_SEED,
             seeds_per_prompt: int = 1, metadata: list[dict] | None = None):
    """Deterministic evaluation (noise level 0): every prompt from the same `seeds_per_prompt` initial noises
    (seed, seed + 1, ...). Returns (reward dict of [P S] tensors, images [P S, ...]), prompt-major. `metadata`:
    one dict per prompt (its dataset row), passed to the reward.

    Sharing the noises across prompts makes the comparison paired: a model that ignores the prompt draws the
    same image for every colour word, and the colour reward of one image summed over red, green and blue is
    exactly 0, so such a model scores 0 on the colour task up to the mean over seeds, not just on average."""
    det = dataclasses.replace(cfg, noise_level=0.0)
    seeds = [seed + j for _ in prompts for j in range(seeds_per_prompt)]
    texts = [p for p in prompts for _ in range(seeds_per_prompt)]
    cond = policy.encode_prompts(texts)
    final, _ = sample_trajectories(policy, cond, seeds, seeds, det)
    images = policy.decode(final)
    if metadata is None:
        return reward_fn(images, texts), images
    return reward_fn(images, texts, [m for m in metadata for _ in range(seeds_per_prompt)]), images


# --- the rollout rank ------------------------------------------------------------------------------
class Sender:
    """A background thread that sends finished fragments (gloo, CPU tensors, a group no other thread uses
    meanwhile), so generation of the next one starts at once."""

    def __init__(self, group, tracer):
        self.group, self.tracer, self.items, self.error = group, tracer, queue_lib.Queue(), None
        self.thread = threading.Thread(target=self._run, name="fragment-sender", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            while (item := self.items.get()) is not None:
                fragment, dst = item
                with self.tracer.span("send", step=fragment.step, first_group=fragment.first_group):
                    gap.send_fragment(fragment, dst, group=self.group)
        except BaseException as exc:  # noqa: BLE001  (re-raised on the main thread)
            self.error = exc

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"fragment sender failed: {self.error}") from self.error

    def put(self, fragment: Fragment, dst: int) -> None:
        self.raise_if_failed()
        self.items.put((fragment, dst))

    def close(self) -> None:
        """Send what is queued, then stop. No deadline: each send completes when its trainer receives it,
        and a dead trainer ends the job through liveness."""
        self.items.put(None)
        self.thread.join()
        self.raise_if_failed()


def run_rollout_rank(*, rank: int, steps: range, queue: gap.FragmentQueue, fragment_groups: int,
                     generate: Callable[[int, int, int, int, int], Fragment], mailbox: async_policy.Mailbox,
                     params: list[torch.Tensor], sender: Sender, destination_of: Callable[[int], int], tracer,
                     report_generation_s: Callable[[float, int], None],
                     stale_budget: async_policy.StaleBudget | None = None) -> None:
    """The rollout rank: batch k with weights version k, streamed fragment by fragment (GAP); with a
    stale budget (TCSS), fragments of batch k + 1 with version k while version k + 1 is on its way."""

    def produce(step: int, claimed: tuple[int, int], ahead: bool) -> None:
        version = mailbox.held_version
        async_policy.check_staleness(step, version, async_on=ahead)  # on-policy unless generated ahead
        start = time.perf_counter()
        fragment = generate(step, claimed[0], claimed[1], version, rank)
        report_generation_s(time.perf_counter() - start, claimed[1])  # for TAG's predictor
        _, dst = queue.announce(step, fragment.first_group, fragment.num_groups, rank, destination_of)
        sender.put(fragment, dst)

    for step in steps:
        with tracer.span("wait", step=step, what="weights"):  # a failed send means the weights never come: raise
            mailbox.wait_for(step, also_check=sender.raise_if_failed)
        for claimed in gap.claims(queue, step, fragment_groups, before_each=lambda: mailbox.swap_into(params)):
            produce(step, claimed, False)  # new weights are swapped in only between fragments
        if stale_budget is not None:  # TCSS: batch `step` is fully claimed
            async_policy.generate_ahead(step, steps.stop - 1, mailbox.latest_version, stale_budget.take,
                                        claim=lambda s: queue.claim(s, fragment_groups),
                                        produce=lambda s, c: produce(s, c, True))
    sender.close()
    mailbox.join()
