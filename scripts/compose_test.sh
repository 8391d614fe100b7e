#!/usr/bin/env bash
# `make compose-test`: pdmesh in containers, for real (tests/compose/): build the image, bring
# router + prefill + decode up with the README's compose line plus the CPU override, then serve,
# scrape, freeze (pause), kill (restart policy) and take it all down.
#
# Needs a container engine: Docker with Compose >= 2.24.4, or podman with podman-compose >= 1.6
# (installed here into .venv when podman is present; on the build machines
# ../shared/containers/setup.sh installs and configures podman). Without one it says so and
# exits 0, so `make test` passes on machines without containers.
# Env: PDMESH_COMPOSE="docker compose" | "podman-compose" picks the engine;
#      PDMESH_REQUIRE_COMPOSE=1 makes a missing engine an error instead of a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PODMAN_COMPOSE_VERSION=1.6.0

skip() {
    if [ "${PDMESH_REQUIRE_COMPOSE:-0}" = 1 ]; then
        echo "compose-test: FAILED: $*" >&2
        exit 1
    fi
    echo "compose-test: SKIPPED: $* (the container tests in tests/compose did not run)" >&2
    exit 0
}

have_docker=0
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then
    have_docker=1
fi
if [ "$have_docker" = 0 ] && ! command -v podman >/dev/null 2>&1; then
    skip "no container engine (Docker with Compose v2, or podman; on the build machines run ../shared/containers/setup.sh)"
fi
if [ "$have_docker" = 0 ] && [ ! -x .venv/bin/podman-compose ] && ! command -v podman-compose >/dev/null 2>&1; then
    echo "compose-test: installing podman-compose==$PODMAN_COMPOSE_VERSION into .venv" >&2
    "$PY" -m pip install -q "podman-compose==$PODMAN_COMPOSE_VERSION" \
        || skip "podman is here but podman-compose could not be installed"
fi
exec "$PY" -m pytest -q tests/compose "$@"
