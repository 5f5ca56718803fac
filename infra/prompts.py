"""Prompt sources: the colour demo task, a plain text file, or a Flow-GRPO dataset folder, split into train and eval.

    source = load_prompt_source("dataset/geneval")     # Flow-GRPO layout: {train,test}_metadata.jsonl
    source = load_prompt_source("dataset/pickscore")   # Flow-GRPO layout: {train,test}.txt
    source = load_prompt_source("my_prompts.txt")      # one prompt per line
    source.train, source.train_metadata, source.eval, source.eval_metadata

- A Flow-GRPO dataset folder trains on `train` and evaluates on `test`, as Flow-GRPO does. `*_metadata.jsonl` has one
  JSON object per line with a `prompt` field; the whole object is that prompt's metadata (Flow-GRPO's
  GenevalPromptDataset passes the whole row: the GenEval server reads its `tag`, `include`, ... and `prompt`).
  `*.txt` prompts carry empty metadata ({}), as Flow-GRPO's TextPromptDataset.
- A plain text file (one prompt per line, blank lines skipped) is split here: E = min(8, n // 10) evenly spaced
  prompts (lines k, 2k, ..., k = n // E) are held out for evaluation and never trained on. A file with fewer than
  10 prompts has no held-out split (`eval` is empty: evaluation uses the training prompts on held-out noises), and
  `note` says so.
- A `.jsonl` file (or a text file whose first line is a JSON object) given as a text file is refused: its lines
  would be trained on as raw JSON. Give the folder that holds `train_metadata.jsonl` / `test_metadata.jsonl`.
- A path that is not a regular file (a device such as /dev/zero, a pipe) or a file over MAX_PROMPT_FILE_BYTES is
  refused before it is read.
- A prompt holding a control character other than tab (NUL, escape, form feed, ...; a binary file that happens to
  decode as UTF-8) is refused naming the file, the line and the character.
Every problem is a ValueError naming the path and what is expected; cli.validate calls this before spawning.
"""
from __future__ import annotations

import dataclasses
import json
import os
import unicodedata

MAX_HELD_OUT = 8  # held-out prompts cut from a plain text file (each costs one generation per evaluation)
# Flow-GRPO's largest prompt set (pickscore train.txt) is ~2 MB; a file that is not a regular one (a device, a pipe)
# or over this size is refused before it is read, not read until memory runs out (/dev/zero)
MAX_PROMPT_FILE_BYTES = 256 * 2**20


def _check_readable(path: str) -> None:
    if not os.path.isfile(path):  # follows links: a link to a regular file is one
        raise ValueError(f"--prompt-file {path!r} is not a regular file (a device, a pipe, a socket?): give a text "
                         "file or a Flow-GRPO dataset folder")
    size = os.path.getsize(path)
    if size > MAX_PROMPT_FILE_BYTES:
        raise ValueError(f"--prompt-file {path!r} is {size / 2**20:.0f} MiB: at most "
                         f"{MAX_PROMPT_FILE_BYTES // 2**20} MiB of prompts are read")


@dataclasses.dataclass
class PromptSource:
    train: list[str]
    eval: list[str]
    train_metadata: list[dict]
    eval_metadata: list[dict]
    kind: str  # "colour task", "text file", "dataset (txt)", "dataset (jsonl)"
    note: str = ""


def _check_text(path: str, number: int, text: str) -> None:
    """A prompt is text: no control characters but tab (a line's own newline is not part of it)."""
    bad = next((ch for ch in text if unicodedata.category(ch) == "Cc" and ch != "\t"), None)
    if bad is not None:
        raise ValueError(f"--prompt-file {path!r} line {number} holds the control character U+{ord(bad):04X} "
                         f"({bad!r}): prompts must be plain text (is it a binary file?)")


def _read_text(path: str) -> list[str]:
    _check_readable(path)
    try:
        with open(path, encoding="utf-8", newline="") as f:
            lines = [line.rstrip("\r\n") for line in f]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompt-file {path!r} cannot be read: {exc}") from exc
    for number, line in enumerate(lines, 1):
        _check_text(path, number, line)
    return [line.strip() for line in lines if line.strip()]


def _read_jsonl(path: str) -> tuple[list[str], list[dict]]:
    prompts, rows = [], []
    _check_readable(path)
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                    raise ValueError(f"line {number} has no non-empty string field 'prompt'")
                _check_text(path, number, row["prompt"])
                prompts.append(row["prompt"].strip())
                rows.append(row)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"--prompt-file dataset file {path!r} cannot be read as JSON lines: {exc}") from exc
    return prompts, rows


def _dataset(folder: str) -> PromptSource:
    def pair(name: str) -> tuple[str, str]:
        return os.path.join(folder, f"train{name}"), os.path.join(folder, f"test{name}")

    for suffix, kind in (("_metadata.jsonl", "dataset (jsonl)"), (".txt", "dataset (txt)")):
        train_path, test_path = pair(suffix)
        if not os.path.isfile(train_path):
            continue
        if not os.path.isfile(test_path):
            raise ValueError(f"--prompt-file {folder!r} has {os.path.basename(train_path)} but no "
                             f"{os.path.basename(test_path)} (the test split is what evaluation uses)")
        if suffix == ".txt":
            (train, test) = _read_text(train_path), _read_text(test_path)
            train_meta, test_meta = [{} for _ in train], [{} for _ in test]
        else:
            (train, train_meta), (test, test_meta) = _read_jsonl(train_path), _read_jsonl(test_path)
        for path, prompts in ((train_path, train), (test_path, test)):
            if not prompts:
                raise ValueError(f"--prompt-file {path!r} has no prompts")
        return PromptSource(train, test, train_meta, test_meta, kind)
    raise ValueError(f"--prompt-file {folder!r} is a folder but not a Flow-GRPO dataset: expected train.txt + "
                     "test.txt, or train_metadata.jsonl + test_metadata.jsonl")


def _looks_like_json_lines(path: str, prompts: list[str]) -> bool:
    return path.endswith(".jsonl") or (prompts[0].startswith("{") and _parses_as_object(prompts[0]))


def _parses_as_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _text_file(path: str) -> PromptSource:
    prompts = _read_text(path)
    if not prompts:
        raise ValueError(f"--prompt-file {path!r} has no prompts (one per line expected)")
    if _looks_like_json_lines(path, prompts):
        folder = os.path.dirname(os.path.abspath(path))
        raise ValueError(f"--prompt-file {path!r} holds JSON lines, not one prompt per line: its lines would be "
                         f"trained on as raw JSON. For a Flow-GRPO dataset give its folder (--prompt-file {folder}), "
                         "which must hold train_metadata.jsonl and test_metadata.jsonl")
    held = min(MAX_HELD_OUT, len(prompts) // 10)
    if held == 0:
        return PromptSource(prompts, [], [{} for _ in prompts], [], "text file",
                            note=f"{len(prompts)} prompts (< 10): no held-out split, evaluation uses the training "
                                 "prompts on held-out noises only")
    stride = len(prompts) // held
    eval_ids = {stride * (j + 1) - 1 for j in range(held)}  # lines k, 2k, ..., held * k (1-based)
    train = [p for i, p in enumerate(prompts) if i not in eval_ids]
    held_out = [prompts[i] for i in sorted(eval_ids)]
    return PromptSource(train, held_out, [{} for _ in train], [{} for _ in held_out], "text file",
                        note=f"{held} of {len(prompts)} prompts (every {stride}th line) held out for evaluation")


def load_prompt_source(path: str | None, colour_train=None, colour_eval=None) -> PromptSource:
    """The prompts of --prompt-file `path` (None: the colour task's lists, given by the caller)."""
    if path is None:
        return PromptSource(list(colour_train), list(colour_eval), [{} for _ in colour_train],
                            [{} for _ in colour_eval], "colour task")
    if os.path.isdir(path):
        return _dataset(path)
    if not os.path.exists(path):
        raise ValueError(f"--prompt-file {path!r} cannot be read: no such file or folder")
    return _text_file(path)
