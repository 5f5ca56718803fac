"""Records every torch.distributed call of a process (tests/test_comm_contract.py puts tests/inject on
PYTHONPATH, so every rank imports it at start-up through tests/inject/sitecustomize.py, under the
self-spawning launcher and under torchrun).

Active only when DIGENRL_COMM_LOG names a folder: each call appends one JSON line to <folder>/<pid>.jsonl
with the op, the group's plane (comm.py names groups "data:<n>" / "compute:<n>"; "default" for the
world group), the devices of the tensors, whether the calling thread is the main thread, and who
called it (the first frame outside this file: a file and function). Nested calls (all_gather_object
calling all_gather) are recorded once, as the outer call.
"""
import os

if os.environ.get("DIGENRL_COMM_LOG"):
    import functools
    import inspect
    import json
    import sys
    import threading

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    _folder = os.environ["DIGENRL_COMM_LOG"]
    _lock, _local = threading.Lock(), threading.local()
    _OPS = ["send", "recv", "isend", "irecv", "broadcast", "all_reduce", "reduce", "all_gather",
            "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
            "reduce_scatter_single", "all_gather_object", "gather_object", "broadcast_object_list", "gather",
            "scatter", "barrier", "all_to_all_single", "batch_isend_irecv", "monitored_barrier"]
    _FUNCOL = ["all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor",
               "reduce_scatter_tensor", "all_reduce_coalesced", "broadcast", "all_to_all_single"]

    def _plane(group) -> str:
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

    def _devices(value, out):
        if isinstance(value, torch.Tensor):
            out.add(str(value.device))
        elif isinstance(value, (list, tuple)):
            for v in value:
                _devices(v, out)
        return out

    def _caller():
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back
        if frame is None:
            return "?", "?"
        return frame.f_code.co_filename, frame.f_code.co_name

    def _wrap(module_name, name, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if getattr(_local, "depth", 0) or not dist.is_initialized():
                return original(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs)
            group = bound.arguments.get("group")
            filename, function = _caller()
            row = {"op": f"{module_name}.{name}", "plane": _plane(group),
                   "devices": sorted(_devices(list(bound.arguments.values()), set())),
                   "main_thread": threading.current_thread() is threading.main_thread(),
                   "thread": threading.current_thread().name, "file": filename, "function": function,
                   "rank": dist.get_rank()}
            with _lock, open(os.path.join(_folder, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            _local.depth = getattr(_local, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                _local.depth -= 1

        return recorded

    for _name in _OPS:
        if hasattr(c10d, _name):
            _wrapped = _wrap("dist", _name, getattr(c10d, _name))
            setattr(c10d, _name, _wrapped)
            setattr(dist, _name, _wrapped)
    for _name in _FUNCOL:
        if hasattr(funcol, _name):
            setattr(funcol, _name, _wrap("funcol", _name, getattr(funcol, _name)))
