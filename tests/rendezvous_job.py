"""A minimal self-spawned job for tests/test_ports.py: infra/launch.py's launcher starts 2 ranks that only meet
(the job's store, a gloo process group, one all-reduce) and write down what they saw.

    python tests/rendezvous_job.py OUT_DIR JOB_ID GO_FILE    # waits for GO_FILE, then launches

The launcher imports torch and forks its ranks (launch's start_method="fork"), so twenty jobs cost twenty torch
imports instead of sixty; main.py's launcher spawns (CUDA needs fresh processes) and every multi-rank test of
main.py runs that path, the listening socket handed to rank 0 through pickling.
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


if __name__ == "__main__":
    out, job, go = sys.argv[1:4]
    open(os.path.join(out, f"{job}.ready"), "w").close()
    while not os.path.exists(go):  # every job launches at the same moment
        time.sleep(0.002)
    sys.exit(launch(meet, {"job": job, "out": out}, 2, role_of=lambda r: "rank", start_method="fork"))
