"""The suite's own scheduling (tests/conftest.py): under `-n 2 --dist loadfile` the slowest files are handed out
first, so a slow file of few tests does not run alone at the end while the other worker idles."""
import collections
import os

import conftest
from conftest import ROOT


def test_every_listed_slow_file_exists():
    """Catches a renamed or split file that silently loses its place at the front of the queue."""
    missing = [name for name in conftest.SLOW_FILES_S if not os.path.isfile(os.path.join(ROOT, "tests", name))]
    assert not missing, f"tests/conftest.py SLOW_FILES_S names files that do not exist: {missing}"


def test_files_are_handed_out_slowest_first_then_in_xdists_order():
    """Catches the scheduler handing out xdist's order (most tests first) instead: the queue below is xdist's, the
    order handed out must be by SLOW_FILES_S's seconds, then the unlisted files in the queue's own order."""
    listed = sorted(conftest.SLOW_FILES_S, key=conftest.SLOW_FILES_S.get)  # fastest first: the worst queue
    queue = collections.OrderedDict((f"tests/{name}", {}) for name in ["test_many.py", *listed, "test_few.py"])
    handed = []
    while queue:  # what SlowestFileFirst._assign_work_unit does, one file per free worker
        handed.append(conftest.slowest_file(queue))
        queue.pop(handed[-1])
    seconds = [conftest.SLOW_FILES_S.get(os.path.basename(path), 0) for path in handed]
    assert seconds == sorted(seconds, reverse=True) and seconds[0] == max(conftest.SLOW_FILES_S.values())
    assert handed[-2:] == ["tests/test_many.py", "tests/test_few.py"]
