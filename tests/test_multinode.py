"""Several nodes under torchrun (issue 38 items 5 and 7), emulated on this host: two `torchrun --nnodes 2
--rdzv-backend c10d --rdzv-endpoint localhost:PORT` processes, each a "node" with its own Hugging Face cache, and
a Hub --pretrained served by tests/inject/fake_hub.py (no network: the tiny FLUX pipeline, copied one file at a
time).

- The README's multi-node command without `--rdzv-backend c10d` formed no job (static rendezvous: node rank 0 on
  both nodes). Through c10d the job forms, trains two steps and both nodes exit 0.
- Every rank used to download --pretrained itself, and a node downloading slowly timed out the store waits of the
  others: now local rank 0 of each node downloads once (node A runs 2 ranks, node B 1: two downloads in all) and
  the others load its copy; the waits' patience is bounded by progress, not time (one process, threads as ranks:
  a download 3 x --timeout-s long that grows is waited for; one that stalls or fails ends every wait).
- A download that fails ends the job on every node with the fetcher's error, naming the id.
"""
import datetime
import os
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

import models
from conftest import ROOT, read_metrics
from infra.node_fetch import NodeFetch

pytestmark = pytest.mark.timeout(400)
HOOKS = os.path.join(ROOT, "tests", "inject")
REPO = "digenrl-test/tiny-flux"
JOB = ["--model", "flux", "--pretrained", REPO, "--mode", "digenrl", "--rollout-ranks", "1", "--prompts-per-step",
       "2", "--fragment-groups", "2", "--group-size", "2", "--num-steps", "2", "--resolution", "32", "--lr", "3e-3",
       "--eval-every", "0", "--no-trace", "--no-progress", "--threads", "1"]


# --- the waits, in one process: three "ranks" as threads, node a with two, node b with one ------------------------
class FakeHub:
    """models.resolve_pretrained for threads that play the ranks of two nodes: a download per node, paced by the
    test, its bytes readable as that node's measure."""

    def __init__(self, seconds: dict[str, float], stall_after: float | None = None, fail: bool = False):
        self.seconds, self.stall_after, self.fail = seconds, stall_after, fail
        self.bytes, self.done, self.calls = {n: 0 for n in seconds}, set(), []
        self.here, self.release = threading.local(), threading.Event()

    def resolve(self, name, path, local_only=False):
        node = self.here.node
        if local_only:
            if node not in self.done:
                raise FileNotFoundError(f"{path} is not in node {node}'s cache")
            return f"/cache-{node}/{path}"
        self.calls.append(node)
        start = time.monotonic()
        while time.monotonic() - start < self.seconds[node]:
            if self.stall_after is not None and node == "b" and time.monotonic() - start > self.stall_after:
                self.release.wait()  # the download hangs
                raise FileNotFoundError("released")
            if self.fail and node == "b":
                raise FileNotFoundError(f"--pretrained {path!r} is not a local directory, and as a Hugging Face Hub "
                                        "id it could not be fetched (OSError: 503 Server Error)")
            self.bytes[node] += 1 << 20
            time.sleep(0.05)
        self.done.add(node)
        return f"/cache-{node}/{path}"


def _ranks(monkeypatch, hub: FakeHub, timeout_s: float) -> dict[int, object]:
    """Ranks 0, 1 (node a, local ranks 0 and 1) and 2 (node b) through NodeFetch on one TCPStore; what each returned
    or raised."""
    monkeypatch.setattr(models, "resolve_pretrained", hub.resolve)
    server = torch_store(0, True)
    cfg = types.SimpleNamespace(model="flux", pretrained="digenrl-test/tiny-flux", timeout_s=timeout_s)
    out = {}

    def rank(r, local, node):
        hub.here.node = node
        fetch = NodeFetch(r, 3, local, node, lambda t: torch_store(server.port, False),
                          measure=lambda repo: hub.bytes[node], report_s=0.05, poll_s=0.05)
        try:
            fetch(cfg)
            out[r] = "ready"
        except FileNotFoundError as error:
            out[r] = error

    threads = [threading.Thread(target=rank, args=args, daemon=True) for args in ((0, 0, "a"), (1, 1, "a"),
                                                                                   (2, 0, "b"))]
    for t in threads:
        t.start()
    for t in threads[:2]:  # node a's ranks (node b's fetcher may hang: released once they are done)
        t.join(60)
    hub.release.set()
    threads[2].join(60)
    return out


def torch_store(port: int, host: bool):
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, None, host, datetime.timedelta(seconds=30), wait_for_workers=False)


def test_ranks_wait_for_a_slow_download_that_progresses(monkeypatch):
    """Catches a wait with a deadline instead of patience: node b's download takes 3 x --timeout-s, its bytes
    growing; every rank waits for it and goes on, and each node downloaded once (node a's local rank 1 loads
    node a's copy)."""
    hub = FakeHub({"a": 0.2, "b": 4.5})
    assert _ranks(monkeypatch, hub, timeout_s=1.5) == {0: "ready", 1: "ready", 2: "ready"}
    assert sorted(hub.calls) == ["a", "b"]


def test_a_stalled_download_ends_the_wait_naming_the_node(monkeypatch):
    """Catches a wait that never ends: node b's download stops growing; after --timeout-s without progress the
    ranks of node a give up, naming the id, node b and how far it got."""
    hub = FakeHub({"a": 0.2, "b": 60}, stall_after=0.3)
    out = _ranks(monkeypatch, hub, timeout_s=1.5)
    for r in (0, 1):
        assert isinstance(out[r], FileNotFoundError), out
        assert "--pretrained 'digenrl-test/tiny-flux': no progress for 1.5 s (--timeout-s) while node b downloads " \
               "it (" in str(out[r]), out[r]


def test_a_failed_download_ends_every_wait_with_its_error(monkeypatch):
    hub = FakeHub({"a": 0.2, "b": 60}, fail=True)
    out = _ranks(monkeypatch, hub, timeout_s=60)  # ended by the error, not by 60 s of patience (join(60) above)
    assert all(isinstance(e, FileNotFoundError) and "could not be fetched (OSError: 503" in str(e)
               for e in out.values()), out
    assert str(out[0]).startswith("on node b: --pretrained 'digenrl-test/tiny-flux'")


# --- torchrun itself ----------------------------------------------------------------------------------------------
def test_every_multi_node_command_names_the_c10d_rendezvous():
    """Catches a documented or printed multi-node command that cannot form a job (the README's had no
    --rdzv-backend: torchrun's static rendezvous gave both nodes node rank 0): every torchrun command with
    --nnodes > 1 in the docs, and tools/plan.py's for 32 GPUs, names the c10d backend and an endpoint."""
    import re
    import shlex

    from test_presets import _doc_commands
    from tools import plan, plan_memory

    problem = plan.Problem(plan_memory.settings("flux")[0], "flux", 32)
    commands = [command for _, command in _doc_commands() if command.startswith("torchrun")]
    commands.append(plan.command(problem, plan.Candidate(rollout_ranks=16, fragment_groups=16, tsp_pack=8, tag=True,
                                                         max_stale=16)))
    multi = [c for c in commands if int((re.search(r"--nnodes[ =](\d+)", c) or [0, 1])[1]) > 1]
    assert len(multi) >= 2, commands  # the README's, the planner's
    for command in multi:
        tokens = shlex.split(command)
        launcher = [part for t in tokens[:tokens.index("main.py")] for part in t.split("=", 1)]
        for flag in ("--rdzv-backend", "--rdzv-endpoint"):  # (--rdzv-id only tells jobs on one endpoint apart)
            assert flag in launcher, (flag, command)
        assert launcher[launcher.index("--rdzv-backend") + 1] == "c10d", command



def _free_port() -> int:
    with socket.socket() as s:  # (the one port chosen by bind-and-close: torchrun's c10d store binds it itself)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(tmp_path, name: str, nproc: int, port: int, job_id: str, args: list[str], **env) -> subprocess.Popen:
    """One emulated node: torchrun with its own Hugging Face cache, the fake Hub injected into its ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_HUB_CACHE=str(tmp_path / f"hf-{name}"), DIGENRL_TEST_INJECT="fake_hub",
               DIGENRL_TEST_FAKE_HUB_CALLS=str(tmp_path / "downloads.txt"),
               PYTHONPATH=os.pathsep.join([HOOKS, ROOT, os.environ.get("PYTHONPATH", "")]), **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", job_id,
           "--rdzv-conf", f"is_host={int(name == 'a')}", os.path.join(ROOT, "main.py"), *args,
           "--out-dir", str(tmp_path)]
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(procs, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    try:
        return [p.wait(max(deadline - time.monotonic(), 1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


def test_two_nodes_form_a_job_through_c10d_with_one_download_per_node(tiny_cache, tmp_path):
    port = _free_port()
    args = [*JOB, "--steps", "2", "--timeout-s", "60", "--run-name", "job"]
    a = _node(tmp_path, "a", 2, port, "two-nodes", args, DIGENRL_TEST_FAKE_HUB_SECONDS="1")
    b = _node(tmp_path, "b", 1, port, "two-nodes", args, DIGENRL_TEST_FAKE_HUB_SECONDS="4")  # node b: slower
    codes = _finish([a, b], 360)
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in "ab"}
    assert codes == [0, 0], {n: log[-3000:] for n, log in logs.items()}
    downloads = sorted((tmp_path / "downloads.txt").read_text().splitlines())
    assert downloads == [f"0 0 {REPO}", f"1 0 {REPO}"], downloads  # GROUP_RANK LOCAL_RANK: local rank 0, per node
    rows = read_metrics(tmp_path / "job")
    assert [r["step"] for r in rows] == [0, 1] and all(r["trajectories"] == 4 for r in rows)
    assert all("spans several hosts" not in log and "spans 2 hosts" not in log for log in logs.values())  # 1 host


def test_a_failed_download_names_the_id_and_ends_the_job_on_every_node(tiny_cache, tmp_path):
    port = _free_port()
    args = [*JOB, "--steps", "1", "--timeout-s", "120", "--run-name", "job"]
    a = _node(tmp_path, "a", 1, port, "failing", args, DIGENRL_TEST_FAKE_HUB_FAIL="1")
    b = _node(tmp_path, "b", 1, port, "failing", args)
    codes = _finish([a, b], 110)  # ended by the error itself, before --timeout-s 120 of no progress could
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in "ab"}
    assert all(code != 0 for code in codes), logs
    assert f"error: --pretrained '{REPO}' is not a local directory, and as a Hugging Face Hub id it could not be " \
           "fetched (OSError: 503 Server Error" in logs["a"], logs["a"][-3000:]
    assert f": --pretrained '{REPO}' is not a local directory" in logs["b"] and "503 Server Error" in logs["b"], \
        logs["b"][-3000:]  # node b's rank names node a's error
    assert (tmp_path / "downloads.txt").read_text().count(REPO) == 2  # one per node, node b's succeeded
