"""docs/COURSE.md runs as written: each assignment's commands on the reference code (the project as it
is) in a fresh copy of the checkout; each blanked function makes its grader fail; tools/course.py's
blank / restore give back every byte.

The commands are read from COURSE.md's marked blocks (`<!-- check N -->`, `<!-- run N -->`,
`<!-- blank N -->`, `<!-- handout -->` before a bash block), so the page cannot drift from what is tested. The
reference's blocks (checks 1-6, run 5) run once, in one interpreter (tests/run_blocks.py: each line as a fresh
`python` would run it, the project's modules imported again for each line, torch, diffusers and pytest once, and
one forkserver for the jobs of assignments 4 and 6), and each test reads its block's exit status and output. Smaller
configurations than the page's, to keep this file near a minute on 2 cores:
- assignment 4: bench.py runs 3 steps of T = 8 (the page: --quick's 8 steps of T = 24);
- assignment 6: learning_bench.py runs seed 0 for 2 steps (the page: seeds 0-2, 200 steps);
- assignment 5's YOUR_T / YOUR_T_SLOW are the reference thresholds, computed here from simulate.py;
- the blanked graders run in one pytest process, assignment 1's on its shard test only (its
  gradient test loads the model; the check of assignment 1 runs it on the reference).
"""
import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from xml.etree import ElementTree

import pytest

from conftest import ROOT
from tools import course, simulate

pytestmark = pytest.mark.timeout(1200)  # the first test of the reference's blocks waits for all of them
PAGE = os.path.join(ROOT, "docs", "COURSE.md")
NOTES = os.path.join(ROOT, "docs", "COURSE_NOTES.md")
BLANKED = {1: ["tsp.py"], 2: ["tag.py"], 3: ["async_policy.py"]}  # what each blank block changes


def blocks(kind: str) -> dict[int, str]:
    with open(PAGE) as f:
        text = f.read()
    found = re.findall(rf"<!-- {kind} ?(\d*) -->\n```bash\n(.*?)```", text, re.DOTALL)
    return {int(n or 0): body for n, body in found}  # unnumbered: 0


def fresh_copy(dest) -> str:
    """The checkout's files (tracked, and new files git does not ignore), as a fresh clone has them."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True)
    if listed.returncode == 0:
        for rel in listed.stdout.splitlines():
            if os.path.isfile(os.path.join(ROOT, rel)):  # (a deleted, not yet committed file is listed)
                os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))
    else:  # not a git checkout (an unpacked archive)
        shutil.copytree(ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".course", "runs", "bench_runs", "__pycache__", ".pytest_cache"))
    return str(dest)


def run(text: str, cwd: str, cache: str, tmp, timeout: int = 400) -> subprocess.CompletedProcess:
    """A block as a bash script (stops at the first failing line); `python` is this interpreter: a wrapper script
    that execs sys.executable by its own path (a symlink to a virtualenv's interpreter, placed in another folder,
    no longer finds the venv's pyvenv.cfg and runs without its packages)."""
    bindir = os.path.join(tmp, "bin")
    if not os.path.exists(bindir):
        os.makedirs(bindir)
        wrapper = os.path.join(bindir, "python")
        with open(wrapper, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
        os.chmod(wrapper, 0o755)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ["PATH"], DIGENRL_CACHE=cache,
               DIGENRL_TEST_CACHE=cache, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")  # one tiny build
    return subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def smaller(text: str, old: str, new: str) -> str:
    assert old in text, f"COURSE.md changed: {old!r} is gone; update the smaller configuration here"
    return text.replace(old, new)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory, tiny_cache):
    tmp = tmp_path_factory.mktemp("course")
    return fresh_copy(tmp / "digenrl"), tiny_cache, tmp


def smaller_checks() -> dict[str, str]:
    """The reference's blocks, in the order they run: the code checks first (nothing else's output can reach
    theirs), the jobs of assignments 4 and 6 last (their forkserver, started by the first, serves the second)."""
    t_ref, t_slow = reference_threshold({}), reference_threshold({0: 0.5})
    return {"check 1": blocks("check")[1], "check 2": blocks("check")[2], "check 3": blocks("check")[3],
            "run 5": blocks("run")[5],
            "check 5": blocks("check")[5].replace("YOUR_T_SLOW", str(t_slow)).replace("YOUR_T", str(t_ref)),
            "check 4": smaller(blocks("check")[4], "--modes naive,gap --out",
                               "--modes naive,gap --steps 3 --num-steps 8 --out"),
            "check 6": smaller(blocks("check")[6], "--seeds 0,1,2", "--seeds 0 --steps 2")}


@pytest.fixture(scope="module")
def reference(checkout) -> dict[str, subprocess.CompletedProcess]:
    """Each of smaller_checks()'s blocks run in the fresh copy: its exit status (the first failing line's, as
    `bash -e`), stdout and stderr."""
    copy, cache, tmp = checkout
    checks = smaller_checks()
    out = os.path.join(tmp, "blocks")
    env = dict(os.environ, DIGENRL_CACHE=cache, DIGENRL_TEST_CACHE=cache, OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "run_blocks.py"), out, *checks.values()],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    def read(i: int, kind: str) -> str:
        with open(os.path.join(out, f"{i}.{kind}"), errors="replace") as f:
            return f.read()

    return {name: subprocess.CompletedProcess(text, int(read(i, "code")), read(i, "out"), read(i, "err"))
            for i, (name, text) in enumerate(checks.items())}


def test_the_page_marks_every_command():
    assert sorted(blocks("check")) == [1, 2, 3, 4, 5, 6]
    assert sorted(blocks("blank")) == sorted(BLANKED) and sorted(blocks("run")) == [5]
    assert list(blocks("handout")) == [0]
    with open(PAGE) as f:
        assert len(re.findall(r"^## \d\. ", f.read(), re.M)) == 6
    for text in smaller_checks().values():  # what tests/run_blocks.py runs: `python` lines only
        assert all(line.startswith("python ") for line in text.splitlines() if line.strip()), text


@pytest.mark.parametrize("n", [1, 2, 3])
def test_code_assignment_checks_pass_on_the_reference(reference, n):
    proc = reference[f"check {n}"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_gap_assignment_check(checkout, reference):
    copy, cache, tmp = checkout
    proc = reference["check 4"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[ok]") == 3
    for mode in ("naive", "gap"):
        assert os.path.getsize(os.path.join(copy, "runs", "course", "gap", mode, "timeline.png")) > 0
    # the check can fail: the same runs with the modes' roles swapped contradict every claim but none
    assert not course.check_gap(os.path.join(copy, "runs", "course", "gap"), off="gap", on="naive")


def test_gap_check_reads_the_order_of_recorded_spans():
    """check-gap's overlap claims are orders of events, so a loaded machine cannot flip them: a naive trace whose
    trainer starts a batch 1 ms before its last generation ended (a clock skew the old share-of-time check read
    as overlap) is a violation however short the overlap; a GAP trace needs one step that trains early."""
    def span(kind, role, start, end, step):
        return {"kind": kind, "role": role, "start": start, "end": end, "args": {"step": step}}

    naive = [span("generate", "rollout", 0.0, 1.0, 1), span("generate", "rollout", 1.0, 2.0, 1),
             span("train", "trainer", 2.1, 3.0, 1), span("generate", "rollout", 3.2, 4.2, 2),
             span("train", "trainer", 4.3, 5.0, 2), span("train", "trainer", 0.5, 0.6, 0)]  # step 0 is ignored
    assert course.trained_before_generated(naive) == (0, 2)
    skewed = naive + [span("train", "trainer", 4.199, 4.3, 2)]
    assert course.trained_before_generated(skewed) == (1, 2)
    gap = [span("generate", "rollout", 0.0, 1.0, 1), span("train", "trainer", 1.01, 1.5, 1),
           span("generate", "rollout", 1.0, 2.0, 1), span("train", "trainer", 2.01, 2.5, 1)]
    assert course.trained_before_generated(gap) == (1, 1)


def gain(costs, cluster, wl, num_steps) -> float:
    """The page's definition: 1 - DigenRL's simulated step time / the same without TAG."""
    w = dataclasses.replace(wl, num_steps=num_steps)
    return 1 - (simulate.simulate("digenrl", costs, cluster, w).step_s
                / simulate.simulate("gap+tsp+tcss", costs, cluster, w).step_s)


def reference_threshold(rank_speed: dict) -> int:
    costs, data = simulate.load_costs(os.path.join(ROOT, "docs", "course_costs.json"))
    wl, cluster = simulate.Workload(**data["workload"]), simulate.Cluster(**data["cluster"])
    cluster.rank_speed = rank_speed
    return next(t for t in range(wl.train_steps + 1, 400) if gain(costs, cluster, wl, t) >= course.MIN_GAIN)


def test_tag_assignment_runs_and_its_check_accepts_only_the_threshold(reference):
    proc = reference["run 5"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("## num_steps=") == 6 + 7 + 4 and proc.stdout.count("digenrl ") == 7 + 4
    t_ref, t_slow = reference_threshold({}), reference_threshold({0: 0.5})
    proc = reference["check 5"]  # YOUR_T and YOUR_T_SLOW: t_ref and t_slow
    assert proc.returncode == 0 and proc.stdout.count("[ok]") == 2, proc.stdout + proc.stderr
    costs = os.path.join(ROOT, "docs", "course_costs.json")
    for wrong in (t_ref - 1, t_ref + 1):  # not yet helping / not where it starts
        assert course.main(["check-tag", "--costs", costs, "--num-steps", str(wrong)]) == 1
    assert course.main(["check-tag", "--costs", costs, "--num-steps", "8"]) == 2  # T <= T_train
    # the teachers' notes quote these thresholds
    with open(NOTES) as f:
        quoted = re.search(r"<!-- check-tag reference: T=(\d+) T_slow=(\d+) -->", f.read())
    assert quoted and (int(quoted[1]), int(quoted[2])) == (t_ref, t_slow)


def test_tcss_assignment_check(checkout, reference):
    copy, cache, tmp = checkout
    proc = reference["check 6"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = os.path.join(copy, "runs", "course", "tcss")
    assert {"reward_curves.png", "reward_curves_wall.png", "time_to_reward.json"} <= set(os.listdir(out))
    assert "to reward" in proc.stdout


def test_blanked_functions_fail_their_graders_and_restore_gives_every_byte_back(tmp_path, tiny_cache):
    copy = fresh_copy(tmp_path / "digenrl")
    for n, text in blocks("blank").items():
        proc = run(text, copy, tiny_cache, tmp_path)
        assert proc.returncode == 0, proc.stderr
        for rel in BLANKED[n]:
            with open(os.path.join(copy, rel)) as f:
                assert "NotImplementedError('course assignment" in f.read()
    graders = ["tests/test_tsp_tag.py::test_tsp_shards_cover_every_pair_once_with_equal_pass_counts",
               "tests/test_tag_predictor.py", "tests/test_tcss_rule.py"]
    report = tmp_path / "graders.xml"
    proc = run(f"python -m pytest -q -p no:cacheprovider --junitxml={report} {' '.join(graders)}", copy, tiny_cache,
               tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    failed = {case.get("classname") for case in ElementTree.parse(report).iter("testcase")
              if any("NotImplementedError" in (f.get("message") or "") for f in case.iter("failure"))}
    # each grader fails on its stub (test_tag_predictor's split-time test does not call the predictor)
    assert failed == {"tests.test_tsp_tag", "tests.test_tag_predictor", "tests.test_tcss_rule"}, proc.stdout[-3000:]
    proc = run("python tools/course.py restore tsp.py tag.py async_policy.py", copy, tiny_cache, tmp_path)
    assert proc.returncode == 0, proc.stderr
    for rel in ("tsp.py", "tag.py", "async_policy.py"):
        with open(os.path.join(ROOT, rel), "rb") as a, open(os.path.join(copy, rel), "rb") as b:
            assert a.read() == b.read(), rel
    assert not os.listdir(os.path.join(copy, ".course"))  # no backup left behind
    # the teachers' hand-out recipe: blanked functions, no originals, no notes; the copy restored
    proc = run(blocks("handout")[0], copy, tiny_cache, tmp_path)
    assert proc.returncode == 0, proc.stderr
    handout = os.path.join(os.path.dirname(copy), "digenrl-handout")
    with open(os.path.join(handout, "tag.py")) as f:
        assert f.read().count("NotImplementedError('course assignment") == 2
    assert not os.path.exists(os.path.join(handout, ".course"))
    assert not os.path.exists(os.path.join(handout, "docs", "COURSE_NOTES.md"))
    assert os.path.isfile(os.path.join(handout, "docs", "COURSE.md"))
    for rel in ("tsp.py", "tag.py", "async_policy.py"):
        with open(os.path.join(ROOT, rel), "rb") as a, open(os.path.join(copy, rel), "rb") as b:
            assert a.read() == b.read(), rel


@pytest.fixture
def project(tmp_path, monkeypatch):
    """tools/course.py pointed at a small project in tmp_path (in-process: no subprocess cost)."""
    for rel in ("tsp.py", "tag.py"):
        shutil.copy2(os.path.join(ROOT, rel), tmp_path / rel)
    os.chmod(tmp_path / "tag.py", 0o640)
    monkeypatch.setattr(course, "ROOT", str(tmp_path))
    monkeypatch.setattr(course, "BACKUP_DIR", str(tmp_path / ".course"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_blank_restore_round_trip_refusals_and_your_version_kept(project):
    before = {rel: ((project / rel).read_bytes(), os.stat(project / rel).st_mode) for rel in ("tsp.py", "tag.py")}
    assert course.blank(["tsp.py:tsp_packs", "tag.py:predict_step_end", "tag.py:Assistant.forget"]) == ["tsp.py",
                                                                                                          "tag.py"]
    stub = (project / "tag.py").read_text()
    assert stub.count("raise NotImplementedError") == 2 and "def assist_groups" in stub
    assert '"""Seconds from now until the trainer group' in stub  # the docstring stays
    spec = importlib.util.spec_from_file_location("blanked_tsp", project / "tsp.py")
    blanked = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(blanked)  # the stub still imports
    with pytest.raises(NotImplementedError, match="tsp_packs"):
        blanked.tsp_packs(2, 2, 0, 1, 2)
    assert blanked.num_passes(4, 3, 2, 4) == 2  # the rest of the file is untouched
    with pytest.raises(course.CourseError, match="blanked already"):
        course.blank(["tag.py:assist_groups"])  # twice: refused, the backup is not overwritten
    assert course.blanked_files() == ["tag.py", "tsp.py"]
    assert course.restore("tsp.py") is None
    (project / "tag.py").write_text(stub + "# my attempt\n")
    kept = course.restore("tag.py")
    with open(kept) as f:
        assert f.read() == stub + "# my attempt\n"  # the student's work is kept aside
    for rel, (data, mode) in before.items():
        assert (project / rel).read_bytes() == data and os.stat(project / rel).st_mode == mode, rel
    assert course.blanked_files() == []


@pytest.mark.parametrize("spec, message", [
    ("tsp.py:nope", "no function 'nope'.*tsp_packs"), ("tsp.py", "expected FILE:FUNCTION"),
    ("missing.py:f", "not a .py file of this project"), ("../x.py:f", "not a .py file of this project")])
def test_blank_refuses_bad_specs_and_writes_nothing(project, spec, message):
    original = (project / "tsp.py").read_bytes()
    with pytest.raises(course.CourseError, match=message):
        course.blank(["tag.py:predict_step_end", spec])
    assert (project / "tsp.py").read_bytes() == original and not os.path.exists(project / ".course")
    with pytest.raises(course.CourseError, match="not blanked"):
        course.restore("tsp.py")


def test_run_blocks_runs_each_line_as_a_fresh_python_would(tmp_path):
    """tests/run_blocks.py, which runs the reference's blocks: a line cannot lean on an earlier line's imports,
    path or environment (each would mask a tool that fails from a fresh shell); a failing line ends its block with
    its exit status, as `bash -e`; the next block runs anyway; `python -m` and SystemExit as the interpreter has
    them."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "helper.py").write_text("VALUE = 'fresh'\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "first.py").write_text(
        "import os, sys\nsys.path.insert(0, os.getcwd())\nimport pkg.helper\npkg.helper.VALUE = 'changed'\n"
        "os.environ['LEAKED'] = '1'\nos.chdir('tools')\nprint('first ran')\n")
    (tmp_path / "tools" / "second.py").write_text(  # no path of its own: pkg is not importable from a fresh shell
        "import os, sys\nprint('leaked' if 'LEAKED' in os.environ else 'clean', os.path.basename(os.getcwd()))\n"
        "print('pkg seen' if 'pkg' in sys.modules else 'pkg unseen')\nimport pkg.helper\n")
    (tmp_path / "tools" / "exits.py").write_text("import sys\nprint('exits', sys.argv[1:])\nsys.exit(3)\n")
    (tmp_path / "tools" / "says.py").write_text("raise SystemExit('error: told')\n")
    blocks_ = ["python tools/first.py\npython tools/second.py", "python tools/exits.py a 'b c'\npython tools/first.py",
               "python -m pkg.helper\npython tools/says.py", "python tools/second.py"]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "run_blocks.py"), str(out), *blocks_],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    read = lambda i, kind: (out / f"{i}.{kind}").read_text()  # noqa: E731
    assert read(0, "out") == f"first ran\nclean {tmp_path.name}\npkg unseen\n" and read(0, "code") == "1"
    assert "No module named 'pkg'" in read(0, "err")  # second.py fails as it would from a shell
    assert read(1, "out") == "exits ['a', 'b c']\n" and read(1, "code") == "3"  # first.py never ran
    assert read(2, "code") == "1" and read(2, "err") == "error: told\n"
    assert read(3, "code") == "1" and read(3, "out") == f"clean {tmp_path.name}\npkg unseen\n"


def test_main_job_refuses_a_bad_job_as_main_py_does_and_sends_one_rank_jobs_to_it(tmp_path):
    """tools/main_job.py (bench.py's and learning_bench.py's jobs): a job refused by validation gets main.py's exit
    code 2 and its one line, written where the caller asked (nothing spawned); the jobs cli.main would run inside
    the calling process itself (one rank, a torchrun rank) and command lines that do not parse go to `python
    main.py`."""
    from tools import main_job

    log = str(tmp_path / "job.log")
    assert main_job.run(["--nproc", "2", "--steps", "0", "--out-dir", str(tmp_path)], stdout=log, stderr=log) == 2
    with open(log) as f:
        text = f.read()
    assert text.startswith("error: ") and "--steps" in text and text.count("\n") == 1, text
    assert os.listdir(tmp_path) == ["job.log"]  # no run folder: refused before anything was written
    assert main_job.in_process(["--nproc", "2"]) and not main_job.in_process(["--nproc", "1"])
    assert not main_job.in_process(["--no-such-flag"])
