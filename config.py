"""The options: the one Config dataclass (every field has a help string stating its trade-off),
the modes, the command-line parser built from the fields, and `resolve` (the defaults a mode, a
family or a preset fills in).

Checking a Config lives in cli.py (`cli.validate`: before any rank is spawned, a bad value exits
with a message naming it and what is allowed). `python main.py --help` prints every field.
"""


from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional

import models
from flowgrpo import presets
from infra import saved_config
from models import lora

MODES = {
    # mode: (placement, gap, tsp, tag, tcss)
    "digenrl": ("disaggregated", True, True, True, True),
    "colocated": ("colocated", False, False, False, False),
    "naive": ("disaggregated", False, False, False, False),
}
MECHANISM_FIELDS = ("placement", "gap", "tsp", "tag", "use_tcss")


def field(default, help_text, **kw):
    return dataclasses.field(default=default, metadata={"help": help_text, **kw})


@dataclasses.dataclass
class Config:
    # what to train
    model: Optional[str] = field(None, "model family: flux, qwenimage, wan, hunyuanvideo, sd3; "
                                 "unset = the family --pretrained's model_index.json names, else "
                                 "flux")
    pretrained: Optional[str] = field(None, "local diffusers pipeline directory; unset = the tiny "
                                      "offline pipeline (built once into the cache)")
    cache_dir: Optional[str] = field(None, "where tiny pipelines are built (default "
                                     "~/.cache/digenrl or $DIGENRL_CACHE)")
    reward: str = field("color", "reward spec, name=weight list, e.g. "
                        "color=1.0,jpeg_compressibility=0.1, or my.py:fn (fn(images, prompts[, "
                        "metadata]) -> scores | (scores, info))")
    clip_path: Optional[str] = field(None, "local CLIP directory for the clip_score reward")
    pickscore_path: Optional[str] = field(None, "local PickScore_v1 CLIPModel directory for "
                                          "the pickscore reward (Flow-GRPO's: logit / 26)")
    pickscore_processor_path: Optional[str] = field(None, "local CLIPProcessor directory for "
                                                    "pickscore (Flow-GRPO loads CLIP-ViT-H-14's); "
                                                    "unset = --pickscore-path")
    remote_url: Optional[str] = field(None, "http(s) URL of a reward server for the remote reward; "
                                      "several remote rewards (--reward "
                                      "remote:geneval=1,remote:deqa=0.5): NAME=URL,NAME=URL. Each "
                                      "server gets one check request before any rank starts")
    # remote reward server (rewards/remote.py)
    remote_protocol: str = field("json", "json (base64 PNGs in JSON) or flow_grpo (Flow-GRPO's "
                                 "reward servers: pickled JPEG batches with prompts and metadata, "
                                 "answers unpickled restricted to plain data); per remote:NAME "
                                 "reward: NAME=VALUE,...")
    remote_score_key: str = field("scores", "key of the server's answer holding the scores: scores "
                                  "(GenEval-style), outputs (DeQA / UnifiedReward-style); per "
                                  "remote:NAME reward: NAME=KEY,...")
    remote_timeout_s: float = field(30.0, "each attempt's whole time (connect, send, wait, read "
                                    "the last byte): longer tolerates a slow server, shorter "
                                    "retries a hung one sooner; a reward call is excused from "
                                    "liveness for its attempts and retries' waits, no longer")
    remote_retries: int = field(7, "retries after the first attempt (timeouts, connection errors, "
                                "HTTP 5xx), with exponential backoff capped at 15 s: the default 7 "
                                "wait 1, 2, 4, 8, 15, 15, 15 s (about a minute), riding out "
                                "a server restart; more rides out longer outages, but a dead "
                                "server takes longer to fail the run")
    remote_batch_size: int = field(64, "images per request (Flow-GRPO: 64): larger = fewer round "
                                   "trips, bigger requests")
    remote_frames: str = field("all", "videos: all (every frame sent as an image, scores averaged "
                               "over frames) or middle (only the middle frame: F times cheaper, "
                               "blind to motion)")
    prompt_file: Optional[str] = field(None, "prompts: a Flow-GRPO dataset folder (train/test .txt "
                                       "or _metadata.jsonl; evaluates on test) or a text file, one "
                                       "prompt per line (every ~10th line held out, at most 8); "
                                       "unset = the colour task's prompts")
    eval_prompts: int = field(8, "evaluation uses the first N prompts of each split it "
                              "evaluates (--eval-split; 0 = all): more = a less noisy "
                              "eval_reward, each costs eval_seeds deterministic generations per "
                              "evaluation")
    eval_split: Optional[str] = field(
        None, "what evaluation samples: test (the held-out split only, Flow-GRPO's eval: "
        "eval_reward is its mean) or train+test (eval_reward on the training prompts from held-out "
        "noises, eval_reward_heldout_prompts on the held-out split: whether the policy learned the "
        "prompts it trains on, the demo's curve); unset = test with --pretrained, train+test for "
        "the tiny pipelines")
    eval_batch_size: Optional[int] = field(
        None, "evaluation samples per forward, VAE decode and reward call on each evaluating rank "
        "(Flow-GRPO's sample.test_batch_size); the samples are spread over the trainer ranks "
        "(every rank colocated), which hold the evaluated (EMA) weights. Larger = fewer, bigger "
        "forwards, more memory; unset = the published setting with --pretrained (presets.py), 0 "
        "(a rank's whole share at once) for the tiny pipelines")
    # placement and mechanisms
    mode: Optional[str] = field(None, "digenrl (all four mechanisms; the default), colocated, "
                                "naive; explicit --placement/--gap/... flags instead give a custom "
                                "mix")
    placement: Optional[str] = field(None, "colocated (every rank generates then trains) or "
                                     "disaggregated (separate rollout and trainer ranks)")
    nproc: int = field(2, "ranks to self-spawn when not under torchrun; more ranks = more "
                       "throughput, more memory")
    rollout_ranks: int = field(1, "R: rollout ranks in the disaggregated placement; the other "
                               "P - R ranks train")
    gap: Optional[bool] = field(None, "GAP: train fragments as they arrive instead of after "
                                "the whole batch")
    tsp: Optional[bool] = field(None, "TSP: spread each fragment's (sample, timestep) pairs over "
                                "all trainers in packed forwards")
    tsp_pack: Optional[int] = field(None, "pairs per forward under TSP: larger = fewer, bigger "
                                    "passes (less per-call overhead, better GPU use), more "
                                    "activation memory; unset = 4 with --pretrained, 20 for "
                                    "the tiny pipelines (on a CPU per-call overhead dominates; 20 "
                                    "divides the default fragment's 40 pairs, so no padding pairs)")
    tsp_span: bool = field(True, "TSP packs span fragments: a trainer's pairs of consecutive "
                                 "fragments fill the same packs, padded once per update, not once "
                                 "per fragment (fewer wasted passes when K * pack does not divide "
                                 "a fragment's pairs); --no-tsp-span packs each fragment alone "
                                 "(the reference)")
    tag: Optional[bool] = field(None, "TAG: an idle trainer generates fragments itself when "
                                "the predictor says the step ends sooner")
    use_tcss: Optional[bool] = field(
        None, "TCSS: rollout may generate the next batch with weights one version old (--async is "
        "accepted too)", flag="tcss", aliases=("async",))
    max_stale_fragments: Optional[int] = field(
        None, "j: at most this many fragments per step generated one version stale (TCSS); "
        "unset = one per rollout rank. Larger hides more of the weight round trip, but more of "
        "each batch is trained off-policy")
    fsdp: bool = field(False, "shard the trainer transformer with FSDP2 over the trainer group "
                       "(needs --tsp)")
    fragment_groups: int = field(1, "groups per fragment: smaller = finer pipelining, more "
                                 "messages and smaller forwards")
    rank_speed: Optional[str] = field(None, "BENCHMARK EMULATION ONLY (infra/emulate.py): "
                                      "RANK=FACTOR,... e.g. 0=0.5 runs rank 0's generation and "
                                      "training at half speed by sleeping; emulates heterogeneous "
                                      "GPUs on one machine, costs wall time, never use it to train")
    # the RL problem size
    steps: int = field(200, "RL steps (optimizer steps)")
    prompts_per_step: Optional[int] = field(
        None, "B: prompts (groups) per step: more = a steadier gradient, more compute per step; "
        "unset = the published setting with --pretrained (presets.py: Flow-GRPO's 48 groups of "
        "its SD3 and FLUX recipes), 3 for the tiny pipelines")
    sample_batch_size: Optional[int] = field(
        None, "trajectories per forward batch, VAE decode and reward call when generating "
        "(Flow-GRPO's sample.train_batch_size), whatever the fragment or group size; must divide a "
        "fragment's trajectories (--fragment-groups x --group-size). Smaller = less activation "
        "and decode memory (a 24-image FLUX fragment decoded at once: 36 GiB at 1024 px), more "
        "forwards; unset = the published setting with --pretrained (presets.py), 0 (a whole "
        "fragment at once) for the tiny pipelines")
    group_size: Optional[int] = field(None, "G: samples per prompt; larger = better advantage "
                                      "estimates, more compute; unset = the published setting with "
                                      "--pretrained (presets.py: FLUX 24, Qwen-Image 16, ...), 8 "
                                      "for the tiny pipelines")
    num_steps: Optional[int] = field(None, "T: SDE sampling steps per trajectory; more = better "
                                     "samples, T forwards per trajectory; unset = the published "
                                     "setting with --pretrained (presets.py: FLUX 6, Qwen-Image "
                                     "10, Wan 20), 6 for the tiny pipelines")
    timestep_fraction: Optional[float] = field(
        None, "share of the sampling steps that are trained, by the references' formulas: "
        "flow_grpo T_train = int(T * f), the first steps; dance_grpo int((T - 1) * f) random "
        "steps, never the last; unset = 0.99 for flow_grpo (Flow-GRPO's configs: all but the last "
        "step), 0.6 for dance_grpo (DanceGRPO's scripts; presets.py). Smaller = cheaper training, "
        "noisier gradient")
    noise_level: Optional[float] = field(
        None, "SDE noise level a (Flow-GRPO) or eta (DanceGRPO): more exploration, lower image "
        "quality; unset = the published setting with --pretrained (presets.py: Flow-GRPO FLUX "
        "0.9, Qwen-Image 1.2, Wan 0.7), 0.5 for the tiny pipelines (measured: at 0.7 the tiny "
        "video models barely learned the colour task in 200 steps, the added noise decides their "
        "colours)")
    algo: str = field("flow_grpo", "flow_grpo (default) or dance_grpo (constant eta, shared group "
                      "noise, random timestep subset)")
    resolution: int = field(0, "image height in pixels (and width, unless --width); larger = finer "
                            "images, quadratically more tokens; 0 = the family's native size with "
                            "--pretrained (FLUX and Qwen-Image 1024, Wan 480 x 832, HunyuanVideo "
                            "720 x 1280), 32 for the tiny pipelines")
    width: int = field(0, "image width in pixels; 0 = --resolution's (square), or the native width "
                       "with --pretrained; FLUX and Qwen-Image are square only")
    frames: int = field(0, "video frames (video families); 0 = the published setting with "
                        "--pretrained (Wan 33, HunyuanVideo 53: presets.py), the family's tiny "
                        "default otherwise")
    guidance: Optional[float] = field(None, "embedded guidance (FLUX, HunyuanVideo) or true-CFG "
                                      "scale (Qwen-Image, Wan); unset = the published setting with "
                                      "--pretrained (presets.py), the family default for the tiny "
                                      "pipelines")
    train_cfg: bool = field(True, "the training forward runs classifier-free guidance as "
                            "the rollout did (Flow-GRPO's train.cfg); --no-train-cfg scores "
                            "the conditional branch alone: half the training FLOPs of a true-CFG "
                            "family, but pairs scored against the rollout's recorded log-prob "
                            "(later minibatches, stale pairs) start with a ratio off 1, since they "
                            "were sampled with CFG (only for sd3, qwenimage, wan)")
    detach_uncond: Optional[bool] = field(
        None, "with --train-cfg, the unconditional branch of the training forward carries no "
        "gradient: v_u.detach() + s (v_c - v_u.detach()), so the gradient is s dv_c (Flow-GRPO's "
        "train_sd3.py); --no-detach-uncond back-propagates through both branches, s dv_c - (s - 1) "
        "dv_u (as its Wan script does); unset = on for sd3 with --algo flow_grpo, off otherwise")
    text_len: int = field(512, "max text tokens (capped by the tokenizer); longer = slower text "
                          "encoding, more memory")
    prompt_cache_size: int = field(
        64, "distinct prompts whose text embeddings stay cached on the device (least recently used "
        "evicted first): more = fewer text-encoder passes when prompts repeat, more memory (FLUX "
        "T5 at 512 tokens: ~4 MB per prompt in bf16); 0 = encode every time")
    # optimisation
    lr: Optional[float] = field(None, "AdamW learning rate; unset = the published setting with "
                                "--pretrained (presets.py: Flow-GRPO 3e-4 for FLUX LoRA, DanceGRPO "
                                "1e-5 full), 3e-3 for the tiny pipelines (tiny full fine-tuning "
                                "learns at 3e-3)")
    clip_range: Optional[float] = field(None, "PPO clip range on the averaged log-prob ratio; "
                                        "unset = the published setting with --pretrained "
                                        "(presets.py: Flow-GRPO 1e-4), 1e-2 for the tiny pipelines")
    updates_per_batch: Optional[int] = field(
        None, "M: optimizer updates per RL step; unset = 2, Flow-GRPO's "
        "(gradient_accumulation_steps = num_batches_per_epoch // 2). The batch's groups are cut "
        "into M minibatches; every update after the first scores its pairs against the rollout's "
        "log-probs, so the PPO clip acts (with M = 1 a fresh pair's ratio is 1 and the clip never "
        "does). More = more learning per sample, smaller minibatches; weights are still published "
        "once per step (1 with --prompts-per-step 1)")
    max_grad_norm: float = field(1.0, "gradient norm clip")
    beta: Optional[float] = field(None, "KL weight to the reference policy (unset = the "
                                  "published setting with --pretrained, presets.py: Flow-GRPO "
                                  "SD3 0.01, FLUX 0; 0 for the tiny pipelines); >0 costs one more "
                                  "forward per "
                        "pair")
    adv_clip: float = field(5.0, "advantages are clipped to +-adv_clip")
    per_prompt_stat_tracking: Optional[bool] = field(
        None, "Flow-GRPO's advantage statistics over the whole batch: on = per prompt (its "
        "PerPromptStatTracker: every group of one prompt in the batch pools one mean and std), "
        "off (--no-per-prompt-stat-tracking) = one mean and std over the batch; unset = per group "
        "(a fragment is self-contained and GAP trains it on arrival; the same as on when a batch's "
        "prompts are unique, i.e. --prompts-per-step <= the number of prompts). Set, a trainer "
        "trains a step's fragments only once the whole batch's rewards are in (batch_rewards.py): "
        "the GAP overlap of that step's training is lost, TCSS's generate-ahead still overlaps")
    global_std: bool = field(
        False, "Flow-GRPO's sample.global_std (needs --per-prompt-stat-tracking): advantages "
        "divide by the std of all the batch's rewards instead of their prompt's; steadier on easy "
        "or hard prompts, but a prompt's advantages then depend on the other prompts' spread")
    collapsed_std: float = field(
        0.0, "a group (a prompt, with batch statistics) whose rewards' population std is <= this "
        "has collapsed: normalising it turns noise into unit-size advantages; --collapsed-groups "
        "says what is done with it, the collapsed_group_frac metric counts it. 0 = only groups "
        "whose rewards are all equal (Flow-GRPO's rule); in reward units, so set it for the "
        "reward's scale (e.g. 0.01 for rewards in [0, 1])")
    collapsed_groups: str = field(
        "drop", "drop (their advantages are 0, so the policy gradient ignores them, as Flow-GRPO "
        "drops samples whose advantages are all zero; they keep their 1/(N T_train) weight, so "
        "the step shrinks instead of renormalising) or floor (divide by max(std, "
        "--collapsed-std): their small real signal is kept at its own scale)")
    kl_scale: Optional[str] = field(
        None, "what the KL term divides the squared mean difference by: diffusion (2 g^2, g the "
        "SDE's diffusion coefficient without the step's sqrt(-dt): Flow-GRPO's kl_loss) or step "
        "(2 g^2 |dt|, the exact KL between the two step Gaussians: 1/|dt| times larger, 3.7-25x on "
        "SD3's 10 steps, so a beta acts that much stronger); unset = diffusion for flow_grpo, step "
        "for dance_grpo (DanceGRPO has no KL term of its own)")
    old_log_prob: str = field(
        "rollout", "whose log-prob a pair's PPO ratio is taken against: rollout (every pair the "
        "log-prob the rollout recorded, Flow-GRPO's; a trainer whose numerics differ from the "
        "rollout's, e.g. bf16 in other batches, starts its ratios off 1 and the tiny clip range "
        "can clip on-policy pairs) or fresh (on-policy pairs of a step's first update against "
        "their own detached log-prob, ratio exactly 1: immune to that gap, but the clip never "
        "acts there)")
    minibatches: Optional[str] = field(
        None, "how a step's samples are cut into the --updates-per-batch minibatches: samples "
        "(Flow-GRPO: the batch's samples permuted, seeded per step, then cut into M equal parts; "
        "every fragment has pairs in every minibatch, so training starts once the whole batch is "
        "in) or groups (M contiguous ranges of whole groups fixed before generation, so GAP trains "
        "each fragment as it arrives); unset = samples when the advantages are batch-level "
        "(--per-prompt-stat-tracking set: the batch is waited for anyway), else groups")
    drop_zero_advantage: Optional[bool] = field(
        None, "samples whose advantage is exactly 0 (all-equal rewards of their prompt) are left "
        "out, a few put back at random so the kept count divides into the M minibatches, and the "
        "rest re-divided (Flow-GRPO's train_sd3.py; its FLUX script keeps them): the step is the "
        "mean over informative samples instead of shrinking with the collapsed ones; needs "
        "--minibatches samples. Unset = on for sd3 with --algo flow_grpo and --minibatches samples")
    weight_decay: Optional[float] = field(None, "AdamW weight decay; unset = the published setting "
                                          "with --pretrained (presets.py: Flow-GRPO 1e-4), 0 for "
                                          "the tiny pipelines")
    optimizer: str = field("adamw", "adamw, or sgd (plain gradient descent: the update is exactly "
                           "-lr x gradient, so two runs' weights differ as their gradients do; "
                           "the equivalence tests use it)")
    lora: Optional[bool] = field(None, "LoRA on the transformer (--no-lora trains all weights); "
                                 "unset = off for tiny pipelines, on for --pretrained")
    lora_rank: Optional[int] = field(None, "LoRA rank: larger = more capacity and bigger weight "
                                     "publishes; unset = the family's Flow-GRPO setting (FLUX, "
                                     "Qwen-Image 64; Wan 32) or --init-lora's")
    lora_alpha: Optional[float] = field(None, "LoRA alpha (scale = alpha / rank); "
                                        "unset = the family's Flow-GRPO setting (2 x rank) or "
                                        "--init-lora's")
    lora_targets: Optional[str] = field(
        None, "flow_grpo (the family's published Flow-GRPO modules: FLUX and Qwen-Image "
        "attention + feed-forward, Wan attention), attention (attention projections only: fewer "
        "parameters), all-linear (every linear in the blocks: most capacity), or a comma list of "
        "module names; models/lora.py. Unset = --init-lora's target_modules (a peft "
        "adapter_config.json, or the LoRA file's metadata) when it lists them, else flow_grpo")
    init_lora: Optional[str] = field(None, "start the LoRA from this diffusers LoRA file (or its "
                                     "folder, or a peft adapter folder as Flow-GRPO saves); its "
                                     "rank and alpha are the defaults")
    fp32_master: bool = field(
        True, "full fine-tuning with a bf16 policy: trainers keep fp32 weights, gradients and "
        "AdamW state and compute in bf16 under autocast (16 instead of 8 bytes per parameter); "
        "--no-fp32-master keeps pure bf16: half the memory, but updates below half a bf16 ulp (lr "
        "1e-5 on typical weights) are lost. No effect with LoRA (adapters are always fp32)")
    grad_ckpt: bool = field(False, "gradient checkpointing in the trainer: less memory, ~30%% more "
                            "compute")
    max_bad_steps: int = field(3, "abort after this many RL steps in a row with a skipped update "
                               "(non-finite loss or gradient)")
    # machine
    device: str = field("auto", "auto, cpu or cuda")
    dtype: str = field(
        "auto", "auto (bfloat16 on cuda, float32 on cpu; on cuda fp16-autocast for sd3 with "
        "--algo flow_grpo, as Flow-GRPO runs SD3.5), float32, bfloat16, or fp16-autocast "
        "(Flow-GRPO's SD3: "
        "float32 transformer and VAE weights, float16 text encoders, the transformer computing "
        "under float16 autocast: twice bf16's weight memory, fp16's finer mantissa)")
    threads: int = field(1, "torch CPU threads per rank")
    timeout_s: float = field(300.0, "seconds a rank may show no sign of life (no heartbeat), and "
                             "the whole job no progress (no forward, pack, fragment or tensor "
                             "anywhere: a hung collective), before the job stops; never bounds "
                             "a step, which may take minutes. Smaller = a dead or stuck rank is "
                             "found sooner; it must exceed one forward or pack")
    excused_timeout_s: Optional[float] = field(
        None, "seconds a rank may spend without reporting progress inside a phase that cannot "
        "report any (loading the pipeline, building the reward, a reward call, writing the run "
        "directory or the trace), counted from the phase's start or its last report; past it that "
        "silence counts like any other (--timeout-s). Unset = 4 x --timeout-s. Larger tolerates "
        "slower disks, downloads and rewards; smaller finds a rank wedged there sooner")
    stop_grace_s: float = field(
        30.0, "after SIGTERM/SIGINT a running job finishes its step and checkpoints; if no rank "
        "makes progress for this many seconds (or --timeout-s, if smaller) it ends without that "
        "checkpoint, the last complete one stays. Schedulers SIGKILL after their own grace (SLURM "
        "KillWait, Kubernetes' terminationGracePeriodSeconds: 30 s by default), so larger helps "
        "only where theirs is larger; smaller ends a stuck job sooner")
    backend: str = field("auto", "compute-plane backend: auto (NCCL when every rank of a node has "
                         "its own GPU, else gloo), nccl, gloo. The data plane is always gloo with "
                         "CPU tensors (comm.py)")
    seed: int = field(0, "seed of prompts order and noise: the same seed gives the same "
                      "trajectories in every mode (0 to about 9 million: every seed derived "
                      "from it stays an int64)")
    # run directory
    run_name: Optional[str] = field(None, "runs/<run_name>; unset = model-mode-timestamp")
    out_dir: str = field("runs", "parent folder of run directories")
    eval_every: int = field(10, "deterministic evaluation every N steps and before the first "
                            "(0 = never); each costs one generation of eval_seeds samples per "
                            "training and held-out prompt")
    eval_seeds: Optional[int] = field(None, "evaluation samples per prompt (the same held-out "
                                      "noises for every prompt): more = a steadier eval_reward and "
                                      "wider eval grids, more time per evaluation; unset = 8 for "
                                      "the tiny pipelines, 1 with --pretrained")
    ema: bool = field(False, "evaluate (and save beside the weights) an exponential moving average "
                            "of the trained weights (Flow-GRPO's train.ema): smoother evaluation "
                            "of a noisy policy, one more copy of the trainable weights per "
                            "trainer; sampling always uses the trained weights")
    ema_decay: float = field(0.9, "the EMA's decay (Flow-GRPO 0.9, warmed up as min((1+u)/(10+u), "
                                  "decay)): higher = a longer average, slower to follow the policy")
    ema_repeats: Optional[int] = field(
        None, "times one EMA trigger is applied to the same weights: Flow-GRPO calls ema.step once "
        "per sampled sub-batch, i.e. gradient_accumulation_steps times per optimizer update (its "
        "SD3 recipes 2, FLUX 6 on their 32 GPUs: an effective decay 0.81 / 0.53 per trigger at "
        "0.9); "
        "more = the average follows the policy faster; unset = the published setting with "
        "--pretrained (presets.py), 1 for the tiny pipelines")
    ema_every: int = field(8, "EMA update every N optimizer updates (Flow-GRPO's "
                              "update_step_interval 8): fewer = cheaper, a coarser average")
    eval_num_steps: Optional[int] = field(
        None, "denoising steps T of each evaluation sample (Flow-GRPO's sample.eval_num_steps): "
        "more = the score of finer final images, more time per evaluation; unset = --num-steps")
    eval_guidance: Optional[float] = field(None, "guidance of evaluation samples (Flow-GRPO's "
                                           "sample.guidance_scale at eval); unset = --guidance "
                                           "(the training one)")
    save_every: int = field(50, "checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = field(2, "keep the last N checkpoints")
    resume: Optional[str] = field(None, "run directory to resume from its last checkpoint")
    tensorboard: bool = field(False, "also log metrics and eval images to TensorBoard in the run "
                              "directory")
    wandb: bool = field(False, "also log metrics, captioned eval images and the config to "
                        "Weights & Biases (WANDB_MODE=offline: no network, sync later)")
    wandb_project: str = field("digenrl", "W&B project")
    wandb_name: Optional[str] = field(None, "W&B run name; unset = the run directory's name")
    config: Optional[str] = field(None, "a run's config.json to start from (flags given override "
                                  "it); a new run")
    trace: Optional[bool] = field(None, "record per-rank spans -> trace.json + timeline.png; "
                                  "unset = on for runs of <= 200 steps")
    progress: bool = field(True, "tqdm progress bar on the leader")
    dry_run: bool = field(False, "validate, print the resolved configuration and the preset in "
                          "force, and exit without starting any rank")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage dump of every option
        self.exit(2, f"error: {message} (python main.py --help lists every option)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(description="digenrl: disaggregated Flow-GRPO for diffusion models",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flags = ["--" + name.replace("_", "-") for name in (f.metadata.get("flag", f.name),
                                                               *f.metadata.get("aliases", ()))]
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind in ("bool", "Optional[bool]"):
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=f.metadata["help"])
        else:
            caster = {"int": int, "Optional[int]": int, "float": float,
                      "Optional[float]": float}.get(kind, str)
            parser.add_argument(*flags, dest=f.name, type=caster, default=f.default,
                                help=f.metadata["help"])
    return parser


def negative_numbers_joined(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--lr -1e-4` -> `--lr=-1e-4`: argparse takes a value that starts with '-' for a flag unless
    it looks like '-1' or '-.5', so '-1e-4' or '-inf' gave "expected one argument" instead of the
    validation's message."""
    takes_value = {o for a in parser._actions
                   if a.nargs is None and not isinstance(a, argparse.BooleanOptionalAction)
                   for o in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        if (argv[i] in takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-")
                and _is_number(argv[i + 1])):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_args(argv=None) -> Config:
    """Flags, on top of --resume RUN's or --config FILE's saved configuration if given
    (infra/saved_config.py)."""
    parser = build_parser()
    argv = negative_numbers_joined(parser, list(sys.argv[1:] if argv is None else argv))
    return saved_config.merge(parser, argv, Config, resolve)


def resolve(cfg: Config, world: int | None = None) -> Config:
    """Fill the derived defaults (mode -> mechanism flags, LoRA auto, trace auto); returns a new
    Config. With `world` = 1 (one rank: torchrun's default of one process per node, or --nproc 1)
    the default mode is colocated: the disaggregated ones need a rollout and a trainer rank."""
    c = dataclasses.replace(cfg)
    given = {name: getattr(c, name) for name in MECHANISM_FIELDS if getattr(c, name) is not None}
    # nothing, or only --no-X flags: DigenRL minus those
    if c.mode is None and not any(given.values()):
        c.mode = "colocated" if world == 1 else "digenrl"
    if c.mode is not None:
        if c.mode not in MODES:
            raise ValueError(f"--mode {c.mode!r} is not one of {', '.join(MODES)}")
        preset = dict(zip(MECHANISM_FIELDS, MODES[c.mode]))
        for name, value in {**preset, **given}.items():  # explicit flags override the mode's preset
            setattr(c, name, value)
        if any(preset[name] != value for name, value in given.items()):
            c.mode = "custom"  # e.g. --mode digenrl --no-tcss: label the run by what it really ran
    else:
        c.mode = "custom"
        c.placement = c.placement or "disaggregated"
        for name in MECHANISM_FIELDS[1:]:
            setattr(c, name, bool(getattr(c, name)))
    if c.model is None:
        c.model = models.family_of_pipeline(c.pretrained) or "flux"
    if c.lora is None:
        c.lora = c.pretrained is not None or c.init_lora is not None
    preset = presets.for_run(c.model, c.pretrained is not None, c.algo, c.lora)
    sample_batch_given = c.sample_batch_size is not None
    # a size given: square
    sized = {"frames"} | (set() if c.resolution or c.width else {"resolution", "width"})
    for name, setting in preset.values.items():  # what no flag set: the published (or tiny) setting
        if getattr(c, name) is None or (name in sized and getattr(c, name) == 0):
            setattr(c, name, setting.value)
    _resolve_flow_grpo(c)
    call = c.fragment_groups * c.group_size  # trajectories per generation call
    if not sample_batch_given and c.sample_batch_size and call > 0 and call % c.sample_batch_size:
        # the published batch where it divides the fragment, else its largest divisor below it
        c.sample_batch_size = max(d for d in range(1, c.sample_batch_size + 1) if call % d == 0)
    if c.lora and (c.lora_rank is None or c.lora_alpha is None):
        rank, alpha = lora.default_rank_alpha(c.model, c.init_lora)
        c.lora_rank = rank if c.lora_rank is None else c.lora_rank
        c.lora_alpha = alpha if c.lora_alpha is None else c.lora_alpha
    if c.lora_targets is None:
        c.lora_targets = lora.default_targets(c.init_lora) if c.lora else "flow_grpo"
    if c.tsp_pack is None:
        c.tsp_pack = 4 if c.pretrained is not None else 20
    # Flow-GRPO: gradient_accumulation_steps = num_batches_per_epoch // 2
    if c.updates_per_batch is None:
        c.updates_per_batch = min(2, c.prompts_per_step)
    if c.eval_seeds is None:
        c.eval_seeds = 1 if c.pretrained is not None else 8
    if c.max_stale_fragments is None:
        c.max_stale_fragments = c.rollout_ranks
    if c.trace is None:
        c.trace = c.steps <= 200
    return c


def _resolve_flow_grpo(c: Config) -> None:
    """Flow-GRPO's training step where a run follows it (docs/USAGE.md, the README's Flow-GRPO
    table): each unset choice resolved from the algorithm, the family and the statistics."""
    flow = c.algo == "flow_grpo"
    if c.kl_scale is None:
        c.kl_scale = "diffusion" if flow else "step"
    if c.detach_uncond is None:  # Flow-GRPO's train_sd3.py detaches; its Wan script does not
        c.detach_uncond = flow and c.model == "sd3"
    if c.minibatches is None:  # batch-level statistics wait for the whole batch anyway
        c.minibatches = "samples" if c.per_prompt_stat_tracking is not None else "groups"
    if c.drop_zero_advantage is None:  # train_sd3.py drops them; train_flux.py keeps them
        c.drop_zero_advantage = flow and c.model == "sd3" and c.minibatches == "samples"
    if c.eval_split is None:
        c.eval_split = "test" if c.pretrained is not None else "train+test"


def from_dict(d: dict) -> Config:
    names = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in saved_config.renamed_fields(d).items() if k in names})
