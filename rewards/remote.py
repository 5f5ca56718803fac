"""Client for an HTTP reward server (as Flow-GRPO's): the `remote` reward of rewards.py.

    python main.py --reward remote --remote-url http://reward-host:8000/score

Protocol: POST JSON {"images": [base64 PNG], "prompts": [...]} -> {"scores": [float per image]}.
Timeouts, connection errors and HTTP 5xx are retried with exponential backoff; HTTP 4xx and malformed
answers (wrong count, non-numbers, NaN) are errors at once, never silently zero: they would fail the
same way again. Every error names the server.
"""
from __future__ import annotations

import base64
import http.client
import io
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import torch
from PIL import Image


class RemoteRewardError(RuntimeError):
    """A reward server failed: unreachable, HTTP error, or a malformed response."""


def _png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _parse_scores(body: bytes, url: str, expected: int) -> torch.Tensor:
    """Validate a server answer {"scores": [float, ...]}; anything else is an error."""
    try:
        scores = json.loads(body)["scores"]
    except (ValueError, TypeError, KeyError) as error:
        raise RemoteRewardError(f"reward server {url} sent a malformed response (need JSON "
                                f'{{"scores": [...]}}): {error!r}; body {body[:200]!r}') from None
    if not isinstance(scores, list) or len(scores) != expected:
        raise RemoteRewardError(f"reward server {url} sent {scores!r:.200} as scores; "
                                f"expected a list of {expected} numbers")
    # bool is an int in Python, but a server answering true/false has a bug.
    bad = [s for s in scores if isinstance(s, bool) or not isinstance(s, (int, float))
           or not math.isfinite(s)]
    if bad:
        raise RemoteRewardError(f"reward server {url} sent non-finite or non-numeric "
                                f"scores {bad[:5]!r}")
    return torch.tensor(scores, dtype=torch.float32)  # [B]


def remote_scorer(url: str, timeout_s: float, retries: int, backoff_s: float) -> Callable:
    """score(pil_images, prompts) -> Tensor[B], posting to `url` with `retries` retries after the first try."""

    def post(body: bytes) -> bytes:
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()

    def score(images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        body = json.dumps({"images": [_png_base64(im) for im in images], "prompts": prompts}).encode("utf-8")
        attempts = retries + 1
        for attempt in range(attempts):
            try:
                return _parse_scores(post(body), url, expected=len(prompts))
            except urllib.error.HTTPError as error:  # a subclass of URLError: test it first
                if error.code < 500:
                    raise RemoteRewardError(f"reward server {url} refused the request with "
                                            f"HTTP {error.code} {error.reason}") from error
                last_error: Exception = error
            except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
                last_error = error  # timeouts and connection errors are OSErrors too
            if attempt + 1 < attempts:
                time.sleep(backoff_s * 2**attempt)
        raise RemoteRewardError(f"reward server {url} failed after {attempts} attempts; "
                                f"last error: {last_error!r}")

    return score
