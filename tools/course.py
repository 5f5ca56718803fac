"""The course kit's helper (docs/COURSE.md): blank a function into a stub for a student, bring the
original back, and check the claims of the measuring assignments.

    python tools/course.py blank tsp.py:tsp_packs          # the body -> raise NotImplementedError
    python tools/course.py blank tag.py:predict_step_end tag.py:assist_groups
    python tools/course.py status                          # which files are blanked
    python tools/course.py restore tsp.py                  # the original back, byte for byte
    python tools/course.py check-gap runs/course/gap       # assignment 4: what GAP changes
    python tools/course.py check-tag --costs docs/course_costs.json --num-steps T   # assignment 5

`blank` keeps the signature and the docstring, so the file still imports and the tests still grade
the real file (the student edits it in place). The original goes to .course/<file>.orig (ignored by
git); blanking a blanked file is refused, and so is overwriting a backup. `restore` puts the
original back; if the student changed the stub, their version is kept as .course/<file>.yours first.
"""
from __future__ import annotations

import argparse
import ast
import os
import shutil
import statistics
import sys

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKUP_DIR = os.path.join(ROOT, ".course")
MIN_GAIN = 0.05  # assignment 5: "TAG helps" = DigenRL's simulated step is at least 5% shorter


class CourseError(Exception):
    """Bad input: the message names the value and what is allowed (exit code 2)."""


# --- blank / restore ------------------------------------------------------------------------------
def _relative(path: str) -> str:
    full = os.path.realpath(path)
    rel = os.path.relpath(full, os.path.realpath(ROOT))
    if rel.startswith(os.pardir) or not full.endswith(".py") or not os.path.isfile(full):
        raise CourseError(f"{path!r} is not a .py file of this project ({ROOT})")
    return rel


def _backup(rel: str, kind: str) -> str:
    return os.path.join(BACKUP_DIR, rel + "." + kind)


def _write(path: str, data: bytes, mode_from: str) -> None:
    """infra.rundir.atomic_write's recipe (a temporary file, fsync, rename: the old file survives any
    crash), without importing torch for a text edit; the file mode is copied from `mode_from`."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        shutil.copymode(mode_from, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _find(tree: ast.Module, name: str, rel: str) -> ast.FunctionDef:
    """`name` is a top-level function or Class.method."""
    scope, node = tree.body, None
    for part in name.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        scope = getattr(node, "body", [])
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        known = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        raise CourseError(f"{rel} has no function {name!r}; its top-level functions: {', '.join(known)} "
                          "(a method is Class.method)")
    return node


def stub_source(source: str, rel: str, names: list[str]) -> str:
    """`source` with the bodies of `names` replaced by `raise NotImplementedError(...)`, docstrings kept."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found = sorted(((_find(tree, name, rel), name) for name in names), key=lambda x: -x[0].lineno)
    for node, name in found:  # bottom up: earlier line numbers stay valid
        body = node.body
        head = body[0].value if isinstance(body[0], ast.Expr) else None
        has_doc = isinstance(head, ast.Constant) and isinstance(head.value, str)  # a docstring first
        first = body[1] if has_doc and len(body) > 1 else (None if has_doc else body[0])
        if body[0].lineno == node.lineno:
            raise CourseError(f"{rel}:{name} has its body on the `def` line: cannot blank it")
        indent = " " * body[0].col_offset
        message = f"course assignment: implement {name} (docs/COURSE.md)"
        stub = [f"{indent}raise NotImplementedError({message!r})\n"]
        if first is None:  # a docstring only: the stub goes after it
            lines[body[0].end_lineno:body[0].end_lineno] = stub
        else:
            lines[first.lineno - 1:node.end_lineno] = stub
    out = "".join(lines)
    compile(out, rel, "exec")  # the stub must still import
    return out


def blank(specs: list[str]) -> list[str]:
    """Blank FILE:FUNCTION specs (several per file allowed); returns the files changed."""
    per_file: dict[str, list[str]] = {}
    for spec in specs:
        path, sep, name = spec.rpartition(":")
        if not sep or not path or not name:
            raise CourseError(f"{spec!r}: expected FILE:FUNCTION, e.g. tsp.py:tsp_packs")
        per_file.setdefault(_relative(path), []).append(name)
    for rel in per_file:
        for kind in ("orig", "stub"):
            if os.path.exists(_backup(rel, kind)):
                raise CourseError(f"{rel} is blanked already ({_backup(rel, kind)} exists): "
                                  f"`python tools/course.py restore {rel}` first")
    stubs = {}
    for rel, names in per_file.items():  # every stub is built before anything is written
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            stubs[rel] = stub_source(f.read(), rel, names)
    for rel, stub in stubs.items():
        full = os.path.join(ROOT, rel)
        with open(full, "rb") as f:
            original = f.read()
        os.makedirs(os.path.dirname(_backup(rel, "orig")), exist_ok=True)
        _write(_backup(rel, "orig"), original, full)  # the backup first: nothing is lost
        _write(_backup(rel, "stub"), stub.encode(), full)
        _write(full, stub.encode(), full)
        print(f"blanked {', '.join(per_file[rel])} in {rel} (original: {_backup(rel, 'orig')})")
    return list(stubs)


def restore(path: str) -> str | None:
    """Put the original of a blanked file back; returns where the student's version went, if kept."""
    rel = _relative(path)
    orig, stub = _backup(rel, "orig"), _backup(rel, "stub")
    if not os.path.exists(orig):
        raise CourseError(f"{rel} is not blanked (no {orig}); blanked files: "
                          f"{', '.join(blanked_files()) or 'none'}")
    full = os.path.join(ROOT, rel)
    with open(full, "rb") as f:
        current = f.read()
    kept = None
    with open(stub, "rb") as f:
        edited = current != f.read()
    if edited:  # the student's work is never overwritten silently
        kept, n = _backup(rel, "yours"), 1
        while os.path.exists(kept):
            kept, n = f"{_backup(rel, 'yours')}.{n}", n + 1
        _write(kept, current, full)
    with open(orig, "rb") as f:
        _write(full, f.read(), orig)
    os.remove(stub)
    os.remove(orig)
    print(f"restored {rel}" + (f"; your version is in {kept}" if kept else ""))
    return kept


def blanked_files() -> list[str]:
    found = []
    for folder, _, files in os.walk(BACKUP_DIR):
        found += [os.path.relpath(os.path.join(folder, f), BACKUP_DIR)[:-len(".orig")]
                  for f in files if f.endswith(".orig")]
    return sorted(found)


# --- assignment 4: what GAP changes in the timeline -------------------------------------------
def _merged(intervals):
    out = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def overlap_s(a, b) -> float:
    """Length of (union of intervals a) intersected with (union of intervals b)."""
    a, b, i, j, total = _merged(a), _merged(b), 0, 0, 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def train_during_generation_s(spans: list[dict]) -> tuple[float, float]:
    """(seconds in which a trainer trains batch k while a rollout rank still generates batch k,
    seconds of training of batch k), means over steps >= 1. GAP's overlap; 0 behind the barrier."""
    steps = sorted({s["args"]["step"] for s in spans if s["kind"] == "train"} - {0})
    both, train_s = [], []
    for k in steps:
        train = [(s["start"], s["end"]) for s in spans if s["kind"] == "train" and s["args"].get("step") == k]
        gen = [(s["start"], s["end"]) for s in spans if s["kind"] == "generate" and s["args"].get("step") == k
               and s["role"] == "rollout"]
        both.append(overlap_s(train, gen))
        train_s.append(sum(hi - lo for lo, hi in train))
    return (statistics.fmean(both), statistics.fmean(train_s)) if steps else (0.0, 0.0)


def trained_before_generated(spans: list[dict]) -> tuple[int, int]:
    """(steps >= 1 in which a trainer started training batch k before the last generation of batch k on a
    rollout rank ended, steps >= 1): an order of recorded events, not a share of measured time."""
    steps = sorted({s["args"]["step"] for s in spans if s["kind"] == "train"} - {0})
    early = 0
    for k in steps:
        gen_end = max((s["end"] for s in spans if s["kind"] == "generate" and s["args"].get("step") == k
                       and s["role"] == "rollout"), default=None)
        starts = [s["start"] for s in spans if s["kind"] == "train" and s["args"].get("step") == k]
        early += gen_end is not None and min(starts) < gen_end
    return early, len(steps)


def check_gap(bench_dir: str, off: str = "naive", on: str = "gap") -> bool:
    """The claims of assignment 4 on a bench.py folder holding both modes; prints the evidence."""
    import json

    from tools.bench_analysis import load_spans
    path = os.path.join(bench_dir, "bench.json")
    if not os.path.isfile(path):
        raise CourseError(f"{bench_dir!r} has no bench.json: run assignment 4's bench.py command first")
    with open(path) as f:
        rows = {r["mode"]: r for r in json.load(f)["rows"]}
    traced = lambda m: os.path.isfile(os.path.join(bench_dir, m, "trace.json"))  # noqa: E731
    missing = [m for m in (off, on) if m not in rows or not traced(m)]
    if missing:
        raise CourseError(f"{bench_dir!r} lacks mode(s) {', '.join(missing)} with a trace: "
                          f"run bench.py --modes {off},{on}")
    print(f"{'mode':<8}{'step ms':>9}{'bubble':>8}  {'busy per rank':<30}"
          "training during the same batch's generation")
    seen = {}
    for mode in (off, on):
        r = rows[mode]
        spans = load_spans(os.path.join(bench_dir, mode, "trace.json"))
        both, train = train_during_generation_s(spans)
        early, steps = trained_before_generated(spans)
        seen[mode] = (r["bubble"], early, steps)
        busy = " ".join(f"{k}={v:.2f}" for k, v in r["busy"].items())
        print(f"{mode:<8}{r['step_s'] * 1e3:9.0f}{r['bubble']:8.2f}  {busy:<30}"
              f"{both * 1e3:.0f} of {train * 1e3:.0f} ms/step; training began before the batch's last "
              f"generation ended in {early} of {steps} steps")
    # The first two claims are orders of recorded events, which no load can turn around: behind the barrier the
    # trainer receives the whole batch before it trains (each receive follows the send that follows a generation,
    # and the ranks of one host share one clock and one zero, infra/tracing.py), so no step may show early
    # training; with GAP one step that does shows the pipeline (with 2 fragments the first is trained while the
    # second is generated in nearly every step; a step misses it only when the trainer is delayed by a whole
    # generation).
    claims = [(f"{off}: the trainer trains a batch only after its generation ended", seen[off][1] == 0),
              (f"{on}: the trainer trains while the same batch is still generated", seen[on][1] >= 1),
              (f"the bubble falls from {off} to {on}", seen[on][0] < seen[off][0])]
    for text, ok in claims:
        print(f"  [{'ok' if ok else 'FAILED'}] {text}")
    return all(ok for _, ok in claims)


# --- assignment 5: where TAG starts to help next to TCSS -------------------------------------
def tag_gain(costs, cluster, wl) -> float:
    """1 - DigenRL's simulated step time / the same without TAG (gap+tsp+tcss)."""
    from tools import simulate
    with_tag = simulate.simulate("digenrl", costs, cluster, wl).step_s
    return 1 - with_tag / simulate.simulate("gap+tsp+tcss", costs, cluster, wl).step_s


def check_tag(costs_path: str, num_steps: int, rank_speed: str | None = None) -> bool:
    """Claim: `num_steps` is the smallest T (T > T_train) at which TAG shortens DigenRL's step by at
    least MIN_GAIN in simulate.py, on this costs file (and rank speeds)."""
    import dataclasses

    from tools import simulate
    if not os.path.isfile(costs_path):
        raise CourseError(f"--costs {costs_path!r} does not exist")
    costs, data = simulate.load_costs(costs_path)
    wl = simulate.Workload(**data["workload"])
    cluster = simulate.Cluster(**data["cluster"])
    try:
        cluster.rank_speed = simulate.parse_rank_speed(rank_speed)
    except ValueError as exc:
        raise CourseError(str(exc)) from None
    if num_steps <= wl.train_steps:
        raise CourseError(f"--num-steps {num_steps}: T must exceed T_train = {wl.train_steps} "
                          "(Flow-GRPO trains at most T - 1 of the T steps)")
    gain = lambda t: tag_gain(costs, cluster, dataclasses.replace(wl, num_steps=t))  # noqa: E731
    here = gain(num_steps)
    print(f"T = {num_steps}: DigenRL with TAG is {here:+.1%} faster than without (needs {MIN_GAIN:.0%})")
    if here < MIN_GAIN:
        print(f"  [FAILED] TAG does not help enough at T = {num_steps}")
        return False
    earlier = [t for t in range(wl.train_steps + 1, num_steps) if gain(t) >= MIN_GAIN]
    if earlier:
        print(f"  [FAILED] TAG already helps at a smaller T: {num_steps} is not where it starts")
        return False
    print(f"  [ok] {num_steps} is the smallest T > {wl.train_steps} at which TAG helps")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("blank", help="replace functions' bodies by raise NotImplementedError")
    p.add_argument("specs", nargs="+", metavar="FILE:FUNCTION")
    p = sub.add_parser("restore", help="bring a blanked file's original back")
    p.add_argument("files", nargs="+", metavar="FILE")
    sub.add_parser("status", help="list the blanked files")
    p = sub.add_parser("check-gap", help="assignment 4: naive vs GAP in a bench.py folder")
    p.add_argument("bench_dir")
    p = sub.add_parser("check-tag", help="assignment 5: the smallest T at which TAG helps")
    p.add_argument("--costs", required=True, help="a bench.py costs.json (e.g. docs/course_costs.json)")
    p.add_argument("--num-steps", type=int, required=True, help="your T")
    p.add_argument("--rank-speed", help="RANK=FACTOR,... as simulate.py --rank-speed")
    args = parser.parse_args(argv)
    try:
        if args.command == "blank":
            blank(args.specs)
        elif args.command == "restore":
            for path in args.files:
                restore(path)
        elif args.command == "status":
            print("\n".join(blanked_files()) or "nothing is blanked")
        elif args.command == "check-gap":
            return 0 if check_gap(args.bench_dir) else 1
        else:
            return 0 if check_tag(args.costs, args.num_steps, args.rank_speed) else 1
    except CourseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
