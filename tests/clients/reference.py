"""transformers on the same checkpoint the mesh serves (models/pdmesh-tiny), in the pytest process:
greedy continuations and continuation log-likelihoods, tokenized as lm-eval tokenizes them."""

from __future__ import annotations

from functools import cache

from services.common.tokenizer import BUILTIN_MODEL_DIR


@cache
def hf_model_and_tokenizer():
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=torch.float32).eval()
    return model, tok


def greedy_text(ids: list[int], max_new_tokens: int, until: list[str]) -> str:
    """transformers' greedy continuation of `ids`, cut before the first stop string (as the server
    cuts a `stop` match)."""
    import torch

    model, tok = hf_model_and_tokenizer()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens)
    text = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    cuts = [text.index(s) for s in until if s and s in text]
    return text[: min(cuts)] if cuts else text


def completion_prompt_ids(context: str) -> list[int]:
    """local-completions' prompt ids: the HF tokenizer with add_special_tokens=False (add_bos_token off)."""
    _, tok = hf_model_and_tokenizer()
    return tok(context, add_special_tokens=False).input_ids


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    _, tok = hf_model_and_tokenizer()
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def continuation_logprob(context: str, continuation: str) -> tuple[float, bool]:
    """(sum of the continuation tokens' logprobs, whether each is the argmax), with lm-eval's split
    for a causal model: trailing spaces of the context move to the continuation, the whole string
    is encoded and the context's own encoding marks where the continuation starts."""
    import torch

    model, tok = hf_model_and_tokenizer()
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctxlen = len(tok(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    picked = [logp[k - 1, whole[k]] for k in range(ctxlen, len(whole))]
    greedy = all(logp[k - 1].argmax().item() == whole[k] for k in range(ctxlen, len(whole)))
    return float(sum(picked)), greedy
