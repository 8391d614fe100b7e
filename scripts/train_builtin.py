"""Train pdmesh's built-in model: a tiny Llama on the docstrings of Python's standard library.

    .venv/bin/python scripts/train_builtin.py                 # writes models/pdmesh-tiny/
    .venv/bin/python scripts/train_builtin.py --steps 20 --out /tmp/tiny   # a quick try

Corpus: every module, class and function docstring of the running interpreter's standard library
(`Lib/`, read with `ast`, never imported; the test suites, idlelib's tests and site-packages are
left out), PSF licence. A file goes to the held-out set when the SHA-256 of its relative path
ends in a byte < HELD_OUT_PER_256, so the split does not depend on anything but the paths.
Half of the docstrings (chosen by the seed) are written as a chat turn of the built-in chat
template ("What does NAME do?" → the docstring), so that the chat endpoint answers in prose.

Tokenizer: byte-level BPE trained with `tokenizers` (ids 0..255 are the 256 bytes, then the
merges, then the special tokens of the old byte tokenizer: <|pad|> <|bos|> <|eos|> <|system|>
<|user|> <|assistant|> <|end|>). Model: transformers' LlamaForCausalLM (the reference pdmesh's
engine is tested against), tied embeddings, trained in float32 and saved in bfloat16.

Deterministic from --seed on a given interpreter (the corpus is that interpreter's Lib/) and
thread count (--threads, 1 by default); prints the loss curve and held-out perplexity, and writes README.md, the loss
curve (training_log.json) and an ordinary Hugging Face folder.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import pathlib
import random
import sys
import sysconfig
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The byte tokenizer's special tokens, in its order; its <|unused0|> only pads that tokenizer's
# embedding table to an even size.
from services.common.builtin_tokenizer import SPECIAL_TOKENS as BYTE_TOKENIZER_SPECIALS  # noqa: E402
from services.common.builtin_tokenizer import chat_template  # noqa: E402

SPECIAL_TOKENS = BYTE_TOKENIZER_SPECIALS[:BYTE_TOKENIZER_SPECIALS.index("<|unused0|>")]
DEFAULT_OUT = REPO / "models" / "pdmesh-tiny"
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}
HELD_OUT_PER_256 = 12  # ~5 % of files
CHAT_TEMPLATE = chat_template("the pdmesh-tiny")


# --- corpus -----------------------------------------------------------------------------------


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def docstrings(path: pathlib.Path, module: str) -> list[tuple[str, str, str]]:
    """(kind, name, docstring) of the module and of every class and function in it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(("module", module, doc))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and not node.name.startswith("test"):
                out.append(("class" if isinstance(node, ast.ClassDef) else "function", node.name, doc))
    return out


def usable(doc: str) -> bool:
    # Prose, not doctest sessions or tables: short lines of mostly letters.
    if len(doc) < 40 or ">>>" in doc:
        return False
    letters = sum(c.isalpha() or c.isspace() for c in doc)
    return doc.isascii() and letters / len(doc) > 0.8


def collect_corpus() -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]], dict]:
    root = stdlib_dir()
    train, held, seen = [], [], set()
    files = sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts))
    for path in files:
        rel = path.relative_to(root).as_posix()
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        target = held if hashlib.sha256(rel.encode()).digest()[-1] < HELD_OUT_PER_256 else train
        for item in docstrings(path, module):
            if usable(item[2]) and item[2] not in seen:
                seen.add(item[2])
                target.append(item)
    chars = sum(len(d) for _, _, d in train + held)
    info = {
        "source": str(root),
        "python": sys.version.split()[0],
        "files": len(files),
        "docstrings_train": len(train),
        "docstrings_held_out": len(held),
        "characters": chars,
        "sha256": hashlib.sha256("\0".join(d for _, _, d in train + held).encode()).hexdigest(),
    }
    return train, held, info


def render(kind: str, name: str, doc: str, chat: bool) -> str:
    if not chat:
        return f"<|bos|>{doc}<|eos|>"
    question = f"What is the {name} module?" if kind == "module" else f"What does {name} do?"
    return f"<|bos|><|user|>{question}<|end|><|assistant|>{doc}<|end|>"


# --- tokenizer --------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    return tok


# --- training ---------------------------------------------------------------------------------


def blocks(ids: list[int], seq_len: int):
    import torch

    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def perplexity(model, data, batch: int = 16) -> float:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(data), batch):
            x = data[i : i + batch]
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total, count = total + loss.item(), count + x[:, 1:].numel()
    return math.exp(total / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--vocab", type=int, default=2048)
    # One thread: on a busy machine two OpenMP threads spin-wait for each other and run ~5x
    # slower than one (measured: 1.0 s vs 4.5-9.6 s a step at load 11 on 2 cores).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args()

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.monotonic()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(args.seed)

    train_docs, held_docs, corpus = collect_corpus()
    print(f"corpus: {json.dumps(corpus)}", flush=True)
    train_texts = [render(*d, chat=rng.random() < 0.5) for d in train_docs]
    held_texts = [render(*d, chat=False) for d in held_docs]
    tok = train_tokenizer([d for _, _, d in train_docs], args.vocab)
    ids = {t.strip("<|>"): tok.token_to_id(t) for t in SPECIAL_TOKENS}  # "pad": id of <|pad|>, ...
    rng.shuffle(train_texts)
    enc = lambda texts: [i for e in tok.encode_batch(texts, add_special_tokens=False) for i in e.ids]  # noqa: E731
    train_ids, held_ids = enc(train_texts), enc(held_texts)
    train_data, held_data = blocks(train_ids, args.seq_len), blocks(held_ids, args.seq_len)
    print(f"tokens: train {len(train_ids)}, held-out {len(held_ids)}; tokenizer {time.monotonic() - t0:.0f} s", flush=True)

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, like the real models
        head_dim=32,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=ids["bos"],
        eos_token_id=[ids["eos"], ids["end"]],
        pad_token_id=ids["pad"],
    )
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params} parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    order = torch.randperm(len(train_data), generator=torch.Generator().manual_seed(args.seed))
    curve, t_train, window = [], time.monotonic(), []
    model.train()
    for step in range(args.steps):
        start = (step * args.batch) % len(order)
        idx = order[start : start + args.batch]
        if len(idx) < args.batch:
            idx = torch.cat([idx, order[: args.batch - len(idx)]])
        x = train_data[idx]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = sum(window) / len(window)
            window = []
            entry = {"step": step + 1, "train_loss": round(mean, 4), "seconds": round(time.monotonic() - t_train, 1)}
            if (step + 1) % (args.log_every * 5) == 0 or step + 1 == args.steps:
                model.eval()
                entry["held_out_ppl"] = round(perplexity(model, held_data[:64]), 3)
                model.train()
            curve.append(entry)
            print(json.dumps(entry), flush=True)

    model.eval()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["end"]], pad_token_id=ids["pad"]
    ).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n", encoding="utf-8")

    # Held-out perplexity of what ships: the bfloat16 weights, computed in float32 as pdmesh does on CPU.
    shipped = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ppl = perplexity(shipped, held_data)
    wall = time.monotonic() - t0
    summary = {
        "corpus": corpus, "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
        "lr": args.lr, "threads": args.threads, "parameters": params, "vocab_size": args.vocab,
        "train_tokens": len(train_ids), "held_out_tokens": held_data.numel(),
        "final_train_loss": curve[-1]["train_loss"], "held_out_ppl_bf16": round(ppl, 3),
        "wall_seconds": round(wall), "curve": curve,
    }
    (out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "README.md").write_text(readme(summary, sys.argv[1:]), encoding="utf-8")
    print(f"held-out perplexity (bf16 weights, {held_data.numel()} tokens): {ppl:.3f}; wall {wall:.0f} s", flush=True)


def readme(s: dict, argv: list[str]) -> str:
    c = s["corpus"]
    return f"""# pdmesh-tiny

pdmesh's built-in model (`--model builtin`): a {s['parameters'] / 1e6:.1f}M-parameter Llama
(4 layers, hidden 128, 4 query / 2 key-value heads, tied embeddings, bfloat16 weights) with a
{s['vocab_size']}-token byte-level BPE tokenizer, trained by `scripts/train_builtin.py` on the
docstrings of Python's standard library. It writes docstring-flavoured English; it knows nothing.
An ordinary Hugging Face folder: `transformers` and pdmesh's loader read it alike.

## Corpus

- Source: the module, class and function docstrings of the standard library of Python
  {c['python']} (`Lib/`, read with `ast`; test suites, idlelib tests, lib2to3, turtledemo and
  site-packages excluded; prose only: ASCII, >= 40 characters, no doctest sessions), deduplicated.
- Size: {c['files']} files, {c['docstrings_train']} training + {c['docstrings_held_out']} held-out
  docstrings, {c['characters']} characters; {s['train_tokens']} training tokens. SHA-256 of the
  corpus text: `{c['sha256']}`.
- Held-out split: by file (the last byte of the SHA-256 of the file's path below Lib/).
- Licence: the corpus is text of the Python standard library, under the Python Software
  Foundation License (PSF-2.0), which permits copying and derived works with the notice kept;
  the weights and tokenizer here are derived from it.
- Half of the training docstrings (chosen by the seed) are written as a chat turn
  (`<|user|>What does NAME do?<|end|><|assistant|>DOCSTRING<|end|>`, the template in
  `chat_template.jinja`), the other half as `<|bos|>DOCSTRING<|eos|>`.

## Training

    nice -n 19 .venv/bin/python scripts/train_builtin.py{"".join(" " + a for a in argv)}

seed {s['seed']}, {s['steps']} steps of {s['batch']} x {s['seq_len']} tokens, AdamW (lr
{s['lr']}, cosine to 10 %, weight decay 0.1), float32 on {s['threads']} CPU thread(s):
{s['wall_seconds']} s of wall time (corpus, tokenizer, training, evaluation; after the imports).
Final training loss {s['final_train_loss']}; held-out perplexity of the shipped bfloat16 weights
{s['held_out_ppl_bf16']} over {s['held_out_tokens']} tokens. The loss curve is in
`training_log.json`.
"""


if __name__ == "__main__":
    main()
