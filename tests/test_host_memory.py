"""Host memory per rank (issue 38 item 8): the leader's checkpoint is streamed tensor by tensor into torch.save's own
file, a rollout rank receives every publish into the same buffers, and fp32 masters are made from the FSDP shards.

Each is checked against a reference beside it (torch.save of the whole state; new buffers per publish; masters made
before sharding: tests/test_memory.py's 2-rank FSDP test) and by counting the host storages it allocates
(tests/host_bytes.py), single-process where the code allows; one 3-rank run of main.py's own wiring counts all
three at once, where they happen in a real run.
"""
import dataclasses
import json
import os
import random
import threading
import weakref
import zipfile

import pytest
import torch

import async_policy
import stall_matrix
import transport
from host_bytes import NewStorages
from infra import checkpoint_file, rundir
from infra.checkpoint_file import Deferred

pytestmark = pytest.mark.timeout(300)


# --- the streamed checkpoint file ------------------------------------------------------------------------------
def _a_state():
    """A state with what a checkpoint holds: fp32 and bf16 tensors, a 0-dim AdamW step, an empty tensor, int64,
    two views of one storage, Python's RNG state (a tuple of ints), nested dicts, lists and tuples."""
    torch.manual_seed(0)
    shared = torch.randn(6)
    return {"weights": {"w": torch.randn(5, 7), "b": torch.randn(3).to(torch.bfloat16), "e": torch.empty(0, 4),
                        "i": torch.arange(12).view(3, 4)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 7)}},
                          "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.999)}]},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "views": [shared, shared[2:4]], "step": 7, "config": {"model": "flux"}}


def _deferred_like(state):
    """The same state with every tensor of 1+ dimensions deferred (its value as its source), except the two views
    of one storage: they stay tensors, written as torch.save writes them (one record)."""
    if isinstance(state, torch.Tensor) and state.ndim:
        return Deferred(state.shape, state.dtype, state)
    if isinstance(state, dict):
        return {k: (v if k == "views" else _deferred_like(v)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_deferred_like(v) for v in state)
    return state


def _same(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_the_streamed_file_is_torch_saves_file_and_holds_one_tensor_at_a_time(tmp_path):
    """Catches a streamed checkpoint that torch.load (or older code, which torch.load'ed torch.save's file) cannot
    read, or that reads back other values, and a writer that keeps the tensors it was given (the whole state on
    the host again): the file is torch.save's for the same state, record for record and byte for byte; produce is
    asked for each Deferred once, in deferred_order, and every tensor it made is freed before the next is asked."""
    state = _a_state()
    torch.save(state, tmp_path / "reference.pt")
    streamed = _deferred_like(state)
    order = checkpoint_file.deferred_order(streamed)
    assert len(order) == 6  # w, b, e, i, exp_avg, the torch RNG state
    asked, previous = [], []

    def produce(d):
        assert not previous or previous[-1]() is None, "the last tensor produced is still alive"
        asked.append(d)
        made = d.source.clone()  # a new tensor, as a gather makes: only the writer may hold it
        previous.append(weakref.ref(made))
        return made

    checkpoint_file.save(streamed, str(tmp_path / "streamed.pt"), produce)
    assert asked == order
    ours, theirs = zipfile.ZipFile(tmp_path / "streamed.pt"), zipfile.ZipFile(tmp_path / "reference.pt")
    names = [i.filename.split("/", 1)[1] for i in theirs.infolist()]
    assert [i.filename.split("/", 1)[1] for i in ours.infolist()] == names
    for a, b in zip(ours.infolist(), theirs.infolist()):  # the same records at the same offsets (mmap-aligned)
        assert (a.header_offset, a.file_size) == (b.header_offset, b.file_size), a.filename
        assert ours.read(a.filename) == theirs.read(b.filename) or a.filename.endswith("serialization_id")
    loaded = torch.load(tmp_path / "streamed.pt", mmap=True, weights_only=True)
    _same(loaded, state)  # every value, dtype and container
    shared, view = loaded["views"]
    assert view.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()  # still one storage

    with pytest.raises(ValueError, match=r"produced a torch.float32 \(7, 5\) tensor .* Deferred\(\(5, 7\)"):
        checkpoint_file.save(streamed, str(tmp_path / "bad.pt"), lambda d: d.source.t() if d.shape == (5, 7)
                             else d.source)


def test_a_save_that_fails_mid_stream_leaves_the_last_checkpoint_the_latest(tmp_path):
    """Catches a streamed save that leaves a half-written checkpoint where --resume would take it: a gather
    failing at the third tensor (a peer died) removes step 2's .partial folder and leaves step 1 the latest."""
    run = rundir.RunDir(str(tmp_path / "run"), "{}")
    state = {**_deferred_like(_a_state()), "step": 1, "identity": {}}
    run.save_checkpoint(1, state, lambda d: d.source)
    asked = []

    def failing(d):
        asked.append(d)
        if len(asked) == 3:
            raise ConnectionResetError("injected: a peer died mid-gather")
        return d.source

    with pytest.raises(ConnectionResetError):
        run.save_checkpoint(2, {**state, "step": 2}, failing)
    assert [os.path.basename(c) for c in rundir.list_checkpoints(run.path)] == ["step_000001"]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_000001"]  # the cut one removed
    assert rundir.check_resume(run.path, type("Cfg", (), {f: None for f in rundir.IDENTITY_FIELDS})) \
        .endswith("step_000001")


# --- the rollout's receive buffers ------------------------------------------------------------------------------
class Wire:
    """dist.broadcast in one process: the publisher's broadcasts are recorded, then replayed to a receiver."""

    def __init__(self, monkeypatch):
        self.sent: list[torch.Tensor] = []
        self.replay = None
        monkeypatch.setattr(transport.dist, "broadcast", self.broadcast)

    def broadcast(self, t, src, group):
        if self.replay is None:
            self.sent.append(t.clone())
        else:
            t.copy_(next(self.replay))

    def publish(self, weights, version, bucket_bytes):
        self.replay, self.sent = None, []
        transport.publish_weights(iter(weights), len(weights), version, src=0, group=None, bucket_bytes=bucket_bytes)
        self.replay = iter(self.sent)


def test_a_rollout_rank_receives_every_publish_into_the_same_buffers(monkeypatch):
    """Catches a fresh host copy of the weights per publish (24 GB for FLUX.1-dev, 8 rollout ranks a node): three
    publishes into transport.WeightReceiver allocate one copy in all, returned in the same storages every time,
    with the values the new-buffers reference (transport.receive_weights) returns, which allocates three."""
    wire = Wire(monkeypatch)
    shapes = [(torch.Size([3]), torch.float32), (torch.Size([2, 2]), torch.bfloat16), (torch.Size([10]), torch.float32),
              (torch.Size([]), torch.float32)]
    one_copy = sum(s.numel() * d.itemsize for s, d in shapes)
    header = 2 * 8  # (version, count) as int64, received before each publish
    receiver = transport.WeightReceiver(0, None, shapes, bucket_bytes=20)
    pointers, versions, allocated = [], [], {"reused": 0, "new": 0}
    for version in (1, 2, 3):
        published = [torch.full(s, float(version), dtype=d) for s, d in shapes]
        wire.publish(published, version, bucket_bytes=20)
        with NewStorages() as seen:
            got_version, got = receiver(begin=versions.append)
        allocated["reused"] += seen.allocated
        assert got_version == version and all(torch.equal(g, p) for g, p in zip(got, published))
        pointers.append([g.data_ptr() for g in got])
        wire.replay = iter(wire.sent)
        with NewStorages() as seen:
            _, reference = transport.receive_weights(0, None, shapes, bucket_bytes=20)
        allocated["new"] += seen.allocated
        assert all(torch.equal(g, r) for g, r in zip(got, reference))
    assert versions == [1, 2, 3]  # begin(version) before each publish's weights are written
    assert pointers[0] == pointers[1] == pointers[2]
    assert allocated == {"reused": one_copy + 3 * header, "new": 3 * one_copy + 3 * header}, allocated


class ScriptedPublish:
    """A receive for transport.Mailbox over persistent buffers, paced by the test: publish v waits for go[v], calls
    begin(v) (then sets begun[v]), writes the first buffer, waits for `resume` if v is `pause_at`, writes the rest.
    After `last` it sends async_policy.STOP."""

    def __init__(self, n: int, last: int):
        self.buffers = [torch.zeros(4) for _ in range(n)]
        self.go = [threading.Event() for _ in range(last + 2)]
        self.begun = [threading.Event() for _ in range(last + 2)]
        self.halfway, self.resume = threading.Event(), threading.Event()
        self.pause_at, self.last, self.version = None, last, 0

    def __call__(self, begin):
        self.version += 1
        self.go[self.version].wait()
        if self.version > self.last:
            return async_policy.STOP, []
        begin(self.version)
        self.begun[self.version].set()
        self.buffers[0].fill_(self.version)
        if self.version == self.pause_at:
            self.halfway.set()
            self.resume.wait()
        for b in self.buffers[1:]:
            b.fill_(self.version)
        return self.version, self.buffers


def _in_thread(fn, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)), daemon=True)
    thread.start()
    return thread, out


def test_the_mailbox_never_swaps_in_a_publish_half_received_into_reused_buffers():
    """Catches a swap that reads the reused buffers while the next publish is being written into them (weights half
    of one version, half of the next: trajectories under no version at all), and a swap that blocks generating
    ahead while a publish arrives. Version 1 arrives and is not taken; version 2 starts overwriting its buffers and
    pauses halfway: a swap waits, then takes all of version 2. Holding version 2, a swap during version 3's
    receive returns at once, still with version 2."""
    wire = ScriptedPublish(3, last=3)
    mailbox = transport.Mailbox(wire)
    params = [torch.zeros(4) for _ in range(3)]
    wire.go[1].set()
    mailbox.wait_for(1)
    wire.pause_at = 2
    wire.go[2].set()
    assert wire.halfway.wait(60)
    swap, out = _in_thread(mailbox.swap_into, params)
    swap.join(0.5)
    assert swap.is_alive(), "swapped while version 2 was half written"  # (a slow machine can only make this pass)
    wire.resume.set()
    swap.join(60)
    assert out["value"] == 2 == mailbox.held_version
    assert all(torch.equal(p, torch.full((4,), 2.0)) for p in params)

    wire.pause_at, wire.resume = 3, threading.Event()
    wire.halfway.clear()
    wire.go[3].set()
    assert wire.halfway.wait(60)
    swap, out = _in_thread(mailbox.swap_into, params)
    swap.join(60)  # nothing newer than what it holds: no wait (a wait here would last until resume, never set)
    assert not swap.is_alive() and out["value"] == 2 and mailbox.latest_version() == 2
    wire.resume.set()
    mailbox.wait_for(3)
    assert mailbox.swap_into(params) == 3 and all(torch.equal(p, torch.full((4,), 3.0)) for p in params)
    wire.go[4].set()
    mailbox.join()


def test_a_publish_waits_for_the_swap_reading_its_buffers():
    """Catches a receive that overwrites the buffers while the main thread copies them into the model: begin() of
    the next publish returns only after the swap in progress has finished."""
    wire = ScriptedPublish(1, last=2)
    mailbox = transport.Mailbox(wire)
    copying, release = threading.Event(), threading.Event()

    class SlowParam:  # the model's weight; its copy is held halfway by the test
        def copy_(self, t):
            copying.set()
            release.wait()

    wire.go[1].set()
    mailbox.wait_for(1)
    swap, _ = _in_thread(mailbox.swap_into, [SlowParam()])
    assert copying.wait(60)
    wire.go[2].set()
    assert not wire.begun[2].wait(0.5), "the next publish began overwriting the buffers during the swap"
    release.set()
    assert wire.begun[2].wait(60)
    swap.join(60)
    wire.go[3].set()
    mailbox.join()


# --- all three in a run of main.py's wiring ---------------------------------------------------------------------
def _probe_rank(payload, rank, world, local_rank, master, agent_store, report_silent):
    """main.run_rank with host-memory probes (tests/host_bytes.py), written to $DIGENRL_MEMORY_PROBE/rank<r>.json:
    - a trainer: the float32 bytes alive at once from models.enable_full_training to the end of
      infra.fsdp.shard_for_fsdp (where the fp32 masters are made);
    - the leader: the bytes alive at once in Bookkeeping._record, which writes the checkpoint;
    - a rollout rank: the bytes its weight mailbox thread allocated over the run, and the versions it received."""
    os.environ.update(payload.pop("_env"))  # forked from the forkserver: the test's variables
    import main
    import models
    from infra import bookkeeping, runtime

    out = {}
    fp32 = NewStorages(dtype=torch.float32)
    load, enable, shard = runtime.load_policy, models.enable_full_training, main.shard_for_fsdp
    record, run = bookkeeping.Bookkeeping._record, transport.Mailbox._run

    def load_policy(*args, **kwargs):
        policy = load(*args, **kwargs)
        out["published_copy"] = sum(p.numel() * p.element_size() for p in policy.transformer.parameters()
                                    if p.requires_grad)  # what the leader publishes, in this rank's dtype
        return policy

    def enable_full_training(*args, **kwargs):
        fp32.__enter__()
        return enable(*args, **kwargs)

    def shard_for_fsdp(policy, *args, **kwargs):
        shard(policy, *args, **kwargs)
        fp32.__exit__(None, None, None)
        out["masters_peak"] = fp32.peak
        out["fp32_whole"] = sum(p.numel() * 4 for p in policy.transformer.parameters())

    def _record(self, *args, **kwargs):
        with NewStorages() as seen:
            record(self, *args, **kwargs)
        out["record_peak"] = max(out.get("record_peak", 0), seen.peak)
        sizes = [p.numel() * p.element_size() for p in self.trainer.params]
        out["largest"], out["state_whole"] = max(sizes), 3 * sum(sizes)  # fp32 weights + AdamW's 2 moments

    def _run(self):
        with NewStorages() as seen:
            run(self)
        out["mailbox_allocated"], out["versions"] = seen.allocated, self.latest_version()

    runtime.load_policy, models.enable_full_training, main.shard_for_fsdp = load_policy, enable_full_training, \
        shard_for_fsdp
    bookkeeping.Bookkeeping._record, transport.Mailbox._run = _record, _run
    code = main.run_rank(payload, rank, world, local_rank, master, agent_store, report_silent)
    with open(os.path.join(os.environ["DIGENRL_MEMORY_PROBE"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return code


def test_host_memory_of_a_full_fine_tuning_run(tiny_cache, tmp_path, monkeypatch):
    """Catches each of issue 38 item 8's host-memory defects where a real run meets it: main.py's wiring on 3 gloo
    ranks (R = 1, K = 2, --fsdp --no-lora, bf16 policy with fp32 masters), 2 steps and a checkpoint.
    - the leader writing a checkpoint held the whole fp32 weights and both AdamW moments (3 x 4 bytes a parameter;
      143 GB for FLUX.1-dev): now at most two whole tensors at once (FSDP's padded gather and the tensor);
    - the rollout rank allocated a new copy of the published weights per publish: now one for the run;
    - a trainer made the fp32 masters of the whole transformer before sharding (4 bytes a parameter): now of its
      shard (4 / K), plus one tensor's re-padding at a time."""
    import cli
    from infra.launch import launch

    import comm

    cfg = cli.prepare(["--mode", "digenrl", "--fsdp", "--nproc", "3", "--rollout-ranks", "1", "--no-lora",
                       "--dtype", "bfloat16", "--steps", "2", "--prompts-per-step", "2", "--fragment-groups", "2",
                       "--group-size", "2", "--num-steps", "2", "--eval-every", "0", "--no-trace", "--no-progress",
                       "--timeout-s", "120", "--out-dir", str(tmp_path), "--run-name", "job"])
    stall_matrix.start_forkserver()  # the ranks forked from the process that imported main.py once
    code = launch(_probe_rank, {**dataclasses.asdict(cfg), "_env": {"DIGENRL_MEMORY_PROBE": str(tmp_path)}}, 3,
                  threads=1, start_method="forkserver", preload=stall_matrix.preload(),
                  role_of=lambda r: comm.role_of(cfg.placement, cfg.rollout_ranks, r, 3))
    assert code == 0
    rollout, leader, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3))
    print(f"rollout rank: {rollout['versions'] + 1} publishes received, {rollout['mailbox_allocated']} B allocated by "
          f"its mailbox (one copy: {rollout['published_copy']} B)")
    print(f"leader: {leader['record_peak']} B alive at once writing the checkpoint (largest tensor "
          f"{leader['largest']} B; weights + AdamW whole {leader['state_whole']} B)")
    for name, m in (("leader", leader), ("other trainer", other)):
        print(f"{name}: {m['masters_peak']} B of fp32 alive at once making the masters (whole: {m['fp32_whole']} B)")
    assert rollout["versions"] >= 2  # versions 0, 1 and 2: three publishes
    assert rollout["published_copy"] <= rollout["mailbox_allocated"] <= 1.05 * rollout["published_copy"]
    assert 0 < leader["record_peak"] <= 2 * leader["largest"] + 64 * 1024  # + the metrics row, the RNG state
    for m in (leader, other):
        assert m["fp32_whole"] / 2 <= m["masters_peak"] <= 0.62 * m["fp32_whole"]  # 1/K + one padded tensor
    state = rundir.load_state(str(tmp_path / "job" / "checkpoints" / "step_000002"))  # torch.load, memory-mapped
    assert state["step"] == 2 and all(t.dtype == torch.float32 for t in state["weights"].values())
