#!/usr/bin/env bash
# The one prepared device check (issues 22, 38), for a session lent one H200: what no CPU test can show, < 8 minutes.
#   python tools/fetch_wheels.py                                  # here, first: .whl/ gets what the image lacks
#   run(command="bash tools/gpu_session.sh", carry=[".whl"], timeout_s=600)
#   bash tools/gpu_session.sh --dry-run                           # print the parts, their limits and the total
# Everything it prints is also in $OUT/log. Each part has its own time limit (`timeout -k`: a rank that ignores
# SIGTERM is killed 5 s later), their sum under 480 s, so a part that hangs costs its limit, never the session.
#  a. 3 ranks on the one GPU (R=1, K=2), the compute plane on gloo with CUDA tensors (NCCL refuses two ranks on
#     one GPU), --fsdp (FSDP2 all-gathers and reduce-scatters between the two trainers), TAG and TCSS at scripted
#     moments (tests/inject/scripted_schedule.py), every torch.distributed call recorded and checked against the
#     communication contract with the policy on cuda; then --resume from its checkpoint.
#  e. full fine-tuning in bf16 with fp32 masters made after sharding (--no-lora --fsdp, K=2, gloo + CUDA), a
#     checkpoint streamed to disk, then --resume: the host-memory paths (infra/checkpoint_file.py, masters).
#  c. one 1024 px rollout forward and two training packs of the default --tsp-pack on the 12B FLUX transformer
#     (LoRA r64) with --grad-ckpt (without it the estimate is ~167 GiB: more than the H200 holds).
#  d. a FLUX.1-dev-size pipeline with random weights, then DigenRL on 2 ranks with the default backend: NCCL for
#     the compute plane over the job's sealed store (infra/jobstore.py), gloo for the data plane; 512 px, LoRA
#     r32, bf16: step times, publish times, logprob_gap, the timeline, each role's peak memory.
# What one GPU cannot show: NCCL between two trainers (K >= 2 over NCCL needs a GPU per trainer: NCCL refuses two
# ranks on one device; part a runs the same FSDP collectives over gloo instead), and multi-node jobs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
TOTAL=0
step() {  # step NAME SECONDS COMMAND...: run COMMAND under a time limit, its output in the log
  local name=$1 limit=$2; shift 2
  TOTAL=$((TOTAL + limit))
  if [ $DRY = 1 ]; then echo "$name ${limit}s: $*"; return 0; fi
  echo "== $name (limit ${limit} s) $(date +%T): $*"
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | grep -v -e "UserWarning" -e "warnings.warn" -e "_register_pre_backward_hook"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
if [ $DRY = 0 ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/log") 2>&1
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  export DIGENRL_CACHE=/tmp/dgcache PYTHONUNBUFFERED=1
fi
RUNS=/tmp/runs
if [ $DRY = 1 ] || ls .whl/*.whl >/dev/null 2>&1; then
  step wheels 25 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl
  export PYTHONPATH=/tmp/site
fi

# a. 3 ranks, one GPU, gloo compute plane with CUDA tensors, FSDP + TAG + TCSS, recorded; then --resume
A="--model flux --mode digenrl --nproc 3 --rollout-ranks 1 --backend gloo --device cuda --fsdp --tcss
   --prompts-per-step 4 --fragment-groups 2 --group-size 2 --num-steps 3 --save-every 2 --eval-every 2 --seed 0
   --timeout-s 60 --trace --no-progress --out-dir $RUNS"
INJECT="env PYTHONPATH=tests/inject:.:${PYTHONPATH:-} DIGENRL_TEST_INJECT=scripted_schedule"
mkdir -p /tmp/calls_a
step a-run 90 $INJECT DIGENRL_COMM_LOG=/tmp/calls_a python3 main.py $A --steps 3 --run-name a3
step a-contract 10 python3 tests/inject/comm_check.py /tmp/calls_a --policy-device cuda
step a-resume 45 $INJECT python3 main.py $A --steps 4 --resume $RUNS/a3

# e. full fine-tuning, bf16 weights with fp32 masters made after sharding, streamed checkpoint, then --resume
E="--model flux --mode digenrl --nproc 3 --rollout-ranks 1 --backend gloo --device cuda --fsdp --no-lora
   --dtype bfloat16 --prompts-per-step 4 --fragment-groups 2 --group-size 2 --num-steps 3 --save-every 2 --eval-every 0 --seed 0
   --timeout-s 60 --no-trace --no-progress --out-dir $RUNS"
step e-run 45 python3 main.py $E --steps 2 --run-name e2
step e-resume 40 python3 main.py $E --steps 3 --resume $RUNS/e2

# c. one 1024 px pack at the default --tsp-pack, 12B, with gradient checkpointing
step c-1024-ckpt 50 python3 tools/estimate_memory.py --model flux --resolution 1024 --group-size 2 --measure cuda \
  --no-estimate --grad-ckpt --json "$OUT/memory_c_ckpt.json"

# d. the 12B pipeline, then 2 ranks with NCCL as the default compute backend
D="--pretrained /tmp/flux12b --resolution 512 --lora --lora-rank 32 --lora-alpha 64 --device cuda --dtype bfloat16
   --steps 3 --prompts-per-step 2 --group-size 2 --num-steps 8 --eval-every 3 --save-every 3 --trace --no-progress
   --out-dir $RUNS --timeout-s 120"
step d-pipeline 75 python3 tools/gpu_pipeline.py --size flux-12b --out /tmp/flux12b --device cuda
step d-nccl 95 python3 main.py $D --mode digenrl --nproc 2 --backend nccl --run-name d2

if [ $DRY = 1 ]; then echo "total limit ${TOTAL}s"; exit 0; fi
python3 - <<'PY'
import json
for run in ("a3", "e2", "d2"):
    try:
        rows = [json.loads(l) for l in open(f"/tmp/runs/{run}/metrics.jsonl")]
    except (OSError, ValueError) as e:
        print(run, "missing:", e); continue
    try:
        events = json.load(open(f"/tmp/runs/{run}/trace.json"))["traceEvents"]
    except (OSError, ValueError):
        events = []  # --no-trace
    publish = [round(e["dur"] / 1e6, 3) for e in events if e.get("name") == "publish"]
    print(run, "steps", [r["step"] for r in rows], "step_time_s", [round(r["step_time_s"], 2) for r in rows],
          "logprob_gap", [f"{r['logprob_gap']:.1e}" for r in rows], "publish_s", publish,
          "tag", [r.get("tag_fragments") for r in rows], "stale", [r.get("stale_fragments") for r in rows])
PY
for run in a3 d2; do cp $RUNS/$run/timeline.png "$OUT/timeline_$run.png" 2>/dev/null; done
echo "total limit ${TOTAL}s; done $(date +%T)"
