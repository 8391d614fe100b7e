"""Load a model from a local Hugging Face folder (config.json + safetensors).

None/"builtin" is the folder shipped in the repository (models/pdmesh-tiny, trained by
scripts/train_builtin.py), loaded by the same code as any downloaded checkpoint. "builtin-random"
is a random tiny Llama over a byte vocabulary made from a seed (services/engine/builtin_model.py),
for tests that want byte-level tokens.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from services.common.tokenizer import BUILTIN_RANDOM, resolve_model_path
from services.engine.model import CausalLM
from services.engine.model_config import ModelConfig

BUILTIN = "builtin"


class ModelLoadError(ValueError):
    """A checkpoint folder is incomplete or inconsistent; the message names the file."""


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    # Defaults from generation_config.json (temperature, top_p, top_k, eos ids), if any.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    path: str | None = None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(path: str | None = None, device: str = "cpu", dtype: torch.dtype | None = None) -> LoadedModel:
    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    if path == BUILTIN_RANDOM:
        from services.engine.builtin_model import builtin_model

        model = builtin_model()
        return LoadedModel(model.to(dev, dtype), model.config, dev, dtype, {}, None)
    folder = pathlib.Path(resolve_model_path(path))
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{cfg_path}: missing (a Hugging Face model folder needs config.json)")
    raw_cfg = json.loads(cfg_path.read_text())
    config = ModelConfig.from_hf_dict(raw_cfg, name=folder.name, source=str(cfg_path))
    gen_defaults = _generation_defaults(folder)
    if gen_defaults.get("eos_token_ids"):
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *gen_defaults["eos_token_ids"]]))
        config = ModelConfig(**{**config.__dict__, "eos_token_ids": merged})
    with torch.device("meta"):
        model = CausalLM(config)
    state = _read_safetensors(folder)
    _load_state(model, state, folder)
    model = model.to(dev, dtype).eval()
    return LoadedModel(model, config, dev, dtype, gen_defaults, str(folder))


def _generation_defaults(folder: pathlib.Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    out: dict[str, Any] = {k: raw[k] for k in ("temperature", "top_p", "top_k") if k in raw}
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
    eos = raw.get("eos_token_id")
    if eos is not None:
        out["eos_token_ids"] = list(eos) if isinstance(eos, list) else [eos]
    return out


def _shard_files(folder: pathlib.Path) -> list[pathlib.Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists shard {missing[0].name}, which is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (model.safetensors or a sharded index)")
    return files


def _read_safetensors(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in _shard_files(folder):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                state[key] = handle.get_tensor(key)
    return state


def _load_state(model: CausalLM, state: dict[str, torch.Tensor], folder: pathlib.Path) -> None:
    expected = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    if tied:
        state.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in state and not (tied and k == "lm_head.weight")]
    if missing:
        raise ModelLoadError(f"{folder}: weights missing from the safetensors files: {missing[:5]}")
    unexpected = [k for k in state if k not in expected and "rotary_emb" not in k]
    if unexpected:
        raise ModelLoadError(f"{folder}: unexpected weights (unsupported variant?): {unexpected[:5]}")
    for name, param in expected.items():
        if name in state and tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{folder}: weight {name} has shape {tuple(state[name].shape)}, config implies {tuple(param.shape)}"
            )
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
