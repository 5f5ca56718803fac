"""The paper-scale table: the four seed models on 16 and 32 H200s (and one heterogeneous cluster)
from the H200 per-operation costs measured in profiles/ and the paper's settings.

    python tools/paper_scale.py              # every case, every mode, and the summary
    python tools/paper_scale.py --out x.json

Each case runs every mode through simulate.py's event model with the best R/K split and the runtime's
default knobs ("digenrl before": fragments of one group, the model's pack, j = R, without issue 25's
changes), plus DigenRL with the smallest stale budget (j=1). The "digenrl" row is tools/plan.py's best
configuration (R, fragment size, pack, TAG, j; memory-checked) with
the runtime since issue 25 (TSP packs that span the fragments of a minibatch; TAG claims whole groups and
splits their trajectories over the K trainers) and the command it prints;
"digenrl planned, today" is the planner's best without issue 25's changes, so the summary separates what the
knobs buy from what the runtime changes buy. The "floor" is sim_model.disaggregated_floor_s at the best R: no
disaggregated schedule of this cost model can beat it (padding per update, per-step costs, generation split
fractionally), so where it is slower than a baseline, no DigenRL configuration can be faster. Every row runs
paper_settings.json's M = updates_per_batch optimizer steps per RL step (the command passes it).
Two colocated baselines: `colocated` is ideal (no switch cost); `colocated-real` pays what a
veRL-Omni-style system pays per step (rollout sleep/wake, weight sync, actor offload/reload; costs and
their sources in profiles/colocated_switch.json). The summary puts DigenRL's speedup over both next to
the paper's 1.56-2.10x. A family with no measured profile is scaled from a measured one by FLOPs, and the output
says so. (The workload and cost readers are tools/paper_costs.py, which plan.py imports too: no cycle.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import plan  # noqa: E402
from tools.paper_costs import (_profile, paper_costs, paper_settings, paper_workload,  # noqa: E402,F401
                               scaled_costs, switch_parts)
from tools.sim_model import disaggregated_floor_s  # noqa: E402
from tools.simulate import MODES, REAL_COLOCATED, Cluster, Costs, best_split, format_report, simulate  # noqa: E402

PAPER_SPEEDUP = "1.56-2.10x"
FLOOR = "digenrl floor (any disaggregated schedule, best R)"


def run_case(label: str, nproc, p: dict) -> dict:
    """Every mode for one model on one cluster; nproc = 16, 32 or "hetero". The "digenrl" row is the
    planner's best configuration (tools/plan.py) with the runtime since issue 25; "digenrl before" is the
    runtime's defaults (fragments of one group, the model's pack, j = R, best R) without issue 25's changes;
    FLOOR is the best disaggregated_floor_s over R (R = 16 on the heterogeneous cluster)."""
    extra = p["unmeasured_example"]
    key = label if label in p["models"] else extra["scale_from"]
    wl = paper_workload(key)

    def costs_of(fragment_groups: int) -> Costs:
        base = paper_costs(key, fragment_groups * wl.group_size, wl.train_steps)
        if key == label:
            return base
        ratio = extra["params"] / p["models"][key]["params"] * extra["tokens_ratio"]  # FLOPs-scaled
        return scaled_costs(base, ratio, label, extra["true_cfg"])

    costs = costs_of(wl.fragment_groups)
    hetero = nproc == "hetero"
    if hetero:
        cluster = Cluster(32, 16, rollout_kind="half", speeds={"h200": 1.0, "half": 0.5})
        run = lambda mode, w: simulate(mode, costs, cluster, w)  # noqa: E731
    else:
        cluster = Cluster(nproc)
        run = lambda mode, w: best_split(mode, costs, cluster, w)  # noqa: E731
    parts = switch_parts(key, cluster.nproc)
    real = dataclasses.replace(costs, switch_s=sum(v for k, v in parts.items() if k.endswith(")")))
    reports = [run(mode, wl) for mode in MODES]
    reports.insert(1, simulate(REAL_COLOCATED, real, cluster, wl))
    reports[-1] = dataclasses.replace(reports[-1], mode="digenrl before")
    reports.append(dataclasses.replace(run("digenrl", paper_workload(key, max_stale=1)),
                                       mode="digenrl j=1 before"))
    planned = {}
    for runtime in ("before-25", "issue25"):
        problem = plan.Problem(key, p["models"][key]["family"] if key == label else None, cluster.nproc,
                               rollout_speed=0.5 if hetero else 1.0, rollout_gpus=16 if hetero else None,
                               runtime=runtime, costs_of=costs_of)
        plans, _ = plan.best(problem, top=1)
        planned[runtime] = (problem, plans[0])
    problem, best_plan = planned["issue25"]
    reports.append(dataclasses.replace(planned["before-25"][1].report, mode="digenrl planned, today"))
    reports.append(dataclasses.replace(best_plan.report, mode="digenrl"))
    splits = [16] if hetero else range(1, cluster.nproc)
    floor = min((disaggregated_floor_s(costs, wl, dataclasses.replace(cluster, rollout_ranks=r)), r)
                for r in splits)
    where = "16 rollout GPUs at 0.5x + 16 H200 trainers" if hetero else f"{nproc} H200"
    return {"model": label, "cluster": where, "provenance": costs.provenance, "workload": wl,
            "switch": parts, "reports": reports, "plan": best_plan.candidate, "floor": floor,
            "command": plan.command(problem, best_plan.candidate) if problem.family else None}


def print_case(case: dict) -> None:
    wl, reports, parts = case["workload"], case["reports"], case["switch"]
    by = {r.mode: r for r in reports}
    print(f"\n## {case['model']}, {case['cluster']}: T={wl.num_steps} T_train={wl.train_steps} "
          f"G={wl.group_size} B={wl.groups}  [{case['provenance']}]")
    print("  colocated-real switch per step: " + ", ".join(
        f"{k} {v:.2f}" + ("" if k.endswith("GB") else " s") for k, v in parts.items()))
    for rep in reports:
        print("  " + format_report(rep))
    d = by["digenrl"]
    print(f"  planner's choice: {case['plan']}" + (f"\n  {case['command']}" if case["command"] else ""))
    floor, r = case["floor"]
    print(f"  {FLOOR}: {floor:.2f} s at R={r} ({by['colocated'].step_s / floor:.4f}x ideal colocated, "
          f"{by[REAL_COLOCATED].step_s / floor:.4f}x real-cost colocated)")
    print(f"  DigenRL vs ideal colocated {by['colocated'].step_s / d.step_s:.2f}x, vs real-cost "
          f"colocated {by[REAL_COLOCATED].step_s / d.step_s:.2f}x (paper: {PAPER_SPEEDUP}), "
          f"vs naive {by['naive'].step_s / d.step_s:.2f}x; a colocated switch cost of "
          f"{max(0.0, 1.56 * d.step_s - by['colocated'].step_s):.1f} s/step would give 1.56x")


def print_summary(cases: list[dict]) -> None:
    print("\n## Summary: DigenRL step-time ratio (higher = DigenRL faster). before: the runtime's defaults "
          "without issue 25; planned: tools/plan.py's best configuration, the runtime before issue 25; after: "
          "planned, the runtime since issue 25 (TSP packs spanning fragments, TAG claims whole groups split over "
          "the trainers by trajectories: the printed command); floor: the best any disaggregated schedule of the model can do (disaggregated_floor_s)")
    print(f"  {'model':<34}{'GPUs':<44}{'vs ideal: before':>17}{'planned':>9}{'after':>7}{'floor':>9}"
          f"{'vs real: before':>16}{'after':>7}{'floor':>7}{'paper':>11}")
    for case in cases:
        by = {r.mode: r.step_s for r in case["reports"]}
        ideal, real = by["colocated"], by[REAL_COLOCATED]
        before, planned, after = by["digenrl before"], by["digenrl planned, today"], by["digenrl"]
        floor = case["floor"][0]
        print(f"  {case['model']:<34}{case['cluster']:<44}{ideal / before:>16.3f}x{ideal / planned:>8.3f}x"
              f"{ideal / after:>6.3f}x{ideal / floor:>8.3f}x{real / before:>15.3f}x{real / after:>6.3f}x"
              f"{real / floor:>6.3f}x{PAPER_SPEEDUP:>11}")


def print_paper(out: str | None = None) -> list[dict]:
    p = paper_settings()
    print("# DigenRL cost model at paper settings (python tools/paper_scale.py). Assumptions "
          "(profiles/paper_settings.json, profiles/colocated_switch.json):")
    assumptions = p["assumptions"] + _profile("colocated_switch.json")["assumptions"]
    print("\n".join(f"#  - {line}" for line in assumptions))
    cases = [(label, n) for label in p["models"] for n in (16, 32)]
    cases += [(p["unmeasured_example"]["label"], 16), (next(iter(p["models"])), "hetero")]
    results = []
    for label, nproc in cases:
        results.append(run_case(label, nproc, p))
        print_case(results[-1])
    print_summary(results)
    if out:
        with open(out, "w") as f:
            json.dump([{**r, "workload": dataclasses.asdict(r["workload"]),
                        "reports": [dataclasses.asdict(x) for x in r["reports"]],
                        "plan": dataclasses.asdict(r["plan"])}
                       for r in results], f, indent=1)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write every report as JSON here")
    print_paper(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
