"""Minimal self-spawned jobs for tests/test_ports.py: infra/launch.py's launcher starts 2 ranks that only meet
(the job's store, a gloo process group, one all-reduce) and write down what they saw.

    python tests/rendezvous_job.py OUT_DIR JOBS    # JOBS launchers at the same moment, then their exit codes

One interpreter imports torch, then forks JOBS processes, each a launcher of its own job (its own listening socket,
its own store) that forks its ranks (launch's start_method="fork"): JOBS jobs cost one torch import instead of JOBS
(or 3 JOBS). main.py's launcher spawns or uses a forkserver, and every multi-rank test of main.py runs that path,
the listening socket handed to rank 0 through pickling.
"""
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from infra.launch import launch, open_store  # noqa: E402


def meet(payload, rank, world, local_rank, master, agent_store, report_silent):
    store = open_store(master, world, is_master=rank == 0, timeout_s=60)
    store.set(f"job/{rank}", payload["job"])
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    seen = [store.get(f"job/{r}").decode() for r in range(world)]  # the job ids every rank of *this* store wrote
    with open(os.path.join(payload["out"], f"{payload['job']}_{rank}.json"), "w") as f:
        json.dump({"job": payload["job"], "rank": rank, "port": master[1], "sum": total.item(), "seen": seen}, f)
    dist.barrier()  # rank 0 hosts the store: nobody may still be reading it when it leaves
    dist.destroy_process_group()


def launcher(out: str, job: str, go: float) -> int:
    while time.monotonic() < go:  # every launcher binds its port and starts its ranks at the same moment
        time.sleep(0.001)
    return launch(meet, {"job": job, "out": out}, 2, role_of=lambda r: "rank", start_method="fork")


if __name__ == "__main__":
    out, jobs = sys.argv[1], int(sys.argv[2])
    go = time.monotonic() + 0.5  # after the forks below (CLOCK_MONOTONIC is one clock for the whole machine)
    children = []
    for j in range(jobs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = launcher(out, f"job{j}", go)
            finally:
                os._exit(code)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    print(json.dumps({"codes": codes}))
    sys.exit(0 if not any(codes) else 1)
