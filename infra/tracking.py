"""Weights & Biases logging for a run (`--wandb`): step metrics, eval images captioned with their prompts, the config.

    tracker = WandbTracker(run_path, project="digenrl", name="flux-lora", config=dataclasses.asdict(cfg))
    tracker.log(step, {"reward_mean": 0.1, ...})
    tracker.log_images(step, images, prompts, scores)   # images [B, 3, H, W] or videos [B, F, 3, H, W]
    tracker.finish()

`wandb` is imported only here, only when --wandb is on. `WANDB_MODE=offline` writes the run under
runs/<name>/wandb/ without any network (upload later with `wandb sync runs/<name>/wandb/offline-run-*`).
The W&B run id is kept in runs/<name>/wandb_id.txt, so `--resume` continues the same W&B run.
Steps are metrics.jsonl's `step` (0-based), as in TensorBoard.
`check_wandb_login()` runs before any rank starts: online W&B without a login would otherwise fail (or wait for a
prompt nobody answers) only once the model is loaded.
"""
from __future__ import annotations

import netrc
import os
import secrets
import urllib.parse

import numpy as np
import torch


OFFLINE_MODES = ("offline", "dryrun", "disabled")


def check_wandb_login(environ=None) -> None:
    """ValueError unless W&B is offline / disabled or a login is there: WANDB_API_KEY, an identity token file, or a
    netrc entry for the W&B host (what `wandb login` writes). Reads no network."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_MODE", "").lower() in OFFLINE_MODES or environ.get("WANDB_DISABLED", "").lower() in (
            "true", "1"):
        return
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urllib.parse.urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise ValueError(f"--wandb: no W&B login here (no WANDB_API_KEY, no {path} entry for {host}): run `wandb login` "
                     "or set WANDB_API_KEY; or WANDB_MODE=offline to log into the run directory and `wandb sync` later")


def _filmstrip(image: torch.Tensor) -> np.ndarray:
    """[3, H, W] -> [H, W, 3] uint8; a video [F, 3, H, W] -> its frames side by side [H, F*W, 3]."""
    if image.dim() == 4:
        image = torch.cat(list(image), dim=-1)  # [3, H, F*W]
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()


class WandbTracker:
    def __init__(self, run_path: str, project: str, name: str | None, config: dict):
        import wandb  # lazy: nothing else pays for importing wandb

        self.wandb = wandb
        id_file = os.path.join(run_path, "wandb_id.txt")
        # secrets, not `random`: the run's RNG state (saved in checkpoints) stays untouched
        run_id = open(id_file).read().strip() if os.path.isfile(id_file) else secrets.token_hex(6)
        self.run = wandb.init(project=project, name=name or os.path.basename(os.path.normpath(run_path)),
                              config=config, dir=run_path, id=run_id, resume="allow")
        with open(id_file, "w") as f:
            f.write(run_id + "\n")

    def log(self, step: int, metrics: dict) -> None:
        row = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating)) and k != "step"}
        self.run.log(row, step=step)

    def log_images(self, step: int, images: torch.Tensor, prompts: list[str], scores=None) -> None:
        captions = [p if scores is None else f"{p} | reward {float(s):.3f}" for p, s in
                    zip(prompts, scores if scores is not None else prompts)]
        media = [self.wandb.Image(_filmstrip(image), caption=caption) for image, caption in zip(images, captions)]
        self.run.log({"eval_images": media}, step=step)

    def finish(self) -> None:
        self.run.finish()
