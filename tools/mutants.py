"""Mutation testing, on demand (not in CI): one small deliberate bug at a time, on a copy of the repository.

A test suite is only as good as the bugs it catches. Each mutant below is one such bug, written as
(file, the exact original snippet, its replacement, what it breaks, the tests that should catch it).
For each mutant the tool copies the repository's files (git's tracked and untracked-not-ignored files)
into a temporary folder, applies that one replacement there (the working tree is never touched), and
runs the mutant's tests with `pytest -x` under a time limit. A mutant is

  KILLED      a test failed (the table names the first failing test), or it timed out;
  SURVIVED    every test passed: a bug the tests let through (add a test, or argue it equivalent);
  EQUIVALENT  marked `equivalent="reason"`: no test can tell it apart (not run unless --run-equivalent);
  STALE       its original snippet is no longer in the file (or occurs more than once): update the list;
  INVALID     the mutated file does not compile: fix the mutant.

The tests of a mutant are the fastest ones that should catch it, so the whole run stays short; before
the mutants, their tests run once on the unmutated copy (a kill only means something if they pass).
The exit code is 0 when every mutant is killed or equivalent.

    python tools/mutants.py                      # every mutant (about 10 min on 2 cores, 20 under load)
    python tools/mutants.py --list               # the mutants, their tests, and which are stale
    python tools/mutants.py --only tcss-bound-2 --only grpo-adv-reversed --show
    python tools/mutants.py --jobs 2 --json runs/mutants.json

Keep the list in step with the code: a refactor that moves a snippet makes its mutant STALE, never
silently skipped. Add a mutant for every bug class a review finds that the suite let through.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools.mutant_list import MUTANTS, Mutant  # noqa: E402


@dataclasses.dataclass
class Result:
    mutant: Mutant
    status: str  # KILLED, SURVIVED, EQUIVALENT, STALE, INVALID, NO TESTS
    killer: str = ""
    seconds: float = 0.0
    output: str = ""


def repository_files() -> list[str]:
    """Tracked files and untracked files git does not ignore (a mutant run sees uncommitted work too)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and os.path.isfile(os.path.join(ROOT, f))]


def copy_repository(files: list[str], dest: str) -> None:
    for f in files:
        os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))


def mutated_source(m: Mutant) -> tuple[str | None, str]:
    """(the mutated file's text, '') or (None, why it cannot be applied)."""
    path = os.path.join(ROOT, m.file)
    if not os.path.isfile(path):
        return None, f"STALE: {m.file} does not exist"
    with open(path) as f:
        source = f.read()
    count = source.count(m.original)
    if count != 1:
        return None, f"STALE: the original snippet occurs {count} times in {m.file} (must be exactly once)"
    mutated = source.replace(m.original, m.replacement)
    try:
        compile(mutated, m.file, "exec")
    except SyntaxError as exc:
        return None, f"INVALID: the mutated {m.file} does not compile: {exc}"
    return mutated, ""


def run_pytest(workdir: str, tests: list[str], timeout_s: float,
               test_timeout_s: int) -> tuple[int | None, str, float]:
    """pytest -x on `tests` in `workdir`; returns (exit code or None on timeout, output, seconds).
    The run gets its own process group, so a timeout ends the ranks main.py spawned too."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    cache = os.environ.get("DIGENRL_TEST_CACHE") or os.environ.get("DIGENRL_CACHE")
    if cache:  # the tiny pipelines, built once, shared read-only by every mutant run
        env["DIGENRL_CACHE"] = env["DIGENRL_TEST_CACHE"] = cache
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider",
           "--timeout", str(test_timeout_s), *tests]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output, time.perf_counter() - start
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this run started (pytest and the ranks it spawned)
        output, _ = proc.communicate()
        return None, output, time.perf_counter() - start


def first_failure(output: str) -> str:
    """The first FAILED/ERROR test id of pytest's short summary (-rfE) and the first line of its error."""
    errors = (line[1:].strip() for line in output.splitlines() if line.startswith("E "))
    error = next((e for e in errors if e), "")
    error = f" ({error[:90]})" if error else ""
    for line in output.splitlines():
        match = re.match(r"(FAILED|ERROR) (.+?)(?: - .*)?$", line)
        if match:
            return match.group(2) + error
    return "(no failing test named)" + error


def run_mutant(m: Mutant, files: list[str], scratch: str, timeout_s: float, test_timeout_s: int,
               keep: bool) -> Result:
    mutated, why = mutated_source(m)
    if mutated is None:
        return Result(m, why.split(":")[0], why)
    workdir = tempfile.mkdtemp(prefix=f"{m.id}-", dir=scratch)
    try:
        copy_repository(files, workdir)
        with open(os.path.join(workdir, m.file), "w") as f:
            f.write(mutated)
        code, output, seconds = run_pytest(workdir, list(m.tests), m.timeout_s or timeout_s, test_timeout_s)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if code is None:
        return Result(m, "KILLED", f"timeout after {seconds:.0f} s", seconds, output)
    if code == 0:
        return Result(m, "SURVIVED", "", seconds, output)
    if code == 5:  # pytest: no tests collected (a test id in the list is wrong)
        return Result(m, "NO TESTS", "no test collected: check the mutant's test ids", seconds, output)
    return Result(m, "KILLED", first_failure(output), seconds, output)


def baseline(mutants: list[Mutant], files: list[str], scratch: str, test_timeout_s: int) -> None:
    """Every selected mutant's tests, once, on the unmutated copy: they must pass."""
    tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
    workdir = tempfile.mkdtemp(prefix="baseline-", dir=scratch)
    copy_repository(files, workdir)
    print(f"baseline: {len(tests)} test ids on the unmutated copy ...", flush=True)
    code, output, seconds = run_pytest(workdir, tests, 3600, test_timeout_s)
    shutil.rmtree(workdir, ignore_errors=True)
    if code != 0:
        sys.exit(f"the mutants' tests fail on the unmutated code (exit {code}, {seconds:.0f} s); "
                 f"a kill would mean nothing:\n{output[-4000:]}")
    print(f"baseline: passed in {seconds:.0f} s", flush=True)


def table(results: list[Result]) -> str:
    rows = ["| mutant | file | what it breaks | result | killed by | s |", "|---|---|---|---|---|---|"]
    for r in results:
        m = r.mutant
        note = r.killer if r.status != "EQUIVALENT" else f"equivalent: {m.equivalent} {r.killer}".rstrip()
        rows.append(f"| {m.id} | {m.file} | {m.breaks} | {r.status} | {note} | {r.seconds:.0f} |")
    return "\n".join(rows)


def summary(results: list[Result]) -> tuple[str, bool]:
    counts = {s: sum(r.status == s for r in results) for s in
              ("KILLED", "SURVIVED", "EQUIVALENT", "STALE", "INVALID", "NO TESTS")}
    scored = len(results) - counts["EQUIVALENT"]
    score = counts["KILLED"] / scored if scored else 1.0
    others = [f"{n} {s.lower()}" for s, n in counts.items() if n and s != "KILLED"]
    text = (f"{counts['KILLED']} of {scored} non-equivalent mutants killed ({100 * score:.0f}%)"
            + "".join(f", {o}" for o in others) + f"; {sum(r.seconds for r in results) / 60:.1f} min of test time")
    return text, counts["KILLED"] == scored


def list_mutants(mutants: list[Mutant]) -> None:
    for m in mutants:
        _, why = mutated_source(m)
        state = why or ("equivalent: " + m.equivalent if m.equivalent else "ok")
        print(f"{m.id:34s} {m.file:22s} {state}\n    breaks: {m.breaks}\n    tests: {' '.join(m.tests)}")


def show(m: Mutant) -> None:
    print(f"--- {m.file} ({m.id})\n- " + m.original.replace("\n", "\n- ")
          + "\n+ " + m.replacement.replace("\n", "\n+ "))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", default=[], help="run only this mutant id (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants (and any stale ones) and exit")
    parser.add_argument("--show", action="store_true", help="print each selected mutant's change before running")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at the same time (each spawns 1-3 ranks)")
    parser.add_argument("--timeout-s", type=float, default=600, help="per mutant, unless the mutant sets its own")
    parser.add_argument("--test-timeout-s", type=int, default=400, help="pytest --timeout per test")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    parser.add_argument("--run-equivalent", action="store_true", help="also run the mutants marked equivalent")
    parser.add_argument("--keep", action="store_true", help="keep each mutant's copy (under the scratch folder)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    ids = [m.id for m in MUTANTS]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        sys.exit(f"duplicate mutant ids: {sorted(duplicates)}")
    unknown = [i for i in args.only if i not in ids]
    if unknown:
        sys.exit(f"unknown mutant ids {unknown}; known: {', '.join(ids)}")
    mutants = [m for m in MUTANTS if not args.only or m.id in args.only]
    if args.list:
        list_mutants(mutants)
        return 0
    if args.show:
        for m in mutants:
            show(m)
    files = repository_files()
    scratch = tempfile.mkdtemp(prefix="digenrl-mutants-")
    to_run = [m for m in mutants if args.run_equivalent or not m.equivalent]
    if not args.no_baseline:
        baseline([m for m in to_run if mutated_source(m)[0] is not None], files, scratch, args.test_timeout_s)
    results: dict[str, Result] = {m.id: Result(m, "EQUIVALENT") for m in mutants if m not in to_run}
    lock, start = threading.Lock(), time.perf_counter()

    def one(m: Mutant) -> Result:
        r = run_mutant(m, files, scratch, args.timeout_s, args.test_timeout_s, args.keep)
        if m.equivalent and r.status == "SURVIVED":
            r.status, r.killer = "EQUIVALENT", "(ran: survived, as argued)"
        elif m.equivalent and r.status == "KILLED":
            r.killer += " -- marked equivalent, but a test kills it: drop the mark"
        with lock:
            done = sum(1 for x in results.values() if x.status != "EQUIVALENT") + 1
            print(f"[{done}/{len(to_run)} {(time.perf_counter() - start) / 60:.1f} min] {m.id}: {r.status} "
                  f"{r.killer} ({r.seconds:.0f} s)", flush=True)
            results[m.id] = r
        return r

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        list(pool.map(one, to_run))
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    ordered = [results[m.id] for m in mutants]
    text, all_killed = summary(ordered)
    print("\n" + table(ordered) + "\n\n" + text + f"\nwall time {(time.perf_counter() - start) / 60:.1f} min")
    for r in ordered:
        if r.status in ("SURVIVED", "NO TESTS"):
            print(f"\n--- {r.mutant.id} {r.status}: the last lines of its run\n{r.output[-1500:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"id": r.mutant.id, "file": r.mutant.file, "breaks": r.mutant.breaks, "status": r.status,
                        "killed_by": r.killer, "seconds": round(r.seconds, 1), "tests": list(r.mutant.tests),
                        "equivalent": r.mutant.equivalent} for r in ordered], f, indent=1)
    return 0 if all_killed else 1


if __name__ == "__main__":
    sys.exit(main())
