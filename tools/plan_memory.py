"""Per-role peak memory for the planner (tools/plan.py), from tools/estimate_memory.py's real-size estimate.

    python tools/plan_memory.py --measure            # re-run the estimates (about 20-40 min on 2 CPU cores)
    python tools/plan_memory.py --model flux         # print the cached lines

estimate_memory.py builds the real-size transformer under FakeTensorMode and runs the project's own rollout
forward and training packs (about a minute per configuration on 2 cores): too slow per planner candidate. So
it runs twice per (family, LoRA or full FSDP) at the planner's paper settings (profiles/paper_settings.json:
resolution, frames, G, gradient checkpointing), at the two ends of the search (fragments of 1 and 4 groups,
packs of 1 and 8 pairs), and the results are cached in profiles/plan_memory.json. Between them each role's
peak is a line in its batch (activations grow with the samples of one forward; weights, adapters, optimizer
state and the text encoders do not):
    rollout_gib(samples) = rollout_gib(s0) + (samples - s0) * slope_rollout      (samples = fragment_groups G)
    trainer_gib(pack, K) = trainer_gib(p0) + (pack - p0) * slope_trainer + states(K) - states(K0)
where states(K) is as estimate_memory.hand_bytes computes it (full fine-tuning under FSDP keeps 1/K of the fp32 masters,
gradients and AdamW; LoRA's do not depend on K). A configuration fits when both peaks plus RESERVE_GIB are at
most the H200's 140.4 GiB (estimate_memory.GPUS["141 GB"]).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, "profiles", "plan_memory.json")
GIB = 2**30
H200_GIB = 143771 * 2**20 / GIB  # estimate_memory.GPUS["141 GB"]: what nvidia-smi reports for an H200
RESERVE_GIB = 4.0  # estimate_memory.RESERVE_GIB: CUDA context, NCCL, fragmentation (not tracked)
POINTS = ((1, 1), (4, 8))  # (fragment_groups, tsp_pack) at which the estimate runs
NPROC, ROLLOUT = 16, 8  # K0 = 8 trainers (only full fine-tuning under FSDP depends on K)


def settings(family: str) -> tuple[str, dict]:
    """(paper_settings label, its model entry) of a family."""
    with open(os.path.join(HERE, "profiles", "paper_settings.json")) as f:
        models = json.load(f)["models"]
    for label, entry in models.items():
        if entry["family"] == family:
            return label, entry
    raise ValueError(f"--model {family!r} has no paper setting: one of "
                     f"{', '.join(e['family'] for e in models.values())}")


def estimate_args(family: str, lora: bool, fragment_groups: int, pack: int) -> list[str]:
    _, s = settings(family)
    args = ["--model", family, "--nproc", str(NPROC), "--rollout-ranks", str(ROLLOUT), "--group-size", str(s["G"]),
            "--fragment-groups", str(fragment_groups), "--tsp-pack", str(pack)]
    for name, value in s["flags"].items():
        args += [f"--{name}", str(value)]
    args += ["--lora"] if lora else ["--no-lora", "--fsdp"]
    return args + (["--grad-ckpt"] if s["grad_ckpt"] else [])


def measure(families, out: str = CACHE) -> dict:
    """Run estimate_memory.py at POINTS for every family and both trainings; write the cache as it goes."""
    cache = load(out) if os.path.exists(out) else {}
    for family in families:
        for lora in (True, False):
            key = f"{family} {'lora' if lora else 'full'}"
            rows = []
            for fg, pack in POINTS:
                with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                    cmd = [sys.executable, os.path.join(HERE, "estimate_memory.py"),
                           *estimate_args(family, lora, fg, pack), "--json", tmp.name]
                    print("$", " ".join(cmd[1:]), flush=True)
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                    with open(tmp.name) as f:
                        row = json.load(f)[0]
                rows.append({"args": " ".join(estimate_args(family, lora, fg, pack)),
                             **{k: row[k] for k in ("fragment_samples", "tsp_pack", "trainers", "rollout_gib",
                                                    "trainer_gib", "params_b", "grad_ckpt")}})
            cache[key] = {"points": rows}
            with open(out, "w") as f:
                json.dump(cache, f, indent=1)
    return cache


def load(path: str = CACHE) -> dict:
    with open(path) as f:
        return json.load(f)


def _line(points, x: str, y: str, at: float) -> float:
    (x0, y0), (x1, y1) = ((p[x], p[y]) for p in points)
    return y0 + (at - x0) * (y1 - y0) / (x1 - x0)


def peaks(family: str, lora: bool, fragment_groups: int, pack: int, trainers: int, cache: dict | None = None) -> dict:
    """GiB per role of one planner candidate, from the cached estimates."""
    cache = load() if cache is None else cache
    key = f"{family} {'lora' if lora else 'full'}"
    if key not in cache:
        raise ValueError(f"no cached memory estimate for {key!r} in {CACHE}: run python tools/plan_memory.py "
                         "--measure")
    points = cache[key]["points"]
    _, s = settings(family)
    rollout = _line(points, "fragment_samples", "rollout_gib", fragment_groups * s["G"])
    trainer = _line(points, "tsp_pack", "trainer_gib", pack)
    if not lora:  # full fine-tuning under FSDP: 16 B/param (fp32 master, gradient, AdamW m and v) / K
        params = points[0]["params_b"] * 1e9
        trainer += 16 * params * (1 / trainers - 1 / points[0]["trainers"]) / GIB
    return {"rollout_gib": rollout, "trainer_gib": trainer}


def fits(p: dict) -> bool:
    return max(p["rollout_gib"], p["trainer_gib"]) + RESERVE_GIB <= H200_GIB


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="re-run estimate_memory.py and rewrite the cache")
    parser.add_argument("--model", action="append", help="families (default: the four with paper settings)")
    parser.add_argument("--out", default=CACHE)
    args = parser.parse_args(argv)
    families = args.model or ["flux", "qwenimage", "wan", "hunyuanvideo"]
    cache = measure(families, args.out) if args.measure else load(args.out)
    for key, entry in cache.items():
        print(key, [(p["fragment_samples"], p["tsp_pack"], round(p["rollout_gib"], 1), round(p["trainer_gib"], 1))
                    for p in entry["points"]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
