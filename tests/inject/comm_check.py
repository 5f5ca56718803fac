"""The communication contract's rules over a record of tests/inject/comm_recorder.py (one JSON line per
torch.distributed call). Used by tests/test_comm_contract.py on CPU and by tools/gpu_session.sh on a GPU (where
the policy is on cuda and the compute plane runs gloo with CUDA tensors), so both check the same rules.

    python tests/inject/comm_check.py RECORD_FOLDER --policy-device cuda    # prints violations, exit 1 if any
"""
import json
import os
import sys

TORCH_INTERNALS = ("torch/distributed/fsdp/", "torch/distributed/tensor/", "torch/nn/utils/clip_grad")
COMPUTE_CALLERS = {("trainer.py", "all_reduce_gradients"),  # the only project code allowed on the compute plane
                   ("fsdp.py", "whole_tensor")}  # FSDP shards made whole (publish, checkpoint), main thread


def calls(rows: list[dict]) -> list[dict]:
    """The torch.distributed calls of a record (it also holds the project's waits and the phases entered)."""
    return [row for row in rows if "plane" in row]


def violations(rows: list[dict], policy_device: str = "cpu") -> list[str]:
    """Every broken rule, one line each (empty when the run kept the contract)."""
    out = []
    for row in calls(rows):
        where = (f"rank {row['rank']} thread {row['thread']}: {row['op']} from "
                 f"{os.path.basename(row['file'])}:{row['function']}")
        if row["plane"] == "compute":
            if not row["main_thread"]:
                out.append(f"{where}: a background thread on the compute plane")
            if any(d.split(":")[0] != policy_device.split(":")[0] for d in row["devices"]):
                out.append(f"{where}: tensors on {row['devices']} on the compute plane (policy device {policy_device})")
            internal = any(part in row["file"].replace(os.sep, "/") for part in TORCH_INTERNALS)
            if not internal and (os.path.basename(row["file"]), row["function"]) not in COMPUTE_CALLERS:
                out.append(f"{where}: only the gradient all-reduce and FSDP may use the compute plane")
        elif row["plane"] == "data":
            if any(d != "cpu" for d in row["devices"]):
                out.append(f"{where}: tensors on {row['devices']} on the data plane (CPU only)")
        else:
            out.append(f"{where}: a collective on the {row['plane']} group")
    return out


def read_record(folder: str) -> list[dict]:
    return [json.loads(line) for name in sorted(os.listdir(folder)) for line in open(os.path.join(folder, name))]


if __name__ == "__main__":
    folder = sys.argv[1]
    device = sys.argv[sys.argv.index("--policy-device") + 1] if "--policy-device" in sys.argv else "cpu"
    rows = calls(read_record(folder))
    found = violations(rows, device)
    planes = sorted({(r["plane"], r["devices"][0] if r["devices"] else "-") for r in rows})
    print(f"comm contract: {len(rows)} calls recorded, planes/devices {planes}, {len(found)} violations")
    print("\n".join(found[:20]))
    sys.exit(1 if found or not rows else 0)
