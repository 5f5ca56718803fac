"""What reaches a run from outside is data, bounded, and never steers it (docs/USAGE.md, "What is trusted"): a reward
server's answer (a real HTTP server on 127.0.0.1 sends each hostile answer), a run folder's saved configuration, the
job's store (a second process tries it), the run lock's order, and inputs that used to pass validation and fail
later. Each test tries what used to crash, hang or steer a run (issue 40) and names the old behaviour.
"""
import contextlib
import os
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
import torch.distributed as dist

import rewards
from infra.liveness import Liveness
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
    watch = Liveness(dist.HashStore(), 0, ["rollout"], timeout_s=5.0, progress=progress, excused_timeout_s=10.0)
    t0 = time.monotonic()
    with progress.excused("reward", up_to_s=3600):
        watch._publish_progress(t0 + 100)  # past --excused-timeout-s but within the call's stated bound
        assert progress.ticks == 1
        with progress.excused("reward", up_to_s=0):  # the earliest end counts
            watch._publish_progress(t0 + 101)
            assert progress.ticks == 1
        watch._publish_progress(t0 + 102)
        assert progress.ticks == 2
        watch._publish_progress(t0 + 3700)  # past the stated bound: a hung server is a stall
        assert progress.ticks == 2
    watch._publish_progress(t0 + 3701)
    assert progress.ticks == 2  # outside any excused section nothing moves
    t1 = time.monotonic()
    with progress.excused("reward"):  # no stated bound (a local function): --excused-timeout-s
        watch._publish_progress(t1 + 9)
        assert progress.ticks == 3
        watch._publish_progress(t1 + 11)
        assert progress.ticks == 3


# ---------------------------------------------------------------- a run folder's files choose no code

EVIL_REWARD = '''
import pathlib
pathlib.Path(__file__).with_name("ran").write_text("the reward file ran")

def fn(images, prompts):
    return images.mean(dim=(1, 2, 3))
'''


def run_folder_naming_code(tmp_path):
    """A run folder (as a shared one could be made by someone else) whose config.json names reward code, with a
    checkpoint where --resume looks for one; the code, if imported, leaves a file `ran` next to itself."""
    import config as config_lib
    from infra import rundir
    code = tmp_path / "elsewhere" / "evil.py"
    code.parent.mkdir()
    code.write_text(EVIL_REWARD)
    run = tmp_path / "shared_run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "state.pt").write_bytes(b"not a checkpoint")
    cfg = config_lib.resolve(config_lib.Config(reward=f"{code}:fn", run_name="shared_run", out_dir=str(tmp_path)))
    (run / "config.json").write_text(rundir.to_json(cfg))
    return run, code, code.parent / "ran"


def refused(argv, monkeypatch, capsys) -> str:
    """main.main(argv) exits 2 before any rank starts; its one-line error."""
    import main
    spawned = []
    monkeypatch.setattr(main, "launch", lambda *a, **k: spawned.append(a) or 0)
    monkeypatch.setattr(main, "run_rank", lambda *a, **k: spawned.append(a) or 0)
    code = main.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and not spawned, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.mark.parametrize("how", ["resume", "config"])
def test_a_saved_configuration_never_runs_the_reward_code_it_names(how, tmp_path, monkeypatch, capsys, tiny_cache):
    """--resume imported the custom reward file the saved config.json names, during validation and before the
    checkpoint was checked: a folder someone else can write to ran their Python. It runs only when the command line
    names it too."""
    run, code, ran = run_folder_naming_code(tmp_path)
    argv = ["--resume", str(run)] if how == "resume" else ["--config", str(run / "config.json"), "--run-name", "new",
                                                           "--out-dir", str(tmp_path)]
    err = refused(argv, monkeypatch, capsys)
    assert f"names reward code '{code}:fn' (a custom reward runs that file's or module's Python): a saved " \
           f"configuration does not choose code to run; give --reward '{code}:fn' on the command line" in err, err
    assert not ran.exists()
    import main  # the same spec on the command line runs it (for --resume, the fake checkpoint is refused next)
    monkeypatch.setattr(main, "launch", lambda *a, **k: 0)
    main.main([*argv, "--reward", f"{code}:fn"])
    assert ran.exists()


@pytest.mark.parametrize("field,value,says", [
    ("nproc", 2.5, "'nproc' must be an integer, got 2.5"),
    ("steps", "5", "'steps' must be an integer, got \"5\""),
    ("reward", ["color"], "'reward' must be a string, got [\"color\"]"),
    ("lr", True, "'lr' must be a number or null, got true"),
])
def test_a_config_file_value_of_the_wrong_type_is_refused_in_one_line(field, value, says, tmp_path, monkeypatch,
                                                                         capsys):
    """--config {"nproc": 2.5} / {"steps": "5"} / {"reward": ["color"]} ended in tracebacks."""
    import json
    (tmp_path / "c.json").write_text(json.dumps({field: value}))
    assert says in refused(["--config", str(tmp_path / "c.json"), "--out-dir", str(tmp_path)], monkeypatch, capsys)


# ---------------------------------------------------------------- the run lock comes first

def test_nothing_in_a_locked_run_folder_is_read_before_the_lock_is_checked(tmp_path, monkeypatch, capsys):
    """--resume of a live run read its config.json and checkpoints before it checked the lock: twice in 24 suite
    runs the second job failed on a checkpoint the live job was pruning ("checkpoint ... cannot be read") instead
    of "in use by another job". Every file opened or listed under the folder is recorded (Python's audit events):
    the lock file is the only one."""
    import sys
    from infra.runlock import LOCK_NAME, RunLock
    run, _, _ = run_folder_naming_code(tmp_path)
    touched, watching = [], [False]

    def audit(event, args):
        if watching[0] and event in ("open", "os.listdir", "os.scandir") and args and args[0] is not None:
            path = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
            if path.startswith(str(run)):
                touched.append(path)

    sys.addaudithook(audit)  # (an audit hook stays for the process's life: it only looks while `watching`)
    held = RunLock.acquire(str(run))  # the live job (another open file description: flock refuses a second one)
    try:
        watching[0] = True
        err = refused(["--resume", str(run)], monkeypatch, capsys)
    finally:
        watching[0] = False
        held.release()
    assert "is in use by another job (host " in err, err
    assert set(touched) == {str(run / LOCK_NAME)}, sorted(set(touched))
    err = refused(["--resume", str(tmp_path / "missing")], monkeypatch, capsys)  # locking it makes no folder
    assert f"--resume '{tmp_path / 'missing'}' is not a directory" in err and not (tmp_path / "missing").exists()


# ---------------------------------------------------------------- inputs refused before any rank starts

INPUTS = {  # each passed validation and failed later, or was accepted: what the refusal now says
    "--weight-decay -1": (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0, got -1.0"),
    "--seed 2**63": (["--seed", str(2**63)], "--seed must be an integer in [0, "),
    "--timeout-s 0.001": (["--timeout-s", "0.001"], "--timeout-s must be at least 1 s"),
    "--resolution 65536": (["--resolution", "65536"], "--resolution must be at most 4096 pixels, got 65536"),
    "--text-len 0": (["--text-len", "0"], "--text-len must be a positive integer, got 0"),
    "--nproc 5000": (["--nproc", "5000"], "--nproc 5000: at most "),
    "--threads 100000": (["--threads", "100000"], "--threads 100000: at most the "),
    "--lr 1e30": (["--lr", "1e30"], "--lr must be a positive number <= 1, got 1e+30"),
    "--prompt-file /dev/zero": (["--prompt-file", "/dev/zero"], "'/dev/zero' is not a regular file"),
    "--run-name ../x": (["--run-name", "../x"], "--run-name '../x' must be a plain name"),
    "--run-name /abs/path": (["--run-name", "/abs/path"], "--run-name '/abs/path' must be a plain name"),
}


@pytest.mark.parametrize("name", INPUTS)
def test_an_input_that_failed_later_is_refused_before_any_rank_starts(name, tmp_path, monkeypatch, capsys):
    argv, says = INPUTS[name]
    err = refused([*argv, "--out-dir", str(tmp_path / "out")], monkeypatch, capsys)
    assert says in err, err
    assert not (tmp_path / "x").exists() and not os.path.exists("/abs/path")



@pytest.mark.parametrize("class_name", [["FluxPipeline"], {"FluxPipeline": 1}, "WanPipeline"])
def test_a_pipeline_folder_that_names_its_class_oddly_is_refused_in_one_line(class_name, tmp_path, monkeypatch,
                                                                               capsys):
    """A --pretrained folder's model_index.json whose _class_name is a list or an object ended in a traceback
    (TypeError: unhashable type, while the family was looked up to default --model): now no family is named, the
    default FLUX checks the folder and says what is missing. A named class still picks its family (WanPipeline)."""
    import json

    import models
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    named = "wan" if class_name == "WanPipeline" else None
    assert models.family_of_pipeline(str(pipe)) == named
    err = refused(["--pretrained", str(pipe), "--out-dir", str(tmp_path / "out")], monkeypatch, capsys)
    assert f"is missing the component 'transformer' (required for {named or 'flux'}:" in err, err

def test_an_unwritable_or_full_output_folder_is_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    """A read-only --out-dir ended in an OSError traceback that did not say so, and a full disk was found at the
    first checkpoint."""
    import errno
    import shutil
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if os.fsdecode(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, *args, **kwargs)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "open", read_only)
    err = refused(["--run-name", "x", "--out-dir", str(tmp_path / "ro")], monkeypatch, capsys)
    assert f"run directory '{tmp_path / 'ro' / 'x'}' cannot be written: Read-only file system [EROFS]" in err, err
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 2**40 - 2**20, 2**20))
    err = refused(["--run-name", "y", "--out-dir", str(tmp_path)], monkeypatch, capsys)
    assert "is on a disk with 0.00 GiB free; its checkpoints need about 0.19 GiB" in err, err


def test_a_full_disk_during_a_checkpoint_says_so_and_keeps_the_last_one(tmp_path, monkeypatch):
    """ENOSPC while writing a checkpoint: one line that says so, the half-written one removed, the last complete
    one kept (and still the one --resume finds)."""
    import errno
    import json
    from infra import checkpoint_file, rundir
    run = rundir.RunDir(str(tmp_path / "run"), "{}", keep_checkpoints=2)
    state = {"weights": {"w": torch.ones(3)}, "step": 1, "identity": {}}
    first = run.save_checkpoint(1, state, None, None)
    real_save = checkpoint_file.save  # state.pt, written tensor by tensor

    def full_disk(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)  # the bytes went in, then the disk filled up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(checkpoint_file, "save", full_disk)
    with pytest.raises(rundir.OutputWriteError) as caught:
        run.save_checkpoint(2, {**state, "step": 2}, None, None)
    message = str(caught.value)
    assert "\n" not in message and "No space left on device [ENOSPC]" in message, message
    assert "the last complete checkpoint, step_000001, is kept: make room, then --resume" in message, message
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_000001"]
    assert rundir.list_checkpoints(str(tmp_path / "run")) == [first]
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "meta.json").read_text())["step"] == 1


def crafted_checkpoint(folder, patch) -> str:
    """checkpoints/step_000001/state.pt of a torch.save'd state (with a numpy array: as checkpoints before
    2026-12-01 kept numpy's RNG state) whose pickle went through patch(bytes)."""
    import zipfile
    path = folder / "checkpoints" / "step_000001"
    path.mkdir(parents=True)
    torch.save({"weights": {"w": torch.zeros(4)}, "rng": {"numpy": np.zeros(2, dtype=np.uint32)}, "step": 1,
                "identity": {}}, path / "state.pt")
    with zipfile.ZipFile(path / "state.pt") as src:
        records = {info.filename: (info, src.read(info)) for info in src.infolist()}
    with zipfile.ZipFile(path / "state.pt", "w", zipfile.ZIP_STORED) as dst:
        for name, (info, data) in records.items():
            dst.writestr(info, patch(data) if name.endswith("data.pkl") else data)
    return str(path)


def test_a_crafted_checkpoint_is_refused_in_one_line(tmp_path):
    """A 1.4 KB state.pt declaring a 373 GiB numpy array ended in a 32-line traceback (numpy's reconstruction was
    allowed by name for older checkpoints' RNG state: it builds arrays of any declared size and dtype, the same
    hole as a reward server's pickle)."""
    from infra import rundir
    huge = (373 * 2**30 // 4).to_bytes(5, "little")

    def numpy_shape(data: bytes) -> bytes:
        at = data.index(b"numpy")  # the first element of the array's shape tuple after numpy's globals
        at = data.index(b"K\x02\x85", at)
        return data[:at] + b"\x8a\x05" + huge + data[at + 2:]

    with pytest.raises(ValueError) as caught:
        rundir.load_state(crafted_checkpoint(tmp_path, numpy_shape))
    assert "\n" not in str(caught.value) and "holds more than tensors and plain data" in str(caught.value)


# ---------------------------------------------------------------- the job's store: only the job's ranks

def test_the_signed_store_answers_as_a_tcp_store_and_refuses_what_it_did_not_seal():
    """The same operations on a SignedStore and on a bare TCPStore (the reference) give the same answers, TCPStore's
    quirks included (a compare_set on a missing key answers its expected value); what lies in the store is opaque
    names and sealed values; a value written without the secret, or with another one, is refused naming the key."""
    import datetime

    import torch.distributed as dist
    from infra.jobstore import SignedStore, StoreTampered
    timeout = datetime.timedelta(seconds=5)
    inner, reference = (dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout) for _ in range(2))
    store = SignedStore(inner, b"k" * 32).prefixed("queue")
    ops = [("set", ("a", "host 12")), ("get", ("a",)), ("add", ("c", 3)), ("add", ("c", 0)), ("add", ("c", -1)),
           ("add", ("n", 0)), ("compare_set", ("q", "x", "y")), ("compare_set", ("q", "", "y")),
           ("compare_set", ("q", "y", "w")), ("compare_set", ("q", "y", "v")), ("check", (["a", "q"],)),
           ("check", (["missing"],)), ("multi_get", (["a", "q"],)), ("delete_key", ("a",)), ("check", (["a"],))]
    for name, args in ops:
        reference_args = (["queue/" + k for k in args[0]],) if name in ("check", "multi_get") else \
            ("queue/" + args[0], *args[1:])
        assert getattr(store, name)(*args) == getattr(reference, name)(*reference_args), (name, args)
    keys = inner.list_keys()
    assert len(keys) == 2 and all(k.startswith("j/") and "queue" not in k for k in keys)  # c and q, opaque
    assert all(b"w" not in inner.get(k)[32:] and inner.get(k)[32:] != b"2" for k in keys)  # sealed values
    inner.set(store._name("q"), b"w")  # another process writes the key (it has seen the name)
    with pytest.raises(StoreTampered, match="holds a value for 'queue/q' that was not written with this job's"):
        store.get("q")
    other = SignedStore(inner, b"o" * 32).prefixed("queue")
    assert not other.check(["c"])  # another secret names other keys
    inner.set(other._name("c"), inner.get(store._name("c")))  # and cannot open this job's values
    with pytest.raises(StoreTampered):
        other.add("c", 0)


def store_port(launcher_pid: int) -> int:
    """The port the launcher's listening socket holds for the job's store (its only one)."""
    import psutil
    ports = [c.laddr.port for c in psutil.Process(launcher_pid).net_connections(kind="tcp")
             if c.status == psutil.CONN_LISTEN]
    assert len(ports) == 1, ports
    return ports[0]


def test_a_neighbour_cannot_steer_the_job_through_its_store_and_a_resume_redoes_steps_once(tiny_cache, tmp_path,
                                                                                           capsys):
    """A second process on the host connects to a running job's store. It used to read every key (hosts, pids,
    claims) and stop the job by writing `preemption/stop/asked` (exit 75); it now sees opaque names and sealed
    values, and its writes under the job's old names are never read: the job ends normally. Then, with the last
    checkpoint gone (a job killed after logging steps it never checkpointed), `--dry-run --resume` works (it was
    refused) and the resumed run's TensorBoard shows each redone step once (it showed them twice). The jobs are
    main.py's, launched from this process as main.py launches them (conftest.run_forked: this process holds the
    store's listening socket, its forkserver's children are the ranks); the dry run is main.main here (it starts
    nothing)."""
    import concurrent.futures
    import datetime
    import shutil
    import socket

    import torch.distributed as dist
    import main
    from conftest import rank_pids, read_metrics, run_forked
    pytest.importorskip("tensorboard")  # --tensorboard: requirements-extras.txt
    args = ["--mode", "digenrl", "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3", "--eval-every",
            "0", "--timeout-s", "60", "--no-trace", "--steps", "6", "--save-every", "2", "--tensorboard"]
    run = tmp_path / "job"
    with concurrent.futures.ThreadPoolExecutor(1) as launcher:
        job = launcher.submit(run_forked, args, tmp_path, "job", tiny_cache, bound_s=300)
        while not (run / "metrics.jsonl").exists():  # the ranks are in their loops
            assert not job.done(), job.exception() or (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.05)
        neighbour = dist.TCPStore("127.0.0.1", store_port(os.getpid()), is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=30))
        for key in ("preemption/stop/asked", "stop/asked", "preemption/stop/done"):
            neighbour.set(key, "0")
        keys = neighbour.list_keys()
        assert any(k.startswith("j/") for k in keys), keys  # the job's own store (its sealed names), not another
        seen = b"".join(neighbour.get(k) for k in keys if not k.startswith(("preemption", "stop")))
        where = [f"{socket.gethostname()} {pid}".encode() for pid, _ in rank_pids(os.getpid(), 2).values()]
        assert not any(w in seen for w in where) and b"inside" not in seen  # liveness: where ranks are, what they do
        assert job.result().code == 0  # (run_forked: it ended normally, not stopped by the neighbour's keys: 75)
    assert [r["step"] for r in read_metrics(run)] == list(range(6))
    shutil.rmtree(run / "checkpoints" / "step_000006")  # steps 4 and 5 logged, their checkpoint lost
    capsys.readouterr()
    assert main.main(["--resume", str(run), "--dry-run", "--out-dir", str(tmp_path), "--no-progress", "--threads",
                      "1"]) == 0, capsys.readouterr().err[-3000:]
    assert "dry run, nothing started" in capsys.readouterr().out and not (run / ".lock").read_text()
    resumed = run_forked(["--resume", str(run)], tmp_path, "resumed", tiny_cache).log
    assert "resumed from step 4 " in resumed and "steps 4-5 were logged after that checkpoint" in resumed, resumed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == list(range(6))
