"""Flow-GRPO's prompt sources and reward functions as inputs: what is read, what reaches the reward, what is refused
before any rank starts (main.main exits 2 with the message, and nothing is spawned). Training runs with a
Flow-GRPO-style (scores, info) reward on a metadata dataset: tests/test_compat_remote.py."""
import json

import pytest
import torch

import rewards
from infra.prompts import load_prompt_source

pytestmark = pytest.mark.timeout(300)
COLOUR = (rewards.color_prompts("train"), rewards.color_prompts("eval"))


def refused(argv, monkeypatch, capsys) -> str:
    """Run main.main(argv); it must exit 2 before spawning anything. Returns its error message."""
    import main

    spawned = []
    monkeypatch.setattr(main, "launch", lambda cfg: spawned.append(cfg) or 0)
    monkeypatch.setattr(main, "run_rank", lambda *a, **k: spawned.append(a))
    assert main.main(argv) == 2 and not spawned
    return capsys.readouterr().err


# ------------------------------------------------------------------ prompt sources

def test_flow_grpo_dataset_folders(tmp_path):
    txt, jsonl = tmp_path / "pickscore", tmp_path / "geneval"
    txt.mkdir()
    (txt / "train.txt").write_text("a cat\n\na dog\n")
    (txt / "test.txt").write_text("a cow\n")
    source = load_prompt_source(str(txt))
    assert (source.train, source.eval, source.train_metadata, source.eval_metadata) == (
        ["a cat", "a dog"], ["a cow"], [{}, {}], [{}])
    jsonl.mkdir()
    rows = [{"tag": "counting", "include": [{"class": "cat", "count": 2}], "prompt": "two cats"}]
    (jsonl / "train_metadata.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (jsonl / "test_metadata.jsonl").write_text(json.dumps({**rows[0], "prompt": "two dogs"}) + "\n")
    source = load_prompt_source(str(jsonl))
    assert source.train == ["two cats"] and source.eval == ["two dogs"]
    assert source.train_metadata == rows  # the whole row, as Flow-GRPO's GenevalPromptDataset (GenEval reads 'prompt')
    (jsonl / "test_metadata.jsonl").unlink()
    with pytest.raises(ValueError, match="no test_metadata.jsonl"):
        load_prompt_source(str(jsonl))
    with pytest.raises(ValueError, match="not a Flow-GRPO dataset: expected train.txt"):
        load_prompt_source(str(tmp_path))
    (jsonl / "test_metadata.jsonl").write_text('{"tag": "counting"}\n')
    with pytest.raises(ValueError, match="line 1 has no non-empty string field 'prompt'"):
        load_prompt_source(str(jsonl))


def test_text_file_holds_out_evenly_spaced_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(1, 31)))  # 30 prompts -> 3 held out: lines 10, 20, 30
    source = load_prompt_source(str(path))
    assert source.eval == ["prompt 10", "prompt 20", "prompt 30"]
    assert len(source.train) == 27 and not set(source.train) & set(source.eval)  # never trained on
    path.write_text("".join(f"prompt {i}\n" for i in range(1, 1001)))
    assert load_prompt_source(str(path)).eval == [f"prompt {125 * j}" for j in range(1, 9)]  # at most 8
    path.write_text("a cat\na dog\n")  # < 10 prompts: no split, and the note says so
    source = load_prompt_source(str(path))
    assert source.train == ["a cat", "a dog"] and source.eval == [] and "no held-out split" in source.note


@pytest.mark.parametrize("name", ["test_metadata.jsonl", "prompts.txt"])
def test_jsonl_as_a_text_file_is_refused_before_spawn(name, tmp_path, monkeypatch, capsys):
    path = tmp_path / name
    path.write_text(json.dumps({"tag": "colors", "prompt": "a red car"}) + "\n")
    err = refused(["--prompt-file", str(path), "--reward", "jpeg_compressibility"], monkeypatch, capsys)
    assert "holds JSON lines, not one prompt per line" in err and f"--prompt-file {tmp_path}" in err


def test_colour_reward_checks_every_prompt_before_spawn(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.txt").write_text("a red car\na green tree\n")
    (folder / "test.txt").write_text("a blue sky\na cloudy sky\n")
    err = refused(["--prompt-file", str(folder)], monkeypatch, capsys)
    assert "reward 'color' cannot score prompt 2 of the evaluation prompts" in err and "'a cloudy sky'" in err


# ------------------------------------------------------------------ reward functions

REWARD_FILE = '''
import torch

def plain(images, prompts):
    return images.flatten(1).mean(1)  # images [B, 3, H, W] or videos [B, F, 3, H, W]

def flow_grpo_style(images, prompts, metadata):
    return [len(m.get("prompt", "")) for m in metadata], {"first_channel": images[:, 0].mean(dim=(1, 2)).tolist()}

def optional_metadata(images, prompts, metadata=None):
    return torch.zeros(len(prompts)), {}

def returns_a_dict(images, prompts, metadata):
    return {"score": 1.0}

def returns_too_few(images, prompts):
    return torch.zeros(1)
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return str(path)


def test_both_reward_function_forms_work_and_info_becomes_columns(reward_file):
    images = torch.rand(2, 3, 8, 8)
    metadata = [{"prompt": "ab"}, {"prompt": "abcd"}]
    spec = f"{reward_file}:plain,{reward_file}:flow_grpo_style=2,{reward_file}:optional_metadata"
    reward = rewards.build_reward(spec, probe=(images, ["x", "y"], metadata))
    styled = "my_rewards_flow_grpo_style"  # metric names: the file's stem and the function, never its path
    assert reward.names == ["my_rewards_plain", styled, "my_rewards_optional_metadata", f"{styled}/first_channel"]
    scores = reward(images, ["x", "y"], metadata)
    assert list(scores) == [*reward.names, "total"]  # the column order fragments carry
    torch.testing.assert_close(scores[styled], torch.tensor([2.0, 4.0]))  # computed from the metadata
    torch.testing.assert_close(scores[f"{styled}/first_channel"], images[:, 0].mean(dim=(1, 2)))
    torch.testing.assert_close(scores["total"], images.mean(dim=(1, 2, 3)) + 2 * torch.tensor([2.0, 4.0]))
    reward.prompt_metadata = [{"prompt": "a"}, {"prompt": "abc"}]  # generation passes prompt ids instead
    torch.testing.assert_close(reward(images, ["x", "y"], prompt_ids=[1, 0])[styled], torch.tensor([3.0, 1.0]))


@pytest.mark.parametrize("function, message", [
    ("returns_a_dict", "custom reward '.*:returns_a_dict' failed a dry call as fn\\(images, prompts, metadata\\) "
                       "on 2 probe images .*returned dict, not 2 scores"),
    ("returns_too_few", "custom reward '.*:returns_too_few' failed a dry call .*returned shape \\(1,\\), expected "
                        "\\(2,\\)"),
])
def test_a_reward_returning_the_wrong_thing_is_refused_before_spawn(function, message, reward_file, monkeypatch,
                                                                     capsys):
    import re

    err = refused(["--reward", f"{reward_file}:{function}"], monkeypatch, capsys)
    assert re.search(message, err), err


def test_video_families_dry_call_custom_rewards_on_videos(reward_file):
    import cli
    import rewards

    cfg = cli.prepare(["--model", "wan", "--reward", f"{reward_file}:plain"])  # the dry call passed on videos
    images, prompts, metadata = rewards.reward_probe(cfg, rewards.prompt_source(cfg))
    assert images.shape == (2, 5, 3, 32, 32) and prompts == COLOUR[0][:2] and metadata == [{}, {}]
