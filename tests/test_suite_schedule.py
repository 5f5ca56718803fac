"""The suite's own scheduling (tests/conftest.py): under `-n 2 --dist loadfile` the slowest files are handed out
first, so a slow file of few tests does not run alone at the end while the other worker idles."""
import os
import types

import conftest
from conftest import ROOT


def test_every_listed_slow_file_exists():
    """Catches a renamed or split file that silently loses its place at the front of the queue."""
    missing = [name for name in conftest.SLOW_FILES_S if not os.path.isfile(os.path.join(ROOT, "tests", name))]
    assert not missing, f"tests/conftest.py SLOW_FILES_S names files that do not exist: {missing}"


class FakeWorker:
    """What the scheduler sees of an xdist worker. As a real one, it runs its first queued test only once it holds
    a second (pytest needs the next item to tear fixtures down) or is told to shut down."""

    def __init__(self, name, clock):
        self.gateway = types.SimpleNamespace(id=name)
        self.queue, self.shutting_down, self.free_at, self.clock = [], False, 0.0, clock

    def send_runtest_some(self, indices):
        self.queue.extend(indices)
        self.free_at = max(self.free_at, self.clock["now"])  # idle until now, if it was waiting for work

    def shutdown(self):
        self.shutting_down = True
        self.free_at = max(self.free_at, self.clock["now"])


def makespan(scheduler, seconds: dict[str, float]) -> float:
    """Seconds until 2 workers have run every test (`seconds`: nodeid -> its duration) as `scheduler` hands them
    out: each test's end is an event, taken in time order, that the scheduler answers as under pytest-xdist."""
    clock = {"now": 0.0}
    workers = [FakeWorker(f"gw{i}", clock) for i in range(2)]
    collection = list(seconds)
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    while True:
        running = [w for w in workers if len(w.queue) >= 2 or (w.queue and w.shutting_down)]
        if not running:
            break
        worker = min(running, key=lambda w: w.free_at + seconds[collection[w.queue[0]]])
        clock["now"] = worker.free_at = worker.free_at + seconds[collection[worker.queue[0]]]
        scheduler.mark_test_complete(worker, worker.queue.pop(0))
    assert all(not w.queue for w in workers) and scheduler.tests_finished
    return max(w.free_at for w in workers)


def test_a_slow_file_of_few_tests_is_handed_out_first():
    """Catches the suite's scheduler handing out files as xdist does (most tests first): ten files of ten 3 s tests
    and the rehearsal's two 90 s tests take 480 s of work; handed out slowest first, two workers finish in 240 s,
    within one short file (30 s) of half the work; xdist's own order runs the rehearsal alone at the end."""
    from xdist.scheduler import LoadFileScheduling

    seconds = {f"tests/test_small{f}.py::test_{t}": 3.0 for f in range(10) for t in range(10)}
    seconds.update({f"tests/test_rehearse.py::test_{t}": 90.0 for t in range(2)})
    config = types.SimpleNamespace(getvalue={"dist": "loadfile", "tx": ["popen", "popen"]}.get,
                                   option=types.SimpleNamespace(loadscopereorder=True))
    quiet = types.SimpleNamespace(loadscopesched=None, loadfilesched=lambda *args: None)  # xdist's log, unprinted
    ours = makespan(conftest.pytest_xdist_make_scheduler(config, quiet), seconds)
    assert ours <= 240 + 30, ours
    assert makespan(LoadFileScheduling(config, quiet), seconds) >= 240 + 90  # what the hook is there to avoid
    assert conftest.pytest_xdist_make_scheduler(types.SimpleNamespace(getvalue={"dist": "load"}.get), None) is None


def test_slowest_file_is_the_most_seconds_then_the_queues_first():
    slowest = max(conftest.SLOW_FILES_S, key=conftest.SLOW_FILES_S.get)
    fastest = min(conftest.SLOW_FILES_S, key=conftest.SLOW_FILES_S.get)
    queue = ["tests/test_a.py", f"tests/{fastest}", f"tests/{slowest}"]
    assert conftest.slowest_file(queue) == f"tests/{slowest}"
    assert conftest.slowest_file(queue[:2]) == f"tests/{fastest}"
    assert conftest.slowest_file(["tests/test_a.py", "tests/test_b.py"]) == "tests/test_a.py"
