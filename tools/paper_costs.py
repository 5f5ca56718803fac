"""The paper-scale workload and costs: the seed models' measured H200 per-operation costs (profiles/h200_*.json),
the workload settings and assumptions (profiles/paper_settings.json) and a veRL-Omni-style colocated system's switch
costs (profiles/colocated_switch.json). Read by tools/paper_scale.py (the table) and tools/plan.py (the planner).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.simulate import Costs, Workload  # noqa: E402

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


def _profile(name: str) -> dict:
    with open(os.path.join(PROFILE_DIR, name)) as f:
        return json.load(f)


def paper_settings() -> dict:
    return _profile("paper_settings.json")


def paper_workload(label: str, max_stale: int | None = None, updates_per_batch: int | None = None) -> Workload:
    """A seed model's workload at paper_settings.json's values; updates_per_batch None = the settings' M."""
    s, p = paper_settings()["models"][label], paper_settings()
    return Workload(groups=p["batch_groups"], group_size=s["G"], num_steps=s["T"],
                    train_steps=round(s["frac"] * s["T"]), fragment_groups=p["fragment_groups"],
                    tsp_pack=s["pack"], max_stale=max_stale, steps=8,
                    updates_per_batch=p["updates_per_batch"] if updates_per_batch is None else updates_per_batch)


def paper_costs(label: str, fragment_m: int, train_steps: int) -> Costs:
    """H200 costs of a seed model: profiles/h200_*.json rows plus paper_settings.json's assumptions."""
    p = paper_settings()
    s = p["models"][label]
    data = _profile(s["file"])

    def rows(key, **match):  # seconds per sample
        return {r["bs"]: r["sec"] / r["bs"] for r in data[key]
                if "sec" in r and all(r.get(k) == v for k, v in match.items())}

    link, scale = p["link_bytes_per_s"], s["params"] / p["flux_params"]  # LoRA size scales
    return Costs(rows(**s["forward"]), rows(**s["train"]), decode_s=s["decode_s"],
                 reward_s=s["reward_s"],
                 transfer_s=fragment_m * (train_steps * s["latent_bytes"] + s["text_bytes"]) / link,
                 publish_s=scale * (p["flux_lora_device_to_host_s"] + p["flux_lora_bytes"] / link),
                 optimizer_s=p["optimizer_s"], allreduce_s=p["allreduce_s"],
                 step_overhead_s=p["step_overhead_s"], true_cfg=s["true_cfg"], name=label,
                 provenance=f"measured: profiles/{s['file']} ({data['gpu']})")


def switch_parts(label: str, nproc: int) -> dict:
    """Seconds per step each GPU of a veRL-Omni-style colocated system spends switching phases
    (profiles/colocated_switch.json says which inputs are measured and which assumed)."""
    sw, p = _profile("colocated_switch.json"), paper_settings()
    transformer = _profile(p["models"][label]["file"])["params"]  # measured architecture size
    replica_bytes = 2 * (transformer + sum(sw["rollout_other_params"][label].values()))
    lora_params = p["flux_lora_bytes"] / 2 * transformer / p["flux_params"]
    actor_bytes = (2 * transformer + sw["actor_state_bytes_per_trainable_param"] * lora_params) / nproc
    d2h, h2d = sw["device_to_host_bytes_per_s"], sw["host_to_device_bytes_per_s"]
    return {"rollout wake (H2D)": replica_bytes / h2d, "rollout sleep (D2H)": replica_bytes / d2h,
            "weight sync (all-gather)": 2 * transformer * (nproc - 1) / nproc / sw["sync_bytes_per_s"],
            "actor offload+reload": actor_bytes / d2h + actor_bytes / h2d,
            "replica GB": replica_bytes / 1e9}


def scaled_costs(base: Costs, ratio: float, label: str, true_cfg: bool) -> Costs:
    """A family with no measurement: forward and train costs of a measured one times a FLOPs ratio."""
    return dataclasses.replace(
        base, forward_s={k: v * ratio for k, v in base.forward_s.items()},
        train_s={k: v * ratio for k, v in base.train_s.items()}, true_cfg=true_cfg, name=label,
        provenance=f"NOT measured: {base.name} costs scaled by FLOPs x{ratio:.2f}")
