"""What used to surface only after the model was loaded and the first rollout done, now refused before any rank
starts with one line each (main.main exits 2, nothing spawned): a reward server's wrong score key (the hint names
the keys found and the flag, the pickled answer printed as data), a dead server, W&B without a login, negative
numbers, control characters in a prompt file, a peft --init-lora folder's targets, a checkpoint that would run code.
And: several remote rewards with weights, retries that ride out a server restart, metric names without paths.
"""
import contextlib
import http.server
import io
import json
import os
import pickle
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image

import main
import cli
import rewards
from conftest import ROOT
from rewards.remote import BACKOFF_CAP_S, backoff_delays

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _no_proxy_for_localhost(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def refused(argv, monkeypatch, capsys) -> str:
    """main.main(argv) must exit 2 before spawning anything; returns its one-line error."""
    spawned = []
    monkeypatch.setattr(main, "launch", lambda *a, **k: spawned.append(a) or 0)
    monkeypatch.setattr(main, "run_rank", lambda *a, **k: spawned.append(a) or 0)
    assert main.main(argv) == 2 and not spawned
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def redness(jpeg: bytes) -> float:
    pixels = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.float64) / 255
    return float(pixels[..., 0].mean() - pixels[..., 1:].mean())


@contextlib.contextmanager
def pickle_server(respond, sock=None):
    """Flow-GRPO's protocol on 127.0.0.1: respond(payload) -> dict (pickled). With `sock` (bound, not yet
    listening) the server starts listening only when the returned start() is called. Yields (url, log, start)."""
    log = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            payload = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = respond(payload)
            log.append((payload, answer))
            body = pickle.dumps(answer)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=sock is None)
    if sock is not None:
        server.socket.close()
        server.socket, server.server_address = sock, sock.getsockname()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)

    def start():
        if sock is not None:
            server.server_activate()  # listen(): connections were refused until now
        thread.start()

    if sock is None:
        start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log, start
    finally:
        if thread.is_alive():
            server.shutdown()
        server.server_close()


def geneval(payload):
    return {"scores": [redness(im) for im in payload["images"]], "strict_rewards": [0.0] * len(payload["images"])}


def deqa(payload):
    return {"outputs": np.asarray([1.0 - redness(im) for im in payload["images"]], dtype=np.float32)}


SMALL = ["--mode", "colocated", "--nproc", "1", "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3",
         "--text-len", "16", "--eval-every", "0", "--save-every", "0", "--no-trace", "--remote-protocol", "flow_grpo",
         "--remote-retries", "0"]


# ---------------------------------------------------------------- item 5: reward servers and W&B

def test_wrong_score_key_names_the_keys_found_and_the_flag_and_prints_the_pickle_as_data(monkeypatch, capsys,
                                                                                           tmp_path):
    """A DeQA server answers `outputs`; the default key is `scores`. The hint used to come after a traceback, once
    the model was loaded, with the pickled answer as raw bytes."""
    with pickle_server(deqa) as (url, log, _):
        err = refused([*SMALL, "--reward", "remote", "--remote-url", url, "--out-dir", str(tmp_path)], monkeypatch,
                      capsys)
        assert "no score key 'scores', its keys are ['outputs']; set --remote-score-key outputs;" in err
        assert "body <<{'outputs': [" in err and "\\x" not in err  # the answer as data, not pickle bytes
        assert len(log) == 1 and len(log[0][0]["images"]) == 2  # one small request, blank images
        assert log[0][0]["prompts"] == rewards.color_prompts("train")[:2]
        cfg = cli.prepare([*SMALL, "--reward", "remote", "--remote-url", url, "--remote-score-key", "outputs",
                           "--out-dir", str(tmp_path)])  # the printed hint works
        assert cfg.remote_score_key == "outputs" and len(log) == 2


def test_a_dead_server_is_refused_before_spawn(monkeypatch, capsys, tmp_path):
    with socket.socket() as held:  # bound, never listening: connections refused, and the port stays ours
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        err = refused([*SMALL, "--reward", "remote", "--remote-url", url, "--out-dir", str(tmp_path)], monkeypatch,
                      capsys)
    assert f"reward 'remote': the check request before training failed: reward server {url} failed after 1 " \
           "attempts" in err and "Connection refused" in err


def test_optional_integrations_without_their_package_name_the_extras_file(monkeypatch, capsys, tmp_path):
    """--tensorboard and --wandb need packages only requirements-extras.txt installs: refused before any rank
    starts, naming the install command (a missing package used to fail inside the run's first step)."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb")
                        else real(name, *a))
    for flag in ("--tensorboard", "--wandb"):
        err = refused([flag, "--out-dir", str(tmp_path)], monkeypatch, capsys)
        assert f"{flag} needs the {flag[2:]} package: pip install -r requirements-extras.txt" in err, err


def test_wandb_without_a_login_is_refused_and_offline_is_not(monkeypatch, capsys, tmp_path):
    pytest.importorskip("wandb")  # requirements-extras.txt
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    err = refused(["--wandb", "--out-dir", str(tmp_path)], monkeypatch, capsys)
    assert "--wandb: no W&B login here" in err and "WANDB_MODE=offline" in err
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    assert cli.prepare(["--wandb", "--out-dir", str(tmp_path)]).wandb  # `wandb login` writes this
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert cli.prepare(["--wandb", "--out-dir", str(tmp_path)]).wandb


def test_several_remote_rewards_with_weights_each_on_its_server(tiny_cache, tmp_path, monkeypatch, capsys):
    """One --remote-url per run used to be all: GenEval and DeQA could not be combined."""
    with pickle_server(geneval) as (g_url, g_log, _), pickle_server(deqa) as (d_url, d_log, _):
        spec = "remote:geneval=1,remote:deqa=0.5"
        urls = f"geneval={g_url},deqa={d_url}"
        keys = "geneval=scores,deqa=outputs"
        options = rewards.RewardOptions(remote_url=urls, remote_score_key=keys, remote_protocol="flow_grpo",
                                        remote_retries=0)
        reward = rewards.build_reward(spec, options)
        images = torch.tensor([(1.0, 0, 0), (0, 0, 1.0)])[:, :, None, None].expand(-1, 3, 8, 8)
        scores = reward(images, ["a", "b"])
        assert reward.names == ["remote_geneval", "remote_deqa"]
        g, d = g_log[-1][1]["scores"], d_log[-1][1]["outputs"]
        torch.testing.assert_close(scores["remote_geneval"], torch.tensor(g, dtype=torch.float32))
        torch.testing.assert_close(scores["total"], torch.tensor(g) + 0.5 * torch.tensor(d))
        # a missing entry, and the hint for a named reward's key
        err = refused([*SMALL, "--reward", spec, "--remote-url", f"geneval={g_url}", "--out-dir", str(tmp_path)],
                      monkeypatch, capsys)
        assert "--remote-url " in err and "has no setting for reward 'remote:deqa'" in err
        err = refused([*SMALL, "--reward", spec, "--remote-url", urls, "--out-dir", str(tmp_path)], monkeypatch,
                      capsys)
        assert "reward 'remote:deqa'" in err and "set --remote-score-key deqa=outputs" in err
        # a --config file may list them as JSON objects
        config = tmp_path / "config.json"
        config.write_text(json.dumps({"reward": spec, "remote_url": {"geneval": g_url, "deqa": d_url},
                                      "remote_score_key": {"geneval": "scores", "deqa": "outputs"}}))
        cfg = cli.prepare(["--config", str(config), *SMALL, "--out-dir", str(tmp_path)])
        assert (cfg.remote_url, cfg.remote_score_key) == (urls, keys)
        # a run logs them separately
        from conftest import read_metrics, run_forked
        run_forked([*SMALL, "--steps", "1", "--reward", spec, "--remote-url", urls, "--remote-score-key", keys],
                   tmp_path, "two", tiny_cache)
    (row,) = read_metrics(tmp_path / "two")
    assert row["reward_mean"] == pytest.approx(row["reward_remote_geneval_mean"]
                                               + 0.5 * row["reward_remote_deqa_mean"], abs=1e-5)


def test_retries_ride_out_a_server_restart():
    """The default retries rode out about 3.5 s of server downtime (3 retries from 0.5 s); now exponential backoff
    capped at 15 s covers about a minute. Here, a server that refuses connections and then comes up on the same
    port is ridden out (backoff scaled down to keep the test short)."""
    assert backoff_delays(7, 1.0) == [1, 2, 4, 8, 15, 15, 15] and BACKOFF_CAP_S == 15
    defaults = rewards.RewardOptions()
    assert sum(backoff_delays(defaults.remote_retries, defaults.remote_backoff_s)) >= 30
    assert main.config_lib.Config().remote_retries == defaults.remote_retries
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    with pickle_server(geneval, sock=sock) as (url, log, start):
        reward = rewards.REWARDS["remote"](remote_url=url, remote_protocol="flow_grpo", remote_retries=6,
                                           remote_backoff_s=0.05, remote_timeout_s=5.0)
        threading.Timer(0.4, start).start()  # "restarted": refused for 0.4 s, then up
        scores = reward(torch.ones(1, 3, 8, 8), ["x"])
    assert len(log) == 1 and scores.shape == (1,)


# ---------------------------------------------------------------- item 6: rough inputs

def test_negative_numbers_parse_and_get_the_validation_message(monkeypatch, capsys):
    """`--lr -1e-4` gave argparse's 'expected one argument' and a 40-line usage dump."""
    err = refused(["--lr", "-1e-4"], monkeypatch, capsys)
    assert err == "error: --lr must be a positive number, got -0.0001\n"
    assert "got -inf" in refused(["--max-grad-norm", "-inf"], monkeypatch, capsys)
    proc = subprocess.run([sys.executable, "main.py", "--lr"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == ("error: argument --lr: expected one argument (python main.py "
                                                    "--help lists every option)\n")


def test_a_prompt_file_with_control_characters_is_refused_naming_the_line(tmp_path, monkeypatch, capsys):
    """A binary file that decodes as UTF-8 (NUL and control bytes) used to be trained on as prompts."""
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"a red car\n\tan indented blue sky\n\x00\x01\x02 binary\n")
    err = refused(["--prompt-file", str(path), "--reward", "jpeg_compressibility"], monkeypatch, capsys)
    assert f"--prompt-file '{path}' line 3 holds the control character U+0000" in err
    path.write_bytes(b"a red car\r\nan indented\tblue sky\r\n")  # CRLF and tabs are text
    assert cli.prepare(["--prompt-file", str(path), "--reward", "jpeg_compressibility"]).prompt_file == str(path)


def test_init_lora_of_a_peft_folder_reads_its_targets_rank_and_alpha(tiny_cache, tmp_path):
    """A peft adapter folder (Flow-GRPO's save_pretrained) used to be refused unless --lora-targets repeated its
    target_modules by hand."""
    import models
    from peft import LoraConfig, get_peft_model

    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32, max_sequence_length=16)
    targets = ["attn.to_k", "attn.to_q", "attn.to_v"]
    peft_model = get_peft_model(policy.transformer, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                              init_lora_weights="gaussian"))
    peft_model.save_pretrained(tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    cfg = cli.prepare(["--model", "flux", "--init-lora", str(tmp_path / "adapter"), "--out-dir", str(tmp_path)])
    assert (cfg.lora, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) == (True, 4, 8.0, ",".join(targets))
    fresh = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32, max_sequence_length=16)
    models.add_lora(fresh, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    lora = models.load_init_lora(fresh.transformer, cfg.init_lora)  # every module matches, weights copied
    params = dict(fresh.transformer.named_parameters())
    some = next(k for k in lora.state if ".lora_B." in k)
    assert torch.equal(params[some.replace(".lora_B.", ".lora_B.default.")], lora.state[some])


def test_reward_metric_names_hold_no_path():
    """`reward_/tmp/x/myreward.py:fn_mean`: slashes split W&B and TensorBoard groups, and moving the file renamed
    the metric."""
    assert rewards.metric_name("/tmp/x/myreward.py:fn") == "myreward_fn"
    assert rewards.metric_name("pkg.my_mod:score.inner") == "my_mod_score_inner"
    assert rewards.metric_name("remote:geneval") == "remote_geneval" and rewards.metric_name("color") == "color"
    with pytest.raises(ValueError, match="would both be logged as 'r_fn'"):
        rewards.parse_reward_spec("/a/r.py:fn,/b/r.py:fn")


# ---------------------------------------------------------------- a checkpoint must not run code

class _WritesMarker:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_state_pt_that_would_run_code_is_refused_on_resume(tmp_path, monkeypatch, capsys):
    """--resume loaded state.pt with weights_only=False: a shared checkpoint ran arbitrary code on load."""
    from infra.rundir import to_json
    from infra import rundir

    cfg = cli.prepare(["--mode", "colocated", "--nproc", "1", "--run-name", "x", "--out-dir", str(tmp_path)])
    run = tmp_path / "x"
    checkpoint = run / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    (run / "config.json").write_text(to_json(cfg))
    (checkpoint / "meta.json").write_text(json.dumps({"step": 1, "identity": rundir.identity(cfg)}))
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "weights": {}, "payload": _WritesMarker(marker)}, checkpoint / "state.pt")
    err = refused(["--resume", str(run)], monkeypatch, capsys)
    assert "holds more than tensors and plain data" in err and "refused to load it" in err and "system" in err
    assert not marker.exists()
    torch.load(checkpoint / "state.pt", weights_only=False)  # the same file, loaded the old way, runs the code
    assert marker.exists()
