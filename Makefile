# Gyre: the two commands are `make demo` and `make test`. Both install what is missing.
SHELL := /bin/bash
PY := .venv/bin/python
export PYTHONPATH := $(CURDIR)

.PHONY: install demo test test-fast lint bench bench-full protos lock clean up wheelhouse base-image images compose-up compose-smoke

install:  ## etcd (apt) when missing, .venv with the pinned packages
	@./scripts/install.sh

demo: install  ## the real system end to end on this machine
	$(PY) -m apps.demo $(DEMO_ARGS)

MODEL_DIR ?= $(CURDIR)/.gyre/models/tiny-seed0

up: install  ## start etcd + every service from one config (Ctrl-C stops all)
	$(PY) -m apps.model.tiny $(MODEL_DIR) >/dev/null
	GYRE_ROUTER__MODEL_DIR=$(MODEL_DIR) GYRE_CELL_AGENT__MODEL_DIR=$(MODEL_DIR) \
		$(PY) -m apps.launch --config $(or $(CONFIG),deploy/local/cluster.yaml) --certs-dir $(CURDIR)/.gyre/certs/local

test: install lint  ## lint, types, then the whole suite (unit, integration, fault; gpu tests skip without CUDA)
	@./scripts/install_browser.sh
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

lint: install  ## ruff (rules + formatting), mypy (strict on gyre/ and the policy) and vulture (dead code), as configured in pyproject.toml
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	.venv/bin/vulture

test-fast: install  ## unit tests only
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

bench: install  ## benchmarks (~30 min on 2 idle cores); JSON in bench/results/, summaries in docs/benchmarks*.md
	$(PY) bench/cluster.py --suite bench --emulate
	$(PY) bench/scheduler_ledger.py
	$(PY) bench/scheduler_takeover.py
	$(PY) bench/router_latency.py
	$(PY) bench/engine_stream_mux.py
	$(PY) bench/dataplane_load.py
	$(PY) bench/engine_reroute.py
	$(PY) bench/packer_claims.py
	$(PY) bench/training_elastic.py
	$(PY) bench/engine_mock.py
	$(PY) bench/engine_vllm.py
	$(PY) bench/trajectory_vllm.py
	$(PY) bench/training_pipeline.py
	$(PY) bench/doc_tables.py

bench-full: install  ## the cluster benchmark's every scenario, seed and sweep point (hours on 2 cores)
	$(PY) bench/cluster.py --emulate

protos: install  ## regenerate gyre/v1 from protos/ (the output is committed)
	./scripts/gen_protos.sh

lock:  ## re-pin requirements.lock from the current .venv
	$(PY) -m pip freeze --exclude-editable | grep -v -E '^(torchvision|torchaudio|torchcodec|triton)==' > requirements.lock.new && mv requirements.lock.new requirements.lock

# Containers (deploy/README.md): Docker, or podman's Docker API; offline with a wheelhouse.
WHEELHOUSE ?= .gyre/wheelhouse
BASE_IMAGE ?= python:3.11-slim-bookworm
export GYRE_BASE_IMAGE := $(BASE_IMAGE)
COMPOSE_SMOKE := $(PY) deploy/compose_smoke.py

wheelhouse: install  ## every pinned package of requirements.lock into $(WHEELHOUSE), with this machine's pip and index
	$(PY) -m pip download --no-deps --dest $(WHEELHOUSE) -r requirements.lock

base-image:  ## a Python 3.11 base image from Debian's packages (root, debootstrap): BASE_IMAGE=localhost/gyre-python:3.11-bookworm
	./scripts/base_image.sh $(if $(filter python:%,$(BASE_IMAGE)),,$(BASE_IMAGE))

images: install  ## gyre and gyre-etcd images, offline from $(WHEELHOUSE) (made when empty; the base image built from Debian when it cannot be pulled)
	GYRE_WHEELHOUSE=$(WHEELHOUSE) $(COMPOSE_SMOKE) build

compose-up: images  ## the whole stack in containers, in the foreground (Ctrl-C stops it)
	$(COMPOSE_SMOKE) up --no-build

compose-smoke: images  ## build, up, >= 3 bursts, kill a cell, check the status, down (minutes; not in `make test`)
	$(COMPOSE_SMOKE) smoke --no-build

clean:
	rm -rf runs .pytest_cache
