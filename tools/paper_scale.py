"""The paper-scale table: the four seed models on 16 and 32 H200s (and one heterogeneous cluster) from
the H200 per-operation costs measured in profiles/ and the paper's settings (profiles/paper_settings.json).

    python simulate.py --paper          # (or: python paper_scale.py)

Each case runs every mode through simulate.py's event model with the best R/K split, plus DigenRL with the
smallest stale budget (j=1), and prints DigenRL's speedup next to the paper's 1.56-2.10x. A family with no
measured profile is scaled from a measured one by FLOPs, and the output says so.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.simulate import MODES, Cluster, Costs, Workload, best_split, format_report, simulate

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


def paper_settings() -> dict:
    with open(os.path.join(PROFILE_DIR, "paper_settings.json")) as f:
        return json.load(f)


def paper_workload(label: str, max_stale: int | None = None) -> Workload:
    s, p = paper_settings()["models"][label], paper_settings()
    return Workload(groups=p["batch_groups"], group_size=s["G"], num_steps=s["T"], train_steps=round(s["frac"] * s["T"]),
                    fragment_groups=p["fragment_groups"], tsp_pack=s["pack"], max_stale=max_stale, steps=8)


def paper_costs(label: str, fragment_m: int, train_steps: int) -> Costs:
    """H200 costs of a seed model: profiles/h200_*.json rows plus the assumptions in profiles/paper_settings.json."""
    p = paper_settings()
    s = p["models"][label]
    with open(os.path.join(PROFILE_DIR, s["file"])) as f:
        data = json.load(f)
    rows = lambda key, **match: {r["bs"]: r["sec"] / r["bs"] for r in data[key]  # noqa: E731  (seconds per sample)
                                 if "sec" in r and all(r.get(k) == v for k, v in match.items())}
    link, scale = p["link_bytes_per_s"], s["params"] / p["flux_params"]  # LoRA size scales with the model
    return Costs(rows(**s["forward"]), rows(**s["train"]), decode_s=s["decode_s"], reward_s=s["reward_s"],
                 transfer_s=fragment_m * (train_steps * s["latent_bytes"] + s["text_bytes"]) / link,
                 publish_s=scale * (p["flux_lora_device_to_host_s"] + p["flux_lora_bytes"] / link),
                 optimizer_s=p["optimizer_s"], allreduce_s=p["allreduce_s"], step_overhead_s=p["step_overhead_s"],
                 true_cfg=s["true_cfg"], name=label, provenance=f"measured: profiles/{s['file']} ({data['gpu']})")


def scaled_costs(base: Costs, ratio: float, label: str, true_cfg: bool) -> Costs:
    """A family with no measurement: forward and train costs of a measured one times a FLOPs ratio."""
    return dataclasses.replace(base, forward_s={k: v * ratio for k, v in base.forward_s.items()},
                               train_s={k: v * ratio for k, v in base.train_s.items()}, true_cfg=true_cfg, name=label,
                               provenance=f"NOT measured: {base.name} costs scaled by FLOPs x{ratio:.2f}")


def print_paper() -> list[dict]:
    p = paper_settings()
    print("# DigenRL cost model at paper settings (python simulate.py --paper). Assumptions (profiles/paper_settings.json):")
    print("\n".join(f"#  - {line}" for line in p["assumptions"]))
    extra = p["unmeasured_example"]
    cases = [(label, n) for label in p["models"] for n in (16, 32)]
    cases += [(extra["label"], 16), (next(iter(p["models"])), "hetero")]
    results = []
    for label, nproc in cases:
        key = label if label in p["models"] else extra["scale_from"]
        wl = paper_workload(key)
        costs = paper_costs(key, wl.m, wl.train_steps)
        if key != label:  # a family with no profile: FLOPs-scaled from a measured one
            ratio = extra["params"] / p["models"][key]["params"] * extra["tokens_ratio"]
            costs = scaled_costs(costs, ratio, label, extra["true_cfg"])
        if nproc == "hetero":
            cluster = Cluster(32, 16, rollout_kind="half", speeds={"h200": 1.0, "half": 0.5})
            run = lambda mode, w: simulate(mode, costs, cluster, w)  # noqa: E731
        else:
            cluster = Cluster(nproc)
            run = lambda mode, w: best_split(mode, costs, cluster, w)  # noqa: E731
        reports = [run(mode, wl) for mode in MODES]
        reports.append(dataclasses.replace(run("digenrl", paper_workload(key, max_stale=1)), mode="digenrl j=1"))
        colocated, naive, full, full_j1 = reports[0], reports[1], reports[-2], reports[-1]
        where = "16 rollout GPUs at 0.5x + 16 H200 trainers" if nproc == "hetero" else f"{nproc} H200"
        print(f"\n## {label}, {where}: T={wl.num_steps} T_train={wl.train_steps} G={wl.group_size} B={wl.groups}  "
              f"[{costs.provenance}]")
        for rep in reports:
            print("  " + format_report(rep))
        best = min(full.step_s, full_j1.step_s)
        print(f"  DigenRL (j=R) vs colocated: {colocated.step_s / full.step_s:.2f}x (j=1: {colocated.step_s / full_j1.step_s:.2f}x; "
              f"paper: 1.56-2.10x); vs naive {naive.step_s / full.step_s:.2f}x; colocated switch for 1.56x: "
              f"{max(0.0, 1.56 * best - colocated.step_s):.1f} s/step")
        results.append({"model": label, "cluster": where, "provenance": costs.provenance,
                        "reports": [dataclasses.asdict(r) for r in reports]})
    return results


if __name__ == "__main__":
    print_paper()
