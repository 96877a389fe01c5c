#!/usr/bin/env bash
# The released SGLang serving a model on this CPU (what the live tests and recipes/tiny_rl_sglang.yaml
# start): usage  serve.sh MODEL HOST PORT DTYPE SEED [more sglang.launch_server arguments...]
# The environment comes from `make sglang-cpu` (.venv-sglang, or $RLRECIPE_SGLANG_VENV). shims/ makes
# two CUDA-only imports importable and pinned memory a no-op (docs/sglang-cpu.md). Always pass --max-total-tokens (else the KV
# pool is sized from RAM) and --context-length.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${RLRECIPE_SGLANG_VENV:-$here/../../.venv-sglang}
if [ ! -x "$venv/bin/python" ]; then
  echo "serve.sh: no SGLang environment at $venv: run 'make sglang-cpu' first" >&2
  exit 2
fi
[ $# -ge 5 ] || { echo "usage: serve.sh MODEL HOST PORT DTYPE SEED [sglang args...]" >&2; exit 2; }
model=$1 host=$2 port=$3 dtype=$4 seed=$5
shift 5
export SGLANG_USE_CPU_ENGINE=1
# When its scheduler ends (a stop: SIGTERM to the process group) SGLang waits 5 s for crash diagnostics, a py-spy
# dump (not installed here) and a CUDA core dump (no CUDA): nothing on this CPU, so the stop does not wait (unless set)
export SGLANG_PYSPY_DUMP_BEFORE_CRASH=${SGLANG_PYSPY_DUMP_BEFORE_CRASH:-0}
export SGLANG_CUDA_COREDUMP_BEFORE_CRASH=${SGLANG_CUDA_COREDUMP_BEFORE_CRASH:-0}
export PYTHONPATH="$here/shims"
# the key a run launching this server draws for it (or the user's): the server then refuses other clients
key=()
[ -n "${SGLANG_API_KEY:-}" ] && key=(--api-key "$SGLANG_API_KEY")
# LoRA (--enable-lora) on a CPU: SGLang's default LoRA kernels are Triton's; torch_native runs here
lora=()
case " $* " in *" --enable-lora "*) case " $* " in *" --lora-backend"*) ;; *) lora=(--lora-backend torch_native) ;; esac ;; esac
# float32 is passed as such: SGLang's "auto" would serve a float32 checkpoint in float16.
# --sleep-on-idle: an idle scheduler otherwise polls without pause and takes a whole core from the
# trainer it shares the CPU with (10 s of CPU in 10 s idle, 0.2 s with it); a request still wakes it at once
exec "$venv/bin/python" -m sglang.launch_server --model-path "$model" --host "$host" --port "$port" \
  --dtype "$dtype" --random-seed "$seed" --device cpu --disable-overlap-schedule \
  --attention-backend torch_native --sleep-on-idle "${key[@]}" "${lora[@]}" "$@"
