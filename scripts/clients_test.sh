#!/usr/bin/env bash
# `make clients-test` (all) and its short form in `make test` (--short: pytest -m "not long"):
# pdmesh tested with real clients (tests/clients/): lm-evaluation-harness and NVIDIA AIPerf
# against router + prefill + decode on the built-in model.
#
# The clients live in a venv of their own, .venv-clients, built here from requirements-clients.txt
# (pinned) the first time and again only when that file changes (a stamp named by its hash), so
# the project's .venv stays lean. The tests themselves run under the project's pytest (.venv) and
# start the clients' commands from .venv-clients as subprocesses.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
CLIENTS=.venv-clients
PYTHON="${PYTHON:-python3}"

# --build-only: build the venv and stop (make test builds it in the background while the main
# suite runs, since pip spends most of that time downloading, not computing).
marker=()
build_only=0
case "${1:-}" in
    --short) marker=(-m "not long"); shift ;;
    --build-only) build_only=1; shift ;;
esac

stamp="$CLIENTS/.stamp-$(sha1sum requirements-clients.txt | cut -c1-12)"
if [ ! -e "$stamp" ]; then
    echo "clients-test: building $CLIENTS from requirements-clients.txt (once; a few minutes)" >&2
    start=$(date +%s)
    rm -rf "$CLIENTS"
    "$PYTHON" -m venv "$CLIENTS"
    nice -n 10 "$CLIENTS/bin/python" -m pip install -q --upgrade pip
    nice -n 10 "$CLIENTS/bin/python" -m pip install -q -r requirements-clients.txt
    touch "$stamp"
    echo "clients-test: $CLIENTS built in $(( $(date +%s) - start ))s" >&2
fi
[ "$build_only" = 1 ] && exit 0
exec "$PY" -m pytest -q "${marker[@]}" tests/clients "$@"
