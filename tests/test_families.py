"""The Qwen-Image, Wan, HunyuanVideo and SD3.5 families: tiny offline pipelines of the real diffusers classes,
loaded through `models.load`, and the RL-facing calls (encode, noise, sigmas, velocity, decode, LoRA, CFG),
checked against the diffusers pipelines' own sampling loops."""
import shutil

import pytest
import torch

import grpo
import models
import rewards
import tsp
from conftest import trainable_state
from fragment import fragment_spec
from rollout import SamplingConfig, generate_fragment

pytestmark = pytest.mark.timeout(300)

FAMILIES = ["qwenimage", "wan", "hunyuanvideo", "sd3"]
CFG_FAMILIES = ["qwenimage", "wan", "sd3"]
IMAGE_FAMILIES = ["qwenimage", "sd3"]
PROMPTS = ["a red image", "a blue video of a cat"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> path of its tiny pipeline, built once per module into a temporary folder."""
    paths = {}

    def get(name):
        if name not in paths:
            path = tmp_path_factory.mktemp(name) / "pipeline"
            models.get_family(name).build_tiny(str(path), seed=0)
            paths[name] = str(path)
        return paths[name]

    return get


def test_family_flags():
    for name in FAMILIES:
        family = models.get_family(name)
        assert family.uses_true_cfg == (name in CFG_FAMILIES)
        assert family.is_video == (name not in IMAGE_FAMILIES)
        if family.is_video:
            assert (family.tiny_frames - 1) % 4 == 0  # the causal video VAEs compress time 4x after frame 0


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_pipeline_calls(name, built):
    policy = models.load(name, built(name))
    family = policy.family
    assert type(policy.pipe).__name__ == family.pipeline_class_name

    # Conditioning: batch first, fixed shapes whatever the prompt length (rows are cached and concatenated).
    both = policy.encode_prompts(PROMPTS)
    alone = [family.encode(policy.pipe, [p], policy.device, policy.max_sequence_length) for p in PROMPTS]
    assert set(both) == set(alone[0]) == set(alone[1])
    for key, value in both.items():
        assert value.shape[0] == 2 and alone[0][key].shape == alone[1][key].shape == value[:1].shape, key
        torch.testing.assert_close(value[1:], alone[1][key])  # batching does not change an encoding
    assert not torch.equal(both[next(iter(both))][0], both[next(iter(both))][1])  # the prompt reaches the encoding

    # Noise: deterministic from a CPU generator, in the transformer's layout.
    a, b = policy.noise(torch.Generator().manual_seed(0)), policy.noise(torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and tuple(a.shape) == policy.latent_shape()
    # [C, F', h, w] video, [C, h, w] SD3 (the transformer patchifies), [tokens, 4C] packed image
    assert len(a.shape) == (4 if family.is_video else 3 if name == "sd3" else 2)

    sigmas = policy.sigmas(4)
    assert sigmas.shape == (5,) and sigmas.dtype == torch.float32
    assert abs(float(sigmas[0]) - 1) < 1e-3 and float(sigmas[-1]) == 0 and bool((sigmas[1:] < sigmas[:-1]).all())

    x = torch.stack([a, policy.noise(torch.Generator().manual_seed(1))])  # [2, ...]
    v = policy.velocity(x, torch.tensor([1.0, 0.35]), both)  # mixed per-sample timesteps
    assert v.shape == x.shape and v.dtype == torch.float32 and bool(v.isfinite().all())
    # Per-sample timesteps really are per sample: each row equals that sample run alone.
    v1 = policy.velocity(x[1:], torch.tensor([0.35]), {k: t[1:] for k, t in both.items()})
    torch.testing.assert_close(v[1:], v1, rtol=1e-4, atol=1e-5)

    images = policy.decode(x)
    size = family.tiny_resolution
    expected = (2, family.tiny_frames, 3, size, size) if family.is_video else (2, 3, size, size)
    assert tuple(images.shape) == expected and images.dtype == torch.float32
    assert float(images.min()) >= 0 and float(images.max()) <= 1


@pytest.mark.parametrize("name", FAMILIES)
def test_velocity_reproduces_the_pipelines_own_sampling(name, built):
    """An Euler ODE loop over policy.velocity lands where the diffusers pipeline itself lands (same noise,
    same schedule): timestep convention, prompt encoding, noise layout and CFG all match the pipeline."""
    policy = models.load(name, built(name))
    pipe = policy.pipe
    steps, prompt, seed = 3, "a red image", 0
    kwargs = dict(prompt=[prompt], height=policy.height, width=policy.width, num_inference_steps=steps,
                  output_type="latent", generator=torch.Generator().manual_seed(seed))
    if name == "qwenimage":
        kwargs.update(negative_prompt=[""], true_cfg_scale=policy.guidance, max_sequence_length=policy.max_sequence_length)
    elif name == "sd3":  # true CFG with the "" negative prompt is the pipeline's default
        kwargs.update(guidance_scale=policy.guidance, max_sequence_length=policy.max_sequence_length)
    else:
        kwargs.update(guidance_scale=policy.guidance, num_frames=policy.frames, max_sequence_length=policy.max_sequence_length)
    out = pipe(**kwargs)
    target = out.images if name in IMAGE_FAMILIES else out.frames  # latents [1, ...]
    schedule = pipe.scheduler.sigmas.clone().float()  # the schedule the pipeline just used
    if name != "wan":  # Wan's tiny FlowMatchEuler is left at its own default inside WanPipeline (see wan.sigmas)
        torch.testing.assert_close(policy.sigmas(steps), schedule)
    x = policy.noise(torch.Generator().manual_seed(seed))[None]
    cond = policy.encode_prompts([prompt])
    for i in range(steps):
        x = x + (schedule[i + 1] - schedule[i]) * policy.velocity(x, schedule[i].expand(1), cond)
    torch.testing.assert_close(x, target.float(), rtol=1e-4, atol=1e-4)


def euler_and_pipeline(policy, prompt, steps, seed):
    """(an Euler ODE loop over policy.velocity, the family's diffusers pipeline's own latents (output_type="latent"),
    the schedule it used): FluxPipeline's packed [1, tokens, 4C], StableDiffusion3Pipeline's [1, C, h, w]."""
    pipe = policy.pipe
    target = pipe(prompt=[prompt], height=policy.height, width=policy.width, num_inference_steps=steps,
                  guidance_scale=policy.guidance, max_sequence_length=policy.max_sequence_length, output_type="latent",
                  generator=torch.Generator().manual_seed(seed)).images  # packed latents [1, tokens, 4C]
    schedule = pipe.scheduler.sigmas.clone().float()  # what the pipeline just used
    x = policy.noise(torch.Generator().manual_seed(seed))[None]
    cond = policy.encode_prompts([prompt])
    with torch.no_grad():
        for i in range(steps):
            x = x + (schedule[i + 1] - schedule[i]) * policy.velocity(x, schedule[i].expand(1), cond)
    return x, target.float(), schedule


@pytest.mark.parametrize("resolution", [32, 64])
def test_flux_velocity_reproduces_flux_pipelines_own_sampling(tiny_cache, resolution):
    """FLUX, the default model, against FluxPipeline: an Euler loop over policy.velocity lands where
    FluxPipeline(output_type="latent") lands, from the same noise, at two resolutions (the scheduler's shift
    depends on the token count, so the schedule differs) and two guidance scales (the embedded guidance reaches
    the transformer). Catches: the timestep passed as t instead of t/1000 (= sigma), the guidance dropped or
    mis-scaled, noise drawn in another layout than prepare_latents' (packed 2x2 tokens), image ids of another
    grid, a schedule without the resolution-dependent shift, the pooled and sequence embeddings swapped."""
    steps, prompt, seed = 3, "a red image", 0
    policy = models.load("flux", models.tiny_pipeline_path("flux"), height=resolution)
    torch.testing.assert_close(policy.sigmas(steps), euler_and_pipeline(policy, prompt, steps, seed)[2])
    landed = {}
    for guidance in (3.5, 5.0):
        policy.guidance = guidance
        x, target, _ = euler_and_pipeline(policy, prompt, steps, seed)
        torch.testing.assert_close(x, target, rtol=1e-4, atol=1e-4)
        landed[guidance] = x
    assert float((landed[3.5] - landed[5.0]).abs().max()) > 1e-3  # the guidance scale changes where it lands
    if resolution == 64:  # the shift grows with the token count: a schedule of its own
        small = models.load("flux", models.tiny_pipeline_path("flux"), height=32)
        assert float((small.sigmas(steps) - policy.sigmas(steps)).abs().max()) > 1e-3


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_starts_as_the_reference(name, built):
    policy = models.load(name, built(name))
    x = torch.stack([policy.noise(torch.Generator().manual_seed(s)) for s in (0, 1)])
    sigma, cond = torch.tensor([0.9, 0.5]), policy.encode_prompts(PROMPTS)
    before = policy.velocity(x, sigma, cond)
    assert not any(p.requires_grad for p in policy.transformer.parameters())
    models.add_lora(policy, 4, 4)
    trainable = trainable_state(policy.transformer)
    assert trainable and all("lora" in n for n in trainable)
    with torch.no_grad():
        torch.testing.assert_close(policy.velocity(x, sigma, cond), before)  # B = 0 at init
        with policy.reference() as ref:
            torch.testing.assert_close(policy.velocity(x, sigma, cond, transformer=ref), before)


@pytest.mark.parametrize("name", CFG_FAMILIES)
def test_true_cfg_runs_in_one_batch(name, built):
    policy = models.load(name, built(name))
    assert policy.negative_cond is not None and all(v.shape[0] == 1 for v in policy.negative_cond.values())
    x = torch.stack([policy.noise(torch.Generator().manual_seed(s)) for s in (0, 1)])
    sigma, cond = torch.tensor([0.8, 0.3]), policy.encode_prompts(PROMPTS)
    calls = []
    hook = policy.transformer.register_forward_hook(lambda mod, args, kwargs_out: calls.append(1))
    try:
        policy.guidance = 4.0
        guided = policy.velocity(x, sigma, cond)
    finally:
        hook.remove()
    assert len(calls) == 1  # conditional and unconditional branches in one transformer call
    policy.guidance = 1.0
    plain = policy.velocity(x, sigma, cond)
    assert not torch.allclose(guided, plain)
    assert bool(guided.isfinite().all())


@pytest.mark.parametrize("name", CFG_FAMILIES)
def test_training_velocity_reproduces_the_rollout(name, built):
    """The trainer's second velocity call and scoring of the rollout's own samples give its log-probs:
    ratio exactly 1 for the rollout's batch composition, and packed mixed timesteps agree closely."""
    policy = models.load(name, built(name))
    models.enable_full_training(policy)
    prompts = rewards.color_prompts("train")
    spec = fragment_spec(seed=0, step=0, first_group=0, num_groups=1, num_prompts_total=len(prompts),
                         groups_per_step=1, group_size=2)
    cfg = SamplingConfig(num_steps=3, noise_level=0.7)
    reward = rewards.build_reward("color,temporal_consistency=0.5" if policy.family.is_video else "color")
    fragment = generate_fragment(policy, spec, prompts, cfg, reward, version=0, producer=0)
    m, t_train = fragment.latents.shape[:2]
    for pack in tsp.per_timestep_packs(m, t_train):  # the rollout's own batches: bitwise the same
        batch = tsp.gather_pairs(fragment, pack)
        v = policy.velocity(batch["latents"], batch["sigma"], batch["cond"])  # grad on, as in training
        _, logp, _, _ = grpo.sde_step_with_logprob(v, batch["latents"], batch["sigma"], batch["sigma_next"],
                                                   cfg.noise_level, prev_sample=batch["next_latents"])
        assert torch.equal(torch.exp(logp.detach() - batch["old_log_prob"]), torch.ones(len(pack)))
    pairs = [(i, j) for i in range(m) for j in range(t_train)]  # one pack, mixed timesteps (TSP)
    batch = tsp.gather_pairs(fragment, pairs)
    assert len(set(batch["sigma"].tolist())) > 1
    with torch.no_grad():
        v = policy.velocity(batch["latents"], batch["sigma"], batch["cond"])
    _, logp, _, _ = grpo.sde_step_with_logprob(v, batch["latents"], batch["sigma"], batch["sigma_next"],
                                               cfg.noise_level, prev_sample=batch["next_latents"])
    torch.testing.assert_close(logp, batch["old_log_prob"], rtol=0, atol=1e-5)


def test_wan_sigmas_match_released_unipc_scheduler(built):
    """Released Wan checkpoints ship UniPC with flow sigmas; the tiny one FlowMatchEuler(shift): same schedule."""
    from diffusers import UniPCMultistepScheduler

    policy = models.load("wan", built("wan"))
    tiny = policy.sigmas(4)
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    unipc.set_timesteps(4)  # what WanPipeline does with a released checkpoint
    policy.pipe.scheduler = unipc
    torch.testing.assert_close(policy.sigmas(4), unipc.sigmas.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(tiny, unipc.sigmas.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["qwenimage", "hunyuanvideo"])
def test_template_prefix_is_exactly_the_cropped_tokens(name, built):
    """The pipelines drop a fixed number of template tokens; the tiny tokenizer spends exactly that many."""
    policy = models.load(name, built(name))
    pipe = policy.pipe
    if name == "qwenimage":
        template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    else:
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        template, drop = DEFAULT_PROMPT_TEMPLATE["template"], DEFAULT_PROMPT_TEMPLATE["crop_start"]
    assert len(pipe.tokenizer(template.split("{}")[0])["input_ids"]) == drop
    with_prompt = pipe.tokenizer(template.format("a red image"))["input_ids"]
    assert pipe.tokenizer.decode(with_prompt[drop:]).startswith("a red image")


@pytest.mark.parametrize("name", FAMILIES)
def test_missing_component_is_named(name, built, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(built(name), broken)
    shutil.rmtree(broken / "text_encoder")
    with pytest.raises(FileNotFoundError, match="'text_encoder'"):
        models.load(name, str(broken))


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        models.get_family("nope")
    for name in ("flux", "hunyuanvideo", "qwenimage", "wan", "sd3"):
        assert name in str(err.value)
