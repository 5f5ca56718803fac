"""Faults for tests/test_liveness.py, injected into every rank of a real run (tests/inject/sitecustomize.py
imports this module when one of the variables below is set; the production path never loads it).

- DIGENRL_TEST_STALL="RANK:OP:CALL": on global rank RANK, the CALL-th call (1-based) of torch.distributed's OP
  never returns: `all_reduce` counts compute-plane calls only (the gradient all-reduce), `send` every send (the
  rollout's fragment-sender thread). The main thread (or the sender) then sleeps inside it forever while the
  liveness heartbeat thread keeps beating: a hung collective as a GPU shows it. When it starts, the time
  goes to the file DIGENRL_TEST_STALL_MARK.
- DIGENRL_TEST_SLOW_ATTENTION=SECONDS: every scaled_dot_product_attention call sleeps that long first, so
  every transformer forward is slow (a long step made of many short units, each reporting progress).
"""
import os

if os.environ.get("DIGENRL_TEST_STALL"):
    import functools
    import threading
    import time

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _rank, _op, _call = os.environ["DIGENRL_TEST_STALL"].split(":")
    _calls = [0]
    _lock = threading.Lock()
    _original = getattr(c10d, _op)

    def _counts(args, kwargs) -> bool:
        if not dist.is_initialized() or dist.get_rank() != int(_rank):
            return False
        if _op == "all_reduce":
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            return group is not None and (getattr(group, "group_desc", "") or "").startswith("compute")
        return True

    @functools.wraps(_original)
    def _stalling(*args, **kwargs):
        if _counts(args, kwargs):
            with _lock:
                _calls[0] += 1
                hit = _calls[0] == int(_call)
            if hit:
                with open(os.environ["DIGENRL_TEST_STALL_MARK"], "w") as f:
                    f.write(f"{time.time()}\n")
                while True:  # blocked inside the collective, as a wedged NCCL or gloo wait would be
                    time.sleep(3600)
        return _original(*args, **kwargs)

    setattr(c10d, _op, _stalling)
    setattr(dist, _op, _stalling)

if os.environ.get("DIGENRL_TEST_SLOW_ATTENTION"):
    import functools
    import time

    import torch.nn.functional as F

    _seconds = float(os.environ["DIGENRL_TEST_SLOW_ATTENTION"])
    _sdpa = F.scaled_dot_product_attention

    @functools.wraps(_sdpa)
    def _slow_sdpa(*args, **kwargs):
        time.sleep(_seconds)
        return _sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = _slow_sdpa
