"""The communication contract of comm.py, enforced on CPU: every torch.distributed call of a real run is
recorded (tests/inject/comm_recorder.py, loaded by every rank through tests/inject/sitecustomize.py) and
checked against the rules that keep the GPU path equal to the tested one:
- a background thread never calls the compute plane (under NCCL it would make generation wait);
- a data-plane call carries CPU tensors only (gloo, whatever the default backend);
- a compute-plane call carries tensors on the policy device, and comes only from the gradient
  all-reduce (Trainer.all_reduce_gradients) or from FSDP2 / DTensor internals;
- nothing runs on the default (world) group.
Three layouts: R=1 K=2 with FSDP + TAG + TCSS, colocated on 2 ranks, R=2 K=1. In the first, TAG and TCSS act
at scripted moments (tests/inject/scripted_schedule.py), so their traffic is in the record on any machine: the
test checks from the run's metrics that both ran (a layout named for them that never ran them proved nothing).
The same record gives the blocking points of these layouts: each must be a row of the stall-and-slow matrix
(tests/stall_matrix.py, tests/test_stall_matrix.py).
"""
import json
import os
import sys

import pytest

from conftest import ROOT, read_metrics, run_forked

pytestmark = pytest.mark.timeout(600)

sys.path.insert(0, os.path.join(ROOT, "tests", "inject"))
from comm_check import calls, violations  # noqa: E402  (the rules, shared with tools/gpu_session.sh)
import stall_matrix  # noqa: E402


LAYOUTS = {
    "fsdp_tag_tcss_r1_k2": ["--mode", "digenrl", "--fsdp", "--nproc", "3", "--rollout-ranks", "1",
                            "--prompts-per-step", "4", "--fragment-groups", "2", "--eval-every", "2"],
    "colocated_2": ["--mode", "colocated", "--nproc", "2", "--prompts-per-step", "2", "--eval-every", "2"],
    "digenrl_r2_k1": ["--mode", "digenrl", "--nproc", "3", "--rollout-ranks", "2", "--prompts-per-step", "4",
                      "--eval-every", "2"],
}
COMMON = ["--steps", "2", "--group-size", "2", "--num-steps", "3", "--save-every", "2", "--timeout-s", "60",
          "--seed", "0"]
SCRIPTED = {"fsdp_tag_tcss_r1_k2"}  # TAG and TCSS scripted (one rollout rank): they act whatever the timing


@pytest.fixture(scope="module")
def recorded(tiny_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("contract")
    result = {}
    for name, args in LAYOUTS.items():
        log = out / f"{name}.calls"
        log.mkdir()
        run_forked([*COMMON, *args], out, name, tiny_cache, scripted=name in SCRIPTED, comm_log=str(log),
                   bound_s=300)
        result[name] = [json.loads(line) for f in os.listdir(log) for line in open(log / f)]
        result[f"{name}/metrics"] = read_metrics(out / name)
    return result


def test_the_tag_and_tcss_layout_ran_tag_and_tcss(recorded):
    """Step 1 trained a fragment generated one version stale and one the trainers generated themselves (scripted:
    deterministic), so the contract above covers TAG's exchange between trainers and TCSS's generate-ahead."""
    rows = recorded["fsdp_tag_tcss_r1_k2/metrics"]
    assert rows[1]["stale_fragments"] >= 1 and rows[1]["tag_fragments"] >= 1, rows[1]
    assert all(r["trajectories"] == 4 * 2 for r in rows)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_distributed_call_keeps_the_contract(recorded, layout):
    rows = calls(recorded[layout])
    assert not violations(rows), "\n".join(violations(rows)[:20])
    # The recorder saw the traffic that matters, so an empty violation list means something.
    planes = {(r["plane"], r["main_thread"]) for r in rows}
    assert ("data", True) in planes
    assert ("compute", True) in planes or layout == "digenrl_r2_k1"  # K = 1 without FSDP: nothing to reduce
    if layout != "colocated_2":  # fragments leave through the sender thread, weights arrive in the mailbox
        threads = {r["thread"] for r in rows if not r["main_thread"]}
        assert {"fragment-sender", "weight-mailbox"} <= threads, threads


def test_fsdp_collectives_and_the_gradient_all_reduce_are_recorded(recorded):
    fsdp = [r for r in calls(recorded["fsdp_tag_tcss_r1_k2"]) if r["plane"] == "compute"]
    assert any("fsdp" in r["file"] for r in fsdp)  # FSDP2's all-gathers / reduce-scatters went through
    colocated = [r for r in calls(recorded["colocated_2"]) if r["plane"] == "compute"]
    assert any(r["function"] == "all_reduce_gradients" for r in colocated)


def test_every_blocking_point_of_these_layouts_is_a_row_of_the_stall_and_slow_matrix(recorded):
    """Catches a collective or a wait added without its row in the matrix (so without a test that a rank stalled
    there is found and named, and one slowed there is not killed), one outside any named phase (liveness could
    only say "outside any named phase"), and a row whose point no longer exists (a renamed phase)."""
    points, unnamed = {}, []
    for layout in LAYOUTS:
        found, outside = stall_matrix.blocking_points(recorded[layout])
        points.update(found)
        unnamed += outside
    assert not unnamed, f"blocking calls outside any named phase: {unnamed}"
    missing = {p: what for p, what in points.items() if p not in stall_matrix.ROWS}
    assert not missing, f"blocking points without a row in tests/stall_matrix.py ROWS: {missing}"
    # Every row is a point of these layouts but resuming (the matrix's own slow run records that one).
    assert set(stall_matrix.ROWS) - set(points) == {"resume"}, set(stall_matrix.ROWS) - set(points)


def test_the_checker_flags_each_broken_rule():
    base = {"rank": 1, "thread": "MainThread", "main_thread": True, "file": "/x/trainer.py",
            "function": "all_reduce_gradients", "op": "dist.all_reduce", "devices": ["cuda:0"], "plane": "compute"}
    assert violations([base], policy_device="cuda:0") == []
    cases = [
        ({"devices": ["cpu"]}, "on the compute plane (policy device cuda:0)"),  # a CPU tensor on NCCL
        ({"main_thread": False, "thread": "weight-mailbox"}, "a background thread on the compute plane"),
        ({"function": "reduce", "devices": ["cuda:0"]}, "only the gradient all-reduce and FSDP"),  # metrics
        ({"plane": "data", "devices": ["cuda:0"]}, "on the data plane (CPU only)"),
        ({"plane": "default", "devices": ["cpu"]}, "a collective on the default group"),
    ]
    for change, message in cases:
        found = violations([{**base, **change}], policy_device="cuda:0")
        assert any(message in v for v in found), (change, found)
