"""The model's name as clients use it: the `model` of the API and the `model_name` label of
every role's metrics, so one dashboard filter selects the router and its workers alike."""

from __future__ import annotations

from pathlib import Path

from services.common.tokenizer import BUILTIN_NAMES

# services/engine/builtin_model.py's folder name (the router must not import torch, so it is repeated)
BUILTIN_MODEL_NAME = "pdmesh-tiny"


def served_name(model: str, explicit: str = "") -> str:
    """--served-model-name, else the model folder's name ('pdmesh-tiny' for the built-in ones).
    Of a comma-separated list the first: every role reads the same PDMESH_SERVED_MODEL_NAME, and
    the router's (repeatable) flag labels its metrics with the first of the names it serves."""
    first = next((n.strip() for n in explicit.split(",") if n.strip()), "")
    if first:
        return first
    if model in BUILTIN_NAMES:
        return BUILTIN_MODEL_NAME
    return Path(model).resolve().name or model
