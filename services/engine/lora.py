"""LoRA adapters (vLLM's --lora-modules): PEFT folders loaded beside the base model, applied per
request inside one batch.

An adapter is a folder as PEFT's `save_pretrained` writes it: `adapter_config.json` and
`adapter_model.safetensors` (or `.bin` is refused: no pickles), with `lora_A` [r, in] and `lora_B`
[out, r] for some of the decoder's linear layers (q/k/v/o_proj, gate/up/down_proj). A layer
with an adapter computes W x + scale · B (A x) for the rows of the requests that named it and
W x for the others, so requests of different adapters and of the base model share one forward.
scale = lora_alpha / r (rsLoRA: lora_alpha / √r), r the layer's own rank (PEFT's rank_pattern).

What PEFT can save that this engine does not compute is refused when the adapter loads, naming
the setting: DoRA, trained biases, modules_to_save (whole replaced layers), the embeddings or
the LM head as targets, alpha_pattern, fan_in_fan_out, and the other PEFT methods. A rank above
--max-lora-rank is refused too (vLLM's bound on what one adapter may cost).

The weights are kept in the model's dtype on its device. `LoraSelection` says, for the forward
being run, which rows belong to which adapter; the runner sets it around each forward.

Adapters may also be loaded and unloaded while the worker serves (the router's runtime LoRA
updates). Loading attaches the new weights under a new name, which no running forward reads.
Unloading first retires the name — it takes no new request — and detaches the weights only once
no request of the worker uses it (`detach_unused`, called by the worker as its requests end), so
a request never changes weights halfway.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from services.common.lora_modules import LoraError, LoraModule

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_RANK = 16  # vLLM's --max-lora-rank default
# PEFT config keys that change what an adapter computes, with the value(s) meaning "not used"
_UNSUPPORTED = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "fan_in_fan_out": (False, None),
    "alpha_pattern": ({}, None),
    "trainable_token_indices": (None,),
    "alora_invocation_tokens": (None,),
    "use_qalora": (False, None),
    "layer_replication": (None,),
}
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass
class LoraWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass
class LoraSelection:
    """The rows of the running forward that belong to each adapter: [(adapter name, row indices,
    or None when they are all the forward's rows)]."""

    groups: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)


class LoraLayer:
    """What one linear layer adds for the adapters that target it."""

    def __init__(self, selection: LoraSelection):
        self.selection = selection
        self.weights: dict[str, LoraWeights] = {}

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (this layer's fresh output, updated in place) plus each adapter's update on its rows."""
        for name, rows in self.selection.groups:
            w = self.weights.get(name)
            if w is None:
                continue
            if rows is None:  # one adapter for the whole forward: no gather, no scatter
                y.addmm_(x @ w.a.t(), w.b.t(), alpha=w.scale)
            else:
                y.index_add_(0, rows, (x[rows] @ w.a.t()) @ w.b.t(), alpha=w.scale)
        return y


def read_adapter(folder: pathlib.Path, max_rank: int) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's config and its (A, B) per module path (e.g. model.layers.0.self_attn.q_proj)."""
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise LoraError(f"{folder}: no adapter_config.json (a PEFT LoRA adapter folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise LoraError(f"{cfg_path}: not valid JSON ({e.msg})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}: only LORA adapters are served")
    for key, unused in _UNSUPPORTED.items():
        if key in cfg and cfg[key] not in unused:
            raise LoraError(f"{cfg_path}: {key} = {cfg[key]!r} is not supported")
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise LoraError(f"{folder}: no adapter_model.safetensors")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as handle:
        for key in handle.keys():
            m = _KEY.match(key)
            if m is None:
                raise LoraError(f"{weights_path}: tensor {key} is not a LoRA A/B weight of a linear layer "
                                "(embeddings, the LM head and trained biases are not supported)")
            pairs.setdefault(m["module"], {})[m["ab"]] = handle.get_tensor(key)
    if not pairs:
        raise LoraError(f"{weights_path}: holds no LoRA weights")
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{weights_path}: {module} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"{weights_path}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                            "do not make a rank-r pair")
        if a.shape[0] > max_rank:
            raise LoraError(f"{weights_path}: {module} has rank {a.shape[0]}, above --max-lora-rank {max_rank}")
        out[module] = (a, b)
    return cfg, out


def _scale(cfg: dict, rank: int) -> float:
    alpha = cfg.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


class LoraAdapters:
    """The adapters a worker serves, attached to its model's linear layers."""

    def __init__(self, model: nn.Module, modules: Iterable[LoraModule] = (), max_rank: int = DEFAULT_MAX_RANK):
        self.model = model
        self.max_rank = max_rank
        self.selection = LoraSelection()
        self.paths: dict[str, str] = {}  # served: name -> folder
        self.retired: dict[str, str] = {}  # unloaded, weights kept while requests use them
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        for module in modules:
            self.load(module)

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def __contains__(self, name: str) -> bool:
        return name in self.paths

    def retire(self, name: str) -> None:
        """Stop serving `name` (KeyError if it is not served); its weights stay until detached."""
        self.retired[name] = self.paths.pop(name)

    def detach_unused(self, in_use: set[str]) -> list[str]:
        """Detach the retired adapters no request uses any more; returns their names."""
        gone = [name for name in self.retired if name not in in_use]
        for name in gone:
            del self.retired[name]
            for module in self.model.modules():
                lora = getattr(module, "lora", None)
                if lora is not None:
                    lora.weights.pop(name, None)
        return gone

    def load(self, module: LoraModule) -> None:
        if module.name in self.paths:
            raise LoraError(f"The LoRA adapter {module.name!r} has already been loaded.")
        if module.name in self.retired:
            raise LoraError(f"The LoRA adapter {module.name!r} was unloaded and requests still use it; load it "
                            "again once they end.")
        folder = pathlib.Path(module.path)
        if not folder.is_dir():
            raise LoraError(f"LoRA adapter {module.name!r}: {folder} is not a folder")
        cfg, pairs = read_adapter(folder, self.max_rank)
        layers = dict(self.model.named_modules())
        staged = []
        for path, (a, b) in pairs.items():
            layer = layers.get(path)
            if layer is None or path.rsplit(".", 1)[-1] not in TARGETS or not isinstance(layer, nn.Linear):
                raise LoraError(f"LoRA adapter {module.name!r} ({folder}): {path} is not a linear layer of this "
                                f"model it can adapt ({', '.join(TARGETS)})")
            if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
                raise LoraError(f"LoRA adapter {module.name!r} ({folder}): {path} is {layer.in_features} -> "
                                f"{layer.out_features}, its lora_A/lora_B are {tuple(a.shape)}/{tuple(b.shape)} "
                                "(an adapter of another model?)")
            w = LoraWeights(a.to(self.device, self.dtype), b.to(self.device, self.dtype), _scale(cfg, a.shape[0]))
            staged.append((layer, w))
        for layer, w in staged:  # all checked first: a refused adapter leaves nothing behind
            if getattr(layer, "lora", None) is None:
                layer.lora = LoraLayer(self.selection)
            layer.lora.weights[module.name] = w
        self.paths[module.name] = str(folder)

    @contextmanager
    def rows(self, names: list[str], rows_of: list[torch.Tensor]) -> Iterator[None]:
        """Select, for one forward, `rows_of[i]` for adapter `names[i]` (the base model: "")."""
        groups: dict[str, list[torch.Tensor]] = {}
        for name, rows in zip(names, rows_of, strict=True):
            if name:
                groups.setdefault(name, []).append(rows)
        if len(groups) == 1 and len(next(iter(groups.values()))) == len(names):
            self.selection.groups = [(next(iter(groups)), None)]
        else:
            self.selection.groups = [(n, torch.cat(r).to(self.device)) for n, r in groups.items()]
        try:
            yield
        finally:
            self.selection.groups = []
