"""One job per run directory: an exclusive lock, taken before anything is written, and no silent reuse of a run name.

    lock = RunLock.acquire("runs/x")   # ValueError naming the holder if another job has it
    ...                                # the job writes runs/x
    lock.release()

`runs/x/.lock` is flock'ed (fcntl.flock, exclusive, non-blocking) for the job's whole life by the process that
started it (main.py's launcher, or under torchrun the leader rank) and holds that job's host, pid and start
time, so a second job (a `--resume` started while the first still runs, or a reused `--run-name`) is refused
with a message naming the holder. The kernel drops a flock when its holder dies however it dies, so a lock
file that is not locked but still names a holder is stale (that job was killed): it is taken over with a
warning. A clean release empties the file. (On a network filesystem flock is as good as its locking: NFSv4
locks across hosts.)

`check_new_run(path)`: a run name whose directory already holds a run is refused unless --resume is given.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

try:
    import fcntl
except ImportError:  # not POSIX: no locking (the message says so once)
    fcntl = None

LOCK_NAME = ".lock"


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {when}"


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", errors="replace").strip()
    if not text:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {"host": "?", "pid": text[:40]}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    def __init__(self, path: str, fd: int | None):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_path: str) -> "RunLock":
        """Lock `run_path` (created if missing) for this process; ValueError naming the holder if it is taken."""
        os.makedirs(run_path, exist_ok=True)
        path = os.path.join(run_path, LOCK_NAME)
        if fcntl is None:
            print(f"[digenrl] no file locking on this platform: nothing stops a second job on {run_path}",
                  file=sys.stderr)
            return cls(path, None)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ValueError(f"run directory {run_path!r} is in use by another job ({_describe(holder)}); wait for it "
                             "to end or stop it, or give another --run-name") from None
        stale = _read_holder(fd)
        if stale:
            print(f"[digenrl] taking over the lock of {run_path}: its holder ({_describe(stale)}) is gone",
                  file=sys.stderr, flush=True)
        mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encode(), 0)
        os.fsync(fd)
        return cls(path, fd)

    def release(self) -> None:
        """Empty the file (a clean end: nothing stale left) and unlock."""
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def check_new_run(run_path: str) -> None:
    """A new run (no --resume) must not write into a directory that holds a run already."""
    if not os.path.isdir(run_path):
        return
    found = sorted(n for n in os.listdir(run_path) if n != LOCK_NAME)
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise ValueError(f"run directory {run_path!r} already holds a run ({shown}): continue it with --resume "
                         f"{run_path}, or give another --run-name")
