"""The chaos soak's checks that need more than a gauge: outputs against single-process
generation (invariant 2) and the router's counters against what the clients saw (invariant 5)."""

from __future__ import annotations

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full
from tests.chaos.soak_load import Result

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


def check_outputs(results: list[Result], batch: int = 32) -> list[str]:
    """Every success must carry exactly the text (and finish reason) that the same model run in
    one process gives for the same prompt and sampling parameters."""
    ok = [r for r in results if r.ok]
    if not ok:
        return []
    # one thread: the workers may still be running, and OpenMP threads spinning on an
    # oversubscribed 2-core machine slow this down by an order of magnitude
    torch.set_num_threads(1)
    loaded, tokenizer = load_model("builtin-random"), load_tokenizer("builtin-random")  # the soak's model
    pool = KVPool(loaded.config, 2048, 16)
    problems = []
    for i in range(0, len(ok), batch):
        chunk = ok[i : i + batch]
        params = [SamplingParams(temperature=r.temperature, seed=r.seed, max_tokens=r.max_tokens) for r in chunk]
        refs = generate_full(loaded.model, pool, [r.prompt for r in chunk], params)
        for r, ref in zip(chunk, refs, strict=True):
            want = tokenizer.decode(ref.token_ids)
            if r.text != want or r.finish_reason != ref.finish_reason:
                problems.append(f"request {r.id} (stream={r.stream}, seed={r.seed}): got {r.text!r}/{r.finish_reason}, "
                                f"single-process {want!r}/{ref.finish_reason}")
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
    just as the new router came up (it carries the old generation's stamp)."""
    problems = []
    for gen, counts in enumerate(router_counts):
        kill = killed_at[gen] if gen < len(killed_at) else None
        within = [r for r in results if r.router_gen == (gen, gen) and not r.cause.startswith("connection")]
        sure = [r for r in within if kill is None or r.ended < kill - 1.0]
        maybe = [r for r in results if r.router_gen[0] == gen and r not in sure]
        maybe += [r for r in results if r.router_gen == (gen - 1, gen)]
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
