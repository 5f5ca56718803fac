"""The trainer side's bookkeeping around the mechanisms: resume, the optimizer step with the agreed stop, and the
end of a step (log, evaluate, checkpoint, forget old store keys, the progress bar).

    books = Bookkeeping(cfg, steps, trainer, policy, source, sampling, score, reward_names, tracer, job, leader)
    metrics = books.optimizer_step(step)   # main.TrainerRank: the step's last update
    books.end_step(step, metrics)          # log, evaluate, checkpoint
    books.forgetting(queue.forget_old, assistant.forget)   # per-step state the mechanisms drop

The leader writes the run directory (infra/rundir.py); every trainer evaluates its share of the evaluation
(gathered over the trainers' data group), and under FSDP gathering a checkpoint is a collective, so every trainer
takes part in it.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable

from infra import checkpoint_file, checkpoint_state, rundir
from infra.evaluation import Evaluator
from infra.preemption import Preempted


def resume(trainer, cfg, progress) -> None:
    """Weights, optimizer state, version and RNG of --resume RUN's last checkpoint (rollout ranks take the
    weights from the leader's first publish). A named phase with a unit of progress per tensor read: under
    FSDP re-sharding is a collective (a resumed run's first)."""
    with progress.inside("resume"):
        state = rundir.load_state(rundir.check_resume(cfg.resume, cfg))  # tensors and plain data only
        checkpoint_state.load(trainer, state)  # re-shards under FSDP
        trainer.version = state["step"]
        rundir.set_rng_state(state["rng"])


class Bookkeeping:
    def __init__(self, cfg, steps: range, trainer, policy, source, sampling, score, reward_names: list[str],
                 tracer, job, leader: bool):
        self.cfg, self.steps, self.trainer, self.policy, self.tracer = cfg, steps, trainer, policy, tracer
        self.reward_names, self.job, self.leader = reward_names, job, leader
        self.run_dir = rundir.open_run_dir(cfg, steps) if leader else None
        self.bar = _progress_bar(cfg, steps) if leader and cfg.progress else None
        # --eval-split train+test: training prompts on held-out noises, then held-out prompts; test: held-out only
        n_eval = 0 if cfg.eval_split == "test" else cfg.eval_prompts or len(source.train)
        eval_sampling = dataclasses.replace(sampling, num_steps=cfg.eval_num_steps or sampling.num_steps,
                                            batch_size=cfg.eval_batch_size)
        group = trainer.data_group if trainer is not None else None
        self.evaluator = Evaluator(source.train[:n_eval], source.eval, eval_sampling, score, cfg.eval_seeds,
                                   self.run_dir.path if leader else None, metadata=source.train_metadata[:n_eval],
                                   heldout_metadata=source.eval_metadata,
                                   on_images=self._log_eval_media if leader else None, guidance=cfg.eval_guidance,
                                   share=_place(group), gather=self._gather if _place(group)[1] > 1 else None,
                                   lockstep=cfg.fsdp)
        self.evaluates = bool(cfg.eval_every)  # every trainer evaluates its share
        self.initial_eval: dict = {}  # the starting policy: logged in the first row as eval_reward_initial, ...
        self.forget: list[Callable[[int], None]] = []
        self.stop_agreed = False  # the trainers agreed at this step's optimizer step to stop after it
        self.last = self.start = time.perf_counter()

    def _gather(self, mine) -> list:
        """Every evaluating rank's (start, rewards, grid images): an all-gather over the trainers' data group."""
        import torch.distributed as dist

        group = self.trainer.data_group
        out: list = [None] * dist.get_world_size(group)
        with self.job.progress.inside("evaluation gather"):
            dist.all_gather_object(out, mine, group=group)
        return out

    def _log_eval_media(self, updates: int, *media) -> None:
        # TB/W&B steps are rows: the first evaluation goes with the first row, the one after step s's update
        # (updates = s + 1) with row s
        self.run_dir.log_eval_media(max(updates - 1, self.steps.start), *media)

    def forgetting(self, *forget: Callable[[int], None]) -> None:
        """Call each forget(step) at the end of every step (per-step state the mechanisms drop)."""
        self.forget.extend(forget)

    def evaluate_initial(self) -> None:
        if self.evaluates:
            with self.tracer.span("eval", step=self.steps.start), self.trainer.evaluation_weights():
                scores = self.evaluator(self.policy, self.steps.start)
            self.initial_eval = {f"{k}_initial": v for k, v in scores.items()}

    def update(self, step: int) -> None:
        """An update inside step `step` (--updates-per-batch > 1): no version, no metrics, no publish."""
        with self.tracer.span("optimizer", step=step):
            self.trainer.update()

    def optimizer_step(self, step: int) -> dict:
        with self.tracer.span("optimizer", step=step):
            reduced = self.trainer.metrics  # reduced over the trainers in trainer.step: all see the same max
            reduced.high("stop_asked", float(self.job.preemption.stop_asked()))
            metrics = self.trainer.step(self.reward_names)
        self.stop_agreed = reduced.maxs["stop_asked"] > 0 and step + 1 < self.cfg.steps
        return metrics

    def end_step(self, step: int, metrics: dict) -> None:
        """Log, evaluate and checkpoint (the leader; under FSDP evaluation and gathering are collectives)."""
        now = time.perf_counter()  # wall_s: seconds since this process's first step (compare_runs' time to reward)
        metrics.update(step_time_s=now - self.last, wall_s=now - self.start, version=self.trainer.version)
        cfg = self.cfg
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            with self.tracer.span("eval", step=step), self.trainer.evaluation_weights():  # --ema: its weights
                metrics.update(self.evaluator(self.policy, step + 1))  # eval_reward, ..._heldout_prompts; grids
        if self.leader or self.cfg.fsdp:
            self._record(step, metrics)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", tag=int(metrics["tag_fragments"]),
                                 stale=int(metrics["stale_fragments"]))
        for forget in self.forget:
            forget(step)
        self.tracer.mark_step(step)
        self.job.progress.bump(step + 1)
        self.last = time.perf_counter()  # step_time_s excludes evaluation and checkpointing
        if self.stop_agreed:
            self._stop(step)

    def _record(self, step: int, metrics: dict) -> None:
        cfg, checkpoint = self.cfg, None
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps or self.stop_agreed:
            # streamed: the leader writes each tensor as it is produced (under FSDP gathered: every trainer
            # produces them in the same order, the others keep none)
            checkpoint = (checkpoint_state.skeleton(self.trainer),
                          functools.partial(checkpoint_state.produce, self.trainer))
            if not self.leader:
                with self.tracer.span("checkpoint", step=step):
                    for tensor in checkpoint_file.deferred_order(checkpoint[0]):
                        checkpoint_state.produce(self.trainer, tensor, keep=False)
        if self.leader:
            metrics.update(self.initial_eval)
            self.initial_eval.clear()
            # metrics, plots, W&B report no progress; the checkpoint reports one unit per tensor produced and
            # one per record written
            with self.job.progress.excused("write the run directory"):
                rundir.record_step(self.run_dir, cfg, self.policy, step, metrics, checkpoint, self.tracer,
                                   on_write=self.job.progress.bump)

    def _stop(self, step: int) -> None:
        if self.leader:
            self.run_dir.plot_rewards()
            self.run_dir.close()
            print(f"[digenrl] stopped on request after step {step}: checkpoint "
                  f"{os.path.join(self.run_dir.path, 'checkpoints', f'step_{step + 1:06d}')}; continue with: "
                  f"python main.py --resume {self.run_dir.path}", flush=True)
        raise Preempted(step)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        return self.run_dir


def _place(group) -> tuple[int, int]:
    """(this rank's index, ranks) in `group` (None or one rank: (0, 1))."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _progress_bar(cfg, steps: range):
    from tqdm import tqdm
    return tqdm(total=cfg.steps, initial=steps.start, desc=f"{cfg.model} {cfg.mode}", dynamic_ncols=True)
