"""A Hub `--pretrained` under torchrun: one download per node, and no rank gives up on a node still downloading.

    fetch = NodeFetch.under_torchrun(os.environ)   # before validation (cli.py)
    cfg = cli.prepare(argv, fetch=fetch)           # fetch(cfg): local rank 0 downloads, the others wait
    run_rank(..., store=fetch.store)               # the job's store, opened here, is the rank's

Every rank used to resolve the id itself (config validation downloads it): 8 downloads of the same 24-57 GB per
node, and a node that downloaded slowly kept its ranks from the store while the ranks of a faster node waited
there for them, with a deadline (--timeout-s): the job died of a slow network. Now, through the job's store (the
torchrun agent's, reachable before any rank's own set-up):
- local rank 0 of each node downloads (models.resolve_pretrained) and posts the bytes in its cache so far, every
  second, then "ok" or its error;
- the node's other ranks wait for that result, then load the same snapshot from the node's cache (no network);
- every rank then waits until every rank of the job has its copy, before any wait that has a deadline.
Patience is bounded by progress, not time: a wait ends with a one-line error naming the id and the node when no
node's download has grown for --timeout-s, or at once with the fetcher's own error (which names the id) when a
download failed. A local directory, or an id the process has already resolved, needs none of this.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

POLL_S = 0.5  # how often a waiting rank reads the store
REPORT_S = 1.0  # how often the fetcher posts its bytes


def cached_bytes(repo_id: str) -> int:
    """Bytes of the regular files under the Hugging Face cache's folder of a model repository (finished blobs and
    the .incomplete ones being written; snapshots are links to the blobs): what a download has fetched so far."""
    from huggingface_hub import constants

    folder = os.path.join(constants.HF_HUB_CACHE, "models--" + repo_id.replace("/", "--"))
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:  # renamed from .incomplete to its final name meanwhile
                continue
            if not os.path.islink(os.path.join(root, name)):
                total += info.st_size
    return total


class NodeFetch:
    """fetch(cfg) for cli.prepare under torchrun; `store` is the job's store once it was needed (else None)."""

    def __init__(self, rank: int, world: int, local_rank: int, node: str, open_store: Callable[[float], object],
                 measure: Callable[[str], int] = cached_bytes, report_s: float = REPORT_S, poll_s: float = POLL_S):
        self.rank, self.world, self.local_rank, self.node = rank, world, local_rank, node
        self.open_store, self.measure, self.report_s, self.poll_s = open_store, measure, report_s, poll_s
        self.store = None

    @staticmethod
    def under_torchrun(env) -> "NodeFetch":
        """From torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK (the node), the job's store at
        MASTER_ADDR:MASTER_PORT (the agent's, or hosted by rank 0)."""
        from infra.jobstore import SignedStore, job_key
        from infra.launch import open_store

        rank, world = int(env["RANK"]), int(env.get("WORLD_SIZE", 1))
        hosts = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"

        def job_store(timeout_s: float):  # only once a Hub id needs it
            return SignedStore(open_store((env["MASTER_ADDR"], int(env["MASTER_PORT"])), world, is_master=hosts,
                                          timeout_s=timeout_s), job_key(env))  # sealed, as every rank's

        return NodeFetch(rank, world, int(env.get("LOCAL_RANK", 0)), env.get("GROUP_RANK") or socket.gethostname(),
                         job_store)

    def __call__(self, cfg) -> None:
        import models

        if not models.is_hub_id(cfg.pretrained):
            return
        import torch.distributed as dist

        self.store = self.open_store(cfg.timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job starts afresh
        store = dist.PrefixStore(f"digenrl/fetch/{attempt}", self.store)
        store.add("arrived", 1)
        if self.local_rank == 0:
            self._fetch(store, cfg)
        else:  # the node's fetcher may still be starting: torchrun ends this rank too if it dies
            self._wait(store, cfg, nodes=lambda: [self.node], done=lambda: _result(store, self.node) == "ok")
            models.resolve_pretrained(cfg.model, cfg.pretrained, local_only=True)  # the node's copy, no network
        store.add("ready", 1)
        self._wait(store, cfg, nodes=lambda: _fetchers(store), done=lambda: store.add("ready", 0) >= self.world)

    def _fetch(self, store, cfg) -> None:
        """Local rank 0: download, posting the bytes so far; then the result, "ok" or the error."""
        import models

        store.set(f"node/{self.node}/bytes", "0")
        store.set(f"fetcher/{store.add('fetchers', 1) - 1}", self.node)
        stop = threading.Event()
        reporter = threading.Thread(target=self._report, args=(store.clone(), cfg.pretrained, stop), daemon=True)
        reporter.start()
        try:
            models.resolve_pretrained(cfg.model, cfg.pretrained)
        except BaseException as error:  # any failure, posted so that no rank waits for this node in vain
            why = str(error) if isinstance(error, FileNotFoundError) else f"{type(error).__name__}: {error}"
            store.set(f"node/{self.node}/result", f"error {why}")
            raise
        finally:
            stop.set()
            reporter.join()
        store.set(f"node/{self.node}/result", "ok")

    def _report(self, store, repo_id: str, stop: threading.Event) -> None:
        while not stop.wait(self.report_s):
            store.set(f"node/{self.node}/bytes", str(self.measure(repo_id)))

    def _wait(self, store, cfg, nodes: Callable[[], list[str]], done: Callable[[], bool]) -> None:
        """Until done(): raise a fetcher's error as soon as one posts it; give up when nothing moved for
        --timeout-s (the bytes of the downloads, the ranks that arrived, finished or are ready), unless a
        node watched has not started its download yet."""
        seen, moved = None, time.monotonic()
        while True:
            watched = nodes()
            results = {n: _result(store, n) for n in watched}
            for n, result in results.items():
                if result is not None and result.startswith("error "):
                    raise FileNotFoundError(f"on node {n}: {result[len('error '):]}")
            if done():
                return
            sizes = {n: int(store.get(f"node/{n}/bytes")) if store.check([f"node/{n}/bytes"]) else None
                     for n in watched}
            progress = (tuple(sizes.values()), tuple(results.values()), store.add("arrived", 0),
                        store.add("ready", 0))
            if progress != seen or None in sizes.values():
                seen, moved = progress, time.monotonic()
            elif time.monotonic() - moved > cfg.timeout_s:
                fetching = [n for n in watched if results[n] is None]
                raise FileNotFoundError(
                    f"--pretrained {cfg.pretrained!r}: no progress for {cfg.timeout_s:g} s (--timeout-s) while "
                    + ("; ".join(f"node {n} downloads it ({sizes[n] / 2**20:.1f} MiB so far)" for n in fetching)
                       or f"{self.world - progress[3]} of {self.world} ranks are not ready (still starting, or "
                          "gone)")
                    + f"; seen by rank {self.rank} on node {self.node}")
            time.sleep(self.poll_s)


def _result(store, node: str) -> str | None:
    """A node's download result: "ok", "error <message>", or None while it runs."""
    return store.get(f"node/{node}/result").decode() if store.check([f"node/{node}/result"]) else None


def _fetchers(store) -> list[str]:
    """The nodes whose local rank 0 has started its download."""
    count = store.add("fetchers", 0)
    return [store.get(f"fetcher/{i}").decode() for i in range(count) if store.check([f"fetcher/{i}"])]
