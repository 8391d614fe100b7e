#!/usr/bin/env bash
# Fill deploy/wheelhouse/ with wheels for exactly requirements.txt, for the image's Python, so that
# `docker build -f deploy/Dockerfile` installs them offline (`pip install --no-index`) instead of
# reaching a package index from inside the build (docs/deploy.md, "Offline build").
#
#   scripts/wheelhouse.sh                      # torch as this machine's pip resolves the pin
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/wheelhouse.sh   # CPU torch
#
# Env: PIP (default: .venv/bin/pip, else pip3), WHEELHOUSE (default deploy/wheelhouse),
#      PYTHON_VERSION (the image's Python: 3.11 for debian:bookworm-slim, 3.12 for the
#      nvidia/cuda ubuntu24.04 base), PLATFORMS (wheel platform tags the
#      base image's glibc accepts; default manylinux_2_31 (llguidance needs it; bookworm has glibc
#      2.36) down to manylinux2014, x86_64).
# Idempotent and quick when nothing changed (pip skips wheels already present). Wheels of other
# versions are removed, so the folder holds one resolution of requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo pip3)}"
WHEELHOUSE="${WHEELHOUSE:-deploy/wheelhouse}"
PYTHON_VERSION="${PYTHON_VERSION:-3.11}"
PLATFORMS="${PLATFORMS:-manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}"
target=(--only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp
        --abi "cp${PYTHON_VERSION/./}" --abi abi3 --abi none)
for p in $PLATFORMS; do target+=(--platform "$p"); done
mkdir -p "$WHEELHOUSE"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
# Reuse what is there (hard links), then let pip add or replace.
find "$WHEELHOUSE" -maxdepth 1 -name '*.whl' -exec ln {} "$stage/" \; 2>/dev/null || true
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    pin="$(grep -E '^torch==' requirements.txt)"
    "$PIP" download -q --no-deps -d "$stage" "${target[@]}" --index-url "$TORCH_INDEX_URL" "$pin"
fi
if ! "$PIP" download -q -d "$stage" "${target[@]}" -r requirements.txt >"$stage/log" 2>&1; then
    grep -v '^WARNING: Location' "$stage/log" >&2
    echo "wheelhouse: pip download failed for requirements.txt" >&2
    exit 1
fi
find "$WHEELHOUSE" -maxdepth 1 -name '*.whl' -delete
mv "$stage"/*.whl "$WHEELHOUSE"/
torch="$(cd "$WHEELHOUSE" && ls torch-*.whl)"
echo "wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1), $torch"
case "$torch" in *cu1*|*+cpu*) ;; *) echo "wheelhouse: note: $torch is PyPI's torch (the CUDA build on Linux)" >&2 ;; esac
