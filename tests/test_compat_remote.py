"""Flow-GRPO's reward servers and datasets, end to end: a real HTTP server on 127.0.0.1 speaking Flow-GRPO's pickle
protocol (as yifan123/reward-server's app_geneval.py / app_deqa.py do), the restricted unpickler, and training runs
that use a Flow-GRPO dataset folder with a metadata-taking reward, W&B (offline) and TensorBoard.
"""
import collections
import contextlib
import glob
import io
import json
import os
import pickle
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import read_metrics, run_forked
from rewards import REWARDS, RemoteRewardError
from rewards.remote import NotPlainData, plain_loads

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _no_proxy_for_localhost(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def redness(jpeg: bytes) -> float:
    """What the test servers score: mean red minus mean of green and blue, in [-1, 1]."""
    pixels = np.asarray(Image.open(io.BytesIO(jpeg), formats=["jpeg"]).convert("RGB"), dtype=np.float64) / 255
    return float(pixels[..., 0].mean() - pixels[..., 1:].mean())


def geneval_answer(payload):
    """app_geneval.py's answer shape (the scores here: redness; GenEval's extra keys filled alike)."""
    scores = [redness(im) for im in payload["images"]]
    assert payload["only_strict"] in (True, False) and len(payload["meta_datas"]) == len(scores)
    return {"scores": scores, "rewards": [float(s > 0) for s in scores], "strict_rewards": [0.0] * len(scores),
            "group_rewards": {"colors": [1.0] * len(scores)}, "group_strict_rewards": {"colors": [0.0] * len(scores)}}


def deqa_answer(payload):
    return {"outputs": np.asarray([redness(im) for im in payload["images"]], dtype=np.float32)}  # numpy, as a model


@contextlib.contextmanager
def pickle_server(respond):
    """Serve Flow-GRPO's protocol: unpickle the request, answer respond(payload) -> dict (pickled, 200) or
    (status, raw body). Yields (url, log of (payload, answer))."""
    log = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            payload = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))  # our own client's request
            answer = respond(payload)
            status, body = answer if isinstance(answer, tuple) else (200, pickle.dumps(answer))
            log.append((payload, answer))
            with contextlib.suppress(ConnectionError):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def flow_grpo_reward(url, **overrides):
    options = dict(remote_url=url, remote_timeout_s=5.0, remote_retries=1, remote_backoff_s=0.01,
                   remote_protocol="flow_grpo", remote_batch_size=2)
    return REWARDS["remote"](**{**options, **overrides})


def coloured(levels):
    """[B, 3, 8, 8] images: sample i is (r, g, b) = levels[i]."""
    return torch.tensor(levels, dtype=torch.float32)[:, :, None, None].expand(-1, 3, 8, 8)


# ------------------------------------------------------------------ the client against the protocol

def test_flow_grpo_request_is_what_the_reference_servers_read():
    images = coloured([(1, 0, 0), (0, 0, 1), (1, 1, 1), (0, 1, 0), (1, 0, 1)])
    metadata = [{"tag": "colors", "include": [{"class": "x", "count": 1}], "prompt": f"p{i}"} for i in range(5)]
    with pickle_server(geneval_answer) as (url, log):
        scores = flow_grpo_reward(url)(images, [m["prompt"] for m in metadata], metadata)
    assert [len(p["images"]) for p, _ in log] == [2, 2, 1]  # batches of --remote-batch-size, in order
    for payload, _ in log:  # app_geneval.py: Image.open(BytesIO(d), formats=["jpeg"]), data["meta_datas"], ...
        assert {"images", "meta_datas", "only_strict", "prompts"} <= set(payload)
        assert all(Image.open(io.BytesIO(d), formats=["jpeg"]).size == (8, 8) for d in payload["images"])
    assert [m for p, _ in log for m in p["meta_datas"]] == metadata
    assert [q for p, _ in log for q in p["prompts"]] == [f"p{i}" for i in range(5)]
    expected = torch.tensor([s for _, a in log for s in a["scores"]])
    torch.testing.assert_close(scores, expected)
    assert scores[0] > 0.9 and scores[1] < -0.4  # red scores high, blue low: the server saw the pixels


def test_deqa_outputs_key_numpy_answers_and_video_frames():
    video = coloured([(1, 0, 0), (0, 0, 1), (0, 0, 1)])[None]  # [1, F=3, 3, 8, 8]: one red, two blue frames
    with pickle_server(deqa_answer) as (url, log):
        reward = flow_grpo_reward(url, remote_score_key="outputs", remote_batch_size=64)
        (score,) = reward(video, ["v"], [{"k": 1}]).tolist()
        assert len(log[-1][0]["images"]) == 3 and log[-1][0]["meta_datas"] == [{"k": 1}] * 3  # every frame
        assert score == pytest.approx(float(np.mean(log[-1][1]["outputs"])), abs=1e-6)
        (middle,) = flow_grpo_reward(url, remote_score_key="outputs", remote_frames="middle")(video, ["v"]).tolist()
        assert len(log[-1][0]["images"]) == 1 and middle < -0.4  # the middle frame is blue
        with pytest.raises(RemoteRewardError, match="no score key 'scores'.*outputs"):
            flow_grpo_reward(url)(video[0], ["a", "b", "c"])  # a DeQA server answers "outputs", not "scores"


def test_server_500_body_is_in_the_error():
    traceback = b"Traceback (most recent call last):\n  File \"app_geneval.py\", line 31\nKeyError: 'meta_datas'\n"
    with pickle_server(lambda payload: (500, traceback)) as (url, log):
        with pytest.raises(RemoteRewardError) as caught:
            flow_grpo_reward(url, remote_retries=2)(coloured([(1, 0, 0)]), ["x"])
    assert len(log) == 3 and "after 3 attempts" in str(caught.value)
    assert "HTTP 500" in str(caught.value) and "KeyError: 'meta_datas'" in str(caught.value)


class _WritesMarker:
    """A pickle that runs code when loaded by plain pickle.loads: os.system(touch marker)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("nested", [False, True])
def test_malicious_pickle_answer_is_refused_and_nothing_runs(tmp_path, nested):
    marker = tmp_path / "pwned"
    evil = _WritesMarker(marker)
    body = pickle.dumps({"scores": [evil]} if nested else evil)
    with pickle_server(lambda payload: (200, body)) as (url, log):
        with pytest.raises(RemoteRewardError, match="not a pickled dict of plain data .* the global .*system"):
            flow_grpo_reward(url)(coloured([(1, 0, 0)]), ["x"])
    assert len(log) == 1 and not marker.exists()
    pickle.loads(body)  # the same bytes, unpickled normally, do run code: the test pickle is really malicious
    assert marker.exists()


def test_plain_loads_keeps_plain_data_and_reads_numpy_as_numbers():
    """What pickle.loads gives, with numpy arrays and scalars as the lists and numbers they hold (every protocol;
    C and Fortran order, big-endian, bool arrays), and nothing that names another callable."""
    data = {"scores": [1, 2.5, np.float32(3.0), np.int64(-4)], "a": np.arange(4.0), "s": {"x", "y"},
            "t": ("u", b"v", None, True), "m": np.arange(6, dtype=np.int16).reshape(2, 3),
            "f": np.asfortranarray(np.arange(6.0).reshape(2, 3)), "big": np.arange(3, dtype=">f4"),
            "b": np.array([True, False]), "d": collections.OrderedDict(k=[0.5])}
    want = pickle.loads(pickle.dumps(data))
    want = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in want.items()}
    want["scores"], want["d"] = [1, 2.5, 3.0, -4], {"k": [0.5]}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = plain_loads(pickle.dumps(data, protocol=protocol))
        assert back == want, protocol
        assert all(type(x) in (int, float) for x in back["scores"] + back["a"] + back["f"][0]), protocol
    with pytest.raises(NotPlainData, match="builtins.eval"):
        plain_loads(b"cbuiltins\neval\n(S'1'\ntR.")  # protocol 0: GLOBAL builtins.eval, REDUCE


# ------------------------------------------------------------------ training runs

def wandb_records(run_dir):
    """The history and run records of an offline W&B run (its .wandb file: LevelDB-log blocks of protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data, pos, chunk, out = open(path, "rb").read(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST fragment of a record
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


META_REWARD = '''
def meta_reward(images, prompts, metadata):
    """Flow-GRPO-style: scores from the metadata, info logged."""
    import numpy as np
    scores = np.array([float(m["weight"]) for m in metadata])
    return scores, {"tag_id": [float(m["tag_id"]) for m in metadata], "note": "strings are not metrics"}
'''


def write_dataset(folder, kind):
    """A Flow-GRPO-layout dataset: train and test prompts (txt), or rows with metadata (jsonl)."""
    os.makedirs(folder)
    train = [f"a red {thing}" for thing in ("apple", "car")]
    test = [f"a red {thing}" for thing in ("kite", "boat", "hat")]
    if kind == "txt":
        for name, prompts in (("train.txt", train), ("test.txt", test)):
            (folder / name).write_text("\n".join(prompts) + "\n")
    else:
        for name, prompts, tag in (("train_metadata.jsonl", train, 7), ("test_metadata.jsonl", test, 9)):
            rows = [{"tag": "colors", "tag_id": tag, "weight": 0.25 * (i + 1), "prompt": p}
                    for i, p in enumerate(prompts)]
            (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train, test


SMALL = ["--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3", "--text-len", "16", "--timeout-s", "60",
         "--save-every", "0", "--seed", "0", "--no-trace", "--remote-protocol", "flow_grpo", "--remote-retries", "1",
         "--eval-seeds", "1"]


def test_geneval_style_server_with_a_metadata_dataset_wandb_and_tensorboard(tiny_cache, tmp_path, monkeypatch):
    """2 ranks (DigenRL) train on train_metadata.jsonl against a GenEval-style server, evaluate on test."""
    pytest.importorskip("wandb")  # optional integrations: requirements-extras.txt
    pytest.importorskip("tensorboard")
    import models
    models.tiny_pipeline_path("flux")
    train, test = write_dataset(tmp_path / "geneval", "jsonl")
    (tmp_path / "meta_reward.py").write_text(META_REWARD)
    monkeypatch.setenv("WANDB_MODE", "offline")
    custom = f"{tmp_path / 'meta_reward.py'}:meta_reward"
    with pickle_server(geneval_answer) as (url, log):
        run_forked(["--model", "flux", "--nproc", "2", *SMALL, "--steps", "2", "--eval-every", "2", "--eval-prompts",
                    "2", "--prompt-file", str(tmp_path / "geneval"), "--reward", f"remote=1,{custom}=0.5",
                    "--remote-url", url, "--wandb", "--wandb-project", "compat", "--tensorboard"],
                   tmp_path, "geneval_run", tiny_cache, env={"WANDB_MODE": "offline"})
    run = tmp_path / "geneval_run"
    rows = read_metrics(run)
    probe, _ = log.pop(0)  # the check request before any rank starts: 2 blank images, the first prompts' rows
    assert probe["prompts"] == train[:2] and [m["prompt"] for m in probe["meta_datas"]] == train[:2]
    assert all(redness(im) == 0 for im in probe["images"])
    # Evaluation (before step 0 and after step 1) asks for the first 2 training prompts on a held-out noise and
    # the first 2 test prompts; training requests hold training prompts only.
    eval_calls = [(p, a) for p, a in log if any(m["tag_id"] == 9 for m in p["meta_datas"])]
    train_calls = [(p, a) for p, a in log if all(m["tag_id"] == 7 for m in p["meta_datas"])]
    assert len(train_calls) + len(eval_calls) == len(log) and len(eval_calls) == 2
    for payload, _ in log:  # the metadata of each image is its own prompt's row
        assert [m["prompt"] for m in payload["meta_datas"]] == payload["prompts"]
    assert {q for p, _ in train_calls for q in p["prompts"]} <= set(train)  # trains on train only
    assert all(p["prompts"] == train[:2] + test[:2] for p, _ in eval_calls)
    # The run's rewards are the server's scores: every trajectory's score was one answer of the server.
    server_train = [s for _, a in train_calls for s in a["scores"]]
    assert len(server_train) == 2 * 4
    logged = sum(r["reward_remote_mean"] * r["trajectories"] for r in rows)
    assert logged == pytest.approx(sum(server_train), abs=1e-4)
    first, last = (a["scores"] for _, a in eval_calls)  # combined: server + 0.5 x the rows' weights (0.25, 0.5)
    assert rows[0]["eval_reward_initial"] == pytest.approx(np.mean(first[:2]) + 0.5 * 0.375, abs=1e-5)
    assert rows[1]["eval_reward"] == pytest.approx(np.mean(last[:2]) + 0.5 * 0.375, abs=1e-5)
    assert rows[1]["eval_reward_heldout_prompts"] == pytest.approx(np.mean(last[2:]) + 0.5 * 0.375, abs=1e-5)
    assert all(r["grad_norm"] > 0 for r in rows)  # the scores differed within groups: a learning signal
    # The metadata-taking reward got each trajectory's row in generation, and its numeric info is logged.
    assert all(r["reward_meta_reward_meta_reward/tag_id_mean"] == 7.0 for r in rows)  # named without the path
    assert "reward_meta_reward_meta_reward/note_mean" not in rows[0]
    assert not any(str(tmp_path) in k or ":" in k for k in rows[0])  # no path, no colon in any metric name
    # W&B (offline): step metrics, eval images captioned with their prompts, and the config.
    records = wandb_records(run)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [0, 1]
    assert [h["reward_mean"] for h in history] == pytest.approx([r["reward_mean"] for r in rows])
    captions = history[1]["eval_images/captions"]
    assert len(captions) == 4 and all(c.startswith(p + " | reward ") for c, p in zip(captions, train + test))
    (config_record,) = [r for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in config_record.run.config.update}
    assert config["reward"] == f"remote=1,{custom}=0.5" and config["prompt_file"] == str(tmp_path / "geneval")
    # TensorBoard: the eval image next to the scalars.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert "eval" in events.Tags()["images"] and "reward_mean" in events.Tags()["scalars"]


def test_deqa_style_server_with_a_text_dataset(tiny_cache, tmp_path):
    import models
    models.tiny_pipeline_path("flux")
    train, test = write_dataset(tmp_path / "pickscore", "txt")
    with pickle_server(deqa_answer) as (url, log):
        run_forked(["--model", "flux", "--mode", "colocated", "--nproc", "1", *SMALL, "--steps", "1", "--eval-every",
                    "1", "--prompt-file", str(tmp_path / "pickscore"), "--reward", "remote", "--remote-url", url,
                    "--remote-score-key", "outputs"], tmp_path, "deqa", tiny_cache)
    (row,) = read_metrics(tmp_path / "deqa")
    probe, _ = log.pop(0)  # the check request before any rank starts
    assert probe["prompts"] == train[:2] and len(probe["images"]) == 2
    eval_calls = [(p, a) for p, a in log if set(p["prompts"]) & set(test)]
    train_calls = [(p, a) for p, a in log if set(p["prompts"]) <= set(train)]
    assert len(train_calls) + len(eval_calls) == len(log) and all(m == {} for p, _ in log for m in p["meta_datas"])
    # before and after the step: both training prompts, then the whole test split (3 <= --eval-prompts)
    assert [p["prompts"] for p, _ in eval_calls] == [train + test] * 2
    server_train = [float(s) for _, a in train_calls for s in a["outputs"]]
    assert row["reward_mean"] * row["trajectories"] == pytest.approx(sum(server_train), abs=1e-4)
    last = [float(s) for s in eval_calls[-1][1]["outputs"]]
    assert row["eval_reward"] == pytest.approx(np.mean(last[:2]), abs=1e-5)
    assert row["eval_reward_heldout_prompts"] == pytest.approx(np.mean(last[2:]), abs=1e-5)


def test_one_update_moves_the_policy_toward_the_servers_scores(tiny_cache):
    """Learning from the server: after one optimizer step on a fragment scored by the server, the clipped policy
    loss of the same trajectories is negative (it is 0 before: ratios 1, zero-mean advantages), i.e. the policy
    now gives the trajectories the server scored higher more probability than those it scored lower."""
    import models
    import rewards
    import tsp
    from fragment import fragment_spec
    from rollout import SamplingConfig, generate_fragment
    from trainer import TrainConfig, Trainer

    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32, max_sequence_length=16)
    models.enable_full_training(policy)
    options = rewards.RewardOptions(remote_timeout_s=5.0, remote_retries=0, remote_protocol="flow_grpo")
    spec = fragment_spec(0, 0, 0, 1, 1, 1, 4)  # one group of 4 samples of one prompt
    with pickle_server(geneval_answer) as (url, log):
        options.remote_url = url
        reward = rewards.build_reward("remote", options)
        fragment = generate_fragment(policy, spec, ["a red image"], SamplingConfig(num_steps=3), reward, 0, 0)
    torch.testing.assert_close(fragment.rewards, torch.tensor(log[0][1]["scores"], dtype=torch.float32))
    assert fragment.advantages.abs().max() > 0.5  # the server's scores differ within the group
    trainer = Trainer(policy, TrainConfig(lr=1e-3))
    packs = tsp.per_timestep_packs(*fragment.latents.shape[:2])
    masks, total = [[1.0] * len(p) for p in packs], sum(len(p) for p in packs)
    trainer.accumulate(fragment, packs, masks, total)
    before = trainer.step(reward.names)
    trainer.accumulate(fragment, packs, masks, total)  # the same trajectories under the updated policy
    after = trainer.step(reward.names)
    assert abs(before["loss"]) < 1e-5 and before["ratio_min"] == before["ratio_max"] == 1.0
    assert after["loss"] < -1e-4 and after["ratio_max"] > 1.0
