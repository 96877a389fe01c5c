# Two commands do all set-up: `make demo` and `make test` create the environment when missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export HF_HUB_DISABLE_TELEMETRY = 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM = false

.PHONY: install install-gpu sglang-cpu slurm-local slurm-local-stop test test-fast demo mismatch-study async-study options-study fp8-study lora-study bench bench-full bench-sglang reproduce-aime gpu-smoke gpu-checks gpu-quick gpu-carry sglang-contract lint clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# GPU machines: keep the CUDA torch already installed (no CPU constraint) and add SGLang, within
# the range the client was checked against (pyproject's gpu extra; docs/gpu.md's version table).
install-gpu:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev,gpu]'
	touch $(STAMP)

# The released SGLang for the live tests (tests/live), in an environment of its own: the pinned set in
# scripts/sglang_cpu/requirements.txt with --no-deps (SGLang's own requirements pull a CUDA torch), about
# 3 GB. `make test` runs the live tests once it is there and skips them, saying so, where it is not.
SGLANG_VENV ?= .venv-sglang
$(SGLANG_VENV)/.installed: scripts/sglang_cpu/requirements.txt
	test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --no-deps -r scripts/sglang_cpu/requirements.txt
	touch $@

sglang-cpu: $(SGLANG_VENV)/.installed

# A real Slurm as two nodes on this machine (127.0.0.1 and 127.0.0.2) for the cluster tests
# (tests/cluster/test_slurm_jobs.py, skipped where it is not up): Debian's slurm-wlm, installed when
# missing (root, apt), its state and logs in .slurm-local/. `make slurm-local-stop` ends every job and daemon.
slurm-local:
	command -v slurmd >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client >/dev/null)
	bash scripts/slurm_local/up.sh

slurm-local-stop:
	bash scripts/slurm_local/down.sh

# Read both ends of the SGLang pin from their released wheels (needs the package index; nothing is
# installed) into tests/data/sglang_contract.json, and check the client against them. Rerun when
# the pin moves; the suite checks the client against the recorded summary offline.
sglang-contract: $(STAMP)
	$(BIN)/python -m scripts.sglang_contract

# Everything CI runs. For the edit loop, `make test-fast` leaves out the tests marked slow
# (subprocess-heavy: DeepSpeed ranks, servers, whole stages; about half the wall time).
test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

demo: $(STAMP)
	$(BIN)/python -m scripts.demo

# Five corrections (recipes/mismatch_*.yaml) under a dialled train/inference mismatch, from the
# demo's SFT model (run `make demo` first); finished runs are kept, so a rerun does only what is
# missing. About an hour on 2 cores. Writes runs/mismatch-study/ and RESULTS.md's section.
mismatch-study: $(STAMP)
	$(BIN)/python -m scripts.mismatch_study

# Synchronous (in-process, both cores) vs rl.async_lag 1 and 2, IcePop, TIS and M2PO, 3 seeds, held-out
# accuracy every 5 steps against wall-clock and steps, from the demo's SFT model (run `make demo` first); about
# 45 minutes on 2 cores, on a quiet machine (it times the runs). Writes runs/async-study/, results/async-study.png
# and RESULTS.md's section.
async-study: $(STAMP)
	$(BIN)/python -m scripts.async_study

# DAPO's dynamic sampling and overlong handling, QAE and Dr. GRPO against tiny_rl, 3 seeds, from the
# demo's SFT model (run `make demo` first); about 70 minutes on 2 cores. Writes runs/options-study/
# and RESULTS.md's section.
options-study: $(STAMP)
	$(BIN)/python -m scripts.options_study

# The rollout's KV cache {bf16, fp8 unit scales, fp8 calibrated} x {no correction, TIS, IcePop, M2PO}, 3 seeds
# of tiny_rl from the demo's SFT model (run `make demo` first); STEPS=40 by default; about 4 hours on 2
# cores (36 runs). Writes runs/fp8-study/study.json, keeps results/fp8-study.json and .png, and regenerates
# RESULTS.md from them; `python -m scripts.fp8_study --no-new-runs ...` only summarises the runs there are.
STEPS ?= 40
fp8-study: $(STAMP)
	$(BIN)/python -m scripts.fp8_study --steps $(STEPS)

# Full fine-tuning against LoRA rank 1, 8 and 32 (all linear layers), each at tiny_rl's learning rate and
# at 10x, 3 seeds, from the demo's SFT model (run `make demo` first); 24 runs of STEPS steps. Writes
# runs/lora-study/, keeps results/lora-study.json and .png, and regenerates RESULTS.md.
lora-study: $(STAMP)
	$(BIN)/python -m scripts.lora_study --steps $(STEPS)

# The fast set a developer runs before a change (the thread-wait check included; about 6 minutes on
# a quiet 2-core machine, 15 at most); bench-full adds the slowest, which start processes of their own
# (async overlap, colocated phases, the plan checks). Both print each benchmark's wall time and load,
# warn of a busy machine, and write bench/results.json.
bench: $(STAMP)
	$(BIN)/python -m bench.run

bench-full: $(STAMP)
	$(BIN)/python -m bench.run --full

# C3PO++ vs synchronous rollout on a real SGLang server (GPU machine): where the speed-up shows.
# Then a cost model is fitted to its step times (bench/cost_model.json), which `make bench`
# uses for its GPU projection in place of the default assumption. A few steps cannot separate
# every parameter: the per-step, per-row and per-prefill-token costs are fitted, the others
# keep the assumption's values (see the fit's condition number).
BENCH_MODEL ?= Qwen/Qwen2.5-1.5B-Instruct
bench-sglang: $(STAMP)
	$(BIN)/python -m bench.c3po_compare --model $(BENCH_MODEL)
	$(BIN)/python -m bench.projection.rollout bench/c3po_server.json --calibrate --params step_s,row_s,prefill_token_s --save-cost bench/cost_model.json

reproduce-aime: $(STAMP)
	$(BIN)/python -m scripts.reproduce

gpu-smoke: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu tests

# Every GPU check in one go (`rlrecipe doctor` for the GPU recipes, 7B micro-batch memory and speed and
# its peak against `rlrecipe plan`, the weight-sync fingerprint, DeepSpeed on the GPU, the suite with
# CUDA visible); logs and JSON in runs/gpu-checks. bench/gpu/ holds what an H100 gave.
gpu-checks: $(STAMP)
	PY=$(BIN)/python bash scripts/gpu_checks.sh

# What only a GPU can tell, within a short loan (8 minutes by default from a cold start; parts in order of
# value, one JSON rewritten after each, in $OUT or runs/gpu-quick): plan vs measured peak under ZeRO-2 and
# -3, the colocated hand-over's seconds and bytes, the push by handle, the torch engine's hand-over test,
# decode tokens/s with bf16 and FP8 KV. Needs no venv (the GPU image's python3 and .gpu-carry/);
# GPU_QUICK_ARGS=--cpu-dry-run runs every part at toy sizes here. docs/gpu.md, "Running the GPU checks".
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-quick:
	$(GPU_PY) -m bench.gpu.quick $(GPU_QUICK_ARGS)

# For a GPU machine without a package index: the dependencies its image lacks, in .gpu-carry/
# (scripts/gpu_carry.sh says how to use them there).
gpu-carry: $(STAMP)
	PY=$(BIN)/python bash scripts/gpu_carry.sh

lint: $(STAMP)
	$(BIN)/ruff check rlrecipe cli eval tests bench scripts

clean:
	rm -rf runs .cache
