"""The curated mutants that tools/mutants.py applies one at a time (see its docstring for how to run them).

Each Mutant is one deliberate bug: the file, the exact original snippet (it must occur exactly once, or
the mutant is reported STALE), its replacement, what it breaks, and the fastest tests that should catch
it (pytest node ids or files, run with -x). `equivalent="reason"` marks a mutant no test can tell apart
from the original, with the argument why; it is listed but not run (--run-equivalent runs it).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    breaks: str
    tests: tuple[str, ...]
    equivalent: str | None = None
    timeout_s: float | None = None  # None: the tool's --timeout-s


def M(id, file, original, replacement, breaks, *tests, equivalent=None, timeout_s=None) -> Mutant:
    return Mutant(id, file, original, replacement, breaks, tuple(tests), equivalent, timeout_s)


# The tests, fastest first where a choice exists.
TRUTH = "tests/test_truth.py::"
ADVANTAGES = TRUTH + "test_rewards_and_advantages_are_those_of_the_same_trajectories"
LATENTS = TRUTH + "test_trained_latents_are_the_states_at_the_trained_sampling_steps"
GRADIENT = TRUTH + "test_one_step_gradient_is_autograd_on_the_plain_objective"
CLIPPING = TRUTH + "test_gradient_clipping_scales_the_step_gradient_to_max_grad_norm"
PADDING = TRUTH + "test_metrics_ignore_padding_pairs"
EVAL_ODE = TRUTH + "test_evaluation_is_the_ode_whatever_the_training_noise_level"
SMALL = "tests/test_truth_small.py::"
PROTOCOL = "tests/test_protocol.py::"
GRPO = "tests/test_grpo.py::"
REFERENCE = "tests/test_reference_steps.py::"
TSP_TAG = "tests/test_tsp_tag.py::"
PREDICTOR = "tests/test_tag_predictor.py::"
PLACEMENTS = "tests/test_placements.py::"
K2 = PLACEMENTS + "test_update_equals_the_single_process_update[gap_tsp_k2]"
K2_CLIPPED = PLACEMENTS + "test_clipping_scales_the_global_gradient_across_two_trainers"
PLAIN_E2E = PLACEMENTS + "test_the_one_process_update_is_minus_the_gradient_of_the_plain_objective"
TAG_E2E = PLACEMENTS + "test_tag_acts_and_the_update_is_unchanged"
RESUME = "tests/test_cli.py::test_resume_continues_with_the_same_metrics"
TERMS = "tests/test_truth_terms.py::"
KL = TERMS + "test_kl_value_and_gradient_are_the_plain_objectives_with_a_perturbed_reference"
DANCE_GAP = TERMS + "test_dance_grpo_trainer_scores_the_rollouts_log_probs"
DANCE_GRADIENT = TERMS + "test_dance_grpo_step_gradient_is_autograd_on_dance_grpos_objective"
DANCE_E2E = "tests/test_family_rl.py::test_dance_grpo_hunyuanvideo_two_steps_with_an_animated_eval"
FAILURE = "tests/test_failure_paths.py::test_a_failing_thread_ends_the_rollout_main_thread_with_its_name"
SCALE = "tests/test_resume_scale.py::"
FLUX_PIPELINE = "tests/test_families.py::test_flux_velocity_reproduces_flux_pipelines_own_sampling"
INDEPENDENT = TRUTH + "test_the_fragment_and_the_trainers_log_probs_are_what_an_independent_sampler_gives"


def bad_input(flags: str) -> str:
    return f"tests/test_cli.py::test_bad_input_is_refused_before_any_rank_starts[{flags}]"


MUTANTS = [
    # --- grpo.py: the math ------------------------------------------------------------------------------
    M("grpo-adv-reversed", "grpo.py",
      "adv = (r - r.mean(dim=1, keepdim=True))", "adv = (r.flip(1) - r.mean(dim=1, keepdim=True))",
      "advantages from the rewards of the wrong trajectories (reversed within each group)", ADVANTAGES),
    M("grpo-adv-sample-std", "grpo.py",
      "r.std(dim=1, unbiased=False, keepdim=True)", "r.std(dim=1, keepdim=True)",
      "advantages normalised by the sample std instead of the population std",
      GRPO + "test_group_advantages_zero_mean_unit_std_per_group"),
    M("grpo-adv-unclipped", "grpo.py",
      "return adv.clamp(-clip, clip).reshape(-1)", "return adv.reshape(-1)",
      "advantages not clipped to +-adv_clip", GRPO + "test_group_advantages_zero_mean_unit_std_per_group"),
    M("grpo-flow-drift", "grpo.py",
      "mean = x + (v + g**2 / (2 * s) * (x + (1 - s) * v)) * dt",
      "mean = x + (v + g**2 / s * (x + (1 - s) * v)) * dt",
      "Flow-GRPO SDE mean: the score correction doubled",
      GRPO + "test_flow_grpo_step_matches_the_formula_and_per_sample_sigmas"),
    M("grpo-dance-score-sign", "grpo.py",
      "mean = x + (v - 0.5 * eta**2 * score) * dsigma", "mean = x + (v + 0.5 * eta**2 * score) * dsigma",
      "DanceGRPO step: the score term with the other sign",
      REFERENCE + "test_dance_step_matches_dance_grpo_flux_step"),
    M("grpo-logprob-summed", "grpo.py",
      "return log_density.mean(dim=tuple(range(1, sample.ndim)))",
      "return log_density.sum(dim=tuple(range(1, sample.ndim)))",
      "log-prob summed over latent dims instead of averaged (ratios explode)",
      GRPO + "test_log_prob_is_the_gaussian_density_it_samples_from"),
    M("grpo-ppo-optimistic", "grpo.py",
      "per_pair = torch.maximum(unclipped, clipped)", "per_pair = torch.minimum(unclipped, clipped)",
      "PPO clipping takes the optimistic branch (no trust region)",
      GRPO + "test_clipping_stops_the_gradient_outside_the_trust_region"),
    M("grpo-padding-in-stats", "grpo.py",
      "weights.to(ratio.device) != 0", "weights.to(ratio.device) >= 0",
      "TSP padding pairs counted in the ratio/KL/clipfrac metrics", PADDING),
    # --- rollout.py --------------------------------------------------------------------------------------
    M("rollout-eval-sde-noise", "rollout.py",
      "det = dataclasses.replace(cfg, noise_level=0.0)", "det = cfg",
      "evaluation samples with the SDE noise instead of noise level 0", EVAL_ODE),
    M("rollout-flow-slots-1-to-T", "rollout.py",
      "return list(range(t_train))", "return list(range(1, t_train + 1))",
      "Flow-GRPO trains sampling steps 1..T_train instead of 0..T_train-1",
      REFERENCE + "test_flow_grpo_trains_the_steps_flow_grpo_trains"),
    M("rollout-dance-trains-last-step", "rollout.py",
      "torch.randperm(cfg.num_steps - 1, generator=gen)", "torch.randperm(cfg.num_steps, generator=gen)",
      "DanceGRPO may train the last sampling step",
      REFERENCE + "test_dance_grpo_trains_a_random_subset_of_all_but_the_last_step"),
    M("rollout-rewards-misaligned", "rollout.py",
      "scores = reward_fn(images, prompt_text", "scores = reward_fn(images.flip(0), prompt_text",
      "each trajectory gets another trajectory's reward", ADVANTAGES),
    M("rollout-one-noise-stream", "rollout.py",
      "torch.randn(x.shape[1:], generator=g) for g in generators",
      "torch.randn(x.shape[1:], generator=generators[0]) for g in generators",
      "noise depends on the batch a trajectory is generated in (not on its own seed)", LATENTS),
    # --- gap.py ------------------------------------------------------------------------------------------
    M("gap-claim-off-by-one", "gap.py",
      "first = end - num_groups\n", "first = end - num_groups + 1\n",
      "a claimed group range off by one (group 0 never generated, one group twice)",
      PROTOCOL + "test_claims_are_contiguous_group_ranges_cut_at_the_batch_end"),
    M("gap-claim-past-the-end", "gap.py",
      "return first, min(end, self.groups_per_step) - first", "return first, num_groups",
      "the last claim of a step runs past the batch end",
      PROTOCOL + "test_claims_are_contiguous_group_ranges_cut_at_the_batch_end"),
    M("gap-seeds-fragment-local", "gap.py",
      "first = first_group * group_size  #", "first = 0  #",
      "noise seeds from the index within the fragment: the trajectories depend on how the batch is cut",
      PROTOCOL + "test_any_cut_of_the_batch_gives_the_same_trajectories"),
    M("gap-dance-noise-not-shared", "gap.py",
      "init_seeds = [base + 2 * (t // group_size * group_size) for t in trajectories]",
      "init_seeds = [base + 2 * t for t in trajectories]",
      "DanceGRPO: the members of a group do not start from the same noise",
      "tests/test_gap.py::test_fragment_specs_are_deterministic_and_whole_groups"),
    M("gap-concat-reversed", "gap.py",
      "torch.cat([t[k] for t in tensors])", "torch.cat([t[k] for t in tensors[::-1]])",
      "TAG's shares joined in the wrong group order",
      PROTOCOL + "test_concat_and_to_keep_group_order_and_every_header_field"),
    M("gap-barrier-when-streaming", "gap.py",
      "    if streaming:\n        for fragment in fragments:",
      "    if not streaming:\n        for fragment in fragments:",
      "GAP waits for the whole batch, the naive barrier streams",
      PROTOCOL + "test_gap_trains_each_fragment_as_it_arrives_and_the_barrier_after_all"),
    M("gap-dealt-twice", "gap.py",
      "for seq in range(trainer_index, fragments_per_step, num_trainers):",
      "for seq in range(0, fragments_per_step, num_trainers):",
      "without TSP, a fragment trained by two trainers and another by none",
      PROTOCOL + "test_dealt_fragments_give_each_announcement_to_exactly_one_trainer"),
    M("gap-wire-version-producer", "gap.py",
      "step, first_group, version, producer, group_size = ints",
      "step, first_group, producer, version, group_size = ints",
      "a rebuilt fragment (Fragment.to, concat, receive) swaps its weights version and producer",
      PROTOCOL + "test_concat_and_to_keep_group_order_and_every_header_field"),
    # --- tsp.py ------------------------------------------------------------------------------------------
    M("tsp-shard-skips-pairs", "tsp.py",
      "per_rank = math.ceil(len(pairs) / world)", "per_rank = len(pairs) // world",
      "a TSP shard drops a pair when K does not divide the pairs",
      TSP_TAG + "test_tsp_shards_cover_every_pair_once_with_equal_pass_counts"),
    M("tsp-padding-weight-1", "tsp.py",
      "mask = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))", "mask = [1.0] * per_rank",
      "TSP padding pairs carry weight 1 (a pair trained twice)",
      TSP_TAG + "test_tsp_shards_cover_every_pair_once_with_equal_pass_counts"),
    M("tsp-same-share-every-rank", "tsp.py",
      "mine = pairs[rank::world]", "mine = pairs[0::world]",
      "every trainer trains rank 0's share (pairs trained K times, others never)",
      TSP_TAG + "test_tsp_shards_cover_every_pair_once_with_equal_pass_counts"),
    M("tsp-advantage-by-slot", "tsp.py",
      '"advantages": fragment.advantages[samples]', '"advantages": fragment.advantages[slots]',
      "a pair gets the advantage of another sample", GRADIENT),
    M("tsp-lockstep-same-fragment", "tsp.py",
      "            next_seq += 1\n", "            next_seq += 0\n",
      "the trainer group trains announced fragment 0 again and again",
      PROTOCOL + "test_lockstep_trains_each_announced_fragment_once_and_counts_groups"),
    M("tsp-lockstep-counts-fragments", "tsp.py",
      "groups_done += fragment.num_groups", "groups_done += 1",
      "the lockstep loop counts fragments as groups (waits for fragments that never come)",
      PROTOCOL + "test_lockstep_trains_each_announced_fragment_once_and_counts_groups"),
    # --- tag.py ------------------------------------------------------------------------------------------
    M("tag-never-the-best-share", "tag.py",
      "if end < best_end - 1e-12:", "if end > best_end + 1e-12:",
      "the predictor never picks the share that ends the step soonest",
      PREDICTOR + "test_predicted_step_end_by_hand"),
    M("tag-quantum-ignored", "tag.py",
      "for n in range(quantum, max(state.unclaimed, 0) + 1, quantum):",
      "for n in range(1, max(state.unclaimed, 0) + 1):",
      "TAG claims shares that are not a multiple of K under FSDP (ranks would run different forwards)",
      PREDICTOR + "test_claims_are_multiples_of_the_quantum_and_the_best_of_them"),
    M("tag-share-local-index", "tag.py",
      "mine = generate(first_group + lo, hi - lo)", "mine = generate(lo, hi - lo)",
      "a trainer generates its share at the index within the claim, not the batch",
      PROTOCOL + "test_assisted_generation_generates_each_claimed_group_once_at_its_global_index"),
    M("tag-wrong-version", "wiring.py",
      "self.generate(step, first, count, self.version(), tag.TAG_PRODUCER)",
      "self.generate(step, first, count, self.version() - 1, tag.TAG_PRODUCER)",
      "TAG labels its fragments with the wrong weights version", TAG_E2E),
    # --- tcss.py (TCSS) ------------------------------------------------------------------------
    M("tcss-bound-2", "tcss.py",
      "allowed = (0, 1) if async_on else (0,)", "allowed = (0, 1, 2) if async_on else (0,)",
      "the staleness bound relaxed to 2",
      PROTOCOL + "test_check_staleness_allows_0_or_1_with_async_and_only_0_without"),
    M("tcss-stale-without-async", "tcss.py",
      "allowed = (0, 1) if async_on else (0,)", "allowed = (0, 1)",
      "a stale fragment accepted with async off",
      PROTOCOL + "test_check_staleness_allows_0_or_1_with_async_and_only_0_without"),
    M("tcss-budget-ignored", "tcss.py",
      'return self.max_stale > 0 and self.store.add(f"stale/{step}", 1) <= self.max_stale',
      "return self.max_stale > 0", "the stale budget j ignored", PROTOCOL + "test_the_stale_budget_is_j_per_step"),
    M("tcss-ahead-after-new-weights", "tcss.py",
      "while step + 1 <= last_step and latest_version() < step + 1 and take_budget(step + 1):",
      "while step + 1 <= last_step and take_budget(step + 1):",
      "rollout keeps generating stale fragments after the new weights arrived",
      PROTOCOL + "test_generate_ahead_stops_at_the_budget_at_new_weights_and_after_the_last_step"),
    M("tcss-mailbox-no-copy", "tcss.py",
      "                    p.copy_(t)\n", "                    p.copy_(p)\n",
      "rollout ranks keep their old weights while reporting the new version",
      "tests/test_gap.py::test_round_trip_broadcast_unique_claims_and_published_weights"),
    M("tcss-mailbox-same-version", "tcss.py",
      "latest[0] > self._held_version", "latest[0] >= self._held_version",
      "the mailbox would copy in a version it already holds",
      "tests/test_gap.py::test_round_trip_broadcast_unique_claims_and_published_weights",
      equivalent="the buffers are consumed on the first swap (set to None) and the leader publishes each version "
                 "once, so the condition is never reached with an equal version"),
    M("tag-no-padding", "tag.py",
      "    if mine is None and lockstep:", "    if False:",
      "under FSDP a trainer whose TAG share came back empty skips its forwards (the others wait in an all-gather)",
      TSP_TAG + "test_a_short_tag_claim_still_gives_every_fsdp_trainer_the_same_forwards"),
    # --- trainer.py ------------------------------------------------------------------------------------
    M("fsdp-reference-unsharded", "trainer.py",
      "    reference = models.frozen_copy(transformer, policy.dtype, on_meta=True) if keep_reference else None",
      "    reference = policy.freeze_reference() if keep_reference else None",
      "the KL reference is a whole copy made before sharding, never sharded (issue 22 item 2)",
      "tests/test_memory.py::test_fsdp_trainers_hold_one_kth_of_the_model_and_optimizer"),
    M("trainer-clip-disabled", "trainer.py",
      "clip_grad_norm_(self.params, self.cfg.max_grad_norm)", "clip_grad_norm_(self.params, math.inf)",
      "gradient clipping disabled", CLIPPING),
    M("trainer-clip-before-all-reduce", "trainer.py",
      "        self.all_reduce_gradients()\n"
      "        with self._inside(\"grad-norm all-reduce\"):\n"
      "            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)",
      "        with self._inside(\"grad-norm all-reduce\"):\n"
      "            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)\n"
      "            self.all_reduce_gradients()",
      "each rank clips its local gradient before the all-reduce (not the global norm)", K2_CLIPPED),
    M("trainer-no-all-reduce", "trainer.py",
      "dist.all_reduce(flat, group=self.compute_group)", "pass",
      "trainers step on their own share of the gradient", K2),
    M("trainer-loss-weights-doubled", "gap.py",
      "return mask / num_pairs  # [p]", "return 2 * mask / num_pairs  # [p]",
      "every pair's loss weight doubled (AdamW would hide the factor)", GRADIENT),
    M("trainer-stale-as-on-policy", "tcss.py",
      "return recorded.to(current.device) if stale else current.detach()", "return current.detach()",
      "stale fragments trained without the PPO ratio against their behaviour log-probs", GRADIENT),
    M("trainer-accepts-two-old", "trainer.py",
      "stale = tcss.check_staleness(self.version, fragment.policy_version, async_on=True) == 1",
      "stale = self.version != fragment.policy_version",
      "Trainer.accumulate trains a fragment two versions old",
      PROTOCOL + "test_the_trainer_refuses_a_fragment_two_versions_old_and_trains_one_version_old"),
    M("trainer-train-fragment-unchecked", "trainer.py",
      "tcss.check_staleness(trainer.version, fragment.policy_version, async_on)  #", "pass  #",
      "train_fragment accepts stale fragments with async off",
      PROTOCOL + "test_train_fragment_refuses_a_stale_fragment_without_async"),
    M("trainer-nan-step-applied", "trainer.py",
      "        if finite:\n", "        if True:\n",
      "a step with a non-finite gradient is applied (weights become NaN)",
      PROTOCOL + "test_a_non_finite_step_is_skipped_and_too_many_in_a_row_abort"),
    M("trainer-reward-std", "trainer.py",
      'out["reward_std"] = max(s.get("reward_sq", 0.0) / traj - mean**2, 0.0) ** 0.5',
      'out["reward_std"] = max(s.get("reward_sq", 0.0) / traj - mean**2, 0.0)',
      "the reward_std metric is the variance", SMALL + "test_summary_formulas_on_hand_computed_sums"),
    M("trainer-zero-std-groups", "trainer.py",
      "(groups.std(dim=1, unbiased=False) < 1e-6).sum()", "(groups.std(dim=1, unbiased=False) > 1e-6).sum()",
      "zero_std_group_frac counts the groups that do carry a signal", SMALL + "test_fragment_counts_by_hand"),
    M("main-total-pairs", "gap.py",
      "return groups_per_step * group_size * num_train_timesteps",
      "return groups_per_step * num_train_timesteps",
      "the loss weight 1/(N T_train) with N = groups, not trajectories (every placement alike)", PLAIN_E2E),
    M("main-count-every-trainer", "main.py",
      "count=leader or not cfg.tsp", "count=True",
      "under TSP every trainer counts each fragment's rewards (metrics K-fold)", K2),
    # --- the resume path (infra/rundir.py, Trainer.load_checkpoint_state, main.py) -----------------------
    M("rundir-write-in-place", "infra/rundir.py",
      'tmp = f"{path}.tmp{os.getpid()}"', "tmp = path",
      "atomic_write writes in place (a crash leaves half a file)",
      SMALL + "test_an_interrupted_atomic_write_leaves_the_old_file_and_no_temporary"),
    M("rundir-no-fsync", "infra/rundir.py",
      "            os.fsync(f.fileno())\n        os.replace(tmp, path)",
      "            pass\n        os.replace(tmp, path)",
      "atomic_write renames before the data is on disk",
      SMALL + "test_an_interrupted_atomic_write_leaves_the_old_file_and_no_temporary",
      equivalent="fsync only matters if the machine loses power or the OS crashes between the rename and the "
                 "write-back; every process, tests included, reads the same bytes either way"),
    M("rundir-partial-checkpoint", "infra/rundir.py",
      ' and not n.endswith(".partial")', "",
      "--resume may load a half-written checkpoint", SMALL + "test_resume_never_sees_a_partial_checkpoint"),
    M("rundir-metrics-not-truncated", "infra/rundir.py",
      'if r["step"] < below_step]', 'if r["step"] <= below_step]',
      "a resumed run keeps the metrics row of the step it redoes (a duplicate row)",
      SMALL + "test_resume_refuses_another_identity_and_drops_the_redone_rows"),
    M("rundir-identity-unchecked", "infra/rundir.py",
      "    if diff:\n", "    if False:\n",
      "--resume accepts a checkpoint of another model or LoRA config (saved_config checks config.json "
      "first; this is the checkpoint's own check)",
      SMALL + "test_resume_refuses_another_identity_and_drops_the_redone_rows"),
    M("resume-no-optimizer", "trainer.py",
      "        self.optimizer.load_state_dict(optimizer)\n", "        pass\n",
      "resume does not restore the AdamW moments", RESUME),
    M("resume-version-zero", "infra/bookkeeping.py",
      'trainer.version = state["step"]', "trainer.version = 0",
      "a resumed trainer restarts at weights version 0", RESUME),
    M("resume-rng-not-restored", "infra/bookkeeping.py",
      '    rundir.set_rng_state(state["rng"])\n', "",
      "resume does not restore the global RNG states", RESUME,
      equivalent="no code path draws from the global RNGs after the start: noise comes from per-trajectory "
                 "generators seeded by (seed, step, index), DanceGRPO's slots from a seeded generator, and "
                 "training scores recorded samples; restoring them is defensive"),
    # --- issue 27: the KL term, the DanceGRPO trainer path, the threads' failures, resume at scale ------------
    M("trainer-kl-sign", "trainer.py",
      "loss = loss + self.cfg.beta * (kl * weights).sum()", "loss = loss - self.cfg.beta * (kl * weights).sum()",
      "the KL penalty with the wrong sign: each step pushes the policy away from the reference", KL),
    M("trainer-kl-weight", "trainer.py",
      "loss = loss + self.cfg.beta * (kl * weights).sum()", "loss = loss + self.cfg.beta * kl.mean()",
      "the KL term without the pairs' 1/(N T_train) weights (K-fold and fragment-count dependent)", KL),
    M("lora-reference-adapters-on", "models/__init__.py",
      "            self.transformer.disable_adapters()\n", "",
      "with LoRA the KL reference is the policy itself (adapters not disabled): the KL is always 0", KL + "[lora]"),
    M("trainer-dance-scored-as-flow", "trainer.py",
      "self.step_fn = step_fn(cfg.algo)", 'self.step_fn = step_fn("flow_grpo")',
      "the trainer scores DanceGRPO pairs with the Flow-GRPO step (log-probs not the rollout's)", DANCE_GAP),
    M("trainer-dance-score-sign", "grpo.py",
      "mean = x + (v - 0.5 * eta**2 * score) * dsigma", "mean = x + (v + 0.5 * eta**2 * score) * dsigma",
      "DanceGRPO's score term with the other sign, seen through the trainer path (rollout and trainer agree with "
      "each other, not with DanceGRPO's flux_step)", DANCE_GRADIENT),
    M("main-trainer-algo", "trainer.py",
      "algo=cfg.algo, max_bad_steps", 'algo="flow_grpo", max_bad_steps',
      "main.py builds the trainers with another algo than the rollout's", DANCE_E2E),
    M("rollout-sender-error-swallowed", "transport.py",
      "            self.error = exc\n", "            pass\n",
      "the fragment sender swallows its error: the rollout rank waits for ever for weights that never come",
      FAILURE + "[sender_sync_one_fragment_per_step]", timeout_s=300),
    M("rollout-wait-ignores-sender", "tcss.py",
      "self.mailbox.wait_for(step, also_check=self.also_check)", "self.mailbox.wait_for(step)",
      "waiting for weights, the rollout rank does not check its sender (hung when the step's last send failed)",
      FAILURE + "[sender_sync_one_fragment_per_step]", timeout_s=300),
    M("mailbox-error-swallowed", "tcss.py",
      "            self.error = exc\n", "            pass\n",
      "the weight mailbox swallows its error: the rollout rank's failure no longer names it",
      FAILURE + "[mailbox_sync]", timeout_s=300),
    M("fsdp-checkpoint-local-shard", "trainer.py",
      "                whole = v.full_tensor() if _is_sharded(v) else v", "                whole = v.to_local() if _is_sharded(v) else v",
      "under FSDP the checkpoint holds each rank's local shard of the AdamW state, not the whole tensor",
      SCALE + "test_fsdp_checkpoint_round_trip_is_bit_exact"),
    M("resume-weights-on-leader-only", "infra/bookkeeping.py",
      "    trainer.load_checkpoint_state(state)  # re-shards under FSDP",
      "    if __import__('torch').distributed.get_rank() == cfg.rollout_ranks:"
      " trainer.load_checkpoint_state(state)",
      "a resumed run loads the checkpoint on the leader only: the other trainers train from the initial weights",
      SCALE + "test_digenrl_k2_with_tag_and_tcss_resumes_as_the_uninterrupted_run"),
    M("tag-own-claims-in-flight", "tag.py",
      "in_flight=max(claimed - announced - self.taken[step], 0)", "in_flight=max(claimed - announced, 0)",
      "TAG's leader counts its own claimed groups as the rollout's, in flight",
      PROTOCOL + "test_the_assistant_hands_the_predictor_the_queues_counts_and_scripted_times"),
    M("clip-prompts-misaligned", "rewards/__init__.py",
      "inputs = processor(text=prompts, ", "inputs = processor(text=prompts[::-1], ",
      "the CLIP reward scores each image against another image's prompt",
      "tests/test_rewards.py::test_clip_score_is_clips_cosine_of_each_image_with_its_own_prompt"),
    M("flux-timestep-t", "models/flux.py",
      "timestep=sigma.to(latents.dtype), guidance=guidance_vec", "timestep=(sigma * 1000).to(latents.dtype), "
      "guidance=guidance_vec", "FLUX's transformer gets the timestep t instead of t/1000 (rollout and trainer alike)",
      FLUX_PIPELINE),
    M("flux-guidance-fixed", "models/flux.py",
      "guidance_vec = torch.full((b,), guidance, device", "guidance_vec = torch.full((b,), 3.5, device",
      "FLUX ignores --guidance (always 3.5)", FLUX_PIPELINE),
    M("rollout-noise-one-stream-independent", "rollout.py",
      "torch.randn(x.shape[1:], generator=g) for g in generators",
      "torch.randn(x.shape[1:], generator=generators[0]) for g in generators",
      "the noise of a trajectory depends on its batch: the independent FLUX sampler sees it", INDEPENDENT),
    # --- config validation -------------------------------------------------------------------------------
    M("config-fragment-divides-unchecked", "config.py",
      "    if c.prompts_per_step % c.fragment_groups:\n", "    if False:\n",
      "a fragment size that does not divide the batch is accepted",
      bad_input("--prompts-per-step 3 --fragment-groups 2")),
    M("config-tag-without-tsp", "config.py",
      "if c.tag and not (c.gap and c.tsp):", "if c.tag and not c.gap:",
      "--tag accepted without --tsp", bad_input("--placement disaggregated --gap --tag")),
    M("config-max-grad-norm-unchecked", "config.py",
      'for name in ("lr", "clip_range", "max_grad_norm", "timeout_s", "adv_clip"):',
      'for name in ("lr", "clip_range", "timeout_s", "adv_clip"):',
      "--max-grad-norm 0 accepted (every update would be zero)", bad_input("--max-grad-norm 0")),
    M("config-fsdp-tag-quantum", "config.py",
      "c.fsdp and c.tag and c.fragment_groups < trainers", "c.fsdp and c.tag and c.fragment_groups < trainers - 1",
      "--fsdp --tag accepted with fewer groups per fragment than trainers",
      bad_input("--fsdp --nproc 3 --fragment-groups 1")),
    M("config-all-ranks-rollout", "config.py",
      "if not 1 <= c.rollout_ranks < world_size:", "if not 1 <= c.rollout_ranks <= world_size:",
      "every rank a rollout rank (no trainer) accepted",
      bad_input("--placement disaggregated --rollout-ranks 2 --nproc 2")),
]
