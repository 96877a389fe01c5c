#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one go (`make gpu-checks`): what a machine with one should run
# first. Each step has its own time limit and a failure does not stop the others. Logs go to one file,
# results to JSON beside it, in $OUT (default runs/gpu-checks).
#
#   1. versions and the GPU; `rlrecipe doctor` for the 7B recipes (what this machine lacks for them);
#   2. the 7B micro-batch's memory (R1-Distill-Qwen-7B's shapes, V = 152,064): full logits vs chunked,
#      then seconds and memory under sdpa's packed mask vs per-document varlen_sdpa, and the chunked
#      peaks beside `rlrecipe plan`'s terms for them (bench/plan_7b_gpu.py);
#   2a. `rlrecipe plan` under DeepSpeed ZeRO-3 and ZeRO-2 against a measured step on every visible GPU
#      (7B's layers and vocabulary, four layers, bf16; bench/plan_vs_measured_ds.py --device cuda);
#   2b. the weight-sync fingerprint against `rlrecipe serve` (a server that loads the wrong weights
#      is named) and its cost per push;
#   3. DeepSpeed ZeRO-3 in one process on the GPU (nccl), the test that runs without a launcher;
#   4. the GPU-marked tests (real SGLang; they skip without it and without weights);
#   5. the whole suite with the GPU visible, so every path that picks CUDA when it can runs on it.
#
# Real SGLang (make gpu-smoke, make bench-sglang, rlrecipe rollout-servers) needs `make install-gpu`
# and model weights on the machine; step 4 says which is missing.
set -u
OUT=${OUT:-runs/gpu-checks}
PY=${PY:-python3}
LOG="$OUT/gpu_checks.log"
SUITE_S=${SUITE_S:-300}
mkdir -p "$OUT"
: >"$LOG"

step() {  # step NAME SECONDS CMD...: run with a limit, log everything, print the verdict and the tail
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout "$limit" "$@" >"$OUT/.step.log" 2>&1
  local rc=$?
  cat "$OUT/.step.log" >>"$LOG"
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  tail -n "${TAIL:-8}" "$OUT/.step.log"
  rm -f "$OUT/.step.log"
}

step env 120 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c '
import torch, transformers, importlib.util as u
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))
print(\"transformers\", transformers.__version__)
for m in (\"deepspeed\", \"sglang\", \"flash_attn\", \"rlrecipe\", \"math_verify\", \"datasets\"):
    print(m, \"present\" if u.find_spec(m) else \"MISSING\")
'"
for recipe in recipes/7b_boba.yaml recipes/7b_boba_icepop_c3po.yaml recipes/32b_200.yaml; do
  step "doctor-$(basename "$recipe" .yaml)" 120 "$PY" -m rlrecipe.cli.app doctor "$recipe"
done
step logprob-7b 240 "$PY" -m bench.logprob_memory --model 7b --tokens 4096,16384,30720 --json "$OUT/logprob_7b.json"
step plan-vs-7b-peak 60 "$PY" -m bench.plan_7b_gpu "$OUT/logprob_7b.json"
step plan-vs-deepspeed-gpu 420 "$PY" -m bench.plan_vs_measured_ds --device cuda --json "$OUT/plan_ds_gpu.json"
step weight-fingerprint 300 bash -c "$PY -m pytest -q -p no:cacheprovider tests/rollout/test_weight_check.py && \
  $PY -m bench.weight_fingerprint --hidden 512 --layers 4"
for attn in sdpa varlen_sdpa; do
  step "attention-7b-$attn" 240 "$PY" -m bench.logprob_memory --model 7b --tokens 4096,16384,30720 --paths chunked \
    --attn "$attn" --json "$OUT/logprob_7b_$attn.json"
done
step deepspeed-gpu 180 "$PY" -m pytest -q -p no:cacheprovider tests/train/test_deepspeed_engine.py -k single_process
step gpu-marked 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests
TAIL=40 step suite-with-gpu "$SUITE_S" "$PY" -m pytest -q -p no:cacheprovider --maxfail=30 -rfE \
  --junitxml="$OUT/junit.xml" ${SUITE_ARGS:-} tests
grep '^=== .*rc=' "$LOG"
