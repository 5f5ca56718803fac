"""Each mechanism file runs alone: copied into an empty folder, `python gap.py` (tsp.py, tag.py, tcss.py) runs
a single-process demonstration on fake ranks and prints what a reader should see. Catches a mechanism file that
needs another project file to show itself working (its loop or rule living elsewhere), and a demo whose
mechanism no longer does what it prints (the equality lines compare the mechanism with its naive reference)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(180)

EXPECTED = {
    # GAP: fragments arrive from two rollout ranks and are trained as they come; the streamed gradient is the
    # full-batch one (the 1/(N T_train) weighting), per minibatch of the two updates
    "gap.py": ["trained fragment of groups [0, 1)", "trained fragment of groups [5, 6)",
               "update 0: every group of [0, 3) is in", "minibatch 0: streamed gradient == full-batch gradient: True",
               "minibatch 1: streamed gradient == full-batch gradient: True"],
    # TSP: packs per trainer, padding, the summed gradient equals the per-timestep loop's; the lockstep loop
    "tsp.py": ["trainer 0: 2 packs", "trainer 1: 2 packs", "summed TSP gradient == per-timestep loop's: True",
               "-> 3 fragments, 3 groups", "3 fragments: 40 pair slots with packs spanning fragments, 48 packed one by one"],
    # TAG: the predictor's step ends, a claim, declining when training is the bottleneck
    "tag.py": ["claim 0: the step ends in 7.60 s", "the leader claims groups [1, 5) for the trainers",
               "it declines: claim 0"],
    # TCSS: a fragment generated ahead with the old version, its ratio, the one-step bound
    "tcss.py": ["generated AHEAD with weights version 0", "stale budget j = 1 spent after 1 fragment(s)",
                "is stale by 1; PPO ratio", "a fragment two versions old is refused"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_mechanism_file_runs_its_demo_alone(name, tmp_path):
    shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in EXPECTED[name]:
        assert line in proc.stdout, f"{name}'s demo did not print {line!r}:\n{proc.stdout}"
    assert "ratio 1.0000" not in proc.stdout  # a stale pair's ratio is not 1
