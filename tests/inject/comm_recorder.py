"""Records every torch.distributed call of a process, and every other way the project's own code blocks
(tests/test_comm_contract.py puts tests/inject on PYTHONPATH, so every rank imports it at start-up through
tests/inject/sitecustomize.py, under the self-spawning launcher and under torchrun; tests/stall_matrix.py
installs it in the ranks it launches).

Active when DIGENRL_COMM_LOG names a folder (or after `install(folder)`): each call appends one JSON line to
<folder>/<pid>.jsonl with the op, the group's plane (comm.py names groups "data:<n>" / "compute:<n>";
"default" for the world group), the devices of the tensors, whether the calling thread is the main thread,
who called it (the first frame outside this file: a file and function), the project's own code that called
it ("site", None inside a library's own machinery) and the phase the thread was inside (infra/progress.py:
what liveness names when the job is stuck; tests/stall_matrix.py derives the blocking points from it). Nested
calls (all_gather_object calling all_gather) are recorded once, as the outer call.
Also recorded, once per (op, site, phase, thread): joining the job and building groups ("setup.init_process_group",
"setup.new_group": rendezvous through the store), the project's own waits ("wait.sleep", "wait.condition",
"wait.join": a polled store key, a mailbox, a thread's end) and every phase entered ("phase", with "excused"
and "idle"): an excused section is a blocking point by definition (it reports nothing). Only the
torch.distributed calls carry a "plane" (tests/inject/comm_check.py's rules).
"""
import os

_state = {"folder": None}


def install(folder: str) -> None:
    """Record this process's calls into `folder` (once per process)."""
    if _state["folder"] is not None:
        return
    _state["folder"] = folder
    _install()


def _install() -> None:
    import functools
    import inspect
    import json
    import sys
    import threading
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import phases

    folder = _state["folder"]
    here = __file__
    lock, local = threading.Lock(), threading.local()
    seen: set = set()

    def plane(group) -> str:
        if isinstance(group, tuple):  # (DeviceMesh, mesh dim)
            group = group[0].get_group(group[1])
        elif isinstance(group, str):  # a group name (functional collectives)
            group = c10d._resolve_process_group(group)
        elif hasattr(group, "get_group"):  # a DeviceMesh
            group = group.get_group()
        if group is None or group is dist.group.WORLD:
            return "default"
        desc = getattr(group, "group_desc", "") or ""
        return desc.split(":")[0] if ":" in desc else f"other({desc})"

    def devices(value, out):
        if isinstance(value, torch.Tensor):
            out.add(str(value.device))
        elif isinstance(value, (list, tuple)):
            for v in value:
                devices(v, out)
        return out

    def caller():
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename == here:
            frame = frame.f_back
        if frame is None:
            return "?", "?"
        return frame.f_code.co_filename, frame.f_code.co_name

    def site():
        found = phases.project_caller()
        return f"{found[0]}:{found[1]}" if found else None

    def write(row) -> None:
        with lock, open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    def thread_fields():
        thread = threading.current_thread()
        return {"main_thread": thread is threading.main_thread(), "thread": thread.name}

    def wrap(module_name, name, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if getattr(local, "depth", 0) or not dist.is_initialized():
                return original(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs)
            group = bound.arguments.get("group")
            filename, function = caller()
            write({"op": f"{module_name}.{name}", "plane": plane(group),
                   "devices": sorted(devices(list(bound.arguments.values()), set())), **thread_fields(),
                   "file": filename, "function": function, "rank": dist.get_rank(), "site": site(),
                   "phase": phases.current()})
            local.depth = getattr(local, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth -= 1

        return recorded

    def once(row: dict) -> None:
        key = tuple(sorted((k, str(v)) for k, v in row.items()))
        if key not in seen:
            seen.add(key)
            write(row)

    def wait_hook(kind, original):
        @functools.wraps(original)
        def waiting(*args, **kwargs):
            thread = threading.current_thread().name
            if not getattr(local, "waiting", False) and dist.is_initialized() and thread not in INFRA_THREADS:
                found = phases.project_caller()
                if found is not None and found[0] not in INFRA_FILES:
                    once({"op": kind, "site": f"{found[0]}:{found[1]}", "phase": phases.current(),
                          "rank": dist.get_rank(), **thread_fields()})
            local.waiting = True  # a condition's wait inside a join, ...: the outer one is the wait
            try:
                return original(*args, **kwargs)
            finally:
                local.waiting = False

        return waiting

    def setup_hook(name, original):  # joining the job and building groups: rendezvous through the store
        signature = inspect.signature(original)

        @functools.wraps(original)
        def joining(*args, **kwargs):
            rank = signature.bind_partial(*args, **kwargs).arguments.get("rank") if name == "init_process_group" \
                else dist.get_rank()
            found = phases.project_caller()
            once({"op": f"setup.{name}", "site": f"{found[0]}:{found[1]}" if found else None,
                  "phase": phases.current(), "rank": rank, **thread_fields()})
            return original(*args, **kwargs)

        return joining

    phases.watch()
    phases.wrap_distributed(wrap)
    for name in ("init_process_group", "new_group"):
        hooked = setup_hook(name, getattr(c10d, name))
        setattr(c10d, name, hooked)
        setattr(dist, name, hooked)
    time.sleep = wait_hook("wait.sleep", time.sleep)
    threading.Condition.wait = wait_hook("wait.condition", threading.Condition.wait)
    threading.Thread.join = wait_hook("wait.join", threading.Thread.join)
    start = threading.Thread.start

    def started(self):  # Thread.start waits for the thread to run: not a wait for another rank
        local.waiting = True
        try:
            return start(self)
        finally:
            local.waiting = False

    threading.Thread.start = started

    from infra import progress as progress_lib
    enter = progress_lib._Inside.__enter__

    def entered(self):
        result = enter(self)
        if dist.is_initialized():
            once({"op": "phase", "phase": self.name, "excused": self.excuse, "idle": getattr(self, "idle", False),
                  "rank": dist.get_rank(), **thread_fields()})
        return result

    progress_lib._Inside.__enter__ = entered


# Threads and files of the machinery that watches a job (liveness, preemption, the launcher): their sleeps and
# joins are how they watch, not a rank blocking.
INFRA_THREADS = ("liveness-watchdog", "preemption-watch", "stop-signals")
INFRA_FILES = ("infra/liveness.py", "infra/preemption.py", "infra/launch.py", "infra/lifeline.py")

if os.environ.get("DIGENRL_COMM_LOG"):
    install(os.environ["DIGENRL_COMM_LOG"])
