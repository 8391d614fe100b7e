"""A grammar's cost, measured before any worker pays it: compile it and compute its first mask
on a thread, within budgets of CPU time, or refuse the request (400).

A short grammar can be expensive: `((a{60}){60}){60}` compiles in a millisecond and then costs a
second per mask, and every mask of a decode batch waits for the slowest row. Structure checks
(grammar_spec.validate) cannot see that, so the router runs what a worker would run first:
llguidance's matcher over the served model's tokenizer, then the first token's mask. Budgets are
CPU seconds of the thread doing it (time.thread_time), so a loaded machine does not turn a cheap
grammar into a refused one:

- `--grammar-compile-budget`: building the matcher (grows with the grammar's size);
- `--grammar-mask-budget`: the first mask (the pathological part).

The work runs on a small pool of threads (llguidance releases the GIL), so the event loop never
waits on it; a check still running past `wall_limit` is answered 503 (the threads are busy)
while the thread finishes on its own. Verdicts are cached by a digest of the grammar within a
byte budget, so a grammar seen before is judged at once, good or bad.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path

import llguidance

from services.common.byte_lru import ByteLRU, source_key
from services.common.grammar_spec import build_tokenizer, to_llguidance
from services.common.logging_setup import get_logger
from services.common.tokenizer import Tokenizer
from services.router.errors import APIError, bad_request

log = get_logger("router.grammar")

VERDICT_CACHE_BYTES = 4 * 1024 * 1024
THREADS = 2  # grammars checked at once; more wait their turn
_OK = ""


class GrammarCost:
    def __init__(self, tokenizer: Tokenizer, model_dir: Path | None, compile_budget: float = 2.0,
                 mask_budget: float = 0.1, wall_limit: float = 30.0, threads: int = THREADS):
        self.compile_budget, self.mask_budget, self.wall_limit = compile_budget, mask_budget, wall_limit
        self._tokenizer = build_tokenizer(tokenizer, model_dir, tokenizer.vocab_size)
        self._verdicts = ByteLRU(VERDICT_CACHE_BYTES)
        self._running: dict[bytes, asyncio.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-cost")

    def measure(self, kind: str, source: str) -> str:
        """On a pool thread: "" when the grammar is within both budgets, else why not."""
        started = time.thread_time()
        try:
            matcher = llguidance.LLMatcher(self._tokenizer, to_llguidance(kind, source), log_level=0)
        except ValueError as e:
            return str(e)
        built = time.thread_time() - started
        if matcher.is_error():
            return matcher.get_error()
        if built > self.compile_budget:
            return (f"compiling it took {built:.2f} s of CPU, over the router's --grammar-compile-budget of "
                    f"{self.compile_budget} s")
        mask_started = time.thread_time()
        matcher.compute_bitmask()
        masked = time.thread_time() - mask_started
        if matcher.is_error():
            return matcher.get_error()
        if masked > self.mask_budget:
            return (f"its first token's mask took {masked:.2f} s of CPU, over the router's --grammar-mask-budget "
                    f"of {self.mask_budget} s")
        return _OK

    async def check(self, grammar: tuple[str, str] | None, param: str = "response_format") -> None:
        """Raises a 400 when the grammar is too expensive to enforce (or does not compile with the
        model's tokenizer), a 503 when no thread could judge it within wall_limit."""
        if grammar is None:
            return
        key = source_key(*grammar)
        verdict = self._verdicts.get(key)
        if verdict is None:
            future = self._running.get(key)  # the same grammar in several requests at once: measured once
            if future is None:
                future = asyncio.get_running_loop().run_in_executor(self._pool, self.measure, *grammar)
                self._running[key] = future
                future.add_done_callback(lambda f, key=key: self._remember(key, f))
            try:
                verdict = await asyncio.wait_for(asyncio.shield(future), self.wall_limit)
            except TimeoutError:
                raise APIError(503, f"The grammar could not be checked within {self.wall_limit} s; try again later.",
                               param=param, code="grammar_check_busy", type="server_error") from None
        if verdict:
            log.info("grammar refused", reason=verdict[:300])
            raise bad_request(f"The grammar is too expensive to enforce or does not compile: {verdict.strip()[:2000]}",
                              param=param, code="grammar_too_expensive")

    def _remember(self, key: bytes, future: asyncio.Future) -> None:
        self._running.pop(key, None)
        if not future.cancelled() and future.exception() is None:
            self._verdicts.put(key, future.result(), len(future.result()))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
