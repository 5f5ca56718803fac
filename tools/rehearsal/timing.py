"""Predicted H200 time of what a rehearsed rank did: the calls it made (replay.py counts every
transformer forward, VAE decode and training pack, with its shapes and phase) times the per-call
costs measured on one H200 (tools/profiles/h200_*.json), and the bytes it published at a stated
bandwidth.

Costs per sample are read at the measured sizes and carried to others by tokens: the measured
points of a family are fitted with t(n) = a n + b n^2 (n = tokens per sample: linear layers and
attention), one point alone scales linearly. A training pair costs the measured forward+backward per
sample of the closest kind (LoRA or full, with or without --grad-ckpt; a kind not measured: the
measured one, said so). SD3.5 has no H200 profile: its calls are counted, not timed. Not timed:
the reward, text encoding, FSDP's all-gathers (their bytes are reported), writing a checkpoint
(its bytes are reported).
"""
from __future__ import annotations

import json
import math
import os

PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles")
FILES = {"flux": "h200_flux1dev_12b.json", "qwenimage": "h200_qwenimage_20b.json",
         "wan": "h200_wan21_14b.json", "hunyuanvideo": "h200_hunyuanvideo_13b.json"}
# the real path of a publish on one host (README "Publishing full weights"): the mailbox receives
# and swaps in at 0.49 GB/s over loopback gloo (2026-12-01); a network between hosts is slower
PUBLISH_BYTES_PER_S = 0.49e9
FRAGMENT_LINK_BYTES_PER_S = 25e9  # profiles/paper_settings.json link_bytes_per_s (an assumption)


def _load(model: str) -> dict | None:
    if model not in FILES:
        return None
    with open(os.path.join(PROFILES, FILES[model])) as f:
        return json.load(f)


def _image_tokens(res: int, patch: int = 16) -> int:
    return (res // patch) ** 2


def _video_tokens(frames: int, h: int, w: int) -> int:
    return ((frames - 1) // 4 + 1) * (h // 16) * (w // 16)


def measured(model: str) -> dict[str, list[tuple[int, float]]]:
    """kind -> [(tokens per sample, seconds per sample)] from the family's profile (largest batch
    measured at each size: the per-sample cost a full GPU reaches)."""
    data = _load(model)
    if data is None:
        return {}
    out: dict[str, dict[int, tuple[int, float]]] = {}

    def add(kind, tokens, bs, sec):
        if sec is None:
            return
        best = out.setdefault(kind, {})
        if tokens not in best or bs > best[tokens][0]:
            best[tokens] = (bs, sec / bs)
    if model == "flux":
        for r in data["rollout_forward_per_step"]:
            add("forward", r["seq"], r["bs"], r["sec"])
        for r in data["train_lora_r32_fwd_bwd_per_timestep"]:
            add("train lora" + (" ckpt" if r["ckpt"] else ""), _image_tokens(r["res"]), r["bs"],
                r.get("sec"))
        for r in data["train_full_fwd_bwd_per_timestep"]:
            add("train full" + (" ckpt" if r["ckpt"] else ""), _image_tokens(r["res"]), r["bs"],
                r.get("sec"))
        for r in data["vae_decode"]:
            add("decode", _image_tokens(r["res"]), r["bs"], r["sec"])
    elif model == "wan":
        for r in data["rollout_forward_per_step"]:
            add("forward", r["seq"], r["bs"], r["sec"])
        for r in data["train_fwd_bwd_per_timestep"]:
            add("train lora ckpt", r["seq"], r["bs"], r["sec"])
    else:
        for r in data["rows"]:
            case = r["case"]
            tokens = _video_tokens(*case) if isinstance(case, list) else _image_tokens(case)
            kind = "forward" if r["what"] == "rollout_fwd" else "train lora ckpt"
            add(kind, tokens, r["bs"], r["sec"])
    return {k: sorted((t, s) for t, (_, s) in v.items()) for k, v in out.items()}


def per_sample(points: list[tuple[int, float]], tokens: int) -> float:
    """t(tokens) from the measured points: a n + b n^2 through the two closest (in log size)."""
    if len(points) == 1:
        n, t = points[0]
        return t * tokens / n
    (n1, t1), (n2, t2) = sorted(points, key=lambda p: abs(math.log(p[0] / tokens)))[:2]
    det = n1 * n2 * (n2 - n1)
    a = (t1 * n2 * n2 - t2 * n1 * n1) / det
    b = (t2 * n1 - t1 * n2) / det
    if a < 0 or b < 0:  # the points do not fit both terms: the nearer point, scaled linearly
        return t1 * tokens / n1
    return a * tokens + b * tokens * tokens


def tokens_of(model: str, latent_shape: tuple) -> int:
    """Tokens per sample of a transformer call's latents [B, ...] (the transformer's patches)."""
    if model in ("flux", "qwenimage"):
        return latent_shape[1]  # [B, tokens, channels]: packed 2x2
    if model in ("wan", "hunyuanvideo"):
        _, _, f, h, w = latent_shape
        return f * (h // 2) * (w // 2)
    _, _, h, w = latent_shape  # sd3 [B, C, h, w], patch 2
    return (h // 2) * (w // 2)


def train_kind(table: dict, lora: bool, ckpt: bool) -> tuple[str | None, str]:
    want = f"train {'lora' if lora else 'full'}{' ckpt' if ckpt else ''}"
    if want in table:
        return want, "measured"
    for other in (f"train {'lora' if lora else 'full'}", f"train {'lora' if lora else 'full'} ckpt",
                  "train lora ckpt", "train lora"):
        if other in table:
            return other, f"{want} not measured: {other}'s cost"
    return None, f"{want} not measured"


def predict(model: str, calls: dict, traffic: dict, lora: bool, ckpt: bool,
            latent_of_pack) -> dict:
    """Seconds by phase for one rank: calls {(phase, what, detail): n} (replay.Replay.calls),
    traffic {(phase, plane, what): bytes}; latent_of_pack: a pack's latent shape (its tokens)."""
    table = measured(model)
    if not table:
        return {"note": f"no H200 profile for {model}: calls counted, not timed"}
    out: dict[str, float] = {}
    notes = set()
    for (phase, what, detail), n in calls.items():
        if what == "forward" and not detail[2]:  # no gradient: sampling, evaluation, TAG, probes
            batch = detail[1][0] * (2 if detail[3] else 1)  # true CFG: both branches
            sec = per_sample(table["forward"], tokens_of(model, detail[1])) * batch
        elif what == "decode" and "decode" in table:
            sec = per_sample(table["decode"], tokens_of(model, detail[1])) * detail[1][0]
        elif what == "pack":
            kind, note = train_kind(table, lora, ckpt)
            notes.add(note)
            if kind is None:
                continue
            sec = per_sample(table[kind], tokens_of(model, latent_of_pack)) * detail[1]
        else:
            if what == "decode":
                notes.add(f"{model} VAE decode not measured")
            continue
        out[phase] = out.get(phase, 0.0) + n * sec
    for (phase, plane, what), nbytes in traffic.items():
        if phase == "publish" and what == "sent":
            out["publish"] = out.get("publish", 0.0) + nbytes / PUBLISH_BYTES_PER_S
        elif phase == "send" and what == "sent":
            out["send"] = out.get("send", 0.0) + nbytes / FRAGMENT_LINK_BYTES_PER_S
    return {"seconds_by_phase": out, "notes": sorted(n for n in notes if n != "measured"),
            "source": f"tools/profiles/{FILES[model]}"}
