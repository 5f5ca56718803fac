"""Ports: the self-spawning launcher's store listens on a socket the OS bound for it and that is held until rank 0's
store serves on it (infra/launch.py), so jobs started together on one machine never pick the same port. The
launcher used to bind a free port, close it, and let rank 0 bind the number again: in between another job could
take it (an unmodified suite run failed with EADDRINUSE when the liveness test started four jobs at once).

Twenty jobs of tests/rendezvous_job.py (2 ranks each: store, gloo group, one all-reduce) start at the same
moment; each must meet only its own ranks. (Their launchers fork the ranks after importing torch: ~30 s on 2 cores
instead of a minute; the spawn path's socket handoff runs in every multi-rank test of main.py.)
"""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(240)
JOBS = 20


def test_twenty_jobs_started_together_each_get_their_own_store(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "rendezvous_job.py"), str(tmp_path),
                               f"job{j}", str(go)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for j in range(JOBS)]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.ready"))) < JOBS:
            assert time.monotonic() < deadline, "the launchers did not start"
            assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs if p.poll() is not None]
            time.sleep(0.01)
        go.touch()  # all twenty launch now
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(j, p.returncode, out[-1500:]) for j, (p, out) in enumerate(zip(procs, outputs)) if p.returncode]
    assert not failed, failed
    rows = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("job*_*.json"))]
    assert len(rows) == 2 * JOBS
    for row in rows:  # both ranks of a job met in one store that held only that job's ranks
        assert row["seen"] == [row["job"]] * 2 and row["sum"] == 3.0, row
    ports = {row["job"]: row["port"] for row in rows}
    assert len(set(ports.values())) == JOBS  # twenty stores, twenty ports
