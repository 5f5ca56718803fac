"""Real-weight presets (flowgrpo/presets.py): --pretrained runs at the family's native size with its published Flow-GRPO /
DanceGRPO settings, every main.py / torchrun command the docs print is valid, and --dry-run says which preset is in
force without starting anything."""
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

import config
import models
from flowgrpo import presets
import cli
from conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def _doc_commands(refused: bool = False) -> list[tuple[str, str]]:
    """(file, command) for every `main.py` command in README.md and docs/*.md: inline code spans and indented
    code lines (joined over trailing backslashes); with `refused`, only those of sections whose heading says
    they are refused (the troubleshooting table), else all the others."""
    found = []
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        lines = open(path).read().splitlines()
        heading = ""
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("#"):
                heading = line
            if ("refused" in heading) != refused:
                i += 1
                continue
            found += [(path, span) for span in re.findall(r"`([^`\n]*main\.py[^`\n]*)`", line)]
            if line.startswith("    ") and re.search(r"(^|\s)(torchrun|python)\s.*main\.py", line):
                command = line.strip()
                while command.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command[:-1] + " " + lines[i].strip()
                found.append((path, command))
            i += 1
    return found


def _args_and_world(command: str) -> tuple[list[str], int | None, bool]:
    """The main.py arguments of a documented command (placeholders such as P, S filled in, `...` dropped), the
    world size torchrun would give it, and whether it runs on real weights."""
    tokens = [t for t in shlex.split(command) if t != "..."]
    tokens = [re.sub(r"(^|=)[A-Z]$", r"\g<1>2", t) for t in tokens]  # --seed S, --nproc_per_node=P
    at = next(i for i, t in enumerate(tokens) if t.endswith("main.py"))
    launcher, args = tokens[:at], tokens[at + 1:]
    world = None
    if any(t.endswith("torchrun") or t == "torch.distributed.run" for t in launcher):
        options = dict(re.match(r"--(nnodes|nproc[_-]per[_-]node)=?(\d*)", t).groups() for t in launcher
                       if re.match(r"--(nnodes|nproc[_-]per[_-]node)", t))
        values = {k.replace("-", "_"): int(v or launcher[launcher.index(f"--{k}") + 1]) for k, v in options.items()}
        world = values.get("nnodes", 1) * values.get("nproc_per_node", 1)  # torchrun: 1 per node by default
    return args, world, "--pretrained" in args


def test_every_documented_command_is_valid_and_real_weights_are_never_tiny(monkeypatch, tiny_cache):
    """Catches docs whose commands are refused (the README's multi-node command lacked --fragment-groups >= K
    for --fsdp with TAG) or run real weights at the tiny 32 px with the tiny lr 3e-3 (issue 22 item 3)."""
    commands = _doc_commands()
    assert len(commands) >= 5, commands  # the parser sees the docs' commands (not vacuous)
    files = {os.path.relpath(path, ROOT) for path, _ in commands}
    assert {"README.md", os.path.join("docs", "RESULTS.md")} <= files, files  # results moved out of the README too
    real = 0
    for path, command in commands:
        args, world, pretrained = _args_and_world(command)
        if pretrained:  # the documented weights are not here: the family's tiny pipeline stands in for them
            at = args.index("--pretrained") + 1
            model = args[args.index("--model") + 1] if "--model" in args else "flux"
            args[at] = models.tiny_pipeline_path(model)
        if world is not None:
            monkeypatch.setenv("WORLD_SIZE", str(world))
        else:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        try:
            cfg = cli.prepare(args)
        except (ValueError, FileNotFoundError) as exc:
            raise AssertionError(f"{os.path.basename(path)}: `{command}` is refused: {exc}") from None
        if pretrained:
            real += 1
            preset = presets.for_run(cfg.model, True, cfg.algo).values
            assert cfg.resolution >= 256, (command, cfg.resolution)
            for name in ("lr", "clip_range", "noise_level", "group_size", "num_steps"):
                if f"--{name.replace('_', '-')}" not in args:
                    assert getattr(cfg, name) == preset[name].value, (command, name, getattr(cfg, name))
            assert "Flow-GRPO" in presets.describe(cfg)
    assert real >= 1  # the GPU section's command runs real weights


def test_every_command_documented_as_refused_is_refused(monkeypatch, tiny_cache):
    """Catches a troubleshooting table that promises a refusal the code no longer makes (and keeps the other test
    from mistaking those rows for runnable commands)."""
    commands = _doc_commands(refused=True)
    assert commands  # the README's troubleshooting table shows refused commands
    for path, command in commands:
        args, world, _ = _args_and_world(command)
        if world is not None:
            monkeypatch.setenv("WORLD_SIZE", str(world))
        else:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        with pytest.raises((ValueError, FileNotFoundError)):
            cli.prepare(args)


@pytest.mark.parametrize("model", ["flux", "wan"])
def test_pretrained_without_flags_uses_the_family_preset(model, tiny_cache):
    """Catches --pretrained silently taking the tiny defaults (32 px, lr 3e-3, clip 1e-2)."""
    cfg = config.resolve(config.parse_args(["--pretrained", models.tiny_pipeline_path(model)]))
    values = presets.for_run(model, True, "flow_grpo").values
    assert cfg.model == model  # from the pipeline's model_index.json
    for name, setting in values.items():
        assert getattr(cfg, name) == setting.value and setting.source, name
    assert (cfg.resolution, cfg.width) == {"flux": (1024, 1024), "wan": (480, 832)}[model]
    assert cfg.lr == {"flux": 3e-4, "wan": 1e-4}[model]  # config/base.py; general_ocr_wan2_1
    dance = config.resolve(config.parse_args(["--model", "flux", "--pretrained", "x", "--algo", "dance_grpo",
                                              "--lr", "2e-5", "--resolution", "512"]))
    assert (dance.lr, dance.noise_level, dance.group_size, dance.timestep_fraction) == (2e-5, 0.3, 12, 0.6)
    assert (dance.resolution, dance.width) == (512, 0)  # a given size stays square
    tiny = config.resolve(config.parse_args([]))
    assert (tiny.lr, tiny.clip_range, tiny.noise_level, tiny.group_size, tiny.resolution) == (3e-3, 1e-2, 0.5, 8, 0)


def test_dry_run_prints_the_preset_of_the_pipelines_family_and_starts_nothing(tiny_cache, tmp_path):
    """`python main.py --pretrained DIR --dry-run` with a pipeline whose model_index.json names Qwen-Image: the
    family comes from the pipeline, the startup line names the preset and its sources, no rank starts."""
    path = models.tiny_pipeline_path("qwenimage")
    env = dict(os.environ, DIGENRL_CACHE=tiny_cache)
    proc = subprocess.run([sys.executable, "main.py", "--pretrained", path, "--dry-run", "--out-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if "preset:" in x)
    assert "preset: Flow-GRPO qwenimage for real weights" in line
    assert "noise_level 1.2 [Flow-GRPO config/grpo.py pickscore_qwenimage" in line
    assert "lr 0.0003 [Flow-GRPO config/base.py" in line and "resolution 1024 [QwenImagePipeline" in line
    assert '"model": "qwenimage"' in proc.stdout and "dry run, nothing started" in proc.stdout
    assert not os.listdir(tmp_path)  # no run directory
    wrong = subprocess.run([sys.executable, "main.py", "--model", "flux", "--pretrained", path, "--dry-run"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "is a qwenimage pipeline" in wrong.stderr


def _flow_grpo_epoch(gpu_number: int, train_batch_size: int, num_image_per_prompt: int, groups: int):
    """Flow-GRPO's config/grpo.py formulas (@ 31c71b9): num_batches_per_epoch = int(groups / (gpu_number *
    train_batch_size / num_image_per_prompt)); the groups of an epoch; gradient_accumulation_steps = num_batches
    // 2 (each an ema.step call per update)."""
    num_batches = int(groups / (gpu_number * train_batch_size / num_image_per_prompt))
    return num_batches * gpu_number * train_batch_size // num_image_per_prompt, num_batches // 2


# Outside truth, re-typed: config/grpo.py @ 31c71b9 (pickscore_flux, pickscore_sd3 [lines 106-141 at ac4c86e],
# pickscore_qwenimage, general_ocr_wan2_1) on config/base.py (line 69 adam_weight_decay 1e-4, line 91 beta 0); DanceGRPO
# scripts/finetune/finetune_flux_grpo.sh @ 22b85ef (2 nodes x 8 GPUs line 21, --train_batch_size 1 line 29,
# --learning_rate 1e-5 line 36, --weight_decay 0.0001 line 50) and fastvideo/train_grpo_flux.py (batch_size = 1 in
# sample_reference_model; no KL term in its loss).
FLUX_EPOCH, SD3_EPOCH, QWEN_EPOCH = (_flow_grpo_epoch(32, 3, 24, 48), _flow_grpo_epoch(32, 9, 24, 48),
                                     _flow_grpo_epoch(32, 4, 16, 32))
PUBLISHED = {
    ("flux", "flow_grpo"): dict(prompts_per_step=FLUX_EPOCH[0], beta=0.0, weight_decay=1e-4, sample_batch_size=3,
                                eval_batch_size=16, ema_repeats=FLUX_EPOCH[1]),
    # sample.train_batch_size 9 does not divide a 24-trajectory fragment: the preset takes 8 (validation refuses 9)
    ("sd3", "flow_grpo"): dict(prompts_per_step=SD3_EPOCH[0], beta=0.01, weight_decay=1e-4, sample_batch_size=8,
                               eval_batch_size=16, ema_repeats=SD3_EPOCH[1]),
    ("qwenimage", "flow_grpo"): dict(prompts_per_step=QWEN_EPOCH[0], beta=0.0, weight_decay=1e-4,
                                     sample_batch_size=4, eval_batch_size=4, ema_repeats=QWEN_EPOCH[1]),
    ("wan", "flow_grpo"): dict(beta=0.004, weight_decay=1e-4, eval_batch_size=2, lr=1e-4),
    ("flux", "dance_grpo"): dict(prompts_per_step=2 * 8 * 1, beta=0.0, weight_decay=1e-4, sample_batch_size=1,
                                 lr=1e-5),
}


@pytest.mark.parametrize("model,algo", sorted(PUBLISHED))
def test_presets_carry_the_published_batch_beta_weight_decay_and_batch_sizes(model, algo):
    """Catches issue 38 defect 6: prompts_per_step left at the tiny 3 (Flow-GRPO: 48 groups), no beta or weight
    decay preset; and a value that names no source file and line (or function)."""
    values = presets.for_run(model, True, algo).values
    assert (FLUX_EPOCH, SD3_EPOCH, QWEN_EPOCH) == ((48, 6), (48, 2), (32, 2))  # the formulas, by hand
    for name, want in PUBLISHED[(model, algo)].items():
        assert values[name].value == want, (model, algo, name)
    for name in ("prompts_per_step", "beta", "weight_decay", "sample_batch_size", "eval_batch_size", "ema_repeats"):
        source = values[name].source
        assert any(f in source for f in (".py", ".sh", "pipelines", "(")), (name, source)


def test_full_fine_tuning_gets_its_own_learning_rate_and_the_tiny_pipelines_their_own():
    """Catches --no-lora taking the LoRA learning rate (Flow-GRPO's 3e-4 for adapters: full weights at that rate
    diverge): no Flow-GRPO recipe trains every weight, so the preset is DanceGRPO's full fine-tuning 1e-5."""
    full = presets.for_run("flux", True, "flow_grpo", lora=False).values["lr"]
    assert full.value == 1e-5 and "finetune_flux_grpo.sh line 36" in full.source
    assert presets.for_run("flux", True, "flow_grpo", lora=True).values["lr"].value == 3e-4
    cfg = config.resolve(config.parse_args(["--model", "sd3", "--pretrained", "x", "--no-lora"]))
    assert (cfg.lr, cfg.prompts_per_step, cfg.beta, cfg.weight_decay) == (1e-5, 48, 0.01, 1e-4)
    assert "full fine-tuning" in presets.describe(cfg)
    tiny = config.resolve(config.parse_args([]))
    assert (tiny.prompts_per_step, tiny.beta, tiny.weight_decay, tiny.sample_batch_size) == (3, 0.0, 0.0, 0)


def test_a_preset_sample_batch_size_fits_a_small_fragment_and_a_given_one_is_checked(tiny_cache):
    """Catches the published --sample-batch-size (FLUX: 3) refusing a small run that never set it: with
    --group-size 2 and one group per fragment (tools/gpu_session.sh's part d) validation said "3 does not divide
    a fragment's 2 trajectories" (found by rehearsing that part). An unset one becomes the largest divisor of the
    fragment at most the published value; one given on the command line is still refused when it does not divide."""
    args = ["--pretrained", models.tiny_pipeline_path("flux"), "--group-size", "2", "--prompts-per-step", "2"]
    cfg = config.resolve(config.parse_args(args))
    cli.validate(cfg, 2)
    assert cfg.sample_batch_size == 2
    six = config.resolve(config.parse_args([*args[:2], "--group-size", "6", "--prompts-per-step", "2"]))
    assert six.sample_batch_size == 3  # the published value where it divides
    five = config.resolve(config.parse_args([*args[:2], "--group-size", "5", "--prompts-per-step", "2"]))
    assert five.sample_batch_size == 1
    given = config.resolve(config.parse_args([*args, "--sample-batch-size", "3"]))
    with pytest.raises(ValueError, match="--sample-batch-size 3 does not divide a fragment's 2 trajectories"):
        cli.validate(given, 2)
