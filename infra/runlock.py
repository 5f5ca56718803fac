"""One job per run directory: an exclusive lock, checked before anything in the directory is read and held until
the last process that writes it is gone, and no silent reuse of a run name.

    lock = RunLock.acquire("runs/x")   # ValueError naming the holder if another job has it
    ...                                # the job reads, then writes runs/x (its ranks inherit the lock: launch.py)
    lock.release()
    RunLock.check_free("runs/x", job)  # no lock taken: refused if another job (not `job`) holds it

`runs/x/.lock` is flock'ed (fcntl.flock, exclusive, non-blocking) for the job's whole life and holds that job's
host, pid, start time and job id, so a second job (a `--resume` started while the first still runs, or a reused
`--run-name`) is refused with a message naming the holder, before it reads a byte of the directory: a live job
prunes old checkpoints, and a second job reading them used to fail on a half-deleted one instead of being told
the run is in use. Who holds it:
- the self-spawning launcher takes it before it reads the directory, and every rank it starts inherits the same
  open file description (launch.InheritedFd). A flock belongs to that description, so it is released only when
  its last holder is gone: a SIGKILLed launcher leaves it held until its ranks, which die with it
  (infra/lifeline.py), have stopped writing. (It used to be free ~2 s before they stopped, and a `--resume` started
  at once took over and read a checkpoint the dying ranks had just written.)
- under torchrun, the leader rank (the one process that writes the directory) takes it once its configuration
  is known; every rank first checks (`check_free`) that no other job holds it before it reads anything, and takes
  nothing itself.
The kernel drops a flock when its holders die however they die, so a lock file that is not locked but still names
a holder is stale (that job was killed): it is taken over with a warning. A clean release empties the file. (On a
network filesystem flock is as good as its locking: NFSv4 locks across hosts.)

`check_new_run(path)`: a run name whose directory already holds a run is refused unless --resume is given.
"""
from __future__ import annotations

import errno
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
SETTLE_S = 2.0  # a lock held this long is a job's: a rank's check_free holds it a moment, a job for its life
POLL_S = 0.02


def _describe(holder: dict) -> str:
    if not holder:
        return "its holder has not written its name yet"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {when}"


def _read_holder(fd: int) -> dict:
    text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()
    if not text:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {"host": "?", "pid": text[:40]}
    return holder if isinstance(holder, dict) else {}


def job_id() -> str:
    """What names this job to its own ranks: under torchrun its run id and store (the same on every node), else
    this process (the self-spawning launcher, whose ranks inherit the lock instead of checking it)."""
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
        return (f"torchrun {os.environ.get('TORCHELASTIC_RUN_ID', '')}@{os.environ.get('MASTER_ADDR', '')}:"
                f"{os.environ.get('MASTER_PORT', '')}")
    return f"{socket.gethostname()} {os.getpid()}"


def _in_use(run_path: str, holder: dict) -> ValueError:
    return ValueError(f"run directory {run_path!r} is in use by another job ({_describe(holder)}); wait for it to "
                      "end or stop it, or give another --run-name")


def _open_failed(run_path: str, error: OSError) -> ValueError:
    name = errno.errorcode.get(error.errno, str(error.errno))
    return ValueError(f"run directory {run_path!r} cannot be written: {error.strerror} [{name}] (a read-only or "
                      "full disk, or no permission): give another --out-dir")


class RunLock:
    def __init__(self, path: str, fd: int | None):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_path: str, job: str | None = None, create: bool = True) -> "RunLock":
        """Lock `run_path` (created if missing, unless `create` is False: --resume of a missing directory is an
        error, not a new one) for this job; ValueError naming the holder if another job has it."""
        job = job or job_id()
        if not create and not os.path.isdir(run_path):
            raise ValueError(f"--resume {run_path!r} is not a directory")
        try:
            os.makedirs(run_path, exist_ok=True)
            path = os.path.join(run_path, LOCK_NAME)
            if fcntl is None:
                print(f"[digenrl] no file locking on this platform: nothing stops a second job on {run_path}",
                      file=sys.stderr)
                return cls(path, None)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children (O_CLOEXEC)
        except OSError as error:
            raise _open_failed(run_path, error) from None
        settle = time.monotonic() + SETTLE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # a job holds it, or one of this job's ranks checks it for a moment
                if time.monotonic() > settle:
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise _in_use(run_path, holder) from None
                time.sleep(POLL_S)
        stale = _read_holder(fd)
        if stale:
            print(f"[digenrl] taking over the lock of {run_path}: its holder ({_describe(stale)}) is gone",
                  file=sys.stderr, flush=True)
        mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "job": job})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, mine.encode(), 0)
            os.fsync(fd)
        except OSError as error:
            os.close(fd)
            raise _open_failed(run_path, error) from None
        return cls(path, fd)

    @staticmethod
    def check_free(run_path: str, job: str | None = None) -> None:
        """ValueError naming the holder when a job other than `job` holds `run_path`'s lock; takes nothing and
        creates nothing (a dry run; a torchrun rank that does not write the directory)."""
        job = job or job_id()
        path = os.path.join(run_path, LOCK_NAME)
        if fcntl is None:
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return  # no job ever locked it
        except OSError as error:
            raise _open_failed(run_path, error) from None
        try:
            settle = time.monotonic() + SETTLE_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free: nobody holds it exclusively
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    return
                except BlockingIOError:
                    holder = _read_holder(fd)
                    if holder.get("job") == job:
                        return  # this job's own leader took it
                    if time.monotonic() > settle:  # not a moment's check by another rank: a job holds it
                        raise _in_use(run_path, holder) from None
                    time.sleep(POLL_S)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Empty the file (a clean end: nothing stale left) and close this process's descriptor. The flock goes
        with the description's last descriptor: ranks that still hold an inherited one keep the directory locked."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass  # a full or read-only disk: the holder's name stays, and the next job takes it over as stale
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
