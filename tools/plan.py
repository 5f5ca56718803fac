"""A planner for real clusters: the fastest DigenRL configuration that fits, as a command to run.

    python tools/plan.py --model flux --gpus 16                       # 16 H200s, LoRA
    python tools/plan.py --model wan --gpus 32 --no-lora              # full fine-tuning (FSDP over the trainers)
    python tools/plan.py --model flux --gpus 32 --rollout-gpus 16 --rollout-speed 0.5   # slower rollout GPUs
    python tools/plan.py --model flux --gpus 16 --runtime before-25   # plan for the runtime before issue 25
    python tools/plan.py --model flux --gpus 16 --updates-per-batch 2 # Flow-GRPO's two updates per batch

It searches R (rollout ranks; K = P - R trainers), the fragment size (--fragment-groups), --tsp-pack, TAG on or
off and TCSS's budget j (--max-stale-fragments 0, 1 or R) with tools/simulate.py's event model on the H200
per-op profiles (tools/profiles/, at paper_settings.json's workload: the model's T, T_train, G, B = 32,
resolution and M updates per batch), drops what the real-size memory estimate says does not fit
(tools/plan_memory.py: both roles' peaks, cached from tools/estimate_memory.py) and what cli.validate
refuses, and prints the best `torchrun ... main.py ...` command with its predicted step time, next to the ideal
colocated system's (same M), and the runner-up configurations. The search is in two stages: every R with
the default knobs, then the full grid of knobs around the three best R.

`--runtime issue25` (the default) simulates the runtime since issue 25: TSP packs span the fragments of a
minibatch (padding once per update), and TAG claims whole groups and splits their trajectories over the K
trainers (tag.Assistant with the group size; simulate.py's tag_split="group-claims"). `--runtime before-25`
simulates the runtime before it: each fragment padded to whole packs, TAG's groups split over the trainers by
whole groups. The printed command is the same for both; only the prediction differs.

`--updates-per-batch M` (default: paper_settings.json's, 1: the DigenRL paper's one optimizer step per RL step)
is simulated and always printed in the command: main.py's own default is Flow-GRPO's min(2, prompts per step).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import plan_memory  # noqa: E402
from tools.paper_costs import paper_costs, paper_settings, paper_workload  # noqa: E402
from tools.simulate import Cluster, StepReport, simulate  # noqa: E402

RUNTIMES = {"issue25": {"tsp_span": True, "tag_split": "group-claims"}, "before-25": {}}
# simulator-only what-ifs: no runtime trains this way, so plan.py does not offer them (unaligned rollout claims)
WHAT_IFS = {"issue25, unaligned part claims": {"tsp_span": True, "tag_split": "trajectories"}}
FRAGMENT_GROUPS, PACKS = (1, 2, 4), (1, 2, 4, 8)
PRETRAINED = {"flux": "/models/FLUX.1-dev", "qwenimage": "/models/Qwen-Image",
              "wan": "/models/Wan2.1-T2V-14B-Diffusers", "hunyuanvideo": "/models/HunyuanVideo"}


@dataclasses.dataclass(frozen=True)
class Candidate:
    rollout_ranks: int
    fragment_groups: int
    tsp_pack: int
    tag: bool
    max_stale: int  # j: fragments per step generated one version stale (TCSS)


@dataclasses.dataclass
class Plan:
    candidate: Candidate
    report: StepReport
    memory: dict | None  # GiB per role (None: no estimate for this model)


@dataclasses.dataclass
class Problem:
    """What is planned: a model's costs and workload on a cluster, the runtime model and the memory limits."""

    label: str  # paper_settings.json's model
    family: str | None  # None: no memory estimate, no command (a FLOPs-scaled family)
    gpus: int
    lora: bool = True
    rollout_speed: float = 1.0
    rollout_gpus: int | None = None  # fixed R (heterogeneous hardware), else searched
    runtime: str = "issue25"
    gpus_per_node: int = 8
    costs_of: object = None  # fragment_groups -> Costs; default: paper_costs of the label
    updates_per_batch: int | None = None  # M; None = paper_settings.json's

    @property
    def updates(self) -> int:
        return paper_settings()["updates_per_batch"] if self.updates_per_batch is None else self.updates_per_batch

    def costs(self, fragment_groups: int):
        if self.costs_of is not None:
            return self.costs_of(fragment_groups)
        wl = self.workload(Candidate(1, fragment_groups, 1, True, 0))
        return paper_costs(self.label, wl.m, wl.train_steps)

    def workload(self, c: Candidate):
        wl = paper_workload(self.label, max_stale=c.max_stale, updates_per_batch=self.updates)
        runtime = {**RUNTIMES, **WHAT_IFS}[self.runtime]
        return dataclasses.replace(wl, fragment_groups=c.fragment_groups, tsp_pack=c.tsp_pack,
                                   fsdp=not self.lora, **runtime)

    def cluster(self, rollout_ranks: int) -> Cluster:
        return Cluster(self.gpus, rollout_ranks, rollout_kind="rollout",
                       speeds={"h200": 1.0, "rollout": self.rollout_speed})


def admissible(p: Problem, c: Candidate, memory_cache: dict | None) -> tuple[bool, dict | None, str]:
    """(runs, memory peaks, why not): the rules cli.validate applies, and the memory estimate."""
    trainers = p.gpus - c.rollout_ranks
    if paper_settings()["batch_groups"] % c.fragment_groups:
        return False, None, "fragment size does not divide the batch"
    if not p.lora and c.tag and c.fragment_groups < trainers:
        return False, None, "--fsdp with --tag needs --fragment-groups >= K"
    if p.family is None:
        return True, None, ""
    peaks = plan_memory.peaks(p.family, p.lora, c.fragment_groups, c.tsp_pack, trainers, memory_cache)
    if not plan_memory.fits(peaks):
        return False, peaks, "memory"
    return True, peaks, ""


def evaluate(p: Problem, c: Candidate, memory_cache, seen: dict) -> Plan | None:
    if c in seen:
        return seen[c]
    ok, peaks, _ = admissible(p, c, memory_cache)
    plan = None
    if ok:
        mode = "digenrl" if c.tag else "gap+tsp+tcss"
        rep = simulate(mode, p.costs(c.fragment_groups), p.cluster(c.rollout_ranks), p.workload(c))
        plan = Plan(c, rep, peaks)
    seen[c] = plan
    return plan


def search(p: Problem, memory_cache: dict | None = None) -> tuple[list[Plan], dict]:
    """Every admissible candidate evaluated, fastest first; and the rejection counts by reason."""
    if p.family is not None and memory_cache is None:
        memory_cache = plan_memory.load()
    pack0 = paper_settings()["models"][p.label]["pack"]
    splits = [p.rollout_gpus] if p.rollout_gpus else range(1, p.gpus)
    seen: dict = {}
    sizes = FRAGMENT_GROUPS if p.lora else FRAGMENT_GROUPS + (8, 16)  # FSDP + TAG needs fragments >= K
    first = []
    for r in splits:  # stage 1: the default knobs per R (TAG off, or the first that fits, where they do not)
        for f, k, tag in [(1, pack0, True), (1, pack0, False)] + [(f, k, t) for f in sizes for k in PACKS
                                                                  for t in (True, False)]:
            if plan := evaluate(p, Candidate(r, f, k, tag, r), memory_cache, seen):
                first.append(plan)
                break
    ranked = sorted(first, key=lambda x: x.report.step_s)
    for r in [x.candidate.rollout_ranks for x in ranked[:3]]:
        for f in sizes:
            for k in PACKS:
                for tag in (True, False):
                    for j in sorted({0, 1, r}):
                        evaluate(p, Candidate(r, f, k, tag, j), memory_cache, seen)
    rejected: dict = {}
    for c, plan in seen.items():
        if plan is None:
            reason = admissible(p, c, memory_cache)[2]
            rejected[reason] = rejected.get(reason, 0) + 1
    plans = sorted((x for x in seen.values() if x),  # ties: fewer rollout ranks
                   key=lambda x: (x.report.step_s, x.candidate.rollout_ranks))
    return plans, rejected


def main_args(p: Problem, c: Candidate, pretrained: str | None = "") -> list[str]:
    """main.py's arguments for a candidate; pretrained "" = the placeholder path, None = left out."""
    s = paper_settings()["models"][p.label]
    path = PRETRAINED.get(p.family, "/models/PIPELINE") if pretrained == "" else pretrained
    args = ["--model", p.family] + (["--pretrained", path] if path else [])
    args += ["--lora"] if p.lora else ["--no-lora", "--fsdp"]
    args += ["--rollout-ranks", str(c.rollout_ranks), "--prompts-per-step", str(paper_settings()["batch_groups"]),
             "--group-size", str(s["G"]), "--num-steps", str(s["T"]), "--timestep-fraction", str(s["frac"])]
    for name, value in s["flags"].items():
        args += [f"--{name}", str(value)]
    args += ["--fragment-groups", str(c.fragment_groups), "--tsp-pack", str(c.tsp_pack),
             "--max-stale-fragments", str(c.max_stale), "--updates-per-batch", str(p.updates)]
    return args + ([] if c.tag else ["--no-tag"]) + (
        ["--grad-ckpt"] if s["grad_ckpt"] else [])


def command(p: Problem, c: Candidate) -> str:
    nodes = max(1, -(-p.gpus // p.gpus_per_node))
    launcher = (f"torchrun --nproc_per_node={p.gpus}" if nodes == 1 else
                f"torchrun --nnodes={nodes} --nproc_per_node={p.gpus // nodes} --rdzv-backend=c10d "
                "--rdzv-endpoint=HEAD_NODE:29500 --rdzv-id=JOB")  # the same on every node (README)
    return f"{launcher} main.py " + " ".join(shlex.quote(a) for a in main_args(p, c))


def validate(p: Problem, c: Candidate) -> None:
    """config's own parser and resolve, and cli's validate, on the candidate's arguments (the weights left out: they are
    not on this machine; tests/test_plan.py also runs it with the family's tiny pipeline in their place)."""
    import cli
    import config
    cfg = config.resolve(config.parse_args(main_args(p, c, pretrained=None)), p.gpus)
    cli.validate(cfg, p.gpus)


def best(p: Problem, memory_cache: dict | None = None, top: int = 5) -> tuple[list[Plan], dict]:
    """The `top` fastest candidates that cli.validate accepts (families with a command), fastest first."""
    plans, rejected = search(p, memory_cache)
    if p.family is None:
        return plans[:top], rejected
    kept = []
    for plan in plans:
        try:
            validate(p, plan.candidate)
        except (ValueError, SystemExit) as exc:
            rejected[f"cli.validate: {exc}"] = rejected.get(f"cli.validate: {exc}", 0) + 1
            continue
        kept.append(plan)
        if len(kept) == top:
            break
    return kept, rejected


def ideal_colocated_s(p: Problem) -> float | None:
    """The ideal colocated system (no switch cost) on the same GPUs; None when the slower GPUs are not fixed."""
    if p.rollout_speed != 1 and p.rollout_gpus is None:
        return None
    wl = paper_workload(p.label, updates_per_batch=p.updates)
    return simulate("colocated", p.costs(wl.fragment_groups), p.cluster(p.rollout_gpus or 1), wl).step_s


def describe(plan: Plan, gpus: int) -> str:
    c, mem = plan.candidate, plan.memory
    memory = f"rollout {mem['rollout_gib']:5.1f} trainer {mem['trainer_gib']:5.1f} GiB" if mem else "no estimate"
    tag = "on " if c.tag else "off"
    return (f"R={c.rollout_ranks:<2} K={gpus - c.rollout_ranks:<2} fragment {c.fragment_groups} pack {c.tsp_pack} "
            f"tag {tag} j={c.max_stale:<2} step {plan.report.step_s:7.2f} s  eff {plan.report.efficiency:.2f}  "
            f"tag groups/step {plan.report.tag_groups:4.1f}  {memory}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(PRETRAINED), help="seed model family")
    parser.add_argument("--gpus", type=int, required=True, help="P: GPUs (ranks) in the job")
    parser.add_argument("--rollout-speed", type=float, default=1.0,
                        help="rollout GPUs' speed relative to an H200 (0.5: half as fast)")
    parser.add_argument("--rollout-gpus", type=int, help="fix R (e.g. the slower GPUs); default: searched")
    parser.add_argument("--lora", action=argparse.BooleanOptionalAction, default=True,
                        help="LoRA (default) or full fine-tuning with FSDP over the trainers")
    parser.add_argument("--runtime", choices=sorted(RUNTIMES), default="issue25",
                        help="issue25 (the runtime since issue 25): TSP packs span the fragments of a minibatch and "
                        "TAG claims whole groups, their trajectories split over the K trainers; before-25 (before it): "
                        "packs per fragment, TAG's groups split over the trainers by whole groups")
    parser.add_argument("--updates-per-batch", type=int, default=paper_settings()["updates_per_batch"],
                        help="M: optimizer steps per RL step, simulated and passed to main.py (default: "
                        "profiles/paper_settings.json's, the DigenRL paper's one; main.py's own default is 2)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--top", type=int, default=5, help="configurations printed (the best and runner-ups)")
    args = parser.parse_args(argv)
    if args.gpus < 2:
        parser.error(f"--gpus {args.gpus}: DigenRL needs at least 2 (a rollout and a trainer rank)")
    if not 0 < args.rollout_speed <= 4:
        parser.error(f"--rollout-speed {args.rollout_speed}: must be in (0, 4]")
    if args.rollout_gpus is not None and not 1 <= args.rollout_gpus < args.gpus:
        parser.error(f"--rollout-gpus {args.rollout_gpus}: must be between 1 and {args.gpus - 1}")
    if not 1 <= args.updates_per_batch <= paper_settings()["batch_groups"]:
        parser.error(f"--updates-per-batch {args.updates_per_batch}: must be between 1 and the "
                     f"{paper_settings()['batch_groups']} groups of a batch")
    label, _ = plan_memory.settings(args.model)
    p = Problem(label, args.model, args.gpus, args.lora, args.rollout_speed, args.rollout_gpus, args.runtime,
                args.gpus_per_node, updates_per_batch=args.updates_per_batch)
    plans, rejected = best(p, top=args.top)
    where = (f"{args.gpus} GPUs" + (f", rollout at {args.rollout_speed:g}x H200" if args.rollout_speed != 1 else
                                   " (H200)"))
    print(f"# plan: {label} on {where}, {'LoRA' if args.lora else 'full fine-tuning (FSDP)'}, M = {p.updates} "
          f"update{'s' if p.updates > 1 else ''} per batch; runtime model: "
          f"{args.runtime} {RUNTIMES[args.runtime] or '(packs per fragment, TAG by whole groups)'}")
    print("# rejected: " + (", ".join(f"{n} ({why})" for why, n in rejected.items()) or "none"))
    if not plans:
        print("no configuration fits: try more GPUs, LoRA, or a smaller workload")
        return 1
    ideal = ideal_colocated_s(p)
    top = plans[0]
    versus = (f"ideal colocated on the same GPUs {ideal:.2f} s: {ideal / top.report.step_s:.2f}x" if ideal else
              "give --rollout-gpus for the colocated comparison")
    print(f"best: predicted step {top.report.step_s:.2f} s ({versus})\n  {describe(top, p.gpus)}\n"
          f"{command(p, top.candidate)}")
    if len(plans) > 1:
        print("runner-up configurations:")
        for plan in plans[1:]:
            print("  " + describe(plan, p.gpus))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
