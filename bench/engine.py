"""Engine throughput vs transformers on the same weights, side by side in one run.

Prints JSON: prefill and decode tokens/s of our paged engine and of transformers' `generate`
(its own KV cache) at batch 1, 8, 32 on the built-in model, and the ratios ours/transformers.
Also our prefill of mixed-length prompts with stacked (padded) attention vs one call per
prompt, in the same run (`mixed_prefill`).
Also the sampler's cost per token (`sampling`): plain (greedy and top-p) against penalties
(presence + frequency + repetition, state rebuilt from a 256 + 64 token history) and logit_bias,
at batch 1 and 32 (`--sampling-only` runs just that part); and a JSON-schema grammar
(llguidance, each row its own random schema, the matcher advancing by the sampled token as on
decode) against plain sampling over the same steps, plus the cost of rebuilding a matcher from
64 generated ids (what a migrated or resumed request pays once).
Usage: python bench/engine.py [--prompt-len 128] [--new-tokens 32] [--repeats 3] [--sampling-only]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.kv_pool import KVPool  # noqa: E402
from services.engine.loader import load_model  # noqa: E402
from services.engine.runner import DecodeItem, ModelRunner, PrefillItem  # noqa: E402
from services.engine.sampler import Sampler  # noqa: E402
from services.fakes.random_schemas import random_schema  # noqa: E402


def to_transformers(loaded):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = loaded.config
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf = LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(loaded.model.state_dict(), strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise RuntimeError(f"weight names differ: missing={missing} unexpected={unexpected}")
    return hf


def same_weights_check(loaded, hf) -> float:
    """Max |logit difference| on one prompt: proves both sides run the same model."""
    ids = [(7 * j) % 256 for j in range(40)]
    pool = KVPool(loaded.config, num_pages=4, page_size=16)
    ours = ModelRunner(loaded.model, pool).prefill([PrefillItem(ids, 0, pool.allocator.alloc(3, owner=0))])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    return float((ours - ref).abs().max())


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_ours(loaded, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    pool = KVPool(loaded.config, num_pages=batch * ((prompt_len + new_tokens) // 16 + 2), page_size=16)
    runner = ModelRunner(loaded.model, pool)
    tables = [pool.allocator.alloc(pool.pages_for_tokens(prompt_len + new_tokens), owner=i) for i in range(batch)]
    prompts = [[(i + j) % 256 for j in range(prompt_len)] for i in range(batch)]

    def prefill():
        return runner.prefill([PrefillItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)])

    def decode():
        for step in range(new_tokens):
            runner.decode([DecodeItem(1, prompt_len + step, t) for t in tables])

    prefill()  # warm-up
    t_prefill = best_of(prefill, repeats)
    t_decode = best_of(decode, repeats)
    return {"prefill_tok_s": batch * prompt_len / t_prefill, "decode_tok_s": batch * new_tokens / t_decode}


def bench_mixed_prefill(loaded, batch: int, repeats: int) -> dict:
    """Prompts of 64-128 tokens: stacked attention groups vs attention one prompt at a time."""
    import random

    rng = random.Random(batch)
    lengths = [rng.randint(64, 128) for _ in range(batch)]
    pool = KVPool(loaded.config, num_pages=batch * 10, page_size=16)
    runner = ModelRunner(loaded.model, pool)
    tables = [pool.allocator.alloc(pool.pages_for_tokens(n), owner=i) for i, n in enumerate(lengths)]
    items = [PrefillItem([(i + j) % 256 for j in range(n)], 0, t) for i, (n, t) in enumerate(zip(lengths, tables, strict=True))]
    out = {}
    for name, ratio in (("stacked", runner.max_padded_length_ratio), ("one_by_one", 0.0)):
        runner.max_padded_length_ratio = ratio
        runner.prefill(items)  # warm-up
        out[f"{name}_tok_s"] = sum(lengths) / best_of(lambda: runner.prefill(items), repeats)
    return {"batch": batch, **out, "speedup": out["stacked_tok_s"] / out["one_by_one_tok_s"]}


def bench_transformers(hf, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    ids = torch.tensor([[(i + j) % 256 for j in range(prompt_len)] for i in range(batch)])
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    gen(1)  # warm-up
    t_prefill = best_of(lambda: gen(1), repeats)
    t_total = best_of(lambda: gen(new_tokens + 1), repeats)
    return {
        "prefill_tok_s": batch * prompt_len / t_prefill,
        "decode_tok_s": batch * new_tokens / max(t_total - t_prefill, 1e-9),
    }


SAMPLING_CASES = {
    "greedy": dict(temperature=0.0),
    "top_p": dict(temperature=0.8, top_p=0.9, seed=1),
    "greedy+penalties": dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    "top_p+penalties": dict(temperature=0.8, top_p=0.9, seed=1, presence_penalty=0.5, frequency_penalty=0.5,
                            repetition_penalty=1.2),
    "greedy+logit_bias": dict(temperature=0.0, logit_bias=tuple((t, 5.0) for t in range(0, 200, 10))),
}


def bench_sampling(vocab: int, batch: int, repeats: int, steps: int = 20) -> dict:
    """Microseconds per sampled token for each case (random logits, a 256 + 64 token history)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    histories = [(torch.randint(0, vocab, (256,), generator=gen).tolist(),
                  torch.randint(0, vocab, (64,), generator=gen).tolist()) for _ in range(batch)]
    sampler, out = Sampler(), {}
    for name, kw in SAMPLING_CASES.items():
        params = [SamplingParams(max_tokens=512, **kw)] * batch

        def run(params=params):
            for s in range(steps):
                sampler.sample(logits, params, [320 + s] * batch, histories)

        out[name] = best_of(run, repeats) / (steps * batch) * 1e6
    return {"batch": batch, "us_per_token": {k: round(v, 1) for k, v in out.items()},
            "vs_plain": {k: round(v / out["greedy" if k.startswith("greedy") else "top_p"], 2) for k, v in out.items()}}


def bench_grammar(loaded, batch: int, repeats: int, steps: int = 64) -> dict:
    """Microseconds per sampled token: plain vs under a JSON-schema grammar, same random logits."""
    from services.common.tokenizer import load_tokenizer
    from services.engine.grammar import GrammarRegistry, build_tokenizer

    vocab = loaded.config.vocab_size
    registry = GrammarRegistry(build_tokenizer(load_tokenizer(loaded.path), pathlib.Path(loaded.path), vocab), vocab)
    eos = tuple(loaded.config.eos_token_ids)
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch, vocab, generator=gen) * 3 for _ in range(steps)]
    prompt = list(range(32))
    out = {}
    for name, kw in (("greedy", dict(temperature=0.0)), ("top_p", dict(temperature=0.8, top_p=0.9, seed=1))):
        for constrained in (False, True):
            params = [SamplingParams(max_tokens=512, stop_token_ids=eos, **kw,
                                     grammar=("json_schema", json.dumps(random_schema(i))) if constrained else None)
                      for i in range(batch)]
            sampler = Sampler(registry)

            def run(params=params, sampler=sampler):
                outputs = [[] for _ in range(batch)]
                for s in range(steps):
                    tokens, _ = sampler.sample(logits[s], params, [len(prompt) + s] * batch,
                                               [(prompt, o) for o in outputs], list(range(batch)))
                    for o, t in zip(outputs, tokens, strict=True):
                        o.append(t)
                for i in range(batch):
                    registry.forget(i)

            run()  # warm-up: compiles each schema once (the compiled grammar is cached)
            out[f"{name}+json_schema" if constrained else name] = best_of(run, repeats) / (steps * batch) * 1e6
    schema = ("json_schema", json.dumps(random_schema(0)))
    ids = []
    sampler = Sampler(registry)
    params = [SamplingParams(temperature=0.0, stop_token_ids=eos, grammar=schema)]
    for s in range(64):  # a valid 64-id output to replay
        ids.append(sampler.sample(logits[s % steps][:1], params, [s], [(prompt, ids)], ["replay"])[0][0])
    registry.forget("replay")
    rebuild = best_of(lambda: registry.allowed_mask(None, schema, ids), repeats * 3) * 1e6
    return {"batch": batch, "us_per_token": {k: round(v, 1) for k, v in out.items()},
            "vs_plain": {k: round(v / out[k.split("+")[0]], 2) for k, v in out.items()},
            "rebuild_from_64_ids_us": round(rebuild, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--sampling-only", action="store_true", help="only the sampler's cost per token")
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_model(None)
    sampling = [bench_sampling(loaded.config.vocab_size, b, args.repeats) for b in (1, 32)]
    grammar = [bench_grammar(loaded, b, args.repeats) for b in (1, 32)]
    if args.sampling_only:
        print(json.dumps({"bench": "engine", "model": loaded.config.name, "vocab_size": loaded.config.vocab_size,
                          "torch_threads": torch.get_num_threads(), "sampling": sampling, "grammar": grammar},
                         indent=2))
        return
    hf = to_transformers(loaded)
    diff = same_weights_check(loaded, hf)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        ours = bench_ours(loaded, b, args.prompt_len, args.new_tokens, args.repeats)
        ref = bench_transformers(hf, b, args.prompt_len, args.new_tokens, args.repeats)
        rows.append(
            {
                "batch": b,
                "ours": ours,
                "transformers": ref,
                "prefill_ratio": ours["prefill_tok_s"] / ref["prefill_tok_s"],
                "decode_ratio": ours["decode_tok_s"] / ref["decode_tok_s"],
            }
        )
    print(
        json.dumps(
            {
                "bench": "engine",
                "model": loaded.config.name,
                "device": str(loaded.device),
                "torch_threads": torch.get_num_threads(),
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "same_weights_max_abs_logit_diff": diff,
                "results": rows,
                "mixed_prefill": [bench_mixed_prefill(loaded, b, args.repeats) for b in (8, 32)],
                "sampling": sampling,
                "grammar": grammar,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
