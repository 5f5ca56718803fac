"""`python main.py ARGS` run from a tool's own process, for tools that run many jobs (bench.py, learning_bench.py).

    code = main_job.run(["--mode", "naive", "--steps", "3", ...], stdout=log, stderr=log)   # main.py's exit code
    costs = main_job.forked(measure, args)   # measure(args) in a process forked from the same forkserver

It is main.py's entry (cli.main: the run lock, validation with exit code 2, the tiny pipeline built once, the
launcher that names the first failing rank) with the ranks forked from one multiprocessing forkserver of this
process, which imported main.py and the pipeline's module once and serves every job the tool runs. `python main.py`
as a subprocess starts two fresh interpreters per job (the launcher, then its forkserver) that import torch and
diffusers again: ~15 s of CPU per job on 2 cores (2026-12-05), more than a short job's own work. The ranks run the
same code either way (main.run_rank, forked from a forkserver; spawned where CUDA may be used, as main.py does), so
what a job measures is unchanged. Their output goes where the caller says, as a subprocess's would. One-rank and
torchrun jobs, which cli.main would run inside the calling process itself, still run as `python main.py`.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_entry(payload, rank, world, local_rank, master, agent_store, report_silent):
    """A rank of the job: its stdout and stderr to the files the job named (None: the tool's own), then main.py's."""
    for fd, path in zip((1, 2), payload.pop("_streams")):
        if path is not None:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)
    import main
    return main.run_rank(payload, rank, world, local_rank, master, agent_store, report_silent)


def preload(model: str) -> tuple[str, ...]:
    """What the forkserver imports once: main.py, the model's pipeline module, this module (the ranks' entry), and
    matplotlib's figure (each job's leader draws its reward curve and timeline: ~1.5 s of CPU per job to import)."""
    import models
    return ("main", models.get_family(model).pipeline_module, __name__, "matplotlib.figure",
            "matplotlib.backends.backend_agg")


def forkserver(model: str):
    """The multiprocessing context whose forkserver serves this process's jobs; the first call of the process
    decides what it imports (a later one for another model: its ranks import the rest themselves)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["infra.rank_server", *preload(model)])  # as infra.launch.launch sets it
    return context


def _call(connection, function, args) -> None:
    try:
        result = (True, function(*args))
    except BaseException:  # noqa: BLE001  (every failure goes back to the caller, named)
        result = (False, traceback.format_exc())
    connection.send(result)
    connection.close()


def forked(function, *args, model: str = "flux"):
    """function(*args), computed in a process forked from the jobs' forkserver, where torch, diffusers, main.py and
    the model's pipeline are imported already: a tool's own use of the pipeline costs no import of it here. The
    function is pickled by name, its arguments and result by value; its exception comes back as a RuntimeError
    with the traceback."""
    receiver, sender = multiprocessing.Pipe(duplex=False)
    process = forkserver(model).Process(target=_call, args=(sender, function, args))
    process.start()
    sender.close()  # the child's end: if it dies without an answer, recv() ends with EOFError
    try:
        ok, result = receiver.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"{function.__name__} died in its forked process (exit code {process.exitcode})") \
            from None
    process.join()
    if not ok:
        raise RuntimeError(f"{function.__name__} failed in its forked process:\n{result}")
    return result


def in_process(argv: list[str]) -> bool:
    """Whether run() launches this job's ranks from here: 2+ ranks, outside torchrun, a command line that parses (a
    bad one goes to main.py, whose message and exit code are the user's answer)."""
    import io

    import config
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parsed = config.parse_args(argv)  # (main.py prints its own message)
    except (SystemExit, ValueError, FileNotFoundError):
        return False
    return parsed.nproc >= 2 and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ


def run(argv: list[str], stdout: str | None = None, stderr: str | None = None) -> int:
    """main.py's exit code for `argv`; `stdout` / `stderr`: files the job's output is appended to (the launcher's
    lines and the ranks' alike; the same file for both is fine), None: this process's own."""
    if not in_process(argv):
        with contextlib.ExitStack() as files:
            streams = [None if path is None else files.enter_context(open(path, "ab")) for path in (stdout, stderr)]
            return subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), *argv], stdout=streams[0],
                                  stderr=streams[1]).returncode
    import cli
    from infra import launch as launching

    def launch(target, payload, nproc, **kwargs):  # cli.main's preload names its own script: ours instead
        payload["_streams"] = (stdout, stderr)
        kwargs["preload"] = preload(payload["model"])
        return launching.launch(rank_entry, payload, nproc, **kwargs)

    def run_rank(*args, **kwargs):  # cli.main calls it itself only for the jobs in_process() leaves out
        raise AssertionError("main_job.run: a job without spawned ranks must run as `python main.py`")

    with contextlib.ExitStack() as redirected:  # the launcher's own lines (cli.main's, the failing rank's name)
        for path, redirect in ((stdout, contextlib.redirect_stdout), (stderr, contextlib.redirect_stderr)):
            if path is not None:
                redirected.enter_context(redirect(redirected.enter_context(open(path, "a"))))
        return cli.main(argv, run_rank, launch)
