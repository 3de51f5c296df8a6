# Serve Llama-family models with TorchServe: build -> archive -> serve -> stream.
#   make demo     set up, build the embedded default, serve it, stream one prompt (server left running)
#   make test     set up and run the whole test suite
#   make stop     stop the server that `make serve`/`make demo` started

PY ?= python3
MODEL ?= tiny-llama
ARCHIVE_FORMAT ?= no-archive
PROMPT ?= The function returns
VENV := .venv
BIN := $(VENV)/bin
BUILD := build
STORE := model_store
SERVE_DIR := $(BUILD)/serve
ENGINE_SRC := $(shell find handlers -name '*.py' -not -path '*/__pycache__/*')
PYTEST_ARGS ?=
SERVE_ARGS ?=
CHECKPOINT ?= $(BUILD)/tiny-llama
BUILD_SCRIPTS := scripts/build_model.py scripts/build_archive.py scripts/prepare_checkpoint.py scripts/convert_gguf.py

# MODEL may name several model-configs, comma-separated: each is built, served and streamed.
comma := ,
MODELS := $(subst $(comma), ,$(MODEL))
ifeq ($(ARCHIVE_FORMAT),tgz)
ARCHIVE_OF = $(STORE)/$(1).tar.gz
else
ARCHIVE_OF = $(STORE)/$(1)/MAR-INF/MANIFEST.json
endif
ARCHIVES := $(foreach m,$(MODELS),$(call ARCHIVE_OF,$(m)))

.PHONY: help demo test lint build check-models one-model serve stop stream check-prereqs venv clean neuron-smoke upload deploy undeploy sagemaker-local bench bench-peers bench-models llamacpp

help:  ## list the targets (the first one, so plain `make` shows this)
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z][a-zA-Z_-]*:.*## / {printf "  %-16s %s\n", $$1, $$2}' $(firstword $(MAKEFILE_LIST))

demo: serve  ## set up, build MODEL, serve it, stream PROMPT with curl -N and stream.py (server left running)
	@for m in $(MODELS); do \
	  echo "--- $$m: streaming with curl -N (tokens appear as they are generated):"; \
	  curl -sS -N --fail-with-body $$($(BIN)/python scripts/tsctl.py url --workdir $(SERVE_DIR))/predictions/$$m \
	    -H "Authorization: Bearer $$($(BIN)/python scripts/tsctl.py key --workdir $(SERVE_DIR))" \
	    -H 'Content-Type: application/json' \
	    -d '{"inputs": "$(PROMPT)", "parameters": {"max_new_tokens": 40}}' || exit 1; \
	  echo "--- $$m: the same prompt, printed as text by scripts/stream.py:"; \
	  $(BIN)/python scripts/stream.py "$(PROMPT)" --model $$m --workdir $(SERVE_DIR) --max-new-tokens 40 --details || exit 1; \
	done
	@echo "--- the server is still running; stop it with: make stop"

check-prereqs:  ## check python3 3.10+, Java 17 and curl; say how to install what is missing
	@bash scripts/check_prereqs.sh $(PY)

venv: $(VENV)/.installed  ## the virtual environment (.venv): the pinned requirements, then this project installed editable

# The pinned requirements, then the project itself, editable and without dependencies (pyproject.toml):
# llama_engine and the scripts package import from anywhere, and the llama-* commands are on .venv/bin.
# -qq there: setuptools warns on every editable install that a same-named folder may shadow the
# package (scripts/ is that package); errors still show.
$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml | check-prereqs
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install -qq --no-deps -e .
	touch $@

# The llamacpp backend: llama-cpp-python built from source for this CPU into the venv, and the
# llama.cpp tree whose convert_hf_to_gguf.py the build step runs (build/peers/llama.cpp). Needs
# cmake and a C++ compiler; ~6 minutes on 2 cores, once.
LLAMACPP_STAMP := $(VENV)/.llamacpp
llamacpp: $(LLAMACPP_STAMP)  ## build llama-cpp-python for this CPU into the venv (backend llamacpp; ~6 min once)
$(LLAMACPP_STAMP): scripts/build_peers.sh scripts/patch_ggml.py | $(VENV)/.installed
	PY=$(abspath $(BIN))/python bash scripts/build_peers.sh backend
	touch $@

# The embedded default model: built offline and deterministically.
$(BUILD)/tiny-llama/config.json: scripts/build_tiny_llama.py | $(VENV)/.installed
	$(BIN)/python scripts/build_tiny_llama.py --out $(BUILD)/tiny-llama

ifneq ($(CHECKPOINT),$(BUILD)/tiny-llama)
$(CHECKPOINT)/config.json:
	@echo "no checkpoint at $(CHECKPOINT): run make build MODEL=$(MODEL) CHECKPOINT=/path/to/hf-checkpoint" >&2; exit 1
endif

build: check-models $(ARCHIVES)  ## archive each MODEL into STORE (compile into the shipped cache where the config compiles)

one-model:
	@test $(words $(MODELS)) -eq 1 || { echo "this target takes one MODEL, got: $(MODEL)" >&2; exit 1; }

check-models:
	@for m in $(MODELS); do test -f model-config/$$m.yaml || { \
	  echo "no model-config/$$m.yaml; MODEL is one of: $$(ls model-config | sed 's/\.yaml$$//' | tr '\n' ' ')" >&2; exit 1; }; done

# Prepare the checkpoint, compile into a shipped cache when the config compiles, package.
$(call ARCHIVE_OF,%): $(CHECKPOINT)/config.json model-config/%.yaml $(ENGINE_SRC) $(BUILD_SCRIPTS) handlers/requirements-model.txt | $(VENV)/.installed
	@if grep -Eq '^[[:space:]]+backend:[[:space:]]*llamacpp' model-config/$*.yaml; then $(MAKE) --no-print-directory llamacpp; fi
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python scripts/build_model.py --config model-config/$*.yaml \
	  --checkpoint $(CHECKPOINT) --export-path $(STORE) --archive-format $(ARCHIVE_FORMAT)

serve: build  ## start TorchServe on 127.0.0.1 with every MODEL and wait until READY (SERVE_ARGS=--free-ports)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python scripts/tsctl.py start --workdir $(SERVE_DIR) --model-store $(STORE) \
	  --models $(MODEL) $(SERVE_ARGS)

stop:  ## stop the server that serve/demo started
	@if [ -x $(BIN)/python ]; then $(BIN)/python scripts/tsctl.py stop --workdir $(SERVE_DIR); else echo "nothing to stop"; fi

stream: | $(VENV)/.installed  ## stream PROMPT from each MODEL of the running server
	@for m in $(MODELS); do echo "--- $$m"; $(BIN)/python scripts/stream.py "$(PROMPT)" --model $$m --workdir $(SERVE_DIR) --details || exit 1; done

test: $(BUILD)/tiny-llama/config.json | $(VENV)/.installed $(LLAMACPP_STAMP)  ## set up (llama.cpp backend included) and run the whole test suite (PYTEST_ARGS=...)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: | $(VENV)/.installed  ## ruff over the tree, with the rules in pyproject.toml (CI runs it before the tests)
	$(BIN)/ruff check .

# Benchmarks (issue 6): a ~116M random-weight Llama served by the handler and run in-process,
# side by side (and peers when installed); JSON, Markdown, PNG plots, docs/benchmarks.md.
# BENCH_ARGS=--quick for a ~2-minute run.
bench: $(BUILD)/tiny-llama/config.json | $(VENV)/.installed  ## the benchmark suite: served vs in-process vs peers, docs/benchmarks.md (BENCH_ARGS=--quick)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m scripts.bench $(BENCH_ARGS)

# The bench model's bf16 and fp32 checkpoints (build/bench-model-*), as the suite builds them.
bench-models: $(BUILD)/tiny-llama/config.json | $(VENV)/.installed  ## build the bench model's bf16 and fp32 checkpoints
	$(BIN)/python -c "from scripts.bench import model; model.ensure_bench_models(('bfloat16', 'float32'), tokenizer_src=model.TINY, log=print)"

# The peers `make bench` drives when installed, all under build/peers/: llama.cpp's llama-server
# (built from source, ~6 min on 2 cores), GGUFs of the bench model, vLLM for CPU (~3.5 GB).
# Steps already done are skipped. BENCH_PEERS="llama gguf" for a subset.
BENCH_PEERS ?= llama gguf vllm
bench-peers: bench-models | $(VENV)/.installed  ## build llama-server, GGUFs and vLLM for CPU under build/peers (BENCH_PEERS=...)
	PY=$(abspath $(BIN))/python bash scripts/build_peers.sh $(BENCH_PEERS)

# SageMaker: upload the uncompressed artifact, deploy it, tear it down. Credentials come from
# the standard AWS chain (environment, profile, instance role), never from arguments.
S3_URI ?=
ROLE_ARN ?=
IMAGE_URI ?=
ENDPOINT ?=
AWS_ARGS := $(if $(REGION),--region $(REGION)) $(if $(ENDPOINT_URL),--endpoint-url $(ENDPOINT_URL))
upload: one-model build  ## upload MODEL's uncompressed artifact to S3_URI
	@test -n "$(S3_URI)" || { echo "set S3_URI=s3://bucket/prefix/" >&2; exit 1; }
	$(BIN)/python scripts/s3_upload.py $(STORE)/$(MODEL) $(S3_URI) $(AWS_ARGS) $(UPLOAD_ARGS)

deploy: one-model | $(VENV)/.installed  ## deploy S3_URI to a SageMaker endpoint (ROLE_ARN, IMAGE_URI)
	@test -n "$(S3_URI)" -a -n "$(ROLE_ARN)" -a -n "$(IMAGE_URI)" || { echo "set S3_URI, ROLE_ARN and IMAGE_URI (see README: Deploy to SageMaker)" >&2; exit 1; }
	$(BIN)/python scripts/sagemaker_deploy.py deploy --config model-config/$(MODEL).yaml --s3-uri $(S3_URI) \
	  --role-arn $(ROLE_ARN) --image-uri $(IMAGE_URI) $(if $(ENDPOINT),--name $(ENDPOINT)) $(if $(REGION),--region $(REGION)) $(DEPLOY_ARGS)

undeploy: | $(VENV)/.installed  ## delete the SageMaker endpoint ENDPOINT
	@test -n "$(ENDPOINT)" || { echo "set ENDPOINT=<name printed by make deploy>" >&2; exit 1; }
	$(BIN)/python scripts/sagemaker_deploy.py undeploy --name $(ENDPOINT) $(if $(REGION),--region $(REGION))

# Serve what S3_URI holds the way the SageMaker container would, locally, and stream once.
sagemaker-local: | $(VENV)/.installed  ## serve S3_URI the way the SageMaker container does, locally, and stream once
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python scripts/sagemaker_local.py $(S3_URI) $(AWS_ARGS) --check

# On an inf2 host: install the Neuron stack, then build, serve from the shipped cache,
# stream, benchmark and report. NEURON_PIP_INDEX: the Neuron pip repository URL, if pip
# does not already know it (the Neuron DLAMI does).
NEURON_VENV := .venv-neuron
neuron-smoke: | check-prereqs  ## on an inf2 host: install the Neuron SDK, build, serve, stream, benchmark MODEL
	test -x $(NEURON_VENV)/bin/python || $(PY) -m venv $(NEURON_VENV)
	$(NEURON_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEURON_VENV)/bin/python -m pip install --quiet $(if $(NEURON_PIP_INDEX),--extra-index-url $(NEURON_PIP_INDEX)) -r requirements-neuron.txt
	PATH=$(abspath $(NEURON_VENV))/bin:$$PATH $(NEURON_VENV)/bin/python scripts/neuron_smoke.py \
	  --model $(MODEL) --checkpoint $(CHECKPOINT)

clean:  ## remove build/ and model_store/
	rm -rf $(BUILD) $(STORE)
