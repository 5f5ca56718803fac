"""Running main.run_rank for the rehearsed ranks, each a thread of this process.

What a rank runs is the program's own code: main.run_rank, its rollout_rank / trainer_rank, the
mechanisms' loops, bookkeeping's evaluation, checkpoint, resume, async_policy.Publisher's publish and
transport's bytes. What the rehearsal puts in its place, each at the seam where a real run meets
hardware or the outside:
- runtime.device_of: the stand-in GPU "gpu:N" (fake_gpu.py), bf16 as on CUDA;
- runtime.connect: an in-process store (HashStore), the process groups of groups.py, no liveness
  watchdog (the rehearsal watches for a deadlock itself), no signal handling;
- models.load: the released pipeline without weights (pipeline.py); runtime.load_policy's result is
  moved onto the stand-in GPU after LoRA / full training / checkpointing are applied;
- rewards.build_reward: a reward of the prompts (values real, no reward model);
- the checkpoint's torch.save / torch.load and the LoRA file: kept in memory (`Disk`), what a save
  writes is counted; the evaluation's image grids are not drawn (fake images have no pixels);
- TAG's decision (tag.Assistant.consider): scripted, one group inside step 0 when every trainer
  is rehearsed, none otherwise (its predictor reads wall-clock times, which mean nothing here);
- the queue's and TAG's poll intervals: 50 ms (a 1 ms busy poll in three threads on 2 CPUs slows
  the ranks it waits for).
Threads a rank starts (the weight mailbox, the fragment sender) join its context: its world, its
FakeTensorMode, its holdings.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from tools.rehearsal import fake_gpu, groups, pipeline, replay, tensors

_local = threading.local()


@dataclasses.dataclass
class Job:
    """One rehearsed job (the run, then its resume): what its ranks share."""

    cfg: object  # config.Config
    world: int
    positions: list[groups.Position]
    exchange: groups.Exchange
    store: dist.Store
    disk: "Disk"
    depth: float = 1.0
    replay: bool = True
    tag_claims: bool = False  # every trainer rehearsed: TAG may claim (scripted)
    tag_claimed: bool = False
    bf16_adapters: bool = False  # only to compare with a profile measured so (rehearse.py)
    verbose: bool = True  # a line per phase a rank enters (generate, train, eval, ...)


@dataclasses.dataclass
class RankContext:
    job: Job
    position: groups.Position
    holdings: tensors.Holdings
    mode: tensors.RealSmallMode
    replay: replay.Replay
    main_thread: int
    world: object = None  # the thread's torch.distributed world, shared with its threads
    error: str | None = None
    result: object = None


def context() -> RankContext | None:
    return getattr(_local, "ctx", None)


class Disk:
    """What the rehearsed jobs "write": a checkpoint's state (fake tensors as their shapes, real
    values as they are) by path, and the bytes each write would take."""

    def __init__(self):
        self.files: dict[str, object] = {}
        self.written: collections.Counter = collections.Counter()  # rank -> bytes

    @staticmethod
    def key(path) -> str:
        return str(path).replace(".partial", "")

    def save_streamed(self, state, path, produce, on_write=None) -> None:
        """checkpoint_file.save's walk: each Deferred produced (a gather under FSDP, the whole
        tensor on the host), its bytes "written", let go before the next, as the real file does."""
        from infra import checkpoint_file

        saved = {}
        for deferred in checkpoint_file.deferred_order(state):
            tensor = produce(deferred)
            if tuple(tensor.shape) != tuple(deferred.shape) or tensor.dtype != deferred.dtype or \
                    tensor.device.type != "cpu":
                raise ValueError(f"produced a {tensor.dtype} {tuple(tensor.shape)} tensor on "
                                 f"{tensor.device} for {deferred!r}")
            saved[id(deferred)] = _Saved(tuple(deferred.shape), deferred.dtype)
            del tensor
            if on_write is not None:  # progress per tensor written, as checkpoint_file.save reports
                on_write()
        whole = checkpoint_file.filled(state, saved)

        def shape(v):
            return _Saved(tuple(v.shape), v.dtype) if isinstance(v, FakeTensor) else v
        self.files[self.key(path)] = pytree.tree_map(shape, whole)
        ctx = context()
        nbytes = sum(d.nbytes for d in checkpoint_file.deferred_order(state)) + sum(
            t.numel() * t.element_size() for t in pytree.tree_leaves(state)
            if isinstance(t, torch.Tensor))
        self.written[ctx.position.rank if ctx else -1] += nbytes
        with open(path, "wb") as f:  # the file must exist (fsync, rename, listing)
            f.write(b"rehearsal placeholder")

    def load(self, path):
        """Memory-mapped as rundir.load_state asks: file-backed pages are no anonymous memory, so
        the tensors are not counted until the rank copies them."""
        ctx = context()
        with ctx.holdings.apart() if ctx else contextlib.nullcontext():
            return pytree.tree_map(lambda v: torch.empty(v.shape, dtype=v.dtype)
                                   if isinstance(v, _Saved) else v, self.files[self.key(path)])


@dataclasses.dataclass(frozen=True)
class _Saved:
    """A fake tensor in a saved checkpoint: its shape and dtype."""

    shape: tuple
    dtype: torch.dtype


# --- the seams ------------------------------------------------------------------------------------
def _device_of(cfg, local_rank: int):
    """Every rank on stand-in device 0 (each is a thread with tensors of its own; autograd's engine
    knows one stand-in device)."""
    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    return f"{fake_gpu.NAME}:0", dtype


class _NoWatch:
    """runtime.shutdown's watchdog calls (the rehearsal watches for a deadlock itself)."""

    def finishing(self):
        pass

    def stop(self):
        pass

    def name_the_dead(self, error):
        pass


class _NoPreemption:
    """No signal handling in a thread; a SIGTERM stop is not rehearsed."""

    def stop_asked(self) -> bool:
        return False

    def finish(self, leader: bool) -> None:
        pass

    def absorb(self, error) -> None:
        pass

    def close(self) -> None:
        pass


def _connect(cfg, rank, world, local_rank, master, agent_store, report_silent, device, roles,
             store=None):
    from infra import runtime
    from infra.progress import Progress

    from infra.jobstore import SignedStore

    ctx = context()
    store = SignedStore(ctx.job.store, b"rehearsal job key")  # the job's store, sealed as in a run
    dist.init_process_group(groups.WORLD, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world)
    ctx.world = groups.thread_world()
    progress = Progress()
    progress.main_ident = threading.get_ident()
    return runtime.Job(store, _NoWatch(), progress, _NoPreemption())


def _load(name, path, device="cpu", dtype=torch.float32, height=None, width=None, frames=None,
          max_sequence_length=512, guidance=None, prompt_cache_size=64):
    import models

    ctx = context()
    family = models.get_family(name)
    transformer = pipeline.build_transformer(name, ctx.job.depth)
    vae = pipeline.build_vae(name)
    with ctx.mode:  # (load_policy runs outside it, on the meta device)
        pipeline.to_device(vae, device)
        pipe = pipeline.stub_pipe(name, transformer, vae, device, dtype)
        return models.Policy(family, pipe, device, dtype, height or family.tiny_resolution,
                             width or height or family.tiny_resolution,
                             frames or family.tiny_frames, max_sequence_length, guidance,
                             prompt_cache_size)


def _load_policy(original, cfg, device, dtype, groups_, progress):
    """runtime.load_policy on the meta device (peft puts its adapters beside the base weights),
    then every weight onto the stand-in GPU."""
    from torch.utils._python_dispatch import _disable_current_modes

    ctx = context()
    with ctx.holdings.opened("load"):
        with _disable_current_modes(), torch.device("meta"):
            policy = original(cfg, device, dtype, groups_, progress)
            if ctx.job.bf16_adapters and cfg.lora:
                for p in policy.transformer.parameters():
                    if p.requires_grad:
                        p.data = p.data.to(torch.bfloat16)
        pipeline.to_device(policy.transformer, device)
    return policy


def _reward(spec, options=None, probe=None):
    """A reward of the prompts only: real values, varied within a group, no model."""
    from rewards.checked import CombinedReward

    def rehearsal(images, prompts):
        n = images.shape[0]  # [B, ...]: fake images have shapes
        base = torch.tensor([(sum(map(ord, p)) % 97) / 97.0 for p in prompts])  # [B]
        return base + torch.linspace(0.0, 1.0, n)
    return CombinedReward({"rehearsal": rehearsal}, {"rehearsal": 1.0})


def _consider(self, step, samples_done, before_publish=False):
    """TAG's decision, scripted: one group of step 0, claimed inside the step, when every trainer
    is rehearsed (a share generated by a stand-in trainer would be data no rehearsed rank has)."""
    job = context().job
    if not job.tag_claims or job.tag_claimed or before_publish or step != 0:
        return False
    g = max(self.group_size, 1)
    claimed = self.claim(step, g)
    if claimed is None:
        return False
    job.tag_claimed = True
    first, count, *_ = claimed
    self.pending[step].append((first * g, (first + count) * g))
    self.taken[step] += count * g
    return True


COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather", "barrier")


def _recording(name, original):
    """dist.<collective>: compute-plane calls recorded and checked (groups.record_compute)."""
    def call(*args, **kwargs):
        ctx = context()
        group = kwargs.get("group")
        if ctx is not None and group is not None and dist.get_backend(group) == groups.COMPUTE:
            tensors_ = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors_ += [t for a in args if isinstance(a, list) for t in a
                         if isinstance(t, torch.Tensor)]
            groups.record_compute(ctx.job.exchange, ctx.position.rank, ctx.main_thread, name,
                                  tensors_)
        return original(*args, **kwargs)
    return call


def _plain(original):
    """dist.*_object: pickled objects as real byte tensors (under the rank's FakeTensorMode torch
    makes their storage meta): the rehearsal's mode stays out of them."""
    from torch.utils._python_dispatch import _disable_current_modes

    def call(*args, **kwargs):
        ctx = context()
        if ctx is None:
            with _disable_current_modes():
                return original(*args, **kwargs)
        # fake tensors in the object (the evaluation's grid images) travel as their shapes; their
        # bytes are counted as the pickle would carry them
        moved = [0]
        args = [_as_shapes(a, moved) for a in args]
        kwargs = {k: _as_shapes(v, moved) for k, v in kwargs.items()}
        if moved[0]:
            ctx.job.exchange.count(ctx.position.rank, "data", "objects' tensors", moved[0])
        with _disable_current_modes():
            out = original(*args, **kwargs)
        for a in (*args, *kwargs.values()):
            if isinstance(a, list):
                a[:] = [_from_shapes(v) for v in a]
        return out
    return call


@dataclasses.dataclass(frozen=True)
class _Shape:
    """A fake tensor inside a pickled object: what it is, not its (absent) bytes."""

    shape: tuple
    dtype: torch.dtype
    device: str


def _as_shapes(value, moved: list):
    """`value` with fake tensors as _Shape (lists changed in place: object lists are in-out)."""
    def one(v):
        if isinstance(v, FakeTensor):
            moved[0] += v.numel() * v.element_size()
            return _Shape(tuple(v.shape), v.dtype, str(v.device))
        return v
    if isinstance(value, list):
        value[:] = [pytree.tree_map(one, v) for v in value]
        return value
    return pytree.tree_map(one, value)


def _from_shapes(value):
    """_Shape back to a fake tensor of this rank (the caller's FakeTensorMode is current)."""
    return pytree.tree_map(lambda v: torch.empty(v.shape, dtype=v.dtype, device=v.device)
                           if isinstance(v, _Shape) else v, value)


def _functional_collective(func, args) -> None:
    """_c10d_functional ops (DTensor's full_tensor, its norms): the compute plane."""
    ctx = context()
    if ctx is not None and func.namespace == "_c10d_functional" and "wait" not in func.__name__:
        groups.record_compute(ctx.job.exchange, ctx.position.rank, ctx.main_thread,
                              func.__name__, [a for a in args if isinstance(a, torch.Tensor)])


SHOWN = {"generate", "tag", "train", "eval", "checkpoint", "publish", "optimizer"}


def _inside_enter(original, self):
    out = original(self)
    ctx = context()
    if ctx is not None:
        ctx.holdings.open(self.name)
        if self.name in SHOWN and ctx.job.verbose:  # the rehearsal moves: say where
            print(f"[rehearse] {time.strftime('%H:%M:%S')} rank {ctx.position.rank} "
                  f"({ctx.position.role}): {self.name} (step {self.step})", file=sys.stderr,
                  flush=True)
    return out


def _inside_exit(original, self, *exc):
    ctx = context()
    if ctx is not None:
        ctx.holdings.close(self.name)
    return original(self, *exc)


def _thread_start(original, self):
    """A thread a rank starts shares its context, world and FakeTensorMode."""
    ctx = context()
    if ctx is not None and not getattr(self, "_rehearsal_joined", False):
        run = self.run

        def run_in_context():
            _local.ctx = ctx
            groups.set_thread_world(ctx.world)
            with ctx.mode, ctx.holdings.opened(f"thread {self.name}"):
                run()
        self.run, self._rehearsal_joined = run_in_context, True
    return original(self)


_installed: list = []


def install() -> None:
    """The seams above, once per process (they act only on threads with a rank context)."""
    if _installed:
        return
    fake_gpu.install()  # first: F.scaled_dot_product_attention is looked up at each call, but early
    import gap
    import models
    import rewards
    import tag
    from infra import evaluation, progress, rundir, runtime
    from trainer import Trainer

    runtime.device_of, runtime.connect = _device_of, _connect
    runtime.name_process = lambda name: None  # a thread would rename the whole process
    runtime.load_policy = functools.partial(_load_policy, runtime.load_policy)
    models.load, rewards.build_reward = _load, _reward
    evaluation.save_panels = lambda *args, **kwargs: None  # fake images have no pixels to draw
    _patch_eval_gather(evaluation)
    groups.holdings_of = lambda: context().holdings if context() is not None else None
    tag.Assistant.consider = _consider
    _patch_init(gap.FragmentQueue, poll_s=0.05)
    _patch_init(tag.Assistant, poll_s=0.05)
    _patch_io(rundir)
    import main
    from infra import bookkeeping
    main.shard_for_fsdp = _in_phase("shard", main.shard_for_fsdp)
    bookkeeping.resume = _in_phase("resume", bookkeeping.resume)
    runtime.shutdown = _in_phase("shutdown", runtime.shutdown)
    for name in COLLECTIVES:
        setattr(dist, name, _recording(name, getattr(dist, name)))
    for name in ("all_gather_object", "gather_object", "broadcast_object_list"):
        setattr(dist, name, _plain(getattr(dist, name)))
    enter, exit_ = progress._Inside.__enter__, progress._Inside.__exit__
    progress._Inside.__enter__ = lambda self: _inside_enter(enter, self)
    progress._Inside.__exit__ = lambda self, *exc: _inside_exit(exit_, self, *exc)
    start = threading.Thread.start
    threading.Thread.start = lambda self: _thread_start(start, self)
    resize = torch.UntypedStorage.resize_

    def resize_(storage, size):  # FSDP2 frees and refills unsharded parameters so: count it
        out = resize(storage, size)
        ctx = context()
        if ctx is not None:
            ctx.holdings.resized(storage, storage.nbytes())
        return out
    torch.UntypedStorage.resize_ = resize_
    replay.install(models.FAMILIES.values(), Trainer,
                   lambda: context().replay if context() is not None else None)
    _installed.append(True)


def _patch_eval_gather(evaluation) -> None:
    """The evaluation's gather over the trainers (bookkeeping's all_gather_object, run as is): a
    stand-in trainer's part arrives as a copy of the rehearsed rank's (its data is no rehearsed
    rank's), so it is replaced by what that rank sends: its own share of the samples (real
    rewards: the rehearsed rank's first, repeated) and its grid images (fake, the same shape)."""
    from rollout import eval_samples

    original = evaluation.Evaluator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.gather is None:
            return
        gather, evaluator = self.gather, self

        def gather_parts(mine):
            parts = gather(mine)
            n = len(eval_samples(len(evaluator.prompts) + len(evaluator.heldout), evaluator.seeds))
            shown = len(evaluator._grid_prompts()) * evaluator.seeds
            template = next((image for _, _, images in parts for image in images.values()), None)
            if template is None:  # the rehearsed rank's share has no grid image (more ranks than
                import models  # samples): one of the decode's shape, [3, H, W] or [F, 3, H, W]
                cfg = context().job.cfg
                h, w = cfg.resolution, cfg.width or cfg.resolution
                shape = (cfg.frames, 3, h, w) if models.get_family(cfg.model).is_video else (3, h, w)
                template = torch.empty(shape, dtype=torch.uint8)
            value = next((v for _, values, _ in parts for v in values), 0.0)
            out = []
            for index, part in enumerate(parts):
                lo, hi = evaluation.share_of(n, index, len(parts))
                if part[0] != lo or len(part[1]) != hi - lo:  # a stand-in's copy
                    part = (lo, [value] * (hi - lo), {i: torch.empty_like(template)
                                                      for i in range(lo, min(hi, shown))})
                out.append(part)
            return out
        self.gather = gather_parts
    evaluation.Evaluator.__init__ = init


def _in_phase(name: str, original):
    """A part of a rank's life with no tracing span of its own, as a phase of the report."""
    def call(*args, **kwargs):
        ctx = context()
        with ctx.holdings.opened(name) if ctx is not None else contextlib.nullcontext():
            return original(*args, **kwargs)
    return call


def _patch_init(cls, **values) -> None:
    original = cls.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for name, value in values.items():
            setattr(self, name, value)
    cls.__init__ = init


def _patch_io(rundir) -> None:
    """The checkpoint's file (infra/checkpoint_file.save, streamed: each Deferred produced, written
    and let go in turn) kept in `Disk`; torch.load of a file there reads it back; the LoRA file's
    bytes counted."""
    from infra import checkpoint_file

    original_save, original_load = checkpoint_file.save, torch.load

    def save(state, path, produce, *args, **kwargs):
        ctx = context()
        if ctx is None:
            return original_save(state, path, produce, *args, **kwargs)
        return ctx.job.disk.save_streamed(state, path, produce, *args, **kwargs)

    def load(f, *args, **kwargs):
        ctx = context()
        if ctx is not None and Disk.key(f) in ctx.job.disk.files:
            return ctx.job.disk.load(f)
        return original_load(f, *args, **kwargs)
    checkpoint_file.save, torch.load = save, load
    checkpoint = rundir.RunDir.save_checkpoint

    def save_checkpoint(self, step, state, produce=None, lora_layers=None, pipeline_class=None,
                        *args, **kwargs):
        return checkpoint(self, step, state, produce, lora_layers,
                          _LoraFile if pipeline_class is not None else None, *args, **kwargs)
    rundir.RunDir.save_checkpoint = save_checkpoint


class _LoraFile:
    """The pipeline class's save_lora_weights for a rehearsal: the file's bytes counted."""

    @staticmethod
    def save_lora_weights(path, transformer_lora_layers=None, **kwargs):
        ctx = context()
        nbytes = sum(t.numel() * t.element_size() for t in (transformer_lora_layers or {}).values())
        ctx.job.disk.written[ctx.position.rank] += nbytes
        with open(os.path.join(path, "pytorch_lora_weights.safetensors"), "wb") as f:
            f.write(b"rehearsal placeholder")


# --- one rank -------------------------------------------------------------------------------------
def run(job: Job, position: groups.Position) -> RankContext:
    """main.run_rank for `position`, in this thread (the caller starts one thread per position)."""
    import dataclasses as dc

    import main

    holdings = tensors.Holdings(f"rank {position.rank}")
    mode = tensors.RealSmallMode(holdings)
    mode.on_collective = _functional_collective
    mode.on_activity = job.exchange.moved
    ctx = RankContext(job, position, holdings, mode,
                      replay.Replay(holdings, job.exchange.compute_log[position.rank], job.replay),
                      threading.get_ident())
    _local.ctx = ctx
    try:
        with mode:
            ctx.result = main.run_rank(dc.asdict(job.cfg), position.rank, job.world,
                                       position.rank % 8, ("rehearsal", 0), agent_store=False)
    except BaseException as error:  # noqa: BLE001  (reported as the rehearsal's finding)
        ctx.error = "".join(traceback.format_exception(error))
        job.exchange.fail(error)
    return ctx


def run_job(job: Job, stall_s: float = groups.STALL_S) -> dict[int, RankContext]:
    """Every position of `job` in a thread of its own; returns their contexts once all ended (or
    one failed, or none moved for `stall_s` while waiting: a deadlock, each thread's stack kept)."""
    results: dict[int, RankContext] = {}
    job.exchange.phase_of = lambda: context().holdings.innermost() if context() else "outside"

    def body(position):
        results[position.rank] = run(job, position)

    threads = [threading.Thread(target=body, args=(p,), name=f"rank{p.rank}", daemon=True)
               for p in job.positions]
    with tensors.sharding_propagation_apart():  # DTensor's shape inference holds no GPU memory
        for t in threads:
            t.start()
        _watch(job, threads, stall_s)
    return results


def _watch(job: Job, threads: list[threading.Thread], stall_s: float) -> None:
    """Until every rank's thread ended, one failed or none moved for `stall_s` (a deadlock)."""
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        if job.exchange.failed is not None:
            break
        if time.monotonic() - job.exchange.last_move > stall_s:
            stacks = {t.name: "".join(traceback.format_stack(
                sys._current_frames()[t.ident])) for t in threads if t.is_alive()}
            job.exchange.fail(groups.RehearsalError(
                f"no rehearsed rank moved for {stall_s:.0f} s: a deadlock. Waiting: "
                f"{dict(job.exchange.waiting)}\n" + "\n".join(f"--- {n}\n{s}"
                                                            for n, s in stacks.items())))
            break
    for t in threads:
        t.join(timeout=5.0 if job.exchange.failed is not None else None)
