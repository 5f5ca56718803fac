"""Client for HTTP reward servers: the `remote` reward of rewards/__init__.py, in two wire protocols.

    python main.py --reward remote --remote-url http://reward-host:18085 --remote-protocol flow_grpo
    python main.py --reward remote --remote-url http://127.0.0.1:18086 --remote-protocol flow_grpo \
        --remote-score-key outputs

- `flow_grpo` (Flow-GRPO's reward servers: yifan123/reward-server app_geneval.py / app_deqa.py, and the UnifiedReward
  server): POST `pickle.dumps({"images": [JPEG bytes], "prompts": [str], "meta_datas": [dict], "only_strict": True})`
  in batches of --remote-batch-size (Flow-GRPO: 64); the answer is a pickled dict whose --remote-score-key holds one
  number per image (`scores` for GenEval, `outputs` for DeQA and UnifiedReward). Each server reads the keys it needs:
  GenEval `images`, `meta_datas` (the dataset's metadata rows) and `only_strict`; DeQA `images`; UnifiedReward
  `images` and `prompts`. JPEGs are PIL's default quality (75), as Flow-GRPO's client encodes them.
- `json` (this project's original protocol): POST JSON {"images": [base64 PNG], "prompts": [...], "meta_datas": [...]}
  -> {"scores": [float per image]} (the score key is configurable here too).

Answers are unpickled by `safe_loads`, which admits only plain containers, numbers, strings, bytes and numpy arrays:
a pickle that names any other callable (os.system, eval, a class with __reduce__) is refused before anything runs.
Timeouts, connection errors and HTTP 5xx are retried with exponential backoff; HTTP 4xx and malformed answers
(wrong count, non-numbers, NaN) are errors at once, never silently zero. Every error names the server and carries
the start of its answer body (a Flask server puts its traceback there).
"""
from __future__ import annotations

import base64
import http.client
import io
import json
import math
import pickle
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

PROTOCOLS = ("json", "flow_grpo")
BODY_SHOWN = 600  # characters of a server's answer quoted in errors


class RemoteRewardError(RuntimeError):
    """A reward server failed: unreachable, HTTP error, or a malformed response."""


# --- safe unpickling ----------------------------------------------------------------------------
_NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric")
_ALLOWED_GLOBALS = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"),
                    ("numpy", "ndarray"), ("numpy", "dtype"), ("collections", "OrderedDict")}
_ALLOWED_GLOBALS |= {(m, f) for m in _NUMPY_MODULES for f in ("_reconstruct", "scalar", "_frombuffer")}


class _RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only the globals plain data needs (numpy arrays and scalars included).

    Unpickling runs code only through globals it looks up (REDUCE/BUILD/INST call what find_class returned), so
    refusing every other name refuses every exploit: os.system, builtins.eval, subprocess, arbitrary classes."""

    def find_class(self, module, name):
        module = "builtins" if module == "__builtin__" else module  # protocols <= 2 write Python 2's name
        if (module, name) == ("_codecs", "encode"):  # protocols <= 2 store bytes as _codecs.encode(str, "latin1")
            return _latin1_encode
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to unpickle the global {module}.{name}: a reward server's answer may "
                                     "hold only plain containers, numbers, strings and numpy arrays")


def _latin1_encode(text, encoding="latin1"):
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"refused _codecs.encode({type(text).__name__}, {encoding!r}) in a pickle")
    return text.encode("latin1")


def safe_loads(data: bytes):
    """pickle.loads restricted to plain data (see _RestrictedUnpickler)."""
    return _RestrictedUnpickler(io.BytesIO(data)).load()


# --- encoding -----------------------------------------------------------------------------------
def _png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _jpeg_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")  # PIL's default quality 75, as Flow-GRPO's clients
    return buffer.getvalue()


def _quote(body: bytes) -> str:
    """The answer body on one line (lines joined by " | "); a long one keeps its start and its end, where a
    traceback's exception is."""
    text = " | ".join(line.strip() for line in body.decode("utf-8", errors="replace").splitlines() if line.strip())
    if len(text) > BODY_SHOWN:
        text = f"{text[:BODY_SHOWN // 3]} ... {text[-2 * BODY_SHOWN // 3:]} ({len(text)} characters)"
    return f"<<{text}>>"


def _parse_answer(body: bytes, url: str, protocol: str, key: str, expected: int) -> list[float]:
    """The server's answer -> `expected` finite floats under `key`; anything else is a RemoteRewardError."""
    try:
        answer = safe_loads(body) if protocol == "flow_grpo" else json.loads(body)
    except pickle.UnpicklingError as error:
        raise RemoteRewardError(f"reward server {url} sent an answer that is not safe plain-data pickle ({error}); "
                                f"body {_quote(body)}") from None
    except Exception as error:  # noqa: BLE001  (truncated pickles raise EOFError, bad JSON ValueError, ...)
        need = "a pickled dict" if protocol == "flow_grpo" else "JSON"
        raise RemoteRewardError(f"reward server {url} sent a malformed response (need {need} with {key!r}): "
                                f"{type(error).__name__}: {error}; body {_quote(body)}") from None
    if not isinstance(answer, dict) or key not in answer:
        found = sorted(map(str, answer)) if isinstance(answer, dict) else type(answer).__name__
        raise RemoteRewardError(f"reward server {url} sent a malformed response: no score key {key!r} (found "
                                f"{found}); set --remote-score-key (GenEval: scores, DeQA / UnifiedReward: outputs); "
                                f"body {_quote(body)}")
    scores = answer[key]
    if isinstance(scores, np.ndarray) and scores.ndim == 1:
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)) or len(scores) != expected:
        raise RemoteRewardError(f"reward server {url} sent {scores!r:.200} as {key!r}; expected a list of "
                                f"{expected} numbers (one per image); body {_quote(body)}")
    # bool is an int in Python, but a server answering true/false has a bug.
    bad = [s for s in scores if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, float, np.number))
           or not math.isfinite(float(s))]
    if bad:
        raise RemoteRewardError(f"reward server {url} sent non-finite or non-numeric scores {bad[:5]!r}; "
                                f"body {_quote(body)}")
    return [float(s) for s in scores]


def remote_scorer(url: str, timeout_s: float, retries: int, backoff_s: float, protocol: str = "json",
                  score_key: str = "scores", batch_size: int = 64) -> Callable:
    """score(pil_images, prompts, metadata) -> Tensor[B], posting batches of `batch_size` to `url`."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"--remote-protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")

    def post(body: bytes) -> bytes:
        kind = "application/octet-stream" if protocol == "flow_grpo" else "application/json"
        request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": kind})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()

    def encode(images, prompts, metadata) -> bytes:
        if protocol == "flow_grpo":
            return pickle.dumps({"images": [_jpeg_bytes(im) for im in images], "prompts": list(prompts),
                                 "meta_datas": list(metadata), "only_strict": True})
        return json.dumps({"images": [_png_base64(im) for im in images], "prompts": list(prompts),
                           "meta_datas": list(metadata)}).encode("utf-8")

    def score_batch(images, prompts, metadata) -> list[float]:
        body = encode(images, prompts, metadata)
        attempts = retries + 1
        for attempt in range(attempts):
            try:
                return _parse_answer(post(body), url, protocol, score_key, expected=len(images))
            except urllib.error.HTTPError as error:  # a subclass of URLError: test it first
                detail = f"HTTP {error.code} {error.reason}, body {_quote(error.read() or b'')}"
                if error.code < 500:
                    raise RemoteRewardError(f"reward server {url} refused the request with {detail}") from None
                last = detail
            except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
                last = repr(error)  # timeouts and connection errors are OSErrors too
            if attempt + 1 < attempts:
                time.sleep(backoff_s * 2**attempt)
        raise RemoteRewardError(f"reward server {url} failed after {attempts} attempts; last error: {last}")

    def score(images: list[Image.Image], prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        metadata = list(metadata) if metadata is not None else [{} for _ in images]
        out: list[float] = []
        for start in range(0, len(images), batch_size):
            end = start + batch_size
            out += score_batch(images[start:end], prompts[start:end], metadata[start:end])
        return torch.tensor(out, dtype=torch.float32)  # [B]

    return score
