"""What LoRA adapters cost the engine, side by side in one run.

Prints JSON: decode tokens/s and prefill tokens/s of the built-in model's paged engine for a batch
whose requests are all on the base model, all on one adapter, and spread over `--adapters`
adapters (each request its own turn of them), and each ratio to the base model. The adapters are
PEFT-format folders written here (random A and B of `--rank`, every linear layer of the decoder
targeted: the most an adapter can cost), loaded by the workers' own loader
(services/engine/lora.py).
Usage: python bench/lora.py [--batch 16] [--prompt-len 256] [--new-tokens 32] [--rank 16] [--adapters 4]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from services.common.lora_modules import LoraModule  # noqa: E402
from services.engine.kv_pool import KVPool  # noqa: E402
from services.engine.loader import load_model  # noqa: E402
from services.engine.lora import TARGETS, LoraAdapters  # noqa: E402
from services.engine.runner import DecodeItem, ModelRunner, PrefillItem  # noqa: E402


def write_adapter(folder: pathlib.Path, model, rank: int, seed: int) -> str:
    """A PEFT LoRA folder targeting every decoder linear layer, with random weights."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            prefix = f"base_model.model.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.05
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
    return str(folder)


def run(runner: ModelRunner, pool: KVPool, names: list[str], prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Prefill every request's prompt in one forward, then decode new_tokens steps of the batch."""
    page = pool.page_size
    per = -(-(prompt_len + new_tokens) // page)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(names))]
    prompt = [(7 * k) % 1000 + 3 for k in range(prompt_len)]
    t0 = time.perf_counter()
    logits = runner.prefill([PrefillItem(prompt, 0, t, n) for t, n in zip(tables, names, strict=True)])
    t1 = time.perf_counter()
    tokens = logits.argmax(-1).tolist()
    for step in range(new_tokens):
        pos = prompt_len + step
        logits = runner.decode([DecodeItem(tok, pos, t, n) for tok, t, n in zip(tokens, tables, names, strict=True)])
        tokens = logits.argmax(-1).tolist()
    t2 = time.perf_counter()
    return {"prefill_tokens_per_s": len(names) * prompt_len / (t1 - t0),
            "decode_tokens_per_s": len(names) * new_tokens / (t2 - t1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(None)
    with tempfile.TemporaryDirectory() as tmp:
        modules = [LoraModule(f"a{i}", write_adapter(pathlib.Path(tmp) / f"a{i}", loaded.model, args.rank, i))
                   for i in range(args.adapters)]
        adapters = LoraAdapters(loaded.model, modules, max_rank=args.rank)
    per = -(-(args.prompt_len + args.new_tokens) // 16)
    pool = KVPool(loaded.config, per * args.batch, 16)
    runner = ModelRunner(loaded.model, pool, adapters)
    cases = {"base": [""] * args.batch, "one_adapter": ["a0"] * args.batch,
             f"{args.adapters}_adapters_mixed": [f"a{i % args.adapters}" for i in range(args.batch)]}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
    run(runner, pool, cases["base"], 16, 2)  # warm-up
    for _ in range(args.repeats):  # interleaved: each round measures every case
        for case, names in cases.items():
            results[case].append(run(runner, pool, names, args.prompt_len, args.new_tokens))
    out: dict[str, object] = {"settings": vars(args)}
    for case, runs in results.items():
        out[case] = {k: round(sorted(r[k] for r in runs)[len(runs) // 2], 1) for k in runs[0]}
    base = out["base"]
    for case in cases:
        if case != "base":
            out[case]["vs_base"] = {k: round(out[case][k] / base[k], 3) for k in base}  # type: ignore[index]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
