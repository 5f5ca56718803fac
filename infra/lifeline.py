"""Ranks die with their launcher: a rank whose parent (main.py's self-spawning launcher, or torchrun's agent) is
gone ends at once instead of training on, reparented to pid 1, with its GPUs busy.

    die_with_parent(parent_pid)   # first thing in every rank process

SLURM, Kubernetes and `timeout` stop a job by signalling the process they started: the launcher. A launcher
that exits normally stops its ranks itself (infra/launch.py forwards SIGTERM and waits), but one that is
SIGKILLed (or crashes) cannot. Two guards, both cheap:
- Linux: prctl(PR_SET_PDEATHSIG, SIGKILL): the kernel kills this process when its parent exits. (Checked
  once more right after the call: a parent that died before it would otherwise go unnoticed.)
- everywhere: a daemon thread compares os.getppid() with the parent every second and exits when it changed
  (the process was reparented). It also covers a platform without prctl.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 1.0


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _orphaned(parent_pid: int) -> None:
    print(f"[digenrl] the launcher (pid {parent_pid}) is gone: rank process {os.getpid()} stops",
          file=sys.stderr, flush=True)
    os._exit(1)


def die_with_parent(parent_pid: int | None = None) -> None:
    """End this process when `parent_pid` (default: the current parent) exits."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    _set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the kernel was told to watch it
        _orphaned(parent_pid)

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(POLL_S):
            if os.getppid() != parent_pid:
                _orphaned(parent_pid)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
