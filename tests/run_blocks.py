"""Bash blocks of `python ...` lines (docs/COURSE.md's commands) run in this one interpreter, each line as `python`
would run it: tests/test_course.py's way of running the page's commands without a fresh interpreter per line, each
importing torch (and diffusers, pytest) again, ~5-10 s of CPU each, more than most of the lines' own work.

    python tests/run_blocks.py OUT BLOCK [BLOCK ...]      # in the folder the lines run in

A BLOCK is lines `python SCRIPT ARGS` or `python -m MODULE ARGS`. It stops at its first failing line, as `bash -e`
does, and its exit status, stdout and stderr go to OUT/<i>.code, OUT/<i>.out and OUT/<i>.err (i from 0); the next
block runs anyway. Before each line, the modules of the folder's project (files under the current directory) are
dropped from sys.modules, and sys.argv, sys.path, the environment and the current directory are what `python` gives
a fresh process: a line cannot pass on what an earlier line imported, put on the path or set. torch, diffusers,
pytest and the other installed packages stay imported (the saving), and so does multiprocessing's forkserver: a
forkserver a line started (tools/main_job.py) serves the later lines' jobs too.
"""
import os
import runpy
import shlex
import sys
import traceback

BASE_PATH = sys.path[1:]  # without this file's folder: what any `python` line starts from


def project_modules(root: str) -> list[str]:
    inside = os.path.realpath(root) + os.sep
    return [name for name, module in list(sys.modules.items()) if name != "__main__"  # (this file, if it is there)
            and os.path.realpath(getattr(module, "__file__", None) or os.sep).startswith(inside)]


def run_line(line: str) -> int:
    """`line`'s exit status, run as `python ...` runs it in a fresh process started in the current directory."""
    words = shlex.split(line)
    if len(words) < 2 or words[0] != "python" or (words[1] == "-m" and len(words) < 3):
        print(f"run_blocks: not a `python SCRIPT` or `python -m MODULE` line: {line!r}", file=sys.stderr)
        return 2
    cwd, environ = os.getcwd(), dict(os.environ)
    for name in project_modules(cwd):
        del sys.modules[name]
    try:
        if words[1] == "-m":  # python -m puts the current directory first on the path
            sys.argv, sys.path[:] = [words[2], *words[3:]], [cwd, *BASE_PATH]
            runpy.run_module(words[2], run_name="__main__", alter_sys=True)
        else:  # python SCRIPT puts the script's folder first
            script = os.path.abspath(words[1])
            sys.argv, sys.path[:] = [words[1], *words[2:]], [os.path.dirname(script), *BASE_PATH]
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)  # as the interpreter does with a message
        return 1
    except BaseException:  # noqa: BLE001  (an uncaught exception: the interpreter prints it and exits 1)
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)


def run_block(block: str, out: str, i: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(os.path.join(out, f"{i}.out"), "w") as stdout, open(os.path.join(out, f"{i}.err"), "w") as stderr:
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        try:
            code = 0
            for line in filter(str.strip, block.splitlines()):
                code = run_line(line)
                if code != 0:
                    break
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    with open(os.path.join(out, f"{i}.code"), "w") as f:
        f.write(str(code))


def main() -> None:
    out, blocks = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    for i, block in enumerate(blocks):
        run_block(block, out, i)


if __name__ == "__main__":
    main()
