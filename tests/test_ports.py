"""Ports: the self-spawning launcher's store listens on a socket the OS bound for it and that is held until rank 0's
store serves on it (infra/launch.py), so jobs started together on one machine never pick the same port. The
launcher used to bind a free port, close it, and let rank 0 bind the number again: in between another job could
take it (an unmodified suite run failed with EADDRINUSE when the liveness test started four jobs at once).

Twenty jobs of tests/rendezvous_job.py (2 ranks each: store, gloo group, one all-reduce) start at the same
moment; each must meet only its own ranks. (Their launchers are forked from one interpreter that imported torch,
and fork their ranks: one torch import instead of sixty; the spawn path's socket handoff runs in every multi-rank
test of main.py.)
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(240)
JOBS = 20


def test_twenty_jobs_started_together_each_get_their_own_store(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "rendezvous_job.py"), str(tmp_path), str(JOBS)],
                          env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert json.loads(proc.stdout.splitlines()[-1])["codes"] == [0] * JOBS
    rows = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("job*_*.json"))]
    assert len(rows) == 2 * JOBS
    for row in rows:  # both ranks of a job met in one store that held only that job's ranks
        assert row["seen"] == [row["job"]] * 2 and row["sum"] == 3.0, row
    ports = {row["job"]: row["port"] for row in rows}
    assert len(set(ports.values())) == JOBS  # twenty stores, twenty ports
