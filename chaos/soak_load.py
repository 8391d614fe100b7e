"""The chaos soak's clients: seeded, mixed requests through the router's OpenAI API.

Each client sends one request at a time (prompt as token ids, so the reference generation
sees exactly the same prompt): mixed prompt and output lengths, streamed or not, greedy or
seeded sampling. A connection refused (the router is restarting) is retried before the request
counts as sent, as a client behind a load balancer would; anything else that ends a request is
recorded with its cause. The multi-round conversations (chaos/soak_conversations.py) send
their rounds through the same `send_recorded`, so their rounds are results like any other.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from services.fakes.random_schemas import random_schema

PRINTABLE = range(32, 127)  # the built-in tokenizer's printable bytes
# Some requests carry a grammar, so faults and migrations also hit structured output, whose
# matcher state every new worker must rebuild from the ids
GRAMMAR_SHARE = 0.15
STREAM_INTERVAL_SHARE = 0.3  # streams that ask for several tokens per event
WORDS_REGEX = r"[a-z]{2,8}( [a-z]{2,8}){0,6}\."


@dataclass
class Result:
    id: int
    client: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    # vLLM's stream_interval of a streamed request (tokens per event): the joined text must not change
    stream_interval: int = 1
    # structured output, (kind, source) as SamplingParams.grammar: sent as the OpenAI field it
    # comes from, checked against single-process generation under the same grammar
    grammar: tuple[str, str] | None = None
    started: float = 0.0
    ended: float = 0.0
    router_gen: tuple[int, int] = (0, 0)  # router generation at start and at end
    status: int | None = None  # HTTP status, None when no response arrived
    text: str = ""
    finish_reason: str = ""
    cause: str = ""  # "" on success; else e.g. "http_503:no_healthy_workers", "stream_error:...", "connection"
    # a conversation's round (soak_conversations.py): which conversation, its round number (from
    # 1), the generated ids the next round's prompt carries, and usage's cached_tokens
    conversation: int | None = None
    round: int = 0
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return not self.cause


@dataclass
class LoadState:
    """Shared between the clients and the fault runner."""

    base_url: str
    router_gen: int = 0
    stop_at: float = 0.0  # the load runs until then, and on while faults are still being injected
    think: float = 0.0  # seconds each client and conversation waits after a request before the next
    hard_stop_at: float = 0.0  # ... but never past this
    faults_done: bool = False

    def running(self) -> bool:
        now = time.monotonic()
        return now < self.hard_stop_at and (now < self.stop_at or not self.faults_done)
    results: list[Result] = field(default_factory=list)
    in_flight: int = 0
    next_id: int = 0


def draw_request(rng: random.Random, rid: int, client: int) -> Result:
    long_prompt = rng.random() < 0.2
    n_prompt = rng.randint(100, 400) if long_prompt else rng.randint(3, 60)
    greedy = rng.random() < 0.6
    grammar = None
    if rng.random() < GRAMMAR_SHARE:
        grammar = ("regex", WORDS_REGEX) if rng.random() < 0.5 else (
            "json_schema", json.dumps(random_schema(rng.randrange(1 << 20)), sort_keys=True))
    r = Result(
        id=rid, client=client,
        prompt=[rng.choice(PRINTABLE) for _ in range(n_prompt)],
        max_tokens=rng.choice((4, 8, 16, 32, 64, 96)),
        temperature=0.0 if greedy else 0.8,
        seed=None if greedy else rng.randrange(1 << 31),
        stream=rng.random() < 0.5,
        grammar=grammar,
    )
    if r.stream and rng.random() < STREAM_INTERVAL_SHARE:
        r.stream_interval = rng.choice((2, 4, 8))
    return r


def _body(r: Result) -> dict:
    body = {"model": "builtin-random", "prompt": r.prompt, "max_tokens": r.max_tokens,
            "temperature": r.temperature, "stream": r.stream}
    if r.seed is not None:
        body["seed"] = r.seed
    if r.stream_interval > 1:
        body["stream_interval"] = r.stream_interval
    if r.grammar is not None:
        kind, source = r.grammar
        if kind == "regex":
            body["structured_outputs"] = {"regex": source}
        else:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "soak", "schema": json.loads(source)}}
    if r.conversation is not None:  # the next round needs the reply's ids, the check its usage
        body["return_token_ids"] = True
        if r.stream:
            body["stream_options"] = {"include_usage": True}
    return body


def _usage(r: Result, payload: dict) -> None:
    details = (payload.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        r.cached_tokens = details["cached_tokens"]


def _error_cause(prefix: str, payload: dict) -> str:
    err = payload.get("error") or {}
    return f"{prefix}:{err.get('code') or err.get('type') or 'unknown'}"


async def _send(http: httpx.AsyncClient, state: LoadState, r: Result) -> None:
    url = state.base_url + "/v1/completions"
    if not r.stream:
        resp = await http.post(url, json=_body(r))
        r.status = resp.status_code
        payload = resp.json()
        if resp.status_code != 200:
            r.cause = _error_cause(f"http_{resp.status_code}", payload)
            return
        choice = payload["choices"][0]
        r.text, r.finish_reason = choice["text"], choice["finish_reason"] or ""
        r.token_ids = choice.get("token_ids") or []
        _usage(r, payload)
        return
    async with http.stream("POST", url, json=_body(r)) as resp:
        r.status = resp.status_code
        if resp.status_code != 200:
            r.cause = _error_cause(f"http_{resp.status_code}", json.loads(await resp.aread()))
            return
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                r.cause = _error_cause("stream_error", chunk)
                return
            _usage(r, chunk)
            for choice in chunk.get("choices", []):
                r.text += choice.get("text", "")
                r.token_ids += choice.get("token_ids") or []
                if choice.get("finish_reason"):
                    r.finish_reason = choice["finish_reason"]
        if not done:
            r.cause = "stream_truncated"


async def send_recorded(http: httpx.AsyncClient, state: LoadState, r: Result) -> bool:
    """Send r until the router takes it (a refused connection is not a send), record how it
    ended in state.results; False when the load stopped before it could be sent."""
    while state.running():
        r.started, r.router_gen = time.monotonic(), (state.router_gen, state.router_gen)
        state.in_flight += 1
        try:
            await _send(http, state, r)
        except httpx.ConnectError:
            state.in_flight -= 1
            await asyncio.sleep(0.2)  # router restarting: not sent yet, try again
            continue
        except httpx.TimeoutException:
            r.cause = "client_timeout"  # the request hung past its deadline
        except (httpx.TransportError, json.JSONDecodeError) as e:
            r.cause = f"connection:{type(e).__name__}"
        state.in_flight -= 1
        r.ended, r.router_gen = time.monotonic(), (r.router_gen[0], state.router_gen)
        state.results.append(r)
        return True
    return False


async def client_loop(state: LoadState, client: int, seed: int, request_timeout: float) -> None:
    rng = random.Random(seed * 1000 + client)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout + 15, connect=2)) as http:
        while state.running():
            r = draw_request(rng, state.next_id, client)
            state.next_id += 1
            await send_recorded(http, state, r)
            await asyncio.sleep(state.think)
