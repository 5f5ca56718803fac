"""A tool's `main(argv)` (tools/rehearse.py, tools/estimate_memory.py) in a process forked from this pytest worker's
forkserver (tests/stall_matrix.py: it imported torch, diffusers and main.py once), for tests of what the tool
computes: `python tools/X.py ...` as a fresh interpreter spends 10-15 s of CPU importing torch, diffusers and
transformers before the tool does anything. The argv goes through the tool's own parser (its main), its stdout and
stderr to a file, read back; its exit status is main's return (1 and a traceback on an exception). What this does not
run is the `if __name__ == "__main__"` line (sys.exit(main())) and the interpreter's start."""
from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import os
import sys

import stall_matrix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Result:
    returncode: int | None  # None: still running at the bound, killed
    output: str  # stdout and stderr, interleaved as written


def _child(module: str, argv: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(ROOT)  # as `cwd=ROOT` for the command line
    sys.argv = [os.path.join(ROOT, *module.split(".")) + ".py", *argv]
    sys.exit(importlib.import_module(module).main(list(argv)))


def run_tool(module: str, argv: list[str], log, timeout_s: float) -> Result:
    """`module`'s main(argv) in a forked process (its output to `log`); killed after `timeout_s` (returncode None)."""
    stall_matrix.start_forkserver()
    process = multiprocessing.get_context("forkserver").Process(
        target=_child, args=(module, [str(a) for a in argv], str(log)), name=module, daemon=True)
    process.start()
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join()
        code = None
    else:
        code = process.exitcode
    output = ""
    if os.path.exists(log):  # not there: the child died before its first line
        with open(log, errors="replace") as f:
            output = f.read()
    return Result(code, output)
