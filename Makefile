# pdmesh: the two commands a newcomer needs are `make run` and `make test`.
# Everything they need (virtual environment, pinned packages, generated gRPC code) is created on demand.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Stamps record which requirement set is installed, so edits to requirements*.txt reinstall.
RUNTIME_STAMP := $(VENV)/.runtime-$(shell cat requirements.txt | sha1sum | cut -c1-12)
DEV_STAMP := $(VENV)/.dev-$(shell cat requirements.txt requirements-dev.txt | sha1sum | cut -c1-12)
PROTO_SRC := $(shell find proto -name '*.proto' 2>/dev/null)
PROTO_OUT := services/common/generated
PROTO_STAMP := $(PROTO_OUT)/.stamp
# The one configuration file shared with docker compose (docs/deploy.md).
ENV_FILE ?= deploy/pdmesh.env

.PHONY: run test long-test compose-test clients-test hosts-test chaos chaos-three chaos-hosts bench bench-router bench-serve gpu-check proto lint venv venv-dev clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(RUNTIME_STAMP): requirements.txt | $(VENV)/bin/python
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(DEV_STAMP): requirements.txt requirements-dev.txt $(RUNTIME_STAMP)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(RUNTIME_STAMP)
venv-dev: $(DEV_STAMP)

$(PROTO_STAMP): $(PROTO_SRC) $(RUNTIME_STAMP) scripts/gen_proto.py
	$(PY) scripts/gen_proto.py
	touch $@

proto: $(PROTO_STAMP)

# The env file gives what the environment does not: `PDMESH_MODEL=/models/x make run` (or `make run
# PDMESH_MODEL=...`) wins over the file.
run: venv proto
	@user_env="$$(export -p)" && set -a && . "$(abspath $(ENV_FILE))" && set +a && eval "$$user_env" && exec $(PY) -m services.mesh

# tests/compose (containers) runs as its own step, compose-test, which skips with a message when
# this machine has no container engine; tests/clients (real clients from their own venv) runs as
# clients-test's short form. Test files run on TEST_WORKERS processes (pytest-xdist,
# one file per process at a time, so a module's shared mesh stays in one process): most of an
# integration test's time is spent waiting on deadlines, not computing. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
# The clients' venv is built in the background meanwhile (its log: .venv-clients.build.log).
test: venv-dev proto
	@scripts/ensure_test_tools.sh
	@scripts/clients_test.sh --build-only > .venv-clients.build.log 2>&1 & build=$$!; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not long" tests --ignore=tests/compose --ignore=tests/clients \
		|| { wait $$build; exit 1; }; \
	wait $$build || { echo "building .venv-clients failed:"; tail -30 .venv-clients.build.log; exit 1; }
	@scripts/compose_test.sh
	@scripts/clients_test.sh --short

# The long scenarios `make test` leaves out (pytest -m long, a minute or more each): the hosts
# soak with partitions, the schemathesis walk of the OpenAPI surface, the 2P+2D kill-and-freeze
# under load, the seeded migration, fifty random JSON schemas, the held-out perplexity, the cut
# under load across hosts, the 16-round growing conversation, and the second of each twin
# scenario (the other role's crashed task or failed forward, the other aborted member of n > 1,
# a restarted prefill's pairs, clients leaving retracted requests, supervisor start-freezes).
# `make test` runs their short forms (the small soak, the hosts tests, the router's API tests,
# 2P+2D with one of each killed, the greedy migration, ten schemas, greedy output against
# transformers, 8 rounds, one of each twin).
long-test: venv-dev proto
	@scripts/ensure_test_tools.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m long tests --ignore=tests/compose --ignore=tests/clients

# pdmesh with real clients (tests/clients, docs/clients.md): lm-evaluation-harness (generate_until
# and multiple choice against transformers) and AIPerf (streaming, multi-turn, cancellations), all
# of them, long runs included; `make test` runs the short form. The clients' venv, .venv-clients,
# is built from requirements-clients.txt on first use.
clients-test: venv-dev proto
	@scripts/clients_test.sh

# pdmesh in containers: build the image, compose up (CPU override), serve, scrape, pause, kill,
# down (docs/deploy.md, "Tests"). Docker with Compose >= 2.24.4, or podman + podman-compose.
compose-test: venv-dev proto
	@scripts/ensure_test_tools.sh
	@scripts/compose_test.sh

# The chaos soak (docs/chaos.md): router + 2P + 2D under load, faults drawn from SEED.
# `make chaos SEED=2 DURATION=120`; `make chaos-three` runs seeds 1, 2, 3 one after another.
SEED ?= 1
DURATION ?= 120
chaos: venv-dev proto
	$(PY) -m chaos.soak --seed $(SEED) --duration $(DURATION) --out bench/out/chaos

chaos-three: venv-dev proto
	for s in 1 2 3; do $(PY) -m chaos.soak --seed $$s --duration $(DURATION) --out bench/out/chaos || exit 1; done

# The soak with each service in its own network namespace, plus prefill <-> decode partitions
# (docs/chaos.md, "Hosts mode"; root). `make chaos-hosts SEED=1 DURATION=90`.
chaos-hosts: venv-dev proto
	$(PY) -m chaos.soak --hosts --seed $(SEED) --duration $(DURATION) --out bench/out/chaos

# The mesh across hosts (network namespaces; root). `make test` runs these too, and they skip
# with the reason where namespaces are unavailable.
hosts-test: venv-dev proto
	$(PY) -m pytest -q -s tests/hosts

bench: venv-dev proto
	$(PY) bench/run_all.py

# pdmesh's router against sglang-router (PD mode), side by side, wrk-driven (docs/router.md,
# "Performance"): needs Debian's wrk; installs sglang-router into bench/.venv-sglang (bench only).
bench-router: venv-dev proto
	@mkdir -p bench/out
	$(PY) bench/router_compare.py --floor > bench/out/router_compare.json
	@cat bench/out/router_compare.json

# PD against colocated on this machine's two cores (docs/bench.md): JSON under bench/out/,
# plots under docs/bench/. `make bench-serve RATES=0.25,0.5,1`.
RATES ?= 0.25,0.5,0.75,1
bench-serve: venv-dev proto
	$(PY) bench/pd_vs_colocated.py --rates $(RATES)
	$(PY) bench/plot.py bench/out/pd_vs_colocated.json

# On a machine with CUDA GPUs (docs/gpu.md): logits vs transformers, a GPU mesh, token parity, a
# short serving run; bench/out/gpu_check.json. Uses the system Python and its CUDA torch (never
# the venv, whose torch is the pinned CPU build); without a GPU it says so and exits 0.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py

lint: venv-dev
	$(PY) -m ruff check services tests bench scripts chaos

clean:
	rm -rf $(VENV) $(PROTO_OUT)
