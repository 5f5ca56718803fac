"""What reaches a run from outside is data, bounded, and never steers it (docs/USAGE.md, "What is trusted"): a reward
server's answer (a real HTTP server on 127.0.0.1 sends each hostile answer), a run folder's saved configuration, the
job's store (a second process tries it), the run lock's order, and inputs that used to pass validation and fail
later. Each test tries what used to crash, hang or steer a run (issue 40) and names the old behaviour.
"""
import contextlib
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

import rewards
from infra.progress import Progress
from rewards import REWARDS, RemoteRewardError
from rewards.remote import MAX_ANSWER_BYTES, call_deadline_s

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _no_proxy_for_localhost(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@contextlib.contextmanager
def raw_server(answer):
    """A server on 127.0.0.1 whose answer(handler, stop) writes the raw response (status line and all) to
    handler.wfile, as slowly or as much as it likes until `stop` is set (at the end of the test). Yields (url, log):
    log["requests"] counts requests, log["sent"] the answer bytes written."""
    log, stop = {"requests": 0, "sent": 0}, threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            log["requests"] += 1
            with contextlib.suppress(ConnectionError, OSError):
                answer(self, stop, log)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def write(handler, log, data: bytes) -> None:
    handler.wfile.write(data)
    handler.wfile.flush()
    log["sent"] += len(data)


def answering(body: bytes, length: int | None = None):
    """An answer(): status 200, Content-Length `length` (default: the body's), the body at once."""
    def answer(handler, stop, log):
        write(handler, log, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
              % (len(body) if length is None else length) + body)
    return answer


def flow_grpo_reward(url, **overrides):
    options = dict(remote_url=url, remote_timeout_s=5.0, remote_retries=0, remote_backoff_s=0.01,
                   remote_protocol="flow_grpo", remote_batch_size=64)
    return REWARDS["remote"](**{**options, **overrides})


RED = torch.tensor([1.0, 0.0, 0.0])[None, :, None, None].expand(1, 3, 8, 8)


def refusal(url, **overrides) -> str:
    """The one-line RemoteRewardError the reward raises for what the server at `url` answers."""
    with pytest.raises(RemoteRewardError) as caught:
        flow_grpo_reward(url, **overrides)(RED, ["a red image"])
    message = str(caught.value)
    assert url in message and "\n" not in message and len(message) < 2000, message[:3000]
    return message


# ---------------------------------------------------------------- reward servers: answers are data

def numpy_pickle(array: np.ndarray, protocol: int = 2) -> bytes:
    return pickle.dumps({"scores": array}, protocol=protocol)


def object_dtype_over_chosen_bytes() -> bytes:
    """An array whose dtype is numpy's object type with its flags saying it holds no references: numpy then takes
    the chosen bytes as pointers (.tolist() dereferenced 0x4141414141414141: main.py exited 139, SIGSEGV)."""
    body = numpy_pickle(np.array([0x4141414141414141], dtype=np.int64))
    assert body.count(b"X\x02\x00\x00\x00i8") == 1 and body.count(b"X\x01\x00\x00\x00<") == 1
    return body.replace(b"X\x02\x00\x00\x00i8", b"X\x02\x00\x00\x00O8").replace(b"X\x01\x00\x00\x00<",
                                                                                 b"X\x01\x00\x00\x00|")


def array_without_its_bytes(count: int) -> bytes:
    """numpy's _reconstruct(ndarray, (count,), b"b") and no BUILD: an uninitialised array of `count` bytes (it
    allocated them before any check, and its heap words were quoted in the error)."""
    return (b"\x80\x03}X\x06\x00\x00\x00scores" + b"cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
            + b"J" + count.to_bytes(4, "little") + b"\x85C\x01b\x87Rs.")


def declared_shape_over_the_bytes() -> bytes:
    """A BUILD whose shape declares 2**24 elements over 8 bytes of data."""
    body = numpy_pickle(np.array([1.0]))
    assert body.count(b"K\x01\x85") == 1
    return body.replace(b"K\x01\x85", b"J\x00\x00\x00\x01\x85")


HOSTILE_ANSWERS = {
    "object dtype over chosen bytes": (object_dtype_over_chosen_bytes(), "a numpy dtype 'O8' (allowed: b1, "),
    "array of declared size, no bytes": (array_without_its_bytes(2**24), "an unfinished or unknown array"),
    "shape over the bytes": (declared_shape_over_the_bytes(), "an array of shape (16777216,) (16777216 elements; at most "),
    "lists nested 100,000 deep": (b"\x80\x02" + b"(" * 100_000 + b"l" * 100_000 + b".", "containers nested deeper than 8"),
    "a list that contains itself": (pickle.dumps({"scores": (lambda x: x.append(x) or x)([])}), "containers nested"),
    "an integer of 100,000 digits": (pickle.dumps({"scores": [10**100_000]}), "an integer of 332193 bits"),
    "a global that runs code": (b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00trueR.", "the global posix.system"),
    "an object built by NEWOBJ": (b"\x80\x02cnumpy\nndarray\n)\x81.", "the pickle opcode NEWOBJ"),
}


@pytest.mark.parametrize("name", HOSTILE_ANSWERS)
def test_a_hostile_answer_is_refused_in_one_line_naming_the_server_and_what_it_sent(name):
    """Each used to be handed to numpy's unpickling: a segfault (exit 139), 1.9 GB allocated from a 145-byte answer
    (the length check came after .tolist()), uninitialised heap words in the error, a 3,000-line RecursionError."""
    body, says = HOSTILE_ANSWERS[name]
    with raw_server(answering(body)) as (url, log):
        message = refusal(url)
    assert "not a pickled dict of plain data with 'scores': it holds " + says in message, message
    assert log["requests"] == 1  # refused at once, never retried


def test_numpy_answers_of_plain_numbers_are_still_scores():
    """What a server that answers np.asarray(scores) sends (any protocol, float32 or int) is read as numbers."""
    for protocol, array in ((2, np.array([0.25], dtype=np.float32)), (5, np.array([3], dtype=np.int64))):
        with raw_server(answering(numpy_pickle(array, protocol))) as (url, log):
            assert flow_grpo_reward(url)(RED, ["a red image"]).tolist() == array.tolist()


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_server_dripping_its_answer_fails_the_attempt_at_its_total_deadline(where):
    """One byte a second used to be read for ever (--remote-timeout-s bounded each socket read, and every byte
    renewed it; 90 s into a 2 s timeout it was still reading). The attempt now ends at its deadline, whole."""
    def drip(handler, stop, log):
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"
        if where == "body":
            write(handler, log, head)
        for byte in (head if where == "headers" else b"") + b"x" * 1000:
            if stop.wait(0.2):
                return
            write(handler, log, bytes([byte]))

    outcome = {}

    def call(url):
        started = time.monotonic()
        try:
            flow_grpo_reward(url, remote_timeout_s=1.0)(RED, ["x"])
        except RemoteRewardError as error:
            outcome["error"] = str(error)
        outcome["took"] = time.monotonic() - started

    with raw_server(drip) as (url, log):
        caller = threading.Thread(target=call, args=(url,), daemon=True)
        caller.start()
        caller.join(timeout=120)  # far beyond the deadline: a client that reads on never returns
        assert not caller.is_alive(), f"still reading after 120 s; {log['sent']} bytes sent"
    assert "failed after 1 attempts; last error: TimeoutError('no whole answer within 1 s')" in outcome["error"]
    assert log["sent"] < 1000 + 60  # it stopped reading long before the answer's end


def test_an_answer_over_the_size_cap_is_refused_before_it_is_read():
    """A 1.5 GB answer body used to be read whole (3.2 GB of memory). Declared too long: refused before a byte of
    it is read; sent without a length: refused once the cap is passed."""
    def endless(handler, stop, log, length=None):
        head = b"HTTP/1.0 200 OK\r\n" + (b"Content-Length: %d\r\n" % length if length else b"") + b"\r\n"
        write(handler, log, head)
        chunk = b"\0" * 65536
        while not stop.is_set() and log["sent"] < 4 * MAX_ANSWER_BYTES:  # a bound for the old client's sake
            write(handler, log, chunk)

    with raw_server(lambda h, stop, log: endless(h, stop, log, length=1_500_000_000)) as (url, log):
        message = refusal(url)
    assert f"sent an answer of 1500000000 bytes (Content-Length; at most {MAX_ANSWER_BYTES}): refused" in message
    with raw_server(endless) as (url, log):
        message = refusal(url)
    assert f"sent an answer of more than {MAX_ANSWER_BYTES} bytes: refused without reading it" in message
    assert log["requests"] == 1


def test_a_reward_call_is_excused_from_liveness_only_up_to_its_deadline():
    """A remote reward's call is bounded (each attempt's deadline, the retries and their waits, per batch of
    requests), and so is the rank's excuse from reporting progress: it used to be excused for as long as the call
    took, and a hung server hung the run."""
    options = rewards.RewardOptions(remote_url="http://127.0.0.1:9", remote_timeout_s=5.0, remote_retries=2,
                                    remote_backoff_s=1.0, remote_batch_size=64)
    remote = rewards.build_reward("remote", options)
    # 130 images: 3 requests, each 3 attempts of 5 s and waits of 1 + 2 s (by hand: 3 x 18 s)
    assert remote.deadline_s(torch.zeros(130, 3, 8, 8)) == 3 * (3 * 5.0 + 1.0 + 2.0) == call_deadline_s(
        130, 5.0, 2, 1.0, 64)
    assert remote.deadline_s(torch.zeros(2, 40, 3, 8, 8)) == 2 * 18.0  # a video sends each of its 40 frames
    assert rewards.build_reward("remote=1,color=1", options).deadline_s(torch.zeros(2, 3, 8, 8)) is None  # unbounded
    progress = Progress()
    progress.start()
    with progress.excused("reward", up_to_s=3600):
        assert progress.is_excused()
        with progress.excused("reward", up_to_s=0):  # the earliest end counts
            assert not progress.is_excused()
        assert progress.is_excused()
    assert not progress.is_excused()
    with progress.excused("reward"):  # no bound: a local function runs as long as it takes
        assert progress.is_excused()
