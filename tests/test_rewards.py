"""Tests for rewards.py: each reward, video handling, the remote server client (against
local servers started here), spec parsing and the weighted combination.

Run: python -m pytest -q tests/test_rewards.py
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from rewards import (COLOR_NAMES, REWARDS, RemoteRewardError, RewardOptions, build_reward,
                     check_reward_options, color_prompts, parse_reward_spec)

pytestmark = pytest.mark.timeout(60)


def solid(rgb, size=16) -> torch.Tensor:
    """One image [3, size, size] filled with the colour ``rgb``."""
    return torch.tensor(rgb, dtype=torch.float32)[:, None, None].expand(3, size, size).clone()


RED = solid((1.0, 0.0, 0.0))


# ---------------------------------------------------------------- color

def test_color_red_image_scores_by_prompt():
    color = REWARDS["color"]()
    scores = color(torch.stack([RED, RED]), ["a red image", "a blue image"])
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    torch.testing.assert_close(scores, torch.tensor([1.0, -0.5]))


def test_color_prompt_without_a_colour_is_an_error():
    with pytest.raises(ValueError, match="a purple image"):
        REWARDS["color"]()(RED[None], ["a purple image"])


def test_color_prompt_lists():
    train, evaluation = color_prompts("train"), color_prompts("eval")
    assert len(train) == 3 and len(evaluation) == 3
    assert not set(train) & set(evaluation)
    for prompts in (train, evaluation):  # every colour once per split
        assert sorted(rewards.prompt_color(p) for p in prompts) == [0, 1, 2]
    assert [f"a {c} image" for c in COLOR_NAMES] == train
    with pytest.raises(ValueError, match="allowed"):
        color_prompts("validation")


def test_prompt_count_must_match_batch():
    with pytest.raises(ValueError, match="2 prompts for a batch of 1"):
        REWARDS["color"]()(RED[None], ["a red image", "a red image"])


# ---------------------------------------------------------------- jpeg

def test_jpeg_noise_is_less_compressible_than_flat():
    generator = torch.Generator().manual_seed(0)
    images = torch.stack([torch.rand(3, 64, 64, generator=generator), solid((0.3, 0.5, 0.7), 64)])
    prompts = ["", ""]
    incompressibility = REWARDS["jpeg_incompressibility"]()(images, prompts)
    compressibility = REWARDS["jpeg_compressibility"]()(images, prompts)
    assert incompressibility[0] > incompressibility[1] > 0
    torch.testing.assert_close(compressibility, -incompressibility)


# ---------------------------------------------------------------- clip_score

def _write_tiny_clip(directory) -> None:
    """Save a random tiny CLIPModel + CLIPProcessor (offline tokenizer) into ``directory``."""
    import transformers
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    tokens = ["<|startoftext|>", "<|endoftext|>", *letters, *(c + "</w>" for c in letters)]
    merges = []
    for word in ("red", "green", "blue", "image"):  # whole-word tokens via chained merges
        pieces = [*word[:-1], word[-1] + "</w>"]
        merged = pieces[0]
        for piece in pieces[1:]:
            merges.append(f"{merged} {piece}")
            merged += piece
            if merged not in tokens:
                tokens.append(merged)
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    # model_max_length must be explicit and fit max_position_embeddings.
    tokenizer = CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"),
                              model_max_length=16)
    # CLIPImageProcessorPil avoids the torchvision fallback warning where it exists.
    image_processor_class = getattr(transformers, "CLIPImageProcessorPil",
                                    transformers.CLIPImageProcessor)
    image_processor = image_processor_class(size={"shortest_edge": 32},
                                            crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(directory)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokens), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(directory)


@pytest.fixture(scope="module")
def tiny_clip_path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_clip")
    _write_tiny_clip(directory)
    return str(directory)


def _clip_cosine_by_hand(path, image, prompt) -> float:
    """CLIP's score of one (image, prompt) pair from CLIPModel's parts, one pair at a time: the projected pooled
    outputs of the vision and text towers, their cosine (torch.nn.functional.cosine_similarity)."""
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    pil = Image.fromarray((image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())
    inputs = processor(text=[prompt], images=[pil], return_tensors="pt")
    with torch.no_grad():
        image_embed = model.visual_projection(model.vision_model(pixel_values=inputs["pixel_values"]).pooler_output)
        text_embed = model.text_projection(model.text_model(input_ids=inputs["input_ids"],
                                                            attention_mask=inputs["attention_mask"]).pooler_output)
    return float(torch.nn.functional.cosine_similarity(image_embed, text_embed)[0])


def test_clip_score_is_clips_cosine_of_each_image_with_its_own_prompt(tiny_clip_path):
    """Outside truth: each score is the cosine computed by hand from CLIPModel for that image and ITS prompt, with
    two different prompts, so a pairing bug (image i scored against prompt j, a reversed or rolled text batch, the
    logits matrix read along the wrong axis) fails; the cross pairs score differently enough to tell."""
    clip_score = REWARDS["clip_score"](clip_path=tiny_clip_path)
    generator = torch.Generator().manual_seed(0)
    images = torch.stack([RED, torch.rand(3, 16, 16, generator=generator)])  # resized to 32
    prompts = ["a red image", "a blue image"]
    scores = clip_score(images, prompts)
    assert scores.shape == (2,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all() and scores.abs().max() <= 1 + 1e-5
    by_hand = [[_clip_cosine_by_hand(tiny_clip_path, images[i], p) for p in prompts] for i in range(2)]  # [image][prompt]
    torch.testing.assert_close(scores, torch.tensor([by_hand[0][0], by_hand[1][1]]), rtol=1e-4, atol=1e-5)
    assert min(abs(by_hand[0][0] - by_hand[0][1]), abs(by_hand[1][1] - by_hand[1][0])) > 1e-3  # pairing shows
    # Deterministic: the same inputs give the same scores.
    torch.testing.assert_close(clip_score(images, prompts), scores)
    # Videos go through the generic per-frame wrapper: static frames score as their image, with its prompt.
    video = images[:, None].expand(2, 3, 3, 16, 16)  # [B=2, F=3, 3, 16, 16]
    torch.testing.assert_close(clip_score(video, prompts), scores)


def flow_grpo_pickscore(model_path, processor_path, images, prompts) -> torch.Tensor:
    """Flow-GRPO's PickScoreScorer.__call__ (flow_grpo/pickscore_scorer.py), re-typed: the processor at
    max_length 77, image and text features L2-normalised, logit_scale.exp() * (text @ image.T), its diagonal, / 26.
    (Its get_*_features calls are written as their towers and projections: transformers 5 changed their return.)"""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(model_path).eval(), CLIPProcessor.from_pretrained(processor_path)
    pil = [Image.fromarray((im.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()) for im in images]
    image_inputs = processor(images=pil, padding=True, truncation=True, max_length=77, return_tensors="pt")
    text_inputs = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image_embs = model.visual_projection(model.vision_model(pixel_values=image_inputs["pixel_values"]).pooler_output)
        image_embs = image_embs / image_embs.norm(p=2, dim=-1, keepdim=True)
        text_embs = model.text_projection(model.text_model(**text_inputs).pooler_output)
        text_embs = text_embs / text_embs.norm(p=2, dim=-1, keepdim=True)
        scores = model.logit_scale.exp() * (text_embs @ image_embs.T)
    return scores.diag() / 26


def test_pickscore_is_flow_grpos_scaled_logit_of_each_image_with_its_prompt(tiny_clip_path, tmp_path):
    """Outside truth: Flow-GRPO's own PickScore computation (re-typed above) on the same images and prompts, with
    two different prompts (a pairing bug fails), and a logit scale that is not CLIP's init (a missing exp, a
    missing / 26 or a plain cosine fails). The processor may live apart from the model (Flow-GRPO loads
    CLIP-ViT-H-14's processor and PickScore_v1's weights); a missing path is refused naming the flag."""
    import math
    import shutil

    from transformers import CLIPModel
    model_dir, processor_dir = tmp_path / "pickscore_v1", tmp_path / "clip_h14"
    model = CLIPModel.from_pretrained(tiny_clip_path)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(90.0))
    model.save_pretrained(model_dir)
    shutil.copytree(tiny_clip_path, processor_dir)
    generator = torch.Generator().manual_seed(0)
    images = torch.stack([RED, torch.rand(3, 16, 16, generator=generator)])
    prompts = ["a red image", "a blue image"]
    pickscore = REWARDS["pickscore"](pickscore_path=str(model_dir), pickscore_processor_path=str(processor_dir))
    scores = pickscore(images, prompts)
    assert scores.shape == (2,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, flow_grpo_pickscore(str(model_dir), str(processor_dir), images, prompts), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(scores, flow_grpo_pickscore(str(model_dir), str(processor_dir), images, prompts[::-1]), atol=1e-3)
    with pytest.raises(ValueError, match="--pickscore-path"):
        REWARDS["pickscore"]()
    with pytest.raises(FileNotFoundError, match="--pickscore-processor-path .*no_such"):
        build_reward("pickscore", RewardOptions(pickscore_path=str(model_dir),
                                                pickscore_processor_path=str(tmp_path / "no_such")))


def test_clip_score_needs_an_existing_path(tmp_path):
    with pytest.raises(ValueError, match="--clip-path"):
        REWARDS["clip_score"]()
    missing = str(tmp_path / "no_such_clip")
    with pytest.raises(FileNotFoundError, match="no_such_clip"):
        build_reward("clip_score", RewardOptions(clip_path=missing))


# ---------------------------------------------------------------- video handling

def test_temporal_consistency_static_beats_flicker():
    consistency = REWARDS["temporal_consistency"]()
    generator = torch.Generator().manual_seed(0)
    frame = torch.rand(3, 8, 8, generator=generator)
    static = frame.expand(4, 3, 8, 8)  # [F=4, 3, 8, 8]
    flicker = torch.stack([frame, 1 - frame] * 2)  # inverted every other frame
    scores = consistency(torch.stack([static, flicker]), ["", ""])
    torch.testing.assert_close(scores[0], torch.tensor(1.0))
    torch.testing.assert_close(scores[1], torch.tensor(-1.0))  # x and 1-x are opposite in [-1, 1]


def test_temporal_consistency_rejects_images():
    with pytest.raises(ValueError, match="needs videos"):
        REWARDS["temporal_consistency"]()(RED[None], ["a red image"])


def test_per_frame_rewards_average_over_frames():
    color = REWARDS["color"]()
    red_video = RED.expand(1, 5, 3, 16, 16)  # [B=1, F=5, 3, H, W]
    torch.testing.assert_close(color(red_video, ["a red image"]), color(RED[None], ["a red image"]))
    frames = torch.stack([RED, solid((0.0, 0.0, 1.0)), solid((0.5, 0.5, 0.5))])  # [F=3, ...]
    expected = color(frames, ["a red image"] * 3).mean()  # 1, -0.5, 0 -> 1/6
    torch.testing.assert_close(color(frames[None], ["a red image"]), expected[None])
    # Each video keeps its own prompt across its frames.
    two_videos = RED.expand(2, 4, 3, 16, 16)  # [B=2, F=4, 3, H, W]
    torch.testing.assert_close(color(two_videos, ["a red image", "a blue image"]),
                               torch.tensor([1.0, -0.5]))


# ---------------------------------------------------------------- remote

def _mean_pixel(encoded: str) -> float:
    image = Image.open(io.BytesIO(base64.b64decode(encoded)))
    return float(np.asarray(image.convert("RGB"), dtype=np.float64).mean() / 255)


@contextlib.contextmanager
def reward_server(respond):
    """Serve ``respond(request_number, payload) -> (status, body bytes)`` on 127.0.0.1.

    Yields (url, requests list). A ``release`` event lets slow handlers finish at shutdown.
    """
    requests, release = [], threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(payload)
            status, body = respond(len(requests), payload, release)
            with contextlib.suppress(ConnectionError):  # the client may have timed out
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args):  # keep test output quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", requests
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def mean_pixel_scores(number, payload, release):
    return 200, json.dumps({"scores": [_mean_pixel(i) for i in payload["images"]]}).encode()


@pytest.fixture(autouse=True)
def _no_proxy_for_localhost(monkeypatch):
    # A proxy configured in the environment must not intercept the local test servers.
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def remote_reward(url, **overrides):
    options = dict(remote_url=url, remote_timeout_s=5.0, remote_retries=2, remote_backoff_s=0.01)
    return REWARDS["remote"](**{**options, **overrides})


def test_remote_scores_and_video_frames():
    levels = torch.tensor([51, 102, 204]) / 255  # exact in uint8, so the PNG round trip is exact
    images = levels[:, None, None, None].expand(3, 3, 8, 8)  # [B=3, 3, 8, 8]
    with reward_server(mean_pixel_scores) as (url, requests):
        scores = remote_reward(url)(images, ["a", "b", "c"])
        torch.testing.assert_close(scores, levels.float())
        assert requests[0]["prompts"] == ["a", "b", "c"]
        video = levels[None, :, None, None, None].expand(1, 3, 3, 8, 8)  # frames 0.2, 0.4, 0.8
        torch.testing.assert_close(remote_reward(url, remote_frames="middle")(video, ["v"]), levels[1:2].float())
        # Default: every frame is scored as an image (prompt repeated) and the video scores their mean.
        torch.testing.assert_close(remote_reward(url)(video, ["v"]), levels.mean()[None].float())
        assert requests[-1]["prompts"] == ["v"] * 3 and len(requests[-1]["images"]) == 3


def test_remote_retries_5xx_then_succeeds():
    def flaky(number, payload, release):
        return (503, b"busy") if number <= 2 else mean_pixel_scores(number, payload, release)

    with reward_server(flaky) as (url, requests):
        scores = remote_reward(url, remote_retries=2)(RED[None], ["a red image"])
        torch.testing.assert_close(scores, torch.tensor([1 / 3]))
        assert len(requests) == 3


def test_remote_always_500_raises_after_all_attempts():
    with reward_server(lambda number, payload, release: (500, b"boom")) as (url, requests):
        with pytest.raises(RemoteRewardError, match="3 attempts") as caught:
            remote_reward(url, remote_retries=2)(RED[None], ["x"])
        assert url in str(caught.value) and "500" in str(caught.value)
        assert len(requests) == 3  # first attempt + 2 retries


def test_remote_timeout_is_retried_then_raises():
    """A server that never answers in time: the client gives up after its timeout, retries, then raises. Shown by
    the order of events, not by the clock: the client raised while no handler had answered (each one is held until
    the test ends, or 60 s), so a client without a timeout, or one that waits for the answer, fails here."""
    answered = []

    def slow(number, payload, release):
        release.wait(timeout=60)  # released at shutdown
        answered.append(number)
        return mean_pixel_scores(number, payload, release)

    with reward_server(slow) as (url, requests):
        with pytest.raises(RemoteRewardError, match="2 attempts") as caught:
            remote_reward(url, remote_timeout_s=0.3, remote_retries=1)(RED[None], ["x"])
        assert url in str(caught.value) and answered == []
        assert len(requests) == 2


def test_remote_connection_refused_is_retried_then_raises():
    with socket.socket() as sock:  # bound, never listening, held: connections are refused and no one takes the port
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/score"
        with pytest.raises(RemoteRewardError, match="2 attempts"):
            remote_reward(url, remote_retries=1)(RED[None], ["x"])


def test_remote_4xx_is_not_retried():
    with reward_server(lambda number, payload, release: (404, b"no")) as (url, requests):
        with pytest.raises(RemoteRewardError, match="404") as caught:
            remote_reward(url)(RED[None], ["x"])
        assert url in str(caught.value) and len(requests) == 1


@pytest.mark.parametrize("body", [
    b"not json", b'{"score": [1.0]}', b'{"scores": [1.0, 2.0]}', b'{"scores": ["high"]}',
    b'{"scores": [NaN]}', b'{"scores": [true]}', b'{"scores": 1.0}', b"[1.0]",
])
def test_remote_malformed_response_is_an_error(body):
    with reward_server(lambda number, payload, release: (200, body)) as (url, requests):
        with pytest.raises(RemoteRewardError, match="malformed|expected|non-finite") as caught:
            remote_reward(url)(RED[None], ["x"])
        assert url in str(caught.value) and len(requests) == 1


# ---------------------------------------------------------------- specs and options

def test_parse_reward_spec_good():
    assert parse_reward_spec("color=1.0, jpeg_compressibility=0.1") == {
        "color": 1.0, "jpeg_compressibility": 0.1}
    assert parse_reward_spec("color") == {"color": 1.0}
    assert parse_reward_spec("temporal_consistency=-2e-1") == {"temporal_consistency": -0.2}


def test_parse_reward_spec_unknown_name_lists_known():
    with pytest.raises(ValueError, match="colour") as caught:
        parse_reward_spec("colour=1")
    assert all(name in str(caught.value) for name in REWARDS)


@pytest.mark.parametrize("spec,bad", [("color=abc", "abc"), ("color=nan", "nan"),
                                      ("color=inf", "inf"), ("color=", "''")])
def test_parse_reward_spec_bad_weight(spec, bad):
    with pytest.raises(ValueError, match="bad weight") as caught:
        parse_reward_spec(spec)
    assert bad in str(caught.value)


@pytest.mark.parametrize("spec,message", [("color,color=2", "twice"), ("", "empty"),
                                          ("   ", "empty"), ("color,", "unknown reward ''")])
def test_parse_reward_spec_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_reward_spec(spec)


def test_check_reward_options():
    check_reward_options("color,jpeg_compressibility", RewardOptions())  # needs nothing
    with pytest.raises(ValueError, match="--remote-url"):
        check_reward_options("remote", RewardOptions())
    with pytest.raises(ValueError, match="ftp://host"):
        check_reward_options("remote", RewardOptions(remote_url="ftp://host"))
    with pytest.raises(ValueError, match="--clip-path"):
        check_reward_options("color=1,clip_score=0.5", RewardOptions())
    with pytest.raises(TypeError, match="allowed"):
        REWARDS["color"](clip_pth="typo")


def test_combined_reward_total_is_weighted_sum():
    combined = build_reward("color=2.0,jpeg_compressibility=-0.5")
    assert combined.names == ["color", "jpeg_compressibility"]
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 16, 16, generator=generator)
    prompts = ["a red image", "a green image"]
    scores = combined(images, prompts)
    assert set(scores) == {"color", "jpeg_compressibility", "total"}
    torch.testing.assert_close(scores["color"], REWARDS["color"]()(images, prompts))
    torch.testing.assert_close(scores["total"],
                               2.0 * scores["color"] - 0.5 * scores["jpeg_compressibility"])
