"""The run directory: resolved config, metrics.jsonl, reward curve, eval grids, TensorBoard, checkpoints.

runs/<name>/
  config.json            the resolved Config
  metrics.jsonl          one JSON object per step (see README's metrics glossary)
  reward_curve.png       train and eval reward per step
  eval/step_000010.png   deterministic samples on held-out prompts (videos: .gif); also in TensorBoard / W&B
  tensorboard/, wandb/   with --tensorboard / --wandb (infra/tracking.py); wandb_id.txt: the W&B run to resume
  checkpoints/step_000050/  state.pt (weights, optimizer, step, RNG, config) and, with LoRA,
                            pytorch_lora_weights.safetensors that `pipe.load_lora_weights` accepts
                            (alpha, rank and targets in its header: diffusers' LoRA adapter metadata)
Every file is written atomically (temporary name, flush, fsync, rename): a crash never leaves half a file.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil

import numpy as np
import torch


def atomic_write(path: str, write) -> None:
    """write(tmp_path) then rename onto `path`; the old file survives any crash before the rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)  # a failed write leaves neither a half file nor a stray temporary
        raise


def save_image_grid(images: torch.Tensor, path: str, nrow: int | None = None) -> None:
    """images [B, 3, H, W] in [0, 1] -> one PNG grid; videos [B, F, 3, H, W] -> an animated GIF grid."""
    from PIL import Image

    if images.ndim == 5:
        frames = [_grid(images[:, f], nrow) for f in range(images.shape[1])]
        pil = [Image.fromarray(f) for f in frames]
        atomic_write(path, lambda p: pil[0].save(p, format="GIF", save_all=True, append_images=pil[1:], duration=120, loop=0))
    else:
        atomic_write(path, lambda p: Image.fromarray(_grid(images, nrow)).save(p, format="PNG"))


def _grid(images: torch.Tensor, nrow: int | None) -> np.ndarray:
    b, c, h, w = images.shape
    nrow = nrow or b
    rows = math.ceil(b / nrow)
    canvas = torch.ones(c, rows * (h + 2), nrow * (w + 2))
    for i in range(b):
        r, col = divmod(i, nrow)
        canvas[:, r * (h + 2) + 1:r * (h + 2) + 1 + h, col * (w + 2) + 1:col * (w + 2) + 1 + w] = images[i]
    return (canvas.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


class RunDir:
    """Owned by the trainer leader; every method is a no-op-free plain file operation."""

    def __init__(self, path: str, config_json: str, tensorboard: bool = False, keep_checkpoints: int = 2,
                 wandb: dict | None = None):
        """`wandb`: None, or WandbTracker's keyword arguments (project, name, config): infra/tracking.py."""
        self.path, self.keep = path, keep_checkpoints
        os.makedirs(os.path.join(path, "eval"), exist_ok=True)
        os.makedirs(os.path.join(path, "checkpoints"), exist_ok=True)
        atomic_write(os.path.join(path, "config.json"), lambda p: open(p, "w").write(config_json))
        self.metrics_path = os.path.join(path, "metrics.jsonl")
        self.tb = self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(path, "tensorboard"))
        if wandb is not None:
            from infra.tracking import WandbTracker
            self.wandb = WandbTracker(path, **wandb)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: (float(v) if isinstance(v, (int, float, np.floating)) else v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:  # append-only: a crash loses at most the last line
            f.write(json.dumps(row) + "\n")
            f.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, float):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(step, row)

    def log_eval(self, step: int, images: torch.Tensor, prompts: list[str], scores: torch.Tensor | None = None) -> None:
        """The evaluation's samples: eval/step_N.png (videos .gif), TensorBoard's `eval` image, W&B captioned images."""
        ext = "gif" if images.ndim == 5 else "png"
        save_image_grid(images, os.path.join(self.path, "eval", f"step_{step + 1:06d}.{ext}"))
        if self.tb is not None:  # one image: a row per sample (videos: its frames left to right)
            strips = images if images.ndim == 4 else torch.cat(list(images.transpose(0, 1)), dim=-1)  # [B, 3, H, W*]
            self.tb.add_image("eval", _grid(strips, 1), step, dataformats="HWC")
            self.tb.add_text("eval_prompts", "  \n".join(f"{i}: {p}" for i, p in enumerate(prompts)), step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log_images(step, images, prompts, scores)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()

    def read_metrics(self) -> list[dict]:
        if not os.path.isfile(self.metrics_path):
            return []
        rows = []
        with open(self.metrics_path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a crash
                    break
        return rows

    def truncate_metrics(self, below_step: int) -> None:
        """On resume, drop rows of steps after the checkpoint (they will be redone)."""
        rows = [r for r in self.read_metrics() if r["step"] < below_step]
        atomic_write(self.metrics_path, lambda p: open(p, "w").write("".join(json.dumps(r) + "\n" for r in rows)))

    def plot_rewards(self) -> None:
        rows = self.read_metrics()
        if rows:
            plot_reward_curves({"train reward (mean)": rows}, os.path.join(self.path, "reward_curve.png"), eval_too=True)
            # A closed figure is cyclic garbage, and with a rank's ~500k long-lived objects Python runs a full
            # collection only every ~100 plots: the leader's RSS crept ~0.8 MB per checkpoint (soak.py). ~0.2 s.
            import gc
            gc.collect()

    # --- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, step: int, state: dict, lora_layers: dict | None, pipeline_class,
                        lora_metadata: dict | None = None) -> str:
        """`lora_metadata` (models.lora_metadata: rank, alpha, targets) goes into the LoRA file's header, where
        `pipe.load_lora_weights` reads it back."""
        final = os.path.join(self.path, "checkpoints", f"step_{step:06d}")
        tmp = final + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        torch.save(state, os.path.join(tmp, "state.pt"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:  # what --resume checks, without loading state.pt
            json.dump({"step": state["step"], "identity": state["identity"]}, f)
        if lora_layers is not None:
            pipeline_class.save_lora_weights(tmp, transformer_lora_layers=lora_layers,
                                             transformer_lora_adapter_metadata=lora_metadata)
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb+") as f:
                os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the directory appears complete or not at all
        for old in list_checkpoints(self.path)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final


def list_checkpoints(run_path: str) -> list[str]:
    folder = os.path.join(run_path, "checkpoints")
    if not os.path.isdir(folder):
        return []
    names = sorted(n for n in os.listdir(folder) if n.startswith("step_") and not n.endswith(".partial")
                   and os.path.isfile(os.path.join(folder, n, "state.pt")))
    return [os.path.join(folder, n) for n in names]


IDENTITY_FIELDS = ("model", "pretrained", "lora", "lora_rank", "lora_alpha", "lora_targets")


def identity(cfg) -> dict:
    return {k: getattr(cfg, k) for k in IDENTITY_FIELDS}


def _meta(checkpoint: str) -> dict:
    """{"step", "identity"} of a checkpoint: meta.json, or (older checkpoints) state.pt memory-mapped."""
    path = os.path.join(checkpoint, "meta.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    state = torch.load(os.path.join(checkpoint, "state.pt"), map_location="cpu", weights_only=False, mmap=True)
    return {"step": state["step"], "identity": state["identity"]}


def checkpoint_step(checkpoint: str) -> int:
    return int(_meta(checkpoint)["step"])


def check_resume(run_path: str, cfg) -> str:
    """The last checkpoint of `run_path`, after checking it belongs to the same model and LoRA config."""
    if not os.path.isdir(run_path):
        raise ValueError(f"--resume {run_path!r} is not a directory")
    ckpts = list_checkpoints(run_path)
    if not ckpts:
        raise ValueError(f"--resume {run_path!r} has no complete checkpoint under checkpoints/")
    theirs, ours = _meta(ckpts[-1])["identity"], identity(cfg)
    diff = {k: (theirs.get(k), ours[k]) for k in ours if theirs.get(k) != ours[k]}
    if diff:
        raise ValueError(f"checkpoint {ckpts[-1]!r} was made with a different model or LoRA config: "
                         + ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items()))
    return ckpts[-1]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (window 1 = the raw values)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_reward_curves(runs: dict[str, list[dict]], path: str, eval_too: bool = False, window: int = 1,
                       title: str | None = None) -> None:
    """One PNG with every run's reward_mean per step (label -> metrics rows), written atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, rows in runs.items():
        line, = ax.plot([r["step"] for r in rows], smooth([r["reward_mean"] for r in rows], window), label=label)
        ev = [r for r in rows if "eval_reward" in r]
        if eval_too and ev:
            ax.plot([r["step"] for r in ev], [r["eval_reward"] for r in ev], "o--", color=line.get_color(),
                    label=f"{label}: eval (deterministic)")
    ax.set_xlabel("step"); ax.set_ylabel("reward" if window == 1 else f"reward ({window}-step mean)")  # noqa: E702
    ax.legend(fontsize=8); ax.grid(alpha=0.3)  # noqa: E702
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
