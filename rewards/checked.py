"""One wrapper for every reward fn: input checks, calling with or without metadata, and normalising what comes back.

A reward fn may be written as `fn(images, prompts)` or `fn(images, prompts, metadata)` (Flow-GRPO, ddpo-pytorch,
TRL's DDPO), and may return `scores` or `(scores, info)`. `scores` is anything `torch.as_tensor` turns into [B]
numbers; `info` is a dict whose numeric entries (a number, or B numbers) are logged as metrics
`reward_<name>/<key>_mean`; other entries (strings, nested dicts such as GenEval's group accuracies) are skipped.
`metadata` is a list of B dicts (the dataset row of each sample's prompt; `{}` for plain-text prompts).

    r = CheckedReward(fn, "my.py:score")
    scores = r(images, prompts, metadata)              # [B] float32 on the CPU
    scores, info = r.scored(images, prompts, metadata)  # info: key -> [B] float32

`CombinedReward` holds the named rewards of a spec and their weighted sum; its `probe` dry-calls the custom ones
before any rank starts (and learns which info keys to log).
"""
from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping

import numpy as np
import torch

from rewards.custom import is_custom


def takes_metadata(fn) -> bool:
    """True when fn can be called as fn(images, prompts, metadata) (a third positional parameter or *args)."""
    try:
        inspect.signature(fn).bind(None, None, None)
        return True
    except TypeError:
        return False
    except ValueError:  # builtins without a signature: call them the plain way
        return False


def _as_scores(value, name: str, batch: int) -> torch.Tensor:
    try:  # custom rewards may return a list or an array; any [B] numbers will do
        scores = torch.as_tensor(np.asarray(value, dtype=np.float32) if isinstance(value, (list, tuple)) else value)
        scores = scores.detach().float().cpu()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"reward {name!r} returned {type(value).__name__}, not {batch} scores (a tensor, array or "
                        f"list of numbers, or a (scores, info) tuple): {error}") from None
    # NaN/inf scores are deliberately passed on: the trainer skips a non-finite step and
    # aborts after --max-bad-steps in a row, which says more than an error here would.
    if scores.shape != (batch,):
        raise RuntimeError(f"reward {name!r} returned shape {tuple(scores.shape)}, expected ({batch},): one score "
                           "per image")
    return scores


def _as_info(info: dict | None, batch: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in (info or {}).items():
        if isinstance(value, numbers.Number) and not isinstance(value, bool):
            out[str(key)] = torch.full((batch,), float(value))
            continue
        try:
            array = np.asarray(value.detach().cpu() if torch.is_tensor(value) else value, dtype=np.float64)
        except (TypeError, ValueError):
            continue  # strings, dicts, ragged lists: not a metric
        if array.shape == (batch,):
            out[str(key)] = torch.as_tensor(array, dtype=torch.float32)
        elif array.shape == ():
            out[str(key)] = torch.full((batch,), float(array))
    return out


class CheckedReward:
    """Validate inputs, call the fn the way it is written, return float32 CPU [B] scores (and numeric info)."""

    def __init__(self, fn, name: str):
        self.fn, self.name, self.__name__ = fn, name, name
        self.wants_metadata = takes_metadata(fn)

    def scored(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None):
        if images.dim() not in (4, 5) or images.shape[-3] != 3:
            raise ValueError(f"reward {self.name!r}: expected images [B, 3, H, W] or videos "
                             f"[B, F, 3, H, W], got shape {tuple(images.shape)}")
        batch = images.shape[0]
        if len(prompts) != batch:
            raise ValueError(f"reward {self.name!r}: got {len(prompts)} prompts for a batch of "
                             f"{batch}; need one prompt per sample")
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if len(metadata) != batch:
            raise ValueError(f"reward {self.name!r}: got {len(metadata)} metadata rows for a batch of {batch}")
        images = images.detach().float()
        out = self.fn(images, list(prompts), metadata) if self.wants_metadata else self.fn(images, list(prompts))
        info = None
        if isinstance(out, tuple) and len(out) == 2 and (out[1] is None or isinstance(out[1], dict)):
            out, info = out  # Flow-GRPO's (scores, info); any other tuple must itself be the B scores
        return _as_scores(out, self.name, batch), _as_info(info, batch)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        return self.scored(images, prompts, metadata)[0]


class CombinedReward:
    """Several named rewards and their weighted sum; call -> {name: [B], ..., "<name>/<info key>": [B], "total": [B]}.

    Keys come in the order of `names` (each reward, then the info keys `probe` found), the column order of the
    fragments' reward parts. `prompt_metadata` (the training prompts' dataset rows) lets generation pass prompt ids
    instead of metadata: __call__(images, prompts, prompt_ids=...)."""

    def __init__(self, fns: Mapping[str, object], weights: Mapping[str, float]):
        if set(fns) != set(weights):
            raise ValueError(f"reward fns {sorted(fns)} and weights {sorted(weights)} differ")
        self.fns = {n: fn if isinstance(fn, CheckedReward) else CheckedReward(fn, n) for n, fn in fns.items()}
        self.weights = dict(weights)
        self.info_keys: dict[str, list[str]] = {}  # reward name -> info keys logged (found by probe)
        self.prompt_metadata: list[dict] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.fns) + [f"{n}/{k}" for n, keys in self.info_keys.items() for k in keys]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None,
                 prompt_ids=None) -> dict[str, torch.Tensor]:
        if metadata is None and prompt_ids is not None and self.prompt_metadata is not None:
            metadata = [self.prompt_metadata[int(i)] for i in prompt_ids]
        scores, infos = {}, {}
        for name, fn in self.fns.items():
            scores[name], infos[name] = fn.scored(images, prompts, metadata)  # [B], key -> [B]
        for name, keys in self.info_keys.items():  # a key missing from this call is logged as NaN
            for key in keys:
                scores[f"{name}/{key}"] = infos[name].get(key, torch.full((images.shape[0],), math.nan))
        scores["total"] = sum(self.weights[n] * scores[n] for n in self.fns)  # [B]
        return scores

    def deadline_s(self, images: torch.Tensor) -> float | None:
        """The longest a call on `images` can take, when every reward fn bounds it (remote rewards:
        rewards/remote.call_deadline_s); None when one does not (a local or custom fn runs as long as it takes)."""
        bounds = [getattr(fn.fn, "deadline_s", None) for fn in self.fns.values()]
        if any(bound is None for bound in bounds):
            return None
        return sum(bound(images) for bound in bounds)

    def probe(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> None:
        """Dry-call every custom reward on a tiny batch: a wrong return type or length fails here (before any rank
        starts), naming the function; the numeric info keys it returns become logged columns."""
        for name, fn in self.fns.items():
            if not is_custom(fn.name):  # keyed by metric name; the CheckedReward keeps the spec name
                continue
            try:
                _, info = fn.scored(images, prompts, metadata)
            except Exception as error:  # noqa: BLE001  (user code: any failure is a bad reward)
                how = "fn(images, prompts, metadata)" if fn.wants_metadata else "fn(images, prompts)"
                raise ValueError(f"custom reward {fn.name!r} failed a dry call as {how} on {images.shape[0]} probe "
                                 f"images {tuple(images.shape)}: {type(error).__name__}: {error}") from None
            if info:
                self.info_keys[name] = sorted(info)


def probe_batch(prompts: list[str], metadata: list[dict], height: int, width: int, frames: int = 0):
    """Two deterministic images (or videos, frames > 0) with the first prompts: the input of CombinedReward.probe."""
    gen = torch.Generator().manual_seed(0)
    shape = (2, frames, 3, height, width) if frames else (2, 3, height, width)
    rows = [(prompts[i % len(prompts)], metadata[i % len(metadata)] if metadata else {}) for i in range(2)]
    return torch.rand(shape, generator=gen), [p for p, _ in rows], [m for _, m in rows]
