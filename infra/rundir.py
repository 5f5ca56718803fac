"""The run directory: resolved config, metrics.jsonl, reward curve, eval grids, TensorBoard, checkpoints.

runs/<name>/
  config.json            the resolved Config
  metrics.jsonl          one JSON object per step (see README's metrics glossary)
  reward_curve.png       train reward per step and the evaluation curves (infra/evaluation.py)
  eval/step_000010.png   deterministic samples after 10 updates, captioned with prompts and rewards (videos: .gif)
  before_after.png       the first evaluation next to the latest one, same prompts and noises (videos: .gif)
  tensorboard/, wandb/   with --tensorboard / --wandb (infra/tracking.py); wandb_id.txt: the W&B run to resume
  checkpoints/step_000050/  state.pt (weights, optimizer, step, RNG, config: tensors and plain data only, loaded
                            with weights_only=True: a state.pt that would run code is refused; written one tensor
                            at a time, infra/checkpoint_file.py, as torch.save writes it) and, with LoRA,
                            pytorch_lora_weights.safetensors that `pipe.load_lora_weights` accepts
                            (alpha, rank and targets in its header: diffusers' LoRA adapter metadata);
                            with --ema the LoRA file holds the EMA's weights, as Flow-GRPO's save_ckpt
                            saves them (state.pt keeps both, for --resume)
Every file is written atomically (temporary name, flush, fsync, rename): a crash never leaves half a file. A full or
read-only disk (ENOSPC, EDQUOT, EROFS, EACCES) is an OutputWriteError that says so in one line; a checkpoint it cut
is removed and the last complete one kept. Before any rank starts, `check_free_space` asks for room for
--keep-checkpoints + 1 checkpoints (`checkpoint_bytes_estimate`: a lower bound).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import pickle
import random
import shutil
from collections.abc import Callable

import numpy as np
import torch


class OutputWriteError(RuntimeError):
    """The run directory's disk refused a write (full, over quota, read-only, no permission): one line."""


_DISK_REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


@contextlib.contextmanager
def writing(what: str, kept: str = ""):
    """Turn a disk's refusal while writing `what` into an OutputWriteError naming it (`kept`: what is left)."""
    try:
        yield
    except OSError as error:
        if error.errno not in _DISK_REFUSED:
            raise
        name = errno.errorcode.get(error.errno, str(error.errno))
        raise OutputWriteError(f"writing {what} failed: {error.strerror} [{name}]{kept}") from None


def atomic_write(path: str, write) -> None:
    """write(tmp_path) then rename onto `path`; the old file survives any crash before the rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with writing(path, "; the previous version of the file is kept"):
            write(tmp)
            with open(tmp, "rb+") as f:
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)  # a failed write leaves neither a half file nor a stray temporary
        raise


def save_image_grid(images: torch.Tensor, path: str, nrow: int | None = None, labels: list[str] | None = None,
                    row_labels: list[str] | None = None, title: str | None = None, scale: int = 1) -> None:
    """images [B, 3, H, W] in [0, 1] -> one PNG grid; videos [B, F, 3, H, W] -> an animated GIF grid.

    nrow images per row; optional captions: `labels` (one per image, under it), `row_labels` (one per row, on the
    left), `title` (on top); `scale` enlarges each image (nearest neighbour) so that tiny images stay readable."""
    save_panels([(title, images, labels)], path, nrow, row_labels, scale)


def save_panels(panels: list[tuple[str | None, torch.Tensor, list[str] | None]], path: str, nrow: int | None = None,
                row_labels: list[str] | None = None, scale: int = 1) -> None:
    """Grids side by side (e.g. before | after), each (title, images, labels) as in `save_image_grid`, sharing the
    row labels on the left. Written atomically: PNG for images, an animated GIF when they are videos."""

    videos = panels[0][1].ndim == 5
    n_frames = panels[0][1].shape[1] if videos else 1
    frames = []
    for f in range(n_frames):
        grids = [_grid(images[:, f] if videos else images, nrow, labels, scale, title)
                 for title, images, labels in panels]
        top = _TITLE if any(title for title, _, _ in panels) else 0
        frames.append(_side_by_side(grids, _row_label_column(row_labels, grids[0].height, top)))
    if videos:
        atomic_write(path, lambda p: frames[0].save(p, format="GIF", save_all=True, append_images=frames[1:],
                                                    duration=150, loop=0))
    else:
        atomic_write(path, lambda p: frames[0].save(p, format="PNG"))


def _font(size: int = 12):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # a scalable font where Pillow has FreeType
    except (TypeError, OSError):
        return ImageFont.load_default()


_PAD, _CAPTION, _TITLE = 2, 14, 18  # pixels: border around each image, caption line, title line


def _grid(images: torch.Tensor, nrow: int | None, labels: list[str] | None, scale: int, title: str | None):
    """[B, 3, H, W] -> a PIL image: nrow per row, each with a border and an optional caption, and a title."""
    from PIL import Image, ImageDraw

    b, _, h, w = images.shape
    nrow = nrow or b
    rows = math.ceil(b / nrow)
    cell_w, cell_h = w * scale + 2 * _PAD, h * scale + 2 * _PAD + (_CAPTION if labels else 0)
    top = _TITLE if title else 0
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8)  # [B, 3, H, W]
    if scale > 1:
        pixels = pixels.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)  # [B, 3, sH, sW]
    canvas = Image.new("RGB", (nrow * cell_w, top + rows * cell_h), "white")
    draw = ImageDraw.Draw(canvas)
    font = _font()
    if title:
        draw.text((_PAD, 2), title, fill="black", font=font)
    for i in range(b):
        r, c = divmod(i, nrow)
        x, y = c * cell_w + _PAD, top + r * cell_h + _PAD
        canvas.paste(Image.fromarray(pixels[i].permute(1, 2, 0).numpy()), (x, y))
        if labels:
            draw.text((x, y + h * scale + 1), labels[i], fill="black", font=font)
    return canvas


def _row_label_column(row_labels: list[str] | None, height: int, top: int):
    """A white column `height` tall with one label per grid row (rows start below `top`), or None."""
    if not row_labels:
        return None
    from PIL import Image, ImageDraw

    font = _font()
    rows = len(row_labels)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    width = 8 + max(int(probe.textlength(t, font=font)) for t in row_labels)
    column = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(column)
    row_h = (height - top) / rows
    for r, text in enumerate(row_labels):
        draw.text((4, top + r * row_h + row_h / 2 - 7), text, fill="black", font=font)
    return column


def _side_by_side(grids, column=None):
    from PIL import Image

    parts = ([column] if column is not None else []) + grids
    gap = 12
    size = (sum(p.width for p in parts) + gap * (len(parts) - 1), max(p.height for p in parts))
    out = Image.new("RGB", size, "white")
    x = 0
    for part in parts:
        out.paste(part, (x, 0))
        x += part.width + gap
    return out


class RunDir:
    """Owned by the trainer leader; every method is a no-op-free plain file operation."""

    def __init__(self, path: str, config_json: str, tensorboard: bool = False, keep_checkpoints: int = 2,
                 wandb: dict | None = None, first_step: int = 0):
        """`wandb`: None, or WandbTracker's keyword arguments (project, name, config): infra/tracking.py.
        `first_step`: the step a resumed run starts at; TensorBoard hides what an earlier job logged from it on
        (those steps are redone, and were shown twice)."""
        self.path, self.keep = path, keep_checkpoints
        os.makedirs(os.path.join(path, "eval"), exist_ok=True)
        os.makedirs(os.path.join(path, "checkpoints"), exist_ok=True)
        atomic_write(os.path.join(path, "config.json"), lambda p: open(p, "w").write(config_json))
        self.metrics_path = os.path.join(path, "metrics.jsonl")
        self.tb = self.wandb = None
        self.drawn = None  # (rows, last row) when reward_curve.png was last drawn
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(path, "tensorboard"), purge_step=first_step or None)
        if wandb is not None:
            from infra.tracking import WandbTracker
            self.wandb = WandbTracker(path, **wandb)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: (float(v) if isinstance(v, (int, float, np.floating)) else v)
                                for k, v in metrics.items()}}
        with writing(self.metrics_path), open(self.metrics_path, "a") as f:  # append-only: a crash loses at most
            f.write(json.dumps(row) + "\n")                                    # the last line
            f.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, float):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(step, row)

    def log_eval_media(self, step: int, images: torch.Tensor, prompts: list[str],
                       scores: torch.Tensor | None = None) -> None:
        """The evaluation's samples in TensorBoard (`eval` image) and W&B (captioned images); the grid files
        are infra/evaluation.py's."""
        if self.tb is not None:  # one image: a row per sample (videos: its frames left to right)
            strips = images if images.ndim == 4 else torch.cat(list(images.transpose(0, 1)), dim=-1)  # [B, 3, H, W*]
            self.tb.add_image("eval", np.asarray(_grid(strips, 1, None, 1, None)), step, dataformats="HWC")
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
        """reward_curve.png from metrics.jsonl, unless no row was logged since this RunDir last drew it (the end
        of a run after a checkpoint's drawing)."""
        rows = self.read_metrics()
        drawn = (len(rows), rows[-1] if rows else None)
        if rows and drawn != self.drawn:
            self.drawn = drawn
            plot_reward_curves({"": rows}, os.path.join(self.path, "reward_curve.png"), eval_too=True)
            # A closed figure is cyclic garbage, and with a rank's ~500k long-lived objects Python runs a full
            # collection only every ~100 plots: the leader's RSS crept ~0.8 MB per checkpoint (soak.py). ~0.2 s.
            import gc
            gc.collect()

    # --- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, step: int, state: dict, produce=None, lora_layers=None, pipeline_class=None,
                        lora_metadata: dict | None = None, on_write: Callable[[], None] | None = None) -> str:
        """state.pt is torch.save(state), written streamed (infra/checkpoint_file.py): each
        checkpoint_file.Deferred in `state` is asked of produce(deferred) when the file reaches it and let go
        once written, so the whole state is never in memory. `lora_layers(weights)` (name -> tensor, read back
        memory-mapped from the state.pt just written) gives the LoRA file's layers; `lora_metadata`
        (models.lora_metadata: rank, alpha, targets) goes into its header, where `pipe.load_lora_weights`
        reads it back. `on_write()` after every record written to state.pt (one per tensor: liveness' progress
        while minutes of a large checkpoint go to disk). The folder appears complete or not at all: a crash mid-save leaves a .partial folder,
        never the latest checkpoint."""
        from infra import checkpoint_file

        final = os.path.join(self.path, "checkpoints", f"step_{step:06d}")
        tmp = final + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        last = list_checkpoints(self.path)
        kept = (f"; the last complete checkpoint, {os.path.basename(last[-1])}, is kept: make room, then --resume "
                f"{self.path}" if last else "; there is no complete checkpoint yet")
        try:
            with writing(f"checkpoint {final}", kept):
                os.makedirs(tmp)
                checkpoint_file.save(state, os.path.join(tmp, "state.pt"), produce, on_write)
                with open(os.path.join(tmp, "meta.json"), "w") as f:  # what --resume checks without state.pt
                    json.dump({"step": state["step"], "identity": state["identity"]}, f)
                if lora_layers is not None:
                    written = load_state(tmp)  # read back memory-mapped
                    # --ema: the LoRA file holds the average, as Flow-GRPO's save_ckpt saves it
                    layers = lora_layers(written.get("ema", written["weights"]))
                    pipeline_class.save_lora_weights(tmp, transformer_lora_layers=layers,
                                                     transformer_lora_adapter_metadata=lora_metadata)
                for name in os.listdir(tmp):
                    with open(os.path.join(tmp, name), "rb+") as f:
                        os.fsync(f.fileno())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a cut checkpoint frees its room, and is never taken for one
            raise
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


def load_state(checkpoint: str) -> dict:
    """A checkpoint's state.pt, memory-mapped (each tensor is read when it is used), with weights_only=True:
    tensors and plain data only. A pickle that names anything else (a class, os.system, numpy's array
    reconstruction, which builds arrays of any declared size and dtype from the file's bytes) is refused with a
    ValueError: a shared checkpoint or run folder must not run code. (A storage declaring more bytes than the file
    holds is mapped as the bytes there are, and a tensor larger than its storage is torch's RuntimeError.)"""
    path = os.path.join(checkpoint, "state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        if "weights only" not in str(error).lower():  # not torch's refusal: a file that is no checkpoint at all
            raise ValueError(f"checkpoint {path!r} cannot be read: {str(error).splitlines()[0]}") from None
        why = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "global" in line),
                   str(error).splitlines()[0])
        raise ValueError(f"checkpoint {path!r} holds more than tensors and plain data ({why}): refused to load it, "
                         "since unpickling it could run code. Only resume from checkpoints this project "
                         "wrote") from None
    except (OSError, RuntimeError, EOFError, ValueError, MemoryError) as error:  # truncated, not a torch file, ...
        raise ValueError(f"checkpoint {path!r} cannot be read: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path!r} holds a {type(state).__name__}, not a checkpoint's dict")
    return state


CHECKPOINT_FLOOR_BYTES = 64 * 2**20  # the least room asked for one checkpoint (LoRA or tiny weights, RNG, config)


def checkpoint_bytes_estimate(cfg) -> int:
    """A lower bound of one checkpoint's size. Full fine-tuning of --pretrained weights saves the trainable
    weights and AdamW's two moments: with fp32 masters 12 bytes a parameter (16 with --ema), 6 of the transformer's
    2 on disk (bf16); pure bf16 6 bytes (8), 3 of them. LoRA and the tiny pipelines: CHECKPOINT_FLOOR_BYTES."""
    if cfg.lora or cfg.pretrained is None:
        return CHECKPOINT_FLOOR_BYTES
    import models
    folder = os.path.join(models.resolve_pretrained(cfg.model, cfg.pretrained), "transformer")
    on_disk = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
                  if n.endswith((".safetensors", ".bin"))) if os.path.isdir(folder) else 0
    per_disk_byte = (6 if cfg.fp32_master else 3) + ((2 if cfg.fp32_master else 1) if cfg.ema else 0)
    return max(CHECKPOINT_FLOOR_BYTES, on_disk * per_disk_byte)


def check_free_space(run_path: str, need: int) -> None:
    """Before any rank starts: ValueError when the run directory's disk has less than `need` bytes free."""
    free = shutil.disk_usage(run_path).free
    if free < need:
        raise ValueError(f"run directory {run_path!r} is on a disk with {free / 2**30:.2f} GiB free; its checkpoints "
                         f"need about {need / 2**30:.2f} GiB (--keep-checkpoints plus the one being written): make "
                         "room, give another --out-dir or fewer --keep-checkpoints")


def _meta(checkpoint: str) -> dict:
    """{"step", "identity"} of a checkpoint: meta.json, or (older checkpoints) state.pt memory-mapped."""
    path = os.path.join(checkpoint, "meta.json")
    if os.path.isfile(path):
        try:
            if os.path.getsize(path) > 2**20:  # a step and six settings
                raise ValueError(f"{os.path.getsize(path)} bytes")
            with open(path) as f:
                meta = json.load(f)
        except (OSError, ValueError, RecursionError) as error:
            raise ValueError(f"checkpoint {checkpoint!r}: meta.json cannot be read ({str(error)[:200]})") from None
    else:
        meta = load_state(checkpoint)
    if not (isinstance(meta, dict) and type(meta.get("step")) is int and isinstance(meta.get("identity"), dict)):
        raise ValueError(f"checkpoint {checkpoint!r} has no step number and identity (is it a checkpoint?)")
    return {"step": meta["step"], "identity": meta["identity"]}


def checkpoint_step(checkpoint: str) -> int:
    return int(_meta(checkpoint)["step"])


def first_step(cfg) -> int:
    """The step a run starts at: 0, or the step of --resume's last checkpoint."""
    return checkpoint_step(check_resume(cfg.resume, cfg)) if cfg.resume else 0


def check_resume(run_path: str, cfg) -> str:
    """The last checkpoint of `run_path`, after checking it belongs to the same model and LoRA config."""
    if not os.path.isdir(run_path):
        raise ValueError(f"--resume {run_path!r} is not a directory")
    ckpts = list_checkpoints(run_path)
    if not ckpts:
        raise ValueError(f"--resume {run_path!r} has no complete checkpoint under checkpoints/")
    load_state(ckpts[-1])  # refuses a state.pt that would run code, before any rank starts (cheap: memory-mapped)
    theirs, ours = _meta(ckpts[-1])["identity"], identity(cfg)
    diff = {k: (theirs.get(k), ours[k]) for k in ours if theirs.get(k) != ours[k]}
    if diff:
        raise ValueError(f"checkpoint {ckpts[-1]!r} was made with a different model or LoRA config: "
                         + ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items()))
    return ckpts[-1]


def rng_state() -> dict:
    """Plain data and tensors only (load_state's weights_only): numpy's key array as a tensor."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                      cached), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    keys = keys.numpy() if torch.is_tensor(keys) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    random.setstate(tuple(state["python"]))


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (window 1 = the raw values)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


EVAL_CURVES = (("eval_reward", "o-", "eval: training prompts, held-out seeds"),
               ("eval_reward_heldout_prompts", "s:", "eval: held-out prompts"))


def eval_points(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(updates, value) of an eval metric: the run's starting policy (`<key>_initial` in its first row, at that
    row's step) and every later evaluation (logged in the row of the step whose update it follows, so at step + 1)."""
    points = [(r["step"], r[f"{key}_initial"]) for r in rows if f"{key}_initial" in r]
    points += [(r["step"] + 1, r[key]) for r in rows if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot_reward_curves(runs: dict[str, list[dict]], path: str, eval_too: bool = False, window: int = 1,
                       title: str | None = None) -> list[str]:
    """One PNG with every run's train reward per step (label -> metrics rows; label "" for a single unnamed run)
    and, with eval_too, its evaluation curves (see EVAL_CURVES). Written atomically; returns the legend entries."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, rows in runs.items():
        prefix = f"{label}: " if label else ""
        rows = [r for r in rows if "reward_mean" in r]
        what = "train reward (mean of the step's samples)" if window == 1 else f"train reward ({window}-step mean)"
        line, = ax.plot([r["step"] for r in rows], smooth([r["reward_mean"] for r in rows], window),
                        label=prefix + what,
                        alpha=0.8)
        for i, (key, style, name) in enumerate(EVAL_CURVES if eval_too else ()):
            steps, values = eval_points(rows, key)
            if steps:  # one run: a colour per curve; several runs: a colour per run
                color = f"C{i + 1}" if len(runs) == 1 else line.get_color()
                ax.plot(steps, values, style, color=color, markersize=3, label=prefix + name)
    ax.set_xlabel("step (optimizer updates)"); ax.set_ylabel("reward")  # noqa: E702
    ax.legend(fontsize=8); ax.grid(alpha=0.3)  # noqa: E702
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    plt.close(fig)
    return legend


def to_json(cfg) -> str:
    """config.json's text: the resolved Config `cfg` (a dataclass), one field a line, sorted."""
    return json.dumps(dataclasses.asdict(cfg), indent=1, sort_keys=True)


def default_run_name(cfg) -> str:
    """A new run's directory name when --run-name is not given: model, mode, start time, launcher pid."""
    import time
    return f"{cfg.model}-{cfg.mode}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def open_run_dir(cfg, steps) -> RunDir:
    """The leader's run directory for Config `cfg` (resumed: drop the rows of steps to be redone); prints its
    path and the resolved config."""
    run_path = cfg.resume or os.path.join(cfg.out_dir, cfg.run_name or default_run_name(cfg))
    wandb = dict(project=cfg.wandb_project, name=cfg.wandb_name, config=dataclasses.asdict(cfg)) if cfg.wandb else None
    run_dir = RunDir(run_path, to_json(cfg), cfg.tensorboard, cfg.keep_checkpoints, wandb,
                     first_step=steps.start if cfg.resume else 0)
    if cfg.resume:
        redone = sorted({r["step"] for r in run_dir.read_metrics() if r["step"] >= steps.start})
        run_dir.truncate_metrics(steps.start)
        again = (f"; steps {redone[0]}-{redone[-1]} were logged after that checkpoint: their rows are dropped and the "
                 "steps redone" if redone else "")
        print(f"[digenrl] resumed from step {steps.start} (checkpoint {list_checkpoints(run_path)[-1]}): steps "
              f"{steps.start}-{steps.stop - 1} to run{again}", flush=True)
    print(f"[digenrl] run dir {run_path}\n[digenrl] config {json.dumps(dataclasses.asdict(cfg), sort_keys=True)}",
          flush=True)
    return run_dir


def record_step(run_dir: RunDir, cfg, policy, step: int, metrics: dict, checkpoint: tuple | None, tracer,
                on_write: Callable[[], None] | None = None) -> None:
    """The leader's end of a step: the metrics row; with `checkpoint` = (state, produce) (checkpoint_state.skeleton
    and .produce), a checkpoint written streamed (and the LoRA file diffusers loads; `on_write` per record
    written) and the reward curve."""
    import functools

    import models

    run_dir.log(step, metrics)
    if checkpoint is not None:
        state, produce = checkpoint
        with tracer.span("checkpoint", step=step):
            state.update(step=step + 1, rng=rng_state(), identity=identity(cfg),
                         config=dataclasses.asdict(cfg))
            lora = functools.partial(models.lora_state_for_diffusers, policy.transformer) if cfg.lora else None
            meta = models.lora_metadata(policy.transformer) if cfg.lora else None  # alpha, rank, targets
            run_dir.save_checkpoint(step + 1, state, produce, lora, policy.family.pipeline_class(), meta, on_write)
        run_dir.plot_rewards()
