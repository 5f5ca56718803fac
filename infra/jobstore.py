"""The job's store, readable and writable only with the job's secret.

    store = SignedStore(open_store(master, world, is_master, timeout_s), job_key())
    store.prefixed("liveness").set("where/0", "host 123")  # stored as an opaque name and a sealed value

torch.distributed's TCPStore has no access control: any process that can reach its port (the self-spawning
launcher's is on 127.0.0.1, so every process of every user on the host; torchrun's on MASTER_ADDR) may read, write
and list its keys. Writing `preemption/stop/asked` from another process used to stop a job (exit 75), and the
claims, announcements and liveness keys were as open. So every rank wraps the store it connects to:
- a key's name is HMAC-SHA256(secret, key) (in hex), so no one without the secret can name a key the job will
  read, nor tell which opaque name is which;
- a value is sealed: encrypted with a keystream of SHAKE-256(secret, fresh nonce) and authenticated with
  HMAC-SHA256(secret, name, nonce, ciphertext) (encrypt-then-MAC). A value that does not open is a StoreTampered
  error naming the store, never data;
- `add` and `compare_set` keep TCPStore's semantics with compare-and-set loops over sealed values (each sealed
  value is unique, so a racing writer never reads its own value back by chance).
The torch.distributed process groups rendezvous through the same wrapper (a dist.Store subclass), so gloo's and
NCCL's addresses and ids are sealed too.

The secret (`job_key`): DIGENRL_JOB_SECRET when set (the same on every node: `export
DIGENRL_JOB_SECRET=$(python -c "import secrets; print(secrets.token_hex(32))")` before torchrun, which passes the
environment to its ranks); else, for self-spawned ranks, a random one their launcher hands them through the start
method's own pipe (infra/launch.py); else, under torchrun, one derived from a per-user file (~/.config/digenrl/
store_secret, made on first use with mode 0600: on a cluster whose home folder every node shares, every node reads
the same) and the job's run id and store address. At start every rank posts a fingerprint of its key (a MAC of a
constant: it gives nothing away) and checks the others', so ranks with different secrets are told so at once
instead of waiting on names the others never write.

What an attacker who reaches the store can still do (no store without access control can prevent it): see how
many keys there are, their sizes and when they change; delete or overwrite keys (the job then fails naming the
store, or, for a deleted counter, waits until liveness names the stall), or put back a value a key held earlier (a
replay of the job's own value: for a claim counter, a fragment generated twice); fill the store's memory. What it
cannot: read a value, name a key the job reads, or write a value the job accepts that the job did not write.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import stat

import torch.distributed as dist

from infra.launch import SECRET_ENV  # the launcher sets it in its ranks (launch.py imports no torch)

NO_DEADLINE = datetime.timedelta(days=7)  # comm.NO_DEADLINE: waits at start are bounded by liveness

MIN_SECRET_CHARS = 32
USER_SECRET = "$XDG_CONFIG_HOME/digenrl/store_secret (~/.config/...)"  # as messages name it (user_secret_path)
NONCE, TAG = 16, 16  # bytes of a sealed value before its ciphertext
_ABSENT = b"\x00absent"  # what a never-matching compare_set answers for a missing key (no sealed value is this short)
FINGERPRINT = "digenrl-secret-check/"  # the only plain keys: one per rank


class StoreTampered(RuntimeError):
    """A value in the job's store that was not sealed with this job's secret."""


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # bytes, bytearray, or the list of ints a C++ caller (gloo, NCCL) hands over


class SignedStore(dist.Store):
    """A store whose key names and values only holders of `key` can make or read (see the module docstring)."""

    def __init__(self, inner: dist.Store, key: bytes, prefix: str = ""):
        super().__init__()
        self.inner, self.key, self.prefix = inner, key, prefix
        self._name_key = hmac.new(key, b"name", hashlib.sha256).digest()
        self._seal_key = hmac.new(key, b"seal", hashlib.sha256).digest()
        self._mac_key = hmac.new(key, b"mac", hashlib.sha256).digest()

    # --- naming and sealing ------------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        return "j/" + hmac.new(self._name_key, (self.prefix + key).encode(), hashlib.sha256).hexdigest()[:32]

    def _seal(self, name: str, value: bytes) -> bytes:
        nonce = os.urandom(NONCE)
        cipher = _xor(value, hashlib.shake_256(self._seal_key + nonce).digest(len(value)))
        tag = hmac.new(self._mac_key, name.encode() + b"\0" + nonce + cipher, hashlib.sha256).digest()[:TAG]
        return nonce + tag + cipher

    def _open(self, key: str, name: str, raw: bytes) -> bytes:
        raw = bytes(raw)
        nonce, tag, cipher = raw[:NONCE], raw[NONCE:NONCE + TAG], raw[NONCE + TAG:]
        want = hmac.new(self._mac_key, name.encode() + b"\0" + nonce + cipher, hashlib.sha256).digest()[:TAG]
        if len(raw) < NONCE + TAG or not hmac.compare_digest(tag, want):  # the length: a cut value never opens
            raise StoreTampered(f"the job's store holds a value for {self.prefix + key!r} that was not written with "
                                "this job's secret: another process wrote to the store (its port accepts anyone "
                                "who reaches it), or this rank's secret differs from the others' "
                                f"({SECRET_ENV} or {USER_SECRET} not the same on every node); stopping")
        return _xor(cipher, hashlib.shake_256(self._seal_key + nonce).digest(len(cipher)))

    def _current(self, name: str) -> bytes:
        """The raw value under `name` in one round trip, _ABSENT when there is none."""
        return self.inner.compare_set(name, _ABSENT, _ABSENT)

    # --- dist.Store --------------------------------------------------------------------------------------
    def set(self, key, value) -> None:
        name = self._name(key)
        self.inner.set(name, self._seal(name, _bytes(value)))

    def get(self, key) -> bytes:
        name = self._name(key)
        return self._open(key, name, self.inner.get(name))  # blocks until the key exists, as TCPStore's

    def multi_get(self, keys) -> list[bytes]:
        names = [self._name(k) for k in keys]
        return [self._open(k, n, raw) for k, n, raw in zip(keys, names, self.inner.multi_get(names))]

    def multi_set(self, keys, values) -> None:
        names = [self._name(k) for k in keys]
        self.inner.multi_set(names, [self._seal(n, _bytes(v)) for n, v in zip(names, values)])

    def add(self, key, amount: int) -> int:
        """TCPStore's add: the counter (0 when missing) plus `amount`, atomically (compare-and-set on sealed
        values); add(key, 0) reads it."""
        name = self._name(key)
        while True:
            raw = self._current(name)
            current = 0 if raw == _ABSENT else int(self._open(key, name, raw))
            if amount == 0:
                return current
            sealed = self._seal(name, str(current + amount).encode())
            if self.inner.compare_set(name, b"" if raw == _ABSENT else raw, sealed) == sealed:
                return current + amount

    def compare_set(self, key, expected, desired) -> bytes:
        """TCPStore's compare_set: `desired` when the value was `expected` (or missing and `expected` empty), else
        the current value (or `expected` itself for a missing key)."""
        name, expected, desired = self._name(key), _bytes(expected), _bytes(desired)
        while True:
            raw = self._current(name)
            if raw == _ABSENT:
                if expected:
                    return expected
            elif self._open(key, name, raw) != expected:
                return self._open(key, name, raw)
            sealed = self._seal(name, desired)
            if self.inner.compare_set(name, b"" if raw == _ABSENT else raw, sealed) == sealed:
                return desired  # else another writer got in between: look again

    def check(self, keys) -> bool:
        return self.inner.check([self._name(k) for k in keys])

    def wait(self, keys, timeout=None) -> None:
        names = [self._name(k) for k in keys]
        self.inner.wait(names) if timeout is None else self.inner.wait(names, timeout)

    def delete_key(self, key) -> bool:
        return self.inner.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    def clone(self) -> "SignedStore":
        """A connection of its own (TCPStore.clone), the same key and prefix."""
        return type(self)(self.inner.clone(), self.key, self.prefix)

    def prefixed(self, name: str) -> "SignedStore":
        """This store under `name/` (what dist.PrefixStore does; its clone() cannot reach a Python store)."""
        return type(self)(self.inner, self.key, f"{self.prefix}{name}/")

    # --- the secret check at start -------------------------------------------------------------------------
    def fingerprint(self) -> str:
        return hmac.new(self.key, b"fingerprint", hashlib.sha256).hexdigest()[:16]

    def check_peers(self, rank: int, world: int) -> None:
        """Post this rank's fingerprint and compare every rank's: ValueError naming a rank whose secret differs."""
        self.inner.set(f"{FINGERPRINT}{rank}", self.fingerprint())
        keys = [f"{FINGERPRINT}{r}" for r in range(world)]
        self.inner.wait(keys, NO_DEADLINE)  # a late rank is liveness' to judge (the store's timeout is --timeout-s)
        theirs = [v.decode(errors="replace") for v in self.inner.multi_get(keys)]
        other = [r for r, f in enumerate(theirs) if f != self.fingerprint()]
        if other:
            raise ValueError(f"rank {other[0]}'s store secret differs from rank {rank}'s: every rank needs the same "
                             f"{SECRET_ENV} (or, under torchrun without it, the same {USER_SECRET} on every node); "
                             "or another process wrote to the job's store")


# --- the secret ------------------------------------------------------------------------------------------
def new_secret() -> str:
    return secrets.token_hex(32)


def user_secret_path(environ=os.environ) -> str:
    return os.path.join(environ.get("XDG_CONFIG_HOME") or os.path.expanduser(os.path.join("~", ".config")),
                        "digenrl", "store_secret")


def _user_secret(path: str) -> bytes:
    """The per-user secret file's bytes, made on first use (mode 0600, written whole then linked into place: two
    ranks making it at once agree on the first one); refused when others can read or change it."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, new_secret().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        os.unlink(tmp)
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path} (the job store's secret under torchrun) must belong to you and be readable by you "
                         f"alone (chmod 600 {path}); or set {SECRET_ENV}")
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{path} holds {len(secret)} characters; a secret needs at least {MIN_SECRET_CHARS}")
    return secret


def job_key(environ=os.environ, job: str | None = None) -> bytes:
    """The job's store key: from DIGENRL_JOB_SECRET (set by the self-spawning launcher for its ranks, or by the
    user for every node), else from the per-user secret file and the job's id (`job`: infra/runlock.job_id)."""
    text = environ.get(SECRET_ENV)
    if text is not None:
        if len(text) < MIN_SECRET_CHARS:
            raise ValueError(f"{SECRET_ENV} has {len(text)} characters; a secret needs at least {MIN_SECRET_CHARS} "
                             "(e.g. python -c \"import secrets; print(secrets.token_hex(32))\")")
        return hashlib.sha256(b"digenrl job secret\0" + text.encode()).digest()
    from infra.runlock import job_id
    return hmac.new(_user_secret(user_secret_path(environ)), (job or job_id()).encode(), hashlib.sha256).digest()
