"""The rollout rank's background threads fail loudly: an error in the fragment sender (transport.FragmentSender)
or in the weight mailbox (transport.Mailbox) ends the rank's main thread with a message naming the thread,
wherever the main thread is at that moment; never a hang (no wait has a deadline, and liveness sees two
live ranks that each wait for the other).

Bugs caught: an error the thread swallows (the main thread would wait for ever); a main thread that checks
the sender only when it hands it the next fragment (it hung in `mailbox.wait_for` when the send of a step's
last fragment failed: the trainer waits for that fragment, the rollout for the weights that follow it).

The harness (tests/dist_harness.py) runs the real `main.rollout_loop` with a real sender and async_policy.RolloutWeights
on rank 0 and a scripted trainer on rank 1 (receives fragments as announced, publishes a version after each
step). The rollout loop is the same code in every disaggregated mode (naive, gap, gap+tsp, gap+tsp+tag,
digenrl); what changes its control flow is TCSS (the stale budget: generate-ahead between a step's last
claim and the next weights), so each fault runs with and without it, and the sender's with one or two
fragments per step (the failed send is the step's last, with or without a fragment sent before it). One real
job (main.py's ranks, the launcher in the test process) checks that the launcher reports the sender's error,
naming the rank.
"""

import pytest
import torch
import torch.distributed as dist

import dist_harness
import gap
import main
import async_policy
import transport
from fragment import Fragment

pytestmark = pytest.mark.timeout(120)

STEPS = 3


def _fragment(step, first, count, version, producer, group_size=2):
    m = count * group_size
    z = torch.zeros
    return Fragment(step=step, first_group=first, policy_version=version, producer=producer, group_size=group_size,
                    prompt_ids=z(m, dtype=torch.long), cond={"e": z(m, 3)}, latents=z(m, 1, 4),
                    next_latents=z(m, 1, 4), timestep_index=z(m, 1, dtype=torch.long), sigmas=z(m, 1),
                    sigmas_next=z(m, 1), log_probs=z(m, 1), rewards=z(m), reward_parts=z(m, 1), advantages=z(m))


def _worker(rank, world, store, fault, use_tcss, fragment_groups, groups_per_step):
    data, publish = dist.new_group([0, 1]), dist.new_group([0, 1])  # as comm.py: one group per thread that talks
    queue = gap.FragmentQueue(dist.PrefixStore("queue", store), groups_per_step)
    weights = [torch.arange(4.0)]
    if rank == 1:  # the trainer, scripted: take each announced fragment, publish the next version after each step
        transport.publish_weights(iter(weights), 1, 0, src=1, group=publish)
        for step in range(STEPS):
            for seq in range(groups_per_step // fragment_groups):
                transport.recv_fragment(queue.wait(step, seq).producer, group=data)
            transport.publish_weights(iter(weights), 1, step + 1, src=1, group=publish)
        transport.publish_weights([], 0, async_policy.STOP, src=1, group=publish)
        return "trainer done"

    calls = {"send": 0, "publish": 0}
    params = [torch.zeros(4)]
    shapes = [(p.shape, p.dtype) for p in params]

    def failing_send(fragment, dst):  # the sender thread's send of the fault's fragment raises
        calls["send"] += 1
        if fault == "sender" and calls["send"] == groups_per_step // fragment_groups:  # the step's last fragment
            raise ConnectionResetError("injected: the connection to the trainer was reset")
        return transport.send_fragment(fragment, dst, group=data)

    receive = transport.WeightReceiver(1, publish, shapes)

    def failing_receive(begin):  # the mailbox thread raises on version 1, mid-run
        calls["publish"] += 1
        if fault == "mailbox" and calls["publish"] == 2:
            raise ConnectionResetError("injected: the publish stream broke")
        return receive(begin)

    def generate(step, first, count, version, part=None):
        return _fragment(step, first, count, version, 0)

    sender = transport.FragmentSender(failing_send)
    budget = async_policy.StaleBudget(dist.PrefixStore("stale", store), 1) if use_tcss else None
    weights = async_policy.RolloutWeights(transport.Mailbox(failing_receive), params, budget, also_check=sender.raise_if_failed)
    def produce(step, claimed, ahead=False):  # main.rollout_rank's, with a scripted generation
        fragment = generate(step, claimed.first_group, claimed.num_groups, weights.version(step, ahead))
        queue.announce(step, claimed.first_group, claimed.num_groups, 0, [1])
        sender.put(fragment, 1)

    main.rollout_loop(range(STEPS), queue, fragment_groups, weights, produce)
    sender.close()
    weights.close()
    return "rollout finished although its thread failed"


CASES = {  # fault, TCSS on, groups per fragment (of 2 per step)
    "sender_sync_one_fragment_per_step": ("sender", False, 2),  # the old code hung
    "sender_sync_two_fragments_per_step": ("sender", False, 1),  # the old code hung
    "sender_tcss": ("sender", True, 2),
    "mailbox_sync": ("mailbox", False, 1),
    "mailbox_tcss": ("mailbox", True, 2),
}
MESSAGES = {"sender": "fragment sender failed: injected", "mailbox": "weight mailbox failed: injected"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failing_thread_ends_the_rollout_main_thread_with_its_name(case):
    fault, use_tcss, fragment_groups = CASES[case]
    message = MESSAGES[fault]
    reports = dist_harness.run(_worker, 2, fault, use_tcss, fragment_groups, 2, timeout_s=60, needed={0})
    report = reports[0]
    print(f"{fault}: the rollout's main thread raised {report.seconds:.2f} s after it started")
    assert not report.ok, report.value
    assert report.value.startswith("RuntimeError: " + message), report.value[:2000]


def test_a_failing_sender_ends_a_real_job_with_a_message_naming_it(tiny_cache, tmp_path, capfd):
    """A real job, the sender's first send made to raise in the rollout rank (tests/inject/fail_sender.py): the
    launcher names the rank and the sender's error. The naive mode with one fragment per step: the failed send is
    the step's last, and the rollout's main thread next waits for weights that never come (the old code hung
    there; TCSS's path is in the harness cases above). Liveness is given 600 s, so only the error path can end the
    job within the test's 90 s. The launcher runs in this process (stall_matrix.run_job, the ranks forked from
    this worker's forkserver)."""
    import stall_matrix

    job = stall_matrix.run_job(["--mode", "naive", "--steps", "3", "--prompts-per-step", "2", "--group-size", "2",
                                "--num-steps", "3", "--fragment-groups", "2", "--eval-every", "0", "--save-every",
                                "0", "--timeout-s", "600", "--no-trace"], tmp_path, "job", tiny_cache, bound_s=90,
                               inject=("fail_sender",))
    assert not job.killed_by_test, ("the job hung: the sender's error never reached the rollout's main thread",
                                    job.log[-3000:])
    err = capfd.readouterr().err
    assert job.code != 0, err[-2000:]
    assert "rank 0 (rollout) failed: RuntimeError: fragment sender failed: injected" in err, err[-3000:]
