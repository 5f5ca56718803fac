"""Client for HTTP reward servers: the `remote` reward of rewards/__init__.py, in two wire protocols.

    python main.py --reward remote --remote-url http://reward-host:18085 --remote-protocol flow_grpo
    python main.py --reward remote --remote-url http://127.0.0.1:18086 --remote-protocol flow_grpo \
        --remote-score-key outputs

- `flow_grpo` (Flow-GRPO's reward servers: yifan123/reward-server app_geneval.py / app_deqa.py, and the UnifiedReward
  server): POST `pickle.dumps({"images": [JPEG bytes], "prompts": [str], "meta_datas": [dict], "only_strict": True})`
  in batches of --remote-batch-size (Flow-GRPO: 64); the answer is a pickled dict whose --remote-score-key holds one
  number per image (`scores` for GenEval, `outputs` for DeQA and UnifiedReward). Each server reads the keys it needs:
  GenEval `images`, `meta_datas` (the dataset's metadata rows) and `only_strict`; DeQA `images`; UnifiedReward
  `images` and `prompts`. JPEGs are PIL's default quality (75), as Flow-GRPO's client encodes them.
- `json` (this project's original protocol): POST JSON {"images": [base64 PNG], "prompts": [...], "meta_datas": [...]}
  -> {"scores": [float per image]} (the score key is configurable here too).

A server's answer is data, never objects. A pickled answer is never given to pickle or numpy: `plain_loads` reads
its opcodes itself and builds only plain containers, strings, bytes and numbers; a numpy array or scalar (what a
server that answers `np.asarray(scores)` sends) becomes a list of numbers, read from its bytes here and only when
its dtype is a plain bool, int or float type, its size fits MAX_ITEMS and its bytes are exactly that size. Anything
else (a callable, an object dtype, a declared size that does not match, nesting deeper than MAX_DEPTH) is refused
before any of it is built. Every answer, JSON included, is bounded: at most MAX_ANSWER_BYTES of body, MAX_DEPTH
levels, MAX_ITEMS entries and elements in all.

Each attempt has a total deadline of --remote-timeout-s (connect, send, wait, read every byte: `_Deadline`), not a
per-read timeout that a server dripping one byte at a time would renew for ever. Timeouts, connection errors and
HTTP 5xx are retried with exponential backoff capped at BACKOFF_CAP_S (the default 7 retries wait 1, 2, 4, 8, 15, 15,
15 s: a server restart of a minute is ridden out), each retry said on stderr; HTTP 4xx, redirects, an answer over
the size cap and malformed answers (wrong count, non-numbers, NaN) are errors at once, never silently zero. So one
call of the scorer ends within `call_deadline_s` (what the rank's liveness excuses, main.Rank.score). Every error
names the server and carries its answer body as text on one line: a pickled answer as the data it holds, anything
else (a Flask traceback) decoded with its unprintable characters escaped. A missing score key names the keys found
and the setting that would read them.
"""
from __future__ import annotations

import base64
import functools
import http.client
import io
import json
import math
import pickle
import pickletools
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

PROTOCOLS = ("json", "flow_grpo")
BODY_SHOWN = 600  # characters of a server's answer quoted in errors
ERROR_BODY_READ = 64 * 1024  # bytes of an HTTP error's body read to quote it (the rest is never read)
BACKOFF_CAP_S = 15.0  # the longest wait between two attempts
# An answer is a few numbers per image (GenEval's for 64 images: ~6 KB pickled): the caps leave room for servers that
# send text per image, and keep a hostile or broken one from filling the rank's memory.
MAX_ANSWER_BYTES = 4 * 2**20
MAX_DEPTH = 8  # GenEval: dict -> dict -> list of numbers (3 levels)
MAX_ITEMS = 2**18  # entries of every container and elements of every array, together (parsing 2**18: ~1 s)
MAX_INT_BITS = 63  # a score or count beyond int64 is no score (and a huge int is slow to print)
READ_CHUNK = 64 * 1024


def backoff_delays(retries: int, base_s: float, cap_s: float = BACKOFF_CAP_S) -> list[float]:
    """Seconds slept before each retry: base, 2 base, 4 base, ... capped at cap_s."""
    return [min(base_s * 2**k, cap_s) for k in range(retries)]


class RemoteRewardError(RuntimeError):
    """A reward server failed: unreachable, HTTP error, or a malformed response."""


class NotPlainData(ValueError):
    """An answer that is not bounded plain data (see the module docstring); the message says what it held."""


# --- answers as plain data -------------------------------------------------------------------------
# numpy's pickle of an array: _reconstruct(ndarray, (0,), b"b") then BUILD (1, shape, dtype, fortran, bytes)
# (protocols <= 4), or _frombuffer(bytes, dtype, shape, order) (protocol 5); a scalar: scalar(dtype, bytes); a dtype:
# dtype(code, False, True) then BUILD (3, byteorder, None, None, None, -1, -1, 0) (numpy/_core/src/multiarray/
# descriptor.c, arraydescr_reduce). Only these names resolve, each to a marker that this module interprets itself.
_NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric")
_GLOBALS = {("numpy", "ndarray"): "ndarray", ("numpy", "dtype"): "dtype", ("_codecs", "encode"): "encode",
            ("builtins", "set"): "set", ("builtins", "frozenset"): "frozenset", ("__builtin__", "set"): "set",
            ("collections", "OrderedDict"): "dict"}
_GLOBALS |= {(m, f): f for m in _NUMPY_MODULES for f in ("_reconstruct", "scalar", "_frombuffer")}
# plain number dtypes by (kind, item size): bool, signed and unsigned ints, floats
_PLAIN_DTYPES = {"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"}
_OPS = {"PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT",
        "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING",
        "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
        "BINUNICODE8", "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2",
        "TUPLE3", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET", "GET", "BINGET",
        "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD"}


class _Marker:
    """A global the answer named (a function of the table above), or a numpy object it is building."""

    def __init__(self, kind: str, value=None):
        self.kind, self.value, self.done = kind, value, False


def _dtype(code, state) -> np.dtype:
    """A plain number dtype from numpy's pickled (code, BUILD state), checked field by field; anything else (an
    object, structured, sub-array or void dtype, flags that say otherwise) is refused before numpy sees it."""
    if not isinstance(code, str) or code not in _PLAIN_DTYPES:
        raise NotPlainData(f"a numpy dtype {code!r} (allowed: {', '.join(sorted(_PLAIN_DTYPES))})")
    if not (isinstance(state, tuple) and len(state) == 8 and state[0] == 3 and state[1] in ("<", ">", "|", "=")
            and state[2:5] == (None, None, None) and state[5:] == (-1, -1, 0)):
        raise NotPlainData(f"a numpy dtype {code!r} with the state {state!r:.120} (a plain number dtype has "
                           "(3, byteorder, None, None, None, -1, -1, 0))")
    return np.dtype(("<" if state[1] == "=" and sys.byteorder == "little" else state[1].replace("=", ">")) + code
                    if code[1:] != "1" else code)


def _numbers(raw, dtype, shape, fortran: bool = False) -> list:
    """The array's elements as (nested) Python lists, read from its bytes after checking their count."""
    if not isinstance(dtype, np.dtype):
        raise NotPlainData(f"an array whose dtype is {type(dtype).__name__}")
    if not (isinstance(shape, tuple) and len(shape) <= MAX_DEPTH
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise NotPlainData(f"an array of shape {shape!r:.80}")
    count = math.prod(shape)
    if count > MAX_ITEMS:
        raise NotPlainData(f"an array of shape {shape} ({count} elements; at most {MAX_ITEMS})")
    if not isinstance(raw, bytes) or len(raw) != count * dtype.itemsize:
        size = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise NotPlainData(f"an array of shape {shape} and dtype {dtype.str} over {size} bytes "
                           f"(it needs {count * dtype.itemsize})")
    return np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C").tolist()


def _reduce(marker: _Marker, args):
    """What calling the global `marker` with `args` gives, done here for the few plain-data forms."""
    kind = marker.kind
    if not isinstance(args, tuple):
        raise NotPlainData(f"a call of {kind} with {type(args).__name__} arguments")
    if kind == "encode" and len(args) in (1, 2) and isinstance(args[0], str) \
            and args[1:] in ((), ("latin1",), ("latin-1",)):
        return args[0].encode("latin1")  # protocols <= 2 store bytes as _codecs.encode(str, "latin1")
    if kind in ("set", "frozenset") and len(args) <= 1:
        return (set if kind == "set" else frozenset)(args[0] if args else ())
    if kind == "dict" and len(args) <= 1:
        return dict(args[0] if args else ())
    if kind == "_reconstruct" and len(args) == 3 and isinstance(args[0], _Marker) and args[0].kind == "ndarray":
        return _Marker("array")  # its BUILD carries shape, dtype and bytes
    if kind == "dtype" and len(args) == 3:
        return _Marker("dtype-pending", args[0])
    if kind == "scalar" and len(args) == 2:
        return _numbers(args[1], _done(args[0], "dtype"), (1,))[0]
    if kind == "_frombuffer" and len(args) == 4 and args[3] in ("C", "F"):
        return _numbers(bytes(args[0]) if isinstance(args[0], bytearray) else args[0], _done(args[1], "dtype"),
                        args[2], fortran=args[3] == "F")
    raise NotPlainData(f"a call of {kind} with {len(args)} arguments")


def _done(value, kind: str):
    if not (isinstance(value, _Marker) and value.kind == kind and value.done):
        raise NotPlainData(f"an unfinished or unknown {kind}: {value!r:.80}")
    return value.value


def _build(target, state) -> None:
    """BUILD on a numpy dtype or array being built: checks its state and finishes it (nothing else has state)."""
    if not isinstance(target, _Marker) or target.done:
        raise NotPlainData(f"state set on {type(target).__name__} (only numpy arrays and dtypes have state)")
    if target.kind == "dtype-pending":
        target.kind, target.value = "dtype", _dtype(target.value, state)
    elif target.kind == "array":
        if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1 and isinstance(state[3], bool)):
            raise NotPlainData(f"an array with the state {state!r:.120}")
        _, shape, dtype, fortran, raw = state
        target.value = _numbers(raw, _done(dtype, "dtype"), shape, fortran)
    else:
        raise NotPlainData(f"state set on {target.kind}")
    target.done = True


def plain_loads(body: bytes):
    """A pickled answer as plain data (dict, list, tuple, set, str, bytes, int, float, bool, None; numpy arrays and
    scalars as lists and numbers), read opcode by opcode (pickletools.genops: it parses, never calls anything);
    NotPlainData naming what else it holds. Nothing the answer names is imported or called."""
    stack: list = []
    marks: list[list] = []
    memo: dict = {}
    try:
        for op, arg, _ in pickletools.genops(body):
            name = op.name
            if name not in _OPS:
                raise NotPlainData(f"the pickle opcode {name} (it builds objects, not data)")
            if name == "STOP":
                return _plain(stack.pop())
            if name in ("PROTO", "FRAME"):
                continue
            if name == "MARK":
                marks.append(stack)
                stack = []
            elif name == "POP":
                stack.pop()
            elif name == "POP_MARK":
                stack = marks.pop()
            elif name == "DUP":
                stack.append(stack[-1])
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name in ("NONE", "NEWTRUE", "NEWFALSE"):  # opcodes without an argument
                stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[name])
            elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE"):
                stack.append({"EMPTY_LIST": list, "EMPTY_DICT": dict, "EMPTY_SET": set, "EMPTY_TUPLE": tuple}[name]())
            elif name in ("LIST", "TUPLE", "DICT", "FROZENSET"):
                items, stack = stack, marks.pop()
                stack.append(dict(zip(items[::2], items[1::2])) if name == "DICT" else
                             {"LIST": list, "TUPLE": tuple, "FROZENSET": frozenset}[name](items))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name in ("APPEND", "SETITEM"):
                items = [stack.pop()] if name == "APPEND" else [stack.pop(-2), stack.pop()]
                _extend(stack[-1], items, name)
            elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
                items, stack = stack, marks.pop()
                _extend(stack[-1], items, name)
            elif name in ("GLOBAL", "STACK_GLOBAL"):
                module, _, attribute = arg.partition(" ") if name == "GLOBAL" else (stack.pop(-2), None, stack.pop())
                kind = _GLOBALS.get((module, attribute))
                if kind is None:
                    raise NotPlainData(f"the global {module}.{attribute} (an answer may hold only containers, "
                                       "strings, numbers and numpy arrays of numbers)")
                stack.append(_Marker(kind))
            elif name == "REDUCE":
                args = stack.pop()
                function = stack.pop()
                if not isinstance(function, _Marker):
                    raise NotPlainData(f"a call of a {type(function).__name__}")
                stack.append(_reduce(function, args))
            elif name == "BUILD":
                state = stack.pop()
                _build(stack[-1], state)
            else:  # a value: a number, a string, bytes
                stack.append(bytes(arg) if isinstance(arg, bytearray) else arg)
    except NotPlainData:
        raise
    except (ValueError, IndexError, KeyError, TypeError, AttributeError, OverflowError, EOFError) as error:
        raise NotPlainData(f"a malformed pickle ({type(error).__name__}: {str(error)[:200]})") from None
    raise NotPlainData("a pickle without its end (no STOP opcode)")


def _extend(target, items: list, how: str) -> None:
    if how in ("APPEND", "APPENDS") and isinstance(target, list):
        target.extend(items)
    elif how in ("SETITEM", "SETITEMS") and isinstance(target, dict) and len(items) % 2 == 0:
        target.update(zip(items[::2], items[1::2]))
    elif how == "ADDITEMS" and isinstance(target, set):
        target.update(items)
    else:
        raise NotPlainData(f"{how} on a {type(target).__name__}")


def _plain(value, depth: int = 0, budget: list | None = None):
    """`value` checked to be bounded plain data (MAX_DEPTH levels, MAX_ITEMS entries; a structure that contains
    itself is infinitely deep), a copy with numpy markers replaced by the numbers they were read as."""
    budget = [MAX_ITEMS] if budget is None else budget
    if isinstance(value, _Marker):
        value = _done(value, "array")  # a dtype alone is no data
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return value
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise NotPlainData(f"an integer of {value.bit_length()} bits (at most {MAX_INT_BITS})")
        return value
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        raise NotPlainData(f"a {type(value).__name__}")
    if depth >= MAX_DEPTH:
        raise NotPlainData(f"containers nested deeper than {MAX_DEPTH} levels")
    budget[0] -= len(value)
    if budget[0] < 0:
        raise NotPlainData(f"more than {MAX_ITEMS} entries and elements")
    if isinstance(value, dict):
        return {_plain(k, depth + 1, budget): _plain(v, depth + 1, budget) for k, v in value.items()}
    return type(value)(_plain(v, depth + 1, budget) for v in value)


def json_loads(body: bytes):
    """A JSON answer as bounded plain data (NotPlainData otherwise)."""
    try:
        answer = json.loads(body)
    except RecursionError:
        raise NotPlainData(f"containers nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as error:  # bad JSON, or an integer of more digits than Python converts
        raise NotPlainData(f"malformed JSON ({str(error)[:200]})") from None
    return _plain(answer)


def safe_loads(data: bytes):
    """The answer of a Flow-GRPO server as plain data: plain_loads (kept under its old name)."""
    return plain_loads(data)


# --- encoding -----------------------------------------------------------------------------------
def _png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _jpeg_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")  # PIL's default quality 75, as Flow-GRPO's clients
    return buffer.getvalue()


def _printable(text: str) -> str:
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _as_text(body: bytes, protocol: str) -> str:
    """A pickled answer as the plain data it holds, when it is plain data; else the bytes decoded (JSON, an HTML or
    traceback page)."""
    if protocol == "flow_grpo":
        try:
            return repr(plain_loads(body))
        except NotPlainData:
            pass
    return body.decode("utf-8", errors="replace")


def _quote(body: bytes, protocol: str = "json") -> str:
    """The answer body as text on one line (lines joined by " | ", unprintable characters escaped); a long one keeps
    its start and its end, where a traceback's exception is."""
    text = " | ".join(_printable(line.strip()) for line in _as_text(body, protocol).splitlines() if line.strip())
    if len(text) > BODY_SHOWN:
        text = f"{text[:BODY_SHOWN // 3]} ... {text[-2 * BODY_SHOWN // 3:]} ({len(text)} characters)"
    return f"<<{text}>>"


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)  # a server answering true/false has a bug


def _score_lists(answer: dict, expected: int) -> list[str]:
    """Keys of `answer` that hold `expected` numbers: what the score key could be set to."""
    return sorted(str(k) for k, v in answer.items()
                  if isinstance(v, (list, tuple)) and len(v) == expected and all(_is_number(x) for x in v))


def _parse_answer(body: bytes, url: str, protocol: str, key: str, expected: int,
                  key_flag: str = "--remote-score-key ") -> list[float]:
    """The server's answer -> `expected` finite floats under `key`; anything else is a RemoteRewardError.
    `key_flag`: how the score key is set (e.g. '--remote-score-key geneval=' for a named remote reward)."""
    try:
        answer = plain_loads(body) if protocol == "flow_grpo" else json_loads(body)
    except NotPlainData as error:
        need = "a pickled dict of plain data" if protocol == "flow_grpo" else "JSON"
        shown = _quote(body) if protocol == "json" else f"{body[:BODY_SHOWN // 3]!r}" + (
            f"... ({len(body)} bytes)" if len(body) > BODY_SHOWN // 3 else "")  # a pickle's bytes, escaped
        raise RemoteRewardError(f"reward server {url} sent an answer that is not {need} with {key!r}: it holds "
                                f"{error}; body {shown}") from None
    if not isinstance(answer, dict) or key not in answer:
        found = sorted(map(str, answer)) if isinstance(answer, dict) else type(answer).__name__
        fits = _score_lists(answer, expected) if isinstance(answer, dict) else []
        hint = (f"set {key_flag}{fits[0]}" if len(fits) == 1 else
                f"set {key_flag}KEY, one of {fits}" if fits else
                f"set {key_flag}KEY (GenEval: scores, DeQA / UnifiedReward: outputs)")
        raise RemoteRewardError(f"reward server {url} sent a malformed response: no score key {key!r}, its keys are "
                                f"{found}; {hint}; body {_quote(body, protocol)}")
    scores = answer[key]
    if not isinstance(scores, (list, tuple)) or len(scores) != expected:
        shown = _printable(repr(scores)[:200])
        raise RemoteRewardError(f"reward server {url} sent {shown} as {key!r}; expected a list of "
                                f"{expected} numbers (one per image); body {_quote(body, protocol)}")
    bad = [s for s in scores if not _is_number(s) or not math.isfinite(s)]
    if bad:
        raise RemoteRewardError(f"reward server {url} sent non-finite or non-numeric scores "
                                f"{_printable(repr(bad[:5])[:200])}; body {_quote(body, protocol)}")
    return [float(s) for s in scores]


# --- one request, within its deadline --------------------------------------------------------------
class _Deadline:
    """The whole time of one attempt: connect, send, wait, read every byte. A timer shuts the connection's socket
    down when it passes, so no read outlasts it however slowly the server drips its bytes (a socket timeout bounds
    each read alone, and every byte renews it)."""

    def __init__(self, seconds: float):
        self.seconds, self.end, self.expired = seconds, time.monotonic() + seconds, False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        return max(self.end - time.monotonic(), 1e-3)

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    try:  # the plain socket's shutdown, also under TLS: the blocked read returns at once, the TLS layer then fails
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


class _DeadlineHTTP(http.client.HTTPConnection):
    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self):
        self.timeout = self.deadline.remaining()  # connecting takes from the same budget
        super().connect()
        self.deadline.watch(self.sock)


class _DeadlineHTTPS(http.client.HTTPSConnection):
    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self):
        self.timeout = self.deadline.remaining()
        super().connect()
        self.deadline.watch(self.sock)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTP, deadline=self.deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTPS, deadline=self.deadline), req, context=self._context)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A reward server's 30x is an error (HTTPError), not a request to another address."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _TooLarge(Exception):
    pass


def _read_capped(response, cap: int) -> bytes:
    """The body, refused (_TooLarge) as soon as it is known to be over `cap` bytes: by its declared length before
    reading any of it, else once cap + 1 bytes have come."""
    declared = response.headers.get("Content-Length") if response.headers is not None else None
    if declared is not None and declared.strip().isdigit() and int(declared) > cap:
        raise _TooLarge(f"an answer of {int(declared)} bytes (Content-Length; at most {cap})")
    chunks, size = [], 0
    while chunk := response.read(min(READ_CHUNK, cap + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            raise _TooLarge(f"an answer of more than {cap} bytes")
    return b"".join(chunks)


def call_deadline_s(images: int, timeout_s: float, retries: int, backoff_s: float, batch_size: int) -> float:
    """The longest one scorer call on `images` images can take: each batch's attempts and the waits between them."""
    batches = max(1, math.ceil(images / batch_size))
    return batches * ((retries + 1) * timeout_s + sum(backoff_delays(retries, backoff_s)))


def remote_scorer(url: str, timeout_s: float, retries: int, backoff_s: float, protocol: str = "json",
                  score_key: str = "scores", batch_size: int = 64, key_flag: str = "--remote-score-key ") -> Callable:
    """score(pil_images, prompts, metadata) -> Tensor[B], posting batches of `batch_size` to `url`; each attempt
    ends within timeout_s, retries wait backoff_delays(retries, backoff_s). score.deadline_s(n): the longest a call
    on n images takes (call_deadline_s)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"--remote-protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")

    def post(body: bytes) -> bytes:
        kind = "application/octet-stream" if protocol == "flow_grpo" else "application/json"
        request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": kind})
        deadline = _Deadline(timeout_s)
        opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline), _NoRedirects())
        try:
            with opener.open(request, timeout=timeout_s) as response:
                answer = _read_capped(response, MAX_ANSWER_BYTES)
        except urllib.error.HTTPError as error:
            try:
                error.body = _read_capped(error, ERROR_BODY_READ)
            except (_TooLarge, OSError, http.client.HTTPException):
                error.body = b"(the error's body was not read: too long or cut)"
            if deadline.expired:
                raise TimeoutError(f"no whole answer within {timeout_s:g} s") from None
            raise
        except (OSError, http.client.HTTPException):
            if deadline.expired:  # the shut socket's error: say what happened
                raise TimeoutError(f"no whole answer within {timeout_s:g} s") from None
            raise
        finally:
            deadline.cancel()
        if deadline.expired:  # a body read to its end because the socket was shut is not the whole answer
            raise TimeoutError(f"no whole answer within {timeout_s:g} s")
        return answer

    def encode(images, prompts, metadata) -> bytes:
        if protocol == "flow_grpo":
            return pickle.dumps({"images": [_jpeg_bytes(im) for im in images], "prompts": list(prompts),
                                 "meta_datas": list(metadata), "only_strict": True})
        return json.dumps({"images": [_png_base64(im) for im in images], "prompts": list(prompts),
                           "meta_datas": list(metadata)}).encode("utf-8")

    def score_batch(images, prompts, metadata) -> list[float]:
        body = encode(images, prompts, metadata)
        delays = backoff_delays(retries, backoff_s)
        for attempt in range(retries + 1):
            try:
                return _parse_answer(post(body), url, protocol, score_key, expected=len(images), key_flag=key_flag)
            except urllib.error.HTTPError as error:  # a subclass of URLError: test it first
                detail = f"HTTP {error.code} {error.reason}, body {_quote(getattr(error, 'body', b''), protocol)}"
                if error.code < 500:
                    raise RemoteRewardError(f"reward server {url} refused the request with {detail}") from None
                last = detail
            except _TooLarge as error:  # a server that sends too much will do it again
                raise RemoteRewardError(f"reward server {url} sent {error}: refused without reading it "
                                        "(an answer is a few numbers per image)") from None
            except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
                last = repr(error)  # timeouts and connection errors are OSErrors too
            if attempt < retries:
                print(f"[digenrl] reward server {url}: attempt {attempt + 1} of {retries + 1} failed ({last:.200}); "
                      f"retrying in {delays[attempt]:g} s", file=sys.stderr, flush=True)
                time.sleep(delays[attempt])
        raise RemoteRewardError(f"reward server {url} failed after {retries + 1} attempts; last error: {last}")

    def score(images: list[Image.Image], prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        metadata = list(metadata) if metadata is not None else [{} for _ in images]
        out: list[float] = []
        for start in range(0, len(images), batch_size):
            end = start + batch_size
            out += score_batch(images[start:end], prompts[start:end], metadata[start:end])
        return torch.tensor(out, dtype=torch.float32)  # [B]

    score.deadline_s = functools.partial(call_deadline_s, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                                         batch_size=batch_size)
    return score
