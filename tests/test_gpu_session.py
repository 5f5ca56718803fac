"""tools/gpu_session.sh, the one prepared GPU check, checked on a CPU: a session lent a GPU gets 15 minutes in all,
so a script that is refused at its third part or overruns its limits wastes the only chance (issue 22).
"""
import os
import re
import shlex
import shutil
import subprocess

import pytest

import cli
from conftest import ROOT

SCRIPT = os.path.join(ROOT, "tools", "gpu_session.sh")


def _dry_run() -> list[str]:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash on this machine")
    proc = subprocess.run([bash, SCRIPT, "--dry-run"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_the_parts_fit_the_device_time_and_everything_is_logged():
    """Catches a script whose limits add up past one 600 s device command (a hung part would then cost the
    session), and output that is not kept in $OUT/log (the only thing that comes back from the machine)."""
    lines = _dry_run()
    limits = [int(m.group(1)) for line in lines if (m := re.match(r"\S+ (\d+)s: ", line))]
    total = int(re.search(r"total limit (\d+)s", lines[-1]).group(1))
    assert len(limits) >= 8 and sum(limits) == total < 540, (limits, total)
    text = open(SCRIPT).read()
    assert 'exec > >(tee -a "$OUT/log")' in text
    parts = {line.split()[0] for line in lines[:-1]}
    assert {"a-run", "a-contract", "a-resume", "e-run", "e-resume", "c-1024-ckpt", "d-pipeline", "d-nccl"} <= parts, parts


def test_its_main_py_commands_are_accepted(monkeypatch, tiny_cache, tmp_path):
    """Catches a flag renamed or a combination refused by cli.validate (it would fail on the GPU after the
    machine started): every main.py command but the --resume one is validated here, with CUDA reported present
    (validate only asks whether it is) and the 12B pipeline folder replaced by a tiny one of the same layout."""
    import torch

    from tools.gpu_pipeline import build

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    pipeline = build("tiny", str(tmp_path / "flux-tiny"))
    checked = 0
    for line in _dry_run():
        if "main.py" not in line or "--resume" in line:
            continue
        tokens = shlex.split(line.split(": ", 1)[1])
        args = tokens[next(i for i, t in enumerate(tokens) if t.endswith("main.py")) + 1:]
        if "--pretrained" in args:
            args[args.index("--pretrained") + 1] = pipeline
        try:
            cfg = cli.prepare(args)
        except (ValueError, FileNotFoundError) as exc:
            raise AssertionError(f"`{line}` is refused: {exc}") from None
        assert cfg.device == "cuda"
        checked += 1
    assert checked == 3  # a-run, e-run, d-nccl
