"""Reward functions for RL on image/video generators, and the registry that names them.

A reward is a callable ``fn(images, prompts[, metadata]) -> Tensor[B]`` (float32, on the CPU), where
``images`` are float tensors in [0, 1], ``[B, 3, H, W]`` for images or ``[B, F, 3, H, W]``
for videos, ``prompts`` is a list of B strings and ``metadata`` a list of B dicts (each prompt's dataset
row; infra/prompts.py). Image rewards given a video are applied to every frame and averaged over frames by
one generic wrapper (``_per_frame``); ``temporal_consistency`` consumes the video itself and ``remote``
(rewards/remote.py) sends every frame (or the middle one) to the server. rewards/checked.py wraps each fn.

Rewards are combined with a spec string such as ``"color=1.0,jpeg_compressibility=0.1"``:
``build_reward(spec, options)`` returns a ``CombinedReward`` whose call gives one tensor per
named reward plus their weighted sum under ``"total"`` (and the numeric ``info`` of custom
rewards). ``parse_reward_spec`` and
``check_reward_options`` validate a spec without loading any model, so a CLI can fail fast
before it spawns processes.

Custom rewards (loaded by rewards/custom.py): a spec name ``path/to/file.py:function`` or
``package.module:function`` names
any callable with the reward signature above, e.g. ``--reward my_rewards.py:aesthetic=0.5,color=1``.
It gets the images (or videos) as they are and returns [B] scores or Flow-GRPO's (scores, info); its
metrics are named after the file's stem (or the module's last part) and the function, never a path
(``reward_my_rewards_aesthetic_mean``: W&B and TensorBoard names keep to letters, digits and underscores, and
moving the file keeps the name).

Remote rewards (rewards/remote.py): ``remote`` with ``--remote-url URL``, or several at once, each with its
weight and its own server, as ``remote:NAME`` (``--reward remote:geneval=1,remote:deqa=0.5 --remote-url
geneval=http://h:18085,deqa=http://h:18086 --remote-score-key geneval=scores,deqa=outputs``), logged separately
(``reward_remote_geneval_mean``). ``check_remote_servers`` sends each server one small request before any rank
starts and checks its answer. ``check_reward_options`` imports it (the file by path, so
spawned rank processes find it without sys.path) and checks that the attribute exists and is callable;
``build_reward(..., probe=probe_batch(...))`` dry-calls it.
A non-finite score is passed on as it is: the trainer skips that step (``--max-bad-steps``).

Try it:
    python -c "import torch, rewards; r = rewards.build_reward('color,jpeg_compressibility=0.1'); \
print(r(torch.rand(2, 3, 32, 32), ['a red image', 'a blue image']))"
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from einops import rearrange
from PIL import Image

import models
from infra.prompts import PromptSource, load_prompt_source
from rewards.checked import CheckedReward, CombinedReward, probe_batch, takes_metadata  # noqa: F401
from rewards.custom import CUSTOM_FORMS, custom_metric_name, is_custom, load_custom_reward, split_custom
from rewards.remote import PROTOCOLS, RemoteRewardError, remote_scorer  # noqa: F401  (re-exported)

REMOTE_PREFIX = "remote:"  # remote:NAME, one of several remote rewards (each with its own server)

RewardFn = Callable[[torch.Tensor, list[str]], torch.Tensor]


@dataclass
class RewardOptions:
    """Everything a reward factory may need; rewards ignore the fields they do not use."""

    clip_path: str | None = None  # local directory with a saved CLIPModel + CLIPProcessor
    pickscore_path: str | None = None  # local PickScore_v1 CLIPModel directory
    pickscore_processor_path: str | None = None  # its CLIPProcessor (CLIP-ViT-H-14); unset = pickscore_path
    remote_url: str | None = None  # http(s) URL of a reward server (see ``remote``)
    remote_timeout_s: float = 30.0  # per attempt, all of it (connect to last byte); a slow server's attempt fails
    remote_retries: int = 7  # retries after the first attempt, for timeouts/connection/5xx
    remote_backoff_s: float = 1.0  # sleep before retry k (0-based): min(backoff * 2**k, remote.BACKOFF_CAP_S)
    remote_protocol: str = "json"  # "json" or "flow_grpo" (pickled JPEG batches; rewards/remote.py)
    remote_score_key: str = "scores"  # the answer's key holding the scores (DeQA / UnifiedReward: "outputs")
    remote_batch_size: int = 64  # images per request (Flow-GRPO's clients send 64)
    remote_frames: str = "all"  # videos: "all" frames scored as images and averaged, or only the "middle" one
    remote_name: str = "remote"  # which remote reward these settings are for: "remote" or "remote:NAME"
    device: str = "cpu"  # where model-based rewards (CLIP) run

    @classmethod
    def of(cls, cfg) -> RewardOptions:
        """A run's reward options, from its config.Config (the fields of the same names)."""
        return cls(clip_path=cfg.clip_path, pickscore_path=cfg.pickscore_path,
                   pickscore_processor_path=cfg.pickscore_processor_path, remote_url=cfg.remote_url,
                   remote_timeout_s=cfg.remote_timeout_s, remote_retries=cfg.remote_retries,
                   remote_protocol=cfg.remote_protocol, remote_score_key=cfg.remote_score_key,
                   remote_batch_size=cfg.remote_batch_size, remote_frames=cfg.remote_frames)


# ---------------------------------------------------------------- registry and video handling

REWARDS: dict[str, Callable[..., RewardFn]] = {}


def _register(name: str, video: str) -> Callable:
    """Register a factory under ``name``. ``video`` says how the returned fn treats videos:
    "per_frame" (generic frame loop added here) or "own" (the fn handles 4-D/5-D itself)."""

    def decorate(make: Callable[[RewardOptions], RewardFn]) -> Callable[..., RewardFn]:
        def factory(options: RewardOptions | None = None, **overrides) -> RewardFn:
            allowed = [f.name for f in dataclasses.fields(RewardOptions)]
            unknown = sorted(set(overrides) - set(allowed))
            if unknown:
                raise TypeError(f"unknown reward option(s) {unknown}; allowed: {allowed}")
            options = dataclasses.replace(options or RewardOptions(), **overrides)
            check_reward_options({name: 1.0}, options)
            fn = make(options)
            return _checked(_per_frame(fn) if video == "per_frame" else fn, name)

        factory.__name__ = factory.__qualname__ = name
        factory.__doc__ = make.__doc__
        REWARDS[name] = factory
        return factory

    return decorate


def _checked(fn, name: str) -> CheckedReward:
    """Validate inputs once for every reward, and normalise the output to float32 CPU [B] (rewards/checked.py)."""
    return CheckedReward(fn, name)


def _per_frame(fn):
    """Apply an image reward to each frame of a video and average over frames (metadata repeated per frame)."""
    wants_metadata = takes_metadata(fn)

    def reward(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        if images.dim() == 4:
            return fn(images, prompts, metadata) if wants_metadata else fn(images, prompts)
        num_frames = images.shape[1]
        frames = rearrange(images, "b f c h w -> (b f) c h w")  # [B*F, 3, H, W]
        frame_prompts = [p for p in prompts for _ in range(num_frames)]  # same b-major order
        frame_metadata = [m for m in metadata for _ in range(num_frames)]
        scores = fn(frames, frame_prompts, frame_metadata) if wants_metadata else fn(frames, frame_prompts)  # [B*F]
        return rearrange(torch.as_tensor(scores, dtype=torch.float32), "(b f) -> b f", f=num_frames).mean(dim=1)  # [B]

    return reward


def to_pil_images(images: torch.Tensor) -> list[Image.Image]:
    """[B, 3, H, W] floats in [0, 1] -> list of B RGB PIL images (rounded to uint8)."""
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8)  # [B, 3, H, W]
    pixels = rearrange(pixels, "b c h w -> b h w c").cpu().numpy()  # [B, H, W, 3]
    return [Image.fromarray(np.ascontiguousarray(p)) for p in pixels]


# ---------------------------------------------------------------- simple pixel rewards

def _jpeg_size_kb(images: torch.Tensor) -> torch.Tensor:
    sizes = []
    for image in to_pil_images(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)  # kB as in ddpo-pytorch (1000, not 1024)
    return torch.tensor(sizes, dtype=torch.float32)  # [B]


@_register("jpeg_compressibility", video="per_frame")
def _make_jpeg_compressibility(options: RewardOptions) -> RewardFn:
    """Minus the JPEG size (quality 95) in kB: rewards simple, smooth images (ddpo-pytorch)."""
    return lambda images, prompts: -_jpeg_size_kb(images)


@_register("jpeg_incompressibility", video="per_frame")
def _make_jpeg_incompressibility(options: RewardOptions) -> RewardFn:
    """The JPEG size (quality 95) in kB: rewards detailed, noisy images (ddpo-pytorch)."""
    return lambda images, prompts: _jpeg_size_kb(images)


COLOR_NAMES = ("red", "green", "blue")  # index = RGB channel
_COLOR_PROMPTS = {
    "train": [f"a {color} image" for color in COLOR_NAMES],
    # Held-out phrasings: the policy must follow the colour word, not memorise a prompt.
    "eval": [f"a picture that is all {color}" for color in COLOR_NAMES],
}


def color_prompts(split: str) -> list[str]:
    """The prompts of the colour demo task, one per colour, for split "train" or "eval"."""
    if split not in _COLOR_PROMPTS:
        raise ValueError(f"unknown prompt split {split!r}; allowed: {sorted(_COLOR_PROMPTS)}")
    return list(_COLOR_PROMPTS[split])


def prompt_color(prompt: str) -> int:
    """Channel index of the one colour named in ``prompt`` (whole words, any case)."""
    found = [i for i, c in enumerate(COLOR_NAMES) if re.search(rf"\b{c}\b", prompt.lower())]
    if len(found) != 1:
        raise ValueError(f"the color reward needs a prompt naming exactly one of "
                         f"{list(COLOR_NAMES)}; got {prompt!r}")
    return found[0]


@_register("color", video="per_frame")
def _make_color(options: RewardOptions) -> RewardFn:
    """Mean of the prompt's colour channel minus the mean of the other two, in [-1, 1]."""

    def color(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        target = torch.tensor([prompt_color(p) for p in prompts], device=images.device)  # [B]
        channel_means = images.mean(dim=(2, 3))  # [B, 3]
        wanted = channel_means.gather(1, target[:, None])[:, 0]  # [B]
        others = (channel_means.sum(dim=1) - wanted) / 2  # [B]
        return wanted - others  # [B]

    return color


# ---------------------------------------------------------------- CLIP score

@_register("clip_score", video="per_frame")
def _make_clip_score(options: RewardOptions) -> RewardFn:
    """Cosine similarity of CLIP image and text embeddings, in [-1, 1] (model at clip_path)."""
    # Imported here so that the registry and the cheap rewards never pay for transformers.
    from transformers import CLIPModel, CLIPProcessor

    device = torch.device(options.device)
    model = CLIPModel.from_pretrained(options.clip_path).to(device).eval()
    processor = CLIPProcessor.from_pretrained(options.clip_path)

    @torch.no_grad()
    def clip_score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        # The processor resizes/crops/normalises PIL images; truncation keeps long prompts
        # within the text encoder's positions (tokenizer.model_max_length).
        inputs = processor(text=prompts, images=to_pil_images(images), return_tensors="pt",
                           padding=True, truncation=True)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        # forward() returns L2-normalised embeddings on every transformers version, whereas
        # get_*_features changed from a tensor to a model output in transformers 5.
        out = model(**inputs)
        return (out.image_embeds * out.text_embeds).sum(dim=-1)  # [B]

    return clip_score


# ---------------------------------------------------------------- PickScore

PICKSCORE_SCALE = 26.0  # Flow-GRPO divides the logit by 26 ("norm to 0-1"); its published curves use it


@_register("pickscore", video="per_frame")
def _make_pickscore(options: RewardOptions) -> RewardFn:
    """PickScore (Kirstain et al. 2023) as Flow-GRPO scores it: exp(logit_scale) * cos(image, text) / 26,
    about 0.85-0.95 for SD3.5 images. Model at pickscore_path, processor at pickscore_processor_path."""
    from transformers import CLIPModel, CLIPProcessor

    device = torch.device(options.device)
    model = CLIPModel.from_pretrained(options.pickscore_path).to(device).eval()
    processor = CLIPProcessor.from_pretrained(options.pickscore_processor_path or options.pickscore_path)

    @torch.no_grad()
    def pickscore(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        inputs = processor(text=prompts, images=to_pil_images(images), return_tensors="pt",
                           padding=True, truncation=True, max_length=77)  # Flow-GRPO's max_length
        out = model(**{k: v.to(device) for k, v in inputs.items()})  # embeds come L2-normalised
        cos = (out.image_embeds * out.text_embeds).sum(dim=-1)  # [B]
        return model.logit_scale.exp() * cos / PICKSCORE_SCALE  # [B]

    return pickscore


# ---------------------------------------------------------------- video reward

@_register("temporal_consistency", video="own")
def _make_temporal_consistency(options: RewardOptions) -> RewardFn:
    """Mean cosine similarity of consecutive frames, in [-1, 1] (videos only).

    Pixels are mapped to [-1, 1] and not centred per frame, so a static video scores 1 even
    when it is flat, and black/white flicker scores -1. An exactly mid-grey frame is the zero
    vector and counts as similarity 0 with its neighbours.
    """

    def temporal_consistency(videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if videos.dim() != 5 or videos.shape[1] < 2:
            raise ValueError(f"temporal_consistency needs videos [B, F, 3, H, W] with F >= 2, "
                             f"got shape {tuple(videos.shape)}")
        frames = rearrange(videos * 2 - 1, "b f c h w -> b f (c h w)")  # [B, F, 3HW]
        similarity = torch.nn.functional.cosine_similarity(
            frames[:, 1:], frames[:, :-1], dim=-1, eps=1e-8)  # [B, F-1]
        return similarity.mean(dim=1)  # [B]

    return temporal_consistency


# ---------------------------------------------------------------- remote reward server

@_register("remote", video="own")
def _make_remote(options: RewardOptions) -> RewardFn:
    """Scores from an HTTP reward server (rewards/remote.py). A video sends every frame as an image (prompt and
    metadata repeated) and scores the mean over frames, or only its middle frame (remote_frames="middle")."""
    score = remote_scorer(options.remote_url, options.remote_timeout_s, options.remote_retries,
                          options.remote_backoff_s, options.remote_protocol, options.remote_score_key,
                          options.remote_batch_size,
                          key_flag="--remote-score-key " + (options.remote_name[len(REMOTE_PREFIX):] + "="
                                                             if options.remote_name.startswith(REMOTE_PREFIX) else ""))
    middle_only = options.remote_frames == "middle"

    def remote(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        if images.dim() == 4:
            return score(to_pil_images(images), prompts, metadata)
        if middle_only:
            return score(to_pil_images(images[:, images.shape[1] // 2]), prompts, metadata)  # [B]
        num_frames = images.shape[1]
        frames = rearrange(images, "b f c h w -> (b f) c h w")  # [B*F, 3, H, W]
        scores = score(to_pil_images(frames), [p for p in prompts for _ in range(num_frames)],
                       [m for m in metadata for _ in range(num_frames)])  # [B*F]
        return rearrange(scores, "(b f) -> b f", f=num_frames).mean(dim=1)  # [B]

    def deadline_s(images: torch.Tensor) -> float:
        """The longest a call on `images` takes: the requests of its images (a video's frames each one)."""
        sent = images.shape[0] * (images.shape[1] if images.dim() == 5 and not middle_only else 1)
        return score.deadline_s(sent)

    remote.deadline_s = deadline_s
    return remote


def is_remote(name: str) -> bool:
    return name == "remote" or name.startswith(REMOTE_PREFIX)


def metric_name(name: str) -> str:
    """What a reward of the spec is logged as (`reward_<metric name>_mean`): letters, digits and underscores."""
    if name.startswith(REMOTE_PREFIX):
        return "remote_" + name[len(REMOTE_PREFIX):]
    return custom_metric_name(name) if is_custom(name) else name


_PER_NAME = re.compile(r"^([A-Za-z_][\w-]*)=(.*)$")


def per_name(value, name: str, flag: str):
    """The setting of remote reward `name` ("remote" or "remote:NAME") in `value`: one value for every remote
    reward, or a comma list of NAME=VALUE (a value holding no NAME= prefix, e.g. a URL, is one value)."""
    if not isinstance(value, str) or not _PER_NAME.match(value):
        return value
    items = [m for m in (_PER_NAME.match(part.strip()) for part in re.split(r",(?=\s*[A-Za-z_][\w-]*=)", value))]
    if not all(items):
        raise ValueError(f"{flag} {value!r}: give one value, or NAME=VALUE,NAME=VALUE for the remote:NAME rewards")
    table = {m.group(1): m.group(2).strip() for m in items}
    key = name[len(REMOTE_PREFIX):] if name.startswith(REMOTE_PREFIX) else None
    if key not in table:
        wanted = f"an entry {key}=..." if key else "one value (the reward is plain 'remote')"
        raise ValueError(f"{flag} {value!r} has no setting for reward {name!r}: give {wanted}")
    return table[key]


def remote_options(options: RewardOptions, name: str) -> RewardOptions:
    """`options` with remote reward `name`'s own URL, protocol and score key (see per_name)."""
    out = dataclasses.replace(
        options, remote_url=per_name(options.remote_url, name, "--remote-url"),
        remote_protocol=per_name(options.remote_protocol, name, "--remote-protocol"),
        remote_score_key=per_name(options.remote_score_key, name, "--remote-score-key"))
    out.remote_name = name
    return out


def make_reward(name: str, options: RewardOptions | None = None) -> CheckedReward:
    """One reward fn by spec name: a registered one, a remote:NAME one, or a custom function (shape-checked)."""
    if is_custom(name):
        return _checked(load_custom_reward(name), name)
    if name.startswith(REMOTE_PREFIX):
        fn = REWARDS["remote"](remote_options(options or RewardOptions(), name))
        fn.name = fn.__name__ = name
        return fn
    if name == "remote":
        return REWARDS["remote"](remote_options(options or RewardOptions(), name))
    return REWARDS[name](options)


# ---------------------------------------------------------------- specs and combination

def parse_reward_spec(spec: str) -> dict[str, float]:
    """ "color=1.0,jpeg_compressibility=0.1" -> {"color": 1.0, ...}; a bare name weighs 1."""
    if not spec or not spec.strip():
        raise ValueError(f"empty reward spec; give e.g. 'color' or 'color=1,clip_score=0.5' "
                         f"with names from {sorted(REWARDS)}")
    weights: dict[str, float] = {}
    for item in spec.split(","):
        name, _, weight_text = item.partition("=")
        name = name.strip()
        if is_custom(name):
            split_custom(name)  # syntax only: importing is check_reward_options' job
        elif name.startswith(REMOTE_PREFIX):
            if not re.fullmatch(r"[A-Za-z_][\w-]*", name[len(REMOTE_PREFIX):]):
                raise ValueError(f"bad remote reward {name!r} in spec {spec!r}: give remote:NAME with NAME a word "
                                 "(letters, digits, _ or -), e.g. remote:geneval")
        elif name not in REWARDS:
            raise ValueError(f"unknown reward {name!r} in spec {spec!r}; known rewards: "
                             f"{sorted(REWARDS)}, or a custom one as {CUSTOM_FORMS}")
        if name in weights:
            raise ValueError(f"reward {name!r} appears twice in spec {spec!r}")
        try:
            weight = float(weight_text) if "=" in item else 1.0
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise ValueError(f"bad weight {weight_text.strip()!r} for reward {name!r} in spec "
                             f"{spec!r}; need a finite number")
        weights[name] = weight
    by_metric: dict[str, str] = {}
    for name in weights:
        other = by_metric.setdefault(metric_name(name), name)
        if other != name:
            raise ValueError(f"rewards {other!r} and {name!r} would both be logged as {metric_name(name)!r}; rename "
                             "one function or file")
    return weights


def check_reward_options(spec: str | Mapping[str, float], options: RewardOptions) -> None:
    """Raise a clear error if the rewards in ``spec`` cannot be built with ``options``."""
    names = parse_reward_spec(spec) if isinstance(spec, str) else dict(spec)
    for name in names:
        if is_custom(name):
            load_custom_reward(name)  # imports the file/module; raises naming the bad part
    if "clip_score" in names:
        if not options.clip_path:
            raise ValueError("reward 'clip_score' needs --clip-path (a local directory with a "
                             "saved CLIPModel and CLIPProcessor)")
        if not os.path.isdir(options.clip_path):
            raise FileNotFoundError(f"--clip-path {options.clip_path!r} is not a directory; "
                                    f"clip_score needs a saved CLIPModel + CLIPProcessor there")
    if "pickscore" in names:
        if not options.pickscore_path:
            raise ValueError("reward 'pickscore' needs --pickscore-path (a local directory with the saved "
                             "PickScore_v1 CLIPModel, e.g. a download of yuvalkirstain/PickScore_v1)")
        for flag, path in (("--pickscore-path", options.pickscore_path),
                           ("--pickscore-processor-path", options.pickscore_processor_path)):
            if path is not None and not os.path.isdir(path):
                raise FileNotFoundError(f"{flag} {path!r} is not a directory; pickscore needs a saved "
                                        "CLIPModel (and a CLIPProcessor, e.g. laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")
    remotes = [n for n in names if is_remote(n)]
    for name in remotes:
        named = remote_options(options, name)
        url = named.remote_url or ""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward {name!r} needs --remote-url starting with http:// or "
                             f"https://, got {named.remote_url!r}")
        if options.remote_timeout_s <= 0 or options.remote_retries < 0 \
                or options.remote_backoff_s < 0 or options.remote_batch_size < 1:
            raise ValueError(f"remote reward needs timeout > 0, retries >= 0, backoff >= 0, batch size >= 1; "
                             f"got timeout {options.remote_timeout_s}, retries {options.remote_retries}, "
                             f"backoff {options.remote_backoff_s}, batch size {options.remote_batch_size}")
        if named.remote_protocol not in PROTOCOLS:
            raise ValueError(f"--remote-protocol {named.remote_protocol!r} (reward {name!r}) is not one of "
                             f"{', '.join(PROTOCOLS)}")
        if options.remote_frames not in ("all", "middle"):
            raise ValueError(f"--remote-frames {options.remote_frames!r} is not one of all, middle")
        if not named.remote_score_key:
            raise ValueError("--remote-score-key must name the answer's score key (e.g. scores, outputs)")


def check_remote_servers(spec: str, options: RewardOptions, probe) -> None:
    """Before any rank starts: each remote reward's server gets one small request (blank images of the run's size
    with the first prompts and their metadata, as training sends them) and its answer is checked: the protocol
    and safe unpickling, the score key, one finite score per image. A failure is a ValueError naming the server."""
    images, prompts, metadata = probe
    for name in (n for n in parse_reward_spec(spec) if is_remote(n)):
        try:
            make_reward(name, options)(torch.zeros_like(images), prompts, metadata)
        except RemoteRewardError as error:
            raise ValueError(f"reward {name!r}: the check request before training failed: {error}") from None


# ---------------------------------------------------------------- what a reward needs of the prompts

PROMPT_RULES: dict[str, Callable[[str], object]] = {"color": prompt_color}  # raises ValueError on a bad prompt


def check_prompts(spec: str, prompts: list[str], where: str) -> None:
    """Raise naming the first prompt a reward of ``spec`` cannot score (e.g. color: no colour word)."""
    for name in parse_reward_spec(spec):
        rule = PROMPT_RULES.get(name)
        for index, prompt in enumerate(prompts if rule else []):
            try:
                rule(prompt)
            except ValueError as error:
                raise ValueError(f"reward {name!r} cannot score prompt {index + 1} of {where}: {error}") from None


def check_custom_rewards(spec: str, probe) -> None:
    """Dry-call the custom rewards of ``spec`` on ``probe`` (probe_batch): a wrong return is refused, named."""
    weights = {n: w for n, w in parse_reward_spec(spec).items() if is_custom(n)}
    if weights:
        CombinedReward({name: make_reward(name) for name in weights}, weights).probe(*probe)


def build_reward(spec: str, options: RewardOptions | None = None, probe=None) -> CombinedReward:
    """Validate ``spec`` and ``options`` first, then build (load) every named reward; ``probe`` (a probe_batch)
    dry-calls the custom ones."""
    options = options or RewardOptions()
    weights = parse_reward_spec(spec)
    check_reward_options(weights, options)
    reward = CombinedReward({metric_name(name): make_reward(name, options) for name in weights},
                            {metric_name(name): weight for name, weight in weights.items()})
    if probe is not None:
        reward.probe(*probe)
    return reward


# ---------------------------------------------------------------- a run's prompts and the reward's dry call

def prompt_source(cfg) -> PromptSource:
    """A run's train and eval prompts with their metadata: --prompt-file's (infra/prompts.py), else
    the colour task's; eval cut to --eval-prompts."""
    source = load_prompt_source(cfg.prompt_file, color_prompts("train"), color_prompts("eval"))
    if cfg.eval_prompts:
        source.eval, source.eval_metadata = (source.eval[:cfg.eval_prompts],
                                             source.eval_metadata[:cfg.eval_prompts])
    return source


def reward_probe(cfg, source: PromptSource):
    """The tiny batch a run's custom rewards are dry-called on: 2 images (videos) of the run's size,
    its first prompts."""
    family = models.get_family(cfg.model)
    size = cfg.resolution or family.tiny_resolution
    frames = (cfg.frames or family.tiny_frames) if family.is_video else 0
    return probe_batch(source.train, source.train_metadata, size, cfg.width or size, frames)
