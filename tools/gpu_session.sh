#!/usr/bin/env bash
# The one prepared device check (bench.py's GPU check): small smoke, FLUX-12B overhead, tiny bf16 end-to-end runs.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export DIGENRL_CACHE=/tmp/dgcache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 120 python3 bench.py --size tiny --device cuda 2>&1 | tail -15
timeout 300 python3 bench.py --size flux-12b --device cuda 2>&1 | tail -20 && cp profiles/gpu_check_*.json $OUT/
timeout 90 python3 main.py --mode colocated --nproc 1 --device cuda --steps 3 --eval-every 3 --out-dir /tmp/runs --run-name bf16 --no-progress 2>&1 | tail -5
timeout 90 python3 main.py --mode digenrl --nproc 2 --device cuda --steps 3 --lora --eval-every 0 --out-dir /tmp/runs --run-name dg --no-progress 2>&1 | tail -5
cut -c1-400 /tmp/runs/bf16/metrics.jsonl /tmp/runs/dg/metrics.jsonl
cp /tmp/runs/dg/timeline.png $OUT/ 2>/dev/null; true
