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
Timeouts, connection errors and HTTP 5xx are retried with exponential backoff capped at BACKOFF_CAP_S (the default
7 retries wait 1, 2, 4, 8, 15, 15, 15 s: a server restart of a minute is ridden out), each retry said on stderr;
HTTP 4xx and malformed answers (wrong count, non-numbers, NaN) are errors at once, never silently zero. Every error
names the server and carries its answer body as text: an unpickled answer as the data it holds, anything else (a
Flask traceback) decoded. A missing score key names the keys found and the setting that would read them.
"""
from __future__ import annotations

import base64
import http.client
import io
import json
import math
import pickle
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

PROTOCOLS = ("json", "flow_grpo")
BODY_SHOWN = 600  # characters of a server's answer quoted in errors
BACKOFF_CAP_S = 15.0  # the longest wait between two attempts


def backoff_delays(retries: int, base_s: float, cap_s: float = BACKOFF_CAP_S) -> list[float]:
    """Seconds slept before each retry: base, 2 base, 4 base, ... capped at cap_s."""
    return [min(base_s * 2**k, cap_s) for k in range(retries)]


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


def _as_text(body: bytes, protocol: str) -> str:
    """A pickled answer as the data it holds (numpy arrays as lists), when it unpickles safely; else the bytes
    decoded (JSON, an HTML or traceback page)."""
    if protocol == "flow_grpo":
        try:
            answer = safe_loads(body)
        except Exception:  # noqa: BLE001  not a (safe) pickle: show it as text
            pass
        else:
            return repr(_plain(answer))
    return body.decode("utf-8", errors="replace")


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


def _quote(body: bytes, protocol: str = "json") -> str:
    """The answer body as text on one line (lines joined by " | "); a long one keeps its start and its end, where a
    traceback's exception is."""
    text = " | ".join(line.strip() for line in _as_text(body, protocol).splitlines() if line.strip())
    if len(text) > BODY_SHOWN:
        text = f"{text[:BODY_SHOWN // 3]} ... {text[-2 * BODY_SHOWN // 3:]} ({len(text)} characters)"
    return f"<<{text}>>"


def _score_lists(answer: dict, expected: int) -> list[str]:
    """Keys of `answer` that hold `expected` numbers: what the score key could be set to."""
    def numbers(v):
        v = v.tolist() if isinstance(v, np.ndarray) and v.ndim == 1 else v
        return isinstance(v, (list, tuple)) and len(v) == expected and all(
            isinstance(x, (int, float, np.number)) and not isinstance(x, (bool, np.bool_)) for x in v)
    return sorted(str(k) for k, v in answer.items() if numbers(v))


def _parse_answer(body: bytes, url: str, protocol: str, key: str, expected: int,
                  key_flag: str = "--remote-score-key ") -> list[float]:
    """The server's answer -> `expected` finite floats under `key`; anything else is a RemoteRewardError.
    `key_flag`: how the score key is set (e.g. '--remote-score-key geneval=' for a named remote reward)."""
    try:
        answer = safe_loads(body) if protocol == "flow_grpo" else json.loads(body)
    except pickle.UnpicklingError as error:
        raise RemoteRewardError(f"reward server {url} sent an answer that is not safe plain-data pickle ({error}); "
                                f"body {_quote(body, protocol)}") from None
    except Exception as error:  # noqa: BLE001  (truncated pickles raise EOFError, bad JSON ValueError, ...)
        need = "a pickled dict" if protocol == "flow_grpo" else "JSON"
        raise RemoteRewardError(f"reward server {url} sent a malformed response (need {need} with {key!r}): "
                                f"{type(error).__name__}: {error}; body {_quote(body, protocol)}") from None
    if not isinstance(answer, dict) or key not in answer:
        found = sorted(map(str, answer)) if isinstance(answer, dict) else type(answer).__name__
        fits = _score_lists(answer, expected) if isinstance(answer, dict) else []
        hint = (f"set {key_flag}{fits[0]}" if len(fits) == 1 else
                f"set {key_flag}KEY, one of {fits}" if fits else
                f"set {key_flag}KEY (GenEval: scores, DeQA / UnifiedReward: outputs)")
        raise RemoteRewardError(f"reward server {url} sent a malformed response: no score key {key!r}, its keys are "
                                f"{found}; {hint}; body {_quote(body, protocol)}")
    scores = answer[key]
    if isinstance(scores, np.ndarray) and scores.ndim == 1:
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)) or len(scores) != expected:
        raise RemoteRewardError(f"reward server {url} sent {scores!r:.200} as {key!r}; expected a list of "
                                f"{expected} numbers (one per image); body {_quote(body, protocol)}")
    # bool is an int in Python, but a server answering true/false has a bug.
    bad = [s for s in scores if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, float, np.number))
           or not math.isfinite(float(s))]
    if bad:
        raise RemoteRewardError(f"reward server {url} sent non-finite or non-numeric scores {bad[:5]!r}; "
                                f"body {_quote(body, protocol)}")
    return [float(s) for s in scores]


def remote_scorer(url: str, timeout_s: float, retries: int, backoff_s: float, protocol: str = "json",
                  score_key: str = "scores", batch_size: int = 64, key_flag: str = "--remote-score-key ") -> Callable:
    """score(pil_images, prompts, metadata) -> Tensor[B], posting batches of `batch_size` to `url`; retries wait
    backoff_delays(retries, backoff_s)."""
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
        delays = backoff_delays(retries, backoff_s)
        for attempt in range(retries + 1):
            try:
                return _parse_answer(post(body), url, protocol, score_key, expected=len(images), key_flag=key_flag)
            except urllib.error.HTTPError as error:  # a subclass of URLError: test it first
                detail = f"HTTP {error.code} {error.reason}, body {_quote(error.read() or b'', protocol)}"
                if error.code < 500:
                    raise RemoteRewardError(f"reward server {url} refused the request with {detail}") from None
                last = detail
            except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
                last = repr(error)  # timeouts and connection errors are OSErrors too
            if attempt < retries:
                print(f"[digenrl] reward server {url}: attempt {attempt + 1} of {retries + 1} failed ({last:.200}); "
                      f"retrying in {delays[attempt]:g} s", file=sys.stderr, flush=True)
                time.sleep(delays[attempt])
        raise RemoteRewardError(f"reward server {url} failed after {retries + 1} attempts; last error: {last}")

    def score(images: list[Image.Image], prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        metadata = list(metadata) if metadata is not None else [{} for _ in images]
        out: list[float] = []
        for start in range(0, len(images), batch_size):
            end = start + batch_size
            out += score_batch(images[start:end], prompts[start:end], metadata[start:end])
        return torch.tensor(out, dtype=torch.float32)  # [B]

    return score
