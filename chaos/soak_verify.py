"""The chaos soak's checks that need more than a gauge: outputs against single-process
generation (invariant 2) and the router's counters against what the clients saw (invariant 5)."""

from __future__ import annotations

from dataclasses import replace

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from chaos.soak_load import Result
from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.engine.grammar import GrammarRegistry, build_tokenizer
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full

STANDARD_LABELS = {"model_name", "engine_type", "worker"}


def scrape(url: str) -> dict[str, float]:
    """/metrics samples keyed `name{label=value,...}` with the standard labels left out."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in STANDARD_LABELS)
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def check_outputs(results: list[Result], batch: int = 32, ties: list[str] | None = None) -> list[str]:
    """Every success must carry exactly the text (and finish reason) that the same model run in
    one process gives for the same prompt and sampling parameters.

    Even the random model has a rare prompt whose logits tie to within float rounding at some
    position, where the batch a sequence shares (the matmul's blocking) decides the token: the
    single-process reference itself then gives different texts in different batches. A mismatch
    is accepted as such a tie (and listed in `ties`) only when the request's output equals the
    reference computed in another batch composition — alone, or beside copies of itself — or
    continued, as a migration does, from a one-shot prefill of its first k ids; any other
    mismatch is a failure."""
    ok = [r for r in results if r.ok]
    if not ok:
        return []
    # one thread: the workers may still be running, and OpenMP threads spinning on an
    # oversubscribed 2-core machine slow this down by an order of magnitude
    torch.set_num_threads(1)
    loaded, tokenizer = load_model("builtin-random"), load_tokenizer("builtin-random")  # the soak's model
    pool = KVPool(loaded.config, 2048, 16)
    vocab = loaded.config.vocab_size
    grammars = GrammarRegistry(build_tokenizer(tokenizer, None, vocab), vocab)

    def params_of(r: Result) -> SamplingParams:
        return SamplingParams(temperature=r.temperature, seed=r.seed, max_tokens=r.max_tokens,
                              grammar=tuple(r.grammar) if r.grammar else None)

    def matches(r: Result, ref) -> bool:
        return r.text == tokenizer.decode(ref.token_ids) and r.finish_reason == ref.finish_reason

    def resumed_tie(r: Result, ref) -> bool:
        """A migrated (or recomputed) request continues from a one-shot prefill of prompt +
        generated ids, where single-process generation decoded them one by one: a near-tie may
        fall the other way on that path. True when, for some k up to where the output leaves the
        reference, continuing from the reference's first k ids that way gives the output."""
        agree = 0
        while agree < len(ref.token_ids) and r.text.startswith(tokenizer.decode(ref.token_ids[: agree + 1])):
            agree += 1
        for k in range(1, min(agree, r.max_tokens - 1) + 1):
            resumed = replace(params_of(r), max_tokens=r.max_tokens - k, num_generated=k)
            rest = generate_full(loaded.model, pool, [r.prompt + ref.token_ids[:k]], [resumed], grammars=grammars)[0]
            if matches(r, replace(rest, token_ids=ref.token_ids[:k] + rest.token_ids)):
                return True
        return False

    problems = []
    for i in range(0, len(ok), batch):
        chunk = ok[i : i + batch]
        refs = generate_full(loaded.model, pool, [r.prompt for r in chunk], [params_of(r) for r in chunk],
                             grammars=grammars)
        for r, ref in zip(chunk, refs, strict=True):
            if matches(r, ref):
                continue
            others = [generate_full(loaded.model, pool, [r.prompt] * n, [params_of(r)] * n, grammars=grammars)[0]
                      for n in (1, 3, 8)]
            if (any(matches(r, other) for other in others) or resumed_tie(r, ref)) and ties is not None:
                ties.append(f"request {r.id}: a near-tie; its output is single-process generation's in another batch or on the resumed path")
                continue
            problems.append(f"request {r.id} (stream={r.stream}, seed={r.seed}, grammar={r.grammar}): got "
                            f"{r.text!r}/{r.finish_reason}, single-process {tokenizer.decode(ref.token_ids)!r}/"
                            f"{ref.finish_reason}")
    return problems


def _total(counts: dict[str, float], status: int | None = None) -> float:
    return sum(v for k, v in counts.items()
               if k.startswith("pdmesh:router_requests_total") and (status is None or f"status={status}" in k))


def check_counts(results: list[Result], router_counts: list[dict[str, float]],
                 killed_at: list[float | None]) -> list[str]:
    """Per router generation (a restart resets its counters): every request that ended within
    one generation with an HTTP answer was counted by that router, and the router counted
    nothing beyond what clients sent. Uncertain, and so allowed either way: a request cut by a
    restart (connection error), one that ended in the last second before its router was killed
    (the client may read the end of a stream just before the router counts it), and one sent
    just as the new router came up (it carries the old generation's stamp, at its start or, when
    answered before the soak saw the restart done, at both ends)."""
    problems = []
    for gen, counts in enumerate(router_counts):
        kill = killed_at[gen] if gen < len(killed_at) else None
        within = [r for r in results if r.router_gen == (gen, gen) and not r.cause.startswith("connection")]
        sure = [r for r in within if kill is None or r.ended < kill - 1.0]
        maybe = [r for r in results if r.router_gen[0] == gen and r not in sure]
        maybe += [r for r in results if r.router_gen == (gen - 1, gen)]
        # sent and answered around the restart: the new router may have served it before the soak
        # recorded the restart as done, so it carries the old generation's stamp at both ends
        prev_kill = killed_at[gen - 1] if 0 < gen <= len(killed_at) else None
        if prev_kill is not None:
            maybe += [r for r in results if r.router_gen == (gen - 1, gen - 1) and r.ended >= prev_kill - 1.0]
        total = _total(counts)
        if not len(sure) <= total <= len(sure) + len(maybe):
            problems.append(f"invariant 5: router generation {gen} counted {total:g} requests; clients got "
                            f"{len(sure)} answers for sure and {len(maybe)} that may or may not count")
        ok_sure, ok_maybe = sum(1 for r in sure if r.ok), sum(1 for r in maybe if r.ok or r.status == 200)
        # a stream that failed after its 200 header is counted under its error's status, not 200
        if not ok_sure <= _total(counts, 200) <= ok_sure + ok_maybe:
            problems.append(f"invariant 5: router generation {gen} counted {_total(counts, 200):g} successes, "
                            f"clients saw {ok_sure} for sure and {ok_maybe} that may or may not count")
    return problems
