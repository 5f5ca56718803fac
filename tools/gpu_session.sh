#!/usr/bin/env bash
# The one prepared device check for a session lent a GPU machine (one H200), inside ~10 minutes:
#   run(command="bash tools/gpu_session.sh", carry=[".whl"])   # .whl/: wheels of diffusers & co (pip download)
# 1. our overhead vs the bare FLUX-12B transformer (tools/gpu_check.py);
# 2. a FLUX.1-dev-size pipeline, random weights (tools/gpu_pipeline.py);
# 3. DigenRL on 2 ranks sharing the GPU: NCCL as the default backend (each NCCL group holds one rank: R=1,
#    K=1), the data plane on gloo; 512 px, LoRA r32, bf16: step time, peak memory per rank, publish time,
#    the timeline;
# 4. the colocated baseline on 1 rank, same settings.
set -x
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export DIGENRL_CACHE=/tmp/dgcache PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 200 python3 tools/bench.py --size flux-12b --device cuda 2>&1 | tail -12 && cp tools/profiles/gpu_check_*.json "$OUT"/
timeout 200 python3 tools/gpu_pipeline.py --size flux-12b --out /tmp/flux12b --device cuda 2>&1 | tail -2
RUN="--pretrained /tmp/flux12b --resolution 512 --lora --lora-rank 32 --lora-alpha 64 --device cuda --dtype bfloat16
     --steps 3 --prompts-per-step 2 --group-size 2 --num-steps 8 --eval-every 3 --save-every 3 --trace --no-progress
     --out-dir /tmp/runs --timeout-s 120"
timeout 240 python3 main.py $RUN --mode digenrl --nproc 2 --backend nccl --run-name dg2 2>&1 | grep -v "config {" | tail -8
timeout 150 python3 main.py $RUN --mode colocated --nproc 1 --run-name co1 2>&1 | grep -v "config {" | tail -6
python3 - <<'PY'
import json
for run in ("dg2", "co1"):
    try:
        rows = [json.loads(l) for l in open(f"/tmp/runs/{run}/metrics.jsonl")]
        events = json.load(open(f"/tmp/runs/{run}/trace.json"))["traceEvents"]
    except OSError as e:
        print(run, "missing:", e); continue
    pub = [e["dur"] / 1e6 for e in events if e.get("name") == "publish"]
    print(run, "step_time_s", [round(r["step_time_s"], 2) for r in rows], "reward", [round(r["reward_mean"], 4) for r in rows],
          "logprob_gap", [f"{r['logprob_gap']:.1e}" for r in rows], "publish_s", [round(p, 3) for p in pub])
PY
cp /tmp/runs/dg2/timeline.png "$OUT"/timeline_dg2.png 2>/dev/null; cp /tmp/runs/co1/timeline.png "$OUT"/timeline_co1.png 2>/dev/null; true
