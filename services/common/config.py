"""Every configuration knob of every pdmesh service, in one place.

Each knob is a CLI flag with a `PDMESH_*` environment twin (the flag wins) and a documented
default; `--help` of each service lists all three. Each service's settings are a frozen,
typed dataclass generated from its flag table (`PrefillSettings`, `DecodeSettings`,
`RouterSettings`), built once at start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import Any


def _bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


@dataclass(frozen=True)
class Flag:
    name: str  # without leading dashes, e.g. "inflight-timeout"
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Sequence[Any] | None = None
    repeatable: bool = False  # may be given several times; env twin is comma-separated
    # a repeatable flag that also takes several values after one name (vLLM's nargs="+")
    several: bool = False
    # other names for it, vLLM's or SGLang's, that a command line written for them uses; for a
    # switch, `aliases` turn it on and `off_names` off
    aliases: tuple[str, ...] = ()
    off_names: tuple[str, ...] = ()

    @property
    def env(self) -> str:
        return "PDMESH_" + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


# --- knobs of every service ------------------------------------------------------------------
LOG_FLAGS = [
    Flag("log-level", str, "info", "debug, info, warning or error"),
    Flag("log-format", str, "auto",
         "auto (human-readable lines when stderr is a terminal, JSON lines otherwise), console or json",
         choices=("auto", "console", "json")),
]


def log_requests_flag(meaning: str) -> Flag:
    """--log-requests, a service's routine lines per request, with vLLM's names for it."""
    return Flag("log-requests", bool, True, meaning, aliases=("enable-log-requests",),
                off_names=("disable-log-requests",))


# vLLM's --tokenizer: the router and both workers read the same folder
TOKENIZER_FLAG = Flag("tokenizer", str, "",
                      "Hugging Face folder of the tokenizer (and its chat template), as vLLM's flag, when it is not "
                      "the model folder's; empty: the model's. Give the router and both workers the same one")


# vLLM's LoRA flags: the router lists and accepts the adapters, both workers load and compute them
LORA_FLAGS = [
    Flag("enable-lora", bool, False, "serve LoRA adapters (vLLM's flag): needed by --lora-modules"),
    Flag("lora-modules", str, [],
         "LoRA adapters served beside the model, as vLLM's flag: name=path (a PEFT adapter folder) or "
         "'{\"name\": ..., \"path\": ...}', several after one flag or repeated (env: comma-separated); a "
         "request names one as its model. Give the router and both workers the same list",
         repeatable=True, several=True),
]
MAX_LORA_RANK_FLAG = Flag("max-lora-rank", int, 16,
                          "the highest rank of a LoRA adapter this worker loads (vLLM's flag); a higher one stops "
                          "the start")


# --- knobs shared by both workers ------------------------------------------------------------
WORKER_FLAGS = [
    log_requests_flag(
        "a JSON line when a request arrives and one when it ends (prefill: 'prefill request' / 'prefill "
        "done'; decode: 'decode request' / 'decode done'), at info; off, only what is not routine (a failed "
        "room, an abort, a failed transfer, the watchdog's evictions) is logged, and the metrics count "
        "every request either way."),
    Flag("model", str, "builtin", "Hugging Face model folder, or 'builtin' for the built-in tiny model"),
    TOKENIZER_FLAG,
    *LORA_FLAGS,
    MAX_LORA_RANK_FLAG,
    Flag("device", str, "auto", "torch device: cpu, cuda:N, or auto (first GPU if any, else cpu)"),
    Flag("dtype", str, "auto", "float32, bfloat16, float16, or auto (float32 on cpu, bfloat16 on cuda)",
         choices=("auto", "float32", "bfloat16", "float16")),
    Flag("host", str, "127.0.0.1", "address the gRPC and HTTP servers bind to"),
    Flag("worker-id", str, "", "stable name of this worker in logs and metrics (default: role-host-port)"),
    Flag("served-model-name", str, "",
         "the model's name in metrics (model_name label), as clients and the router call it; set it like "
         "the router's flag of the same name (of a comma-separated list, the first; default: the model "
         "folder's name)"),
    Flag("page-size", int, 16, "tokens per KV page", aliases=("block-size",)),
    Flag("num-pages", int, 0,
         "KV pages in this worker's pool (allocated once at start); 0: sized from --kv-cache-memory-bytes, else "
         "on CUDA from --gpu-memory-utilization, else 4096"),
    Flag("kv-cache-memory-bytes", int, 0,
         "bytes of KV cache to allocate, on any device (vLLM's flag); 0: not set. --num-pages wins"),
    Flag("gpu-memory-utilization", float, 0.9,
         "on CUDA without --num-pages or --kv-cache-memory-bytes: the fraction of the device's memory for "
         "weights, activations and KV cache together (vLLM's meaning)"),
    Flag("max-model-len", int, 0,
         "longest prompt + completion served, in tokens (vLLM's flag); 0: the model's max_position_embeddings"),
    Flag("watchdog-interval", float, 1.0, "seconds between watchdog sweeps (runs even when idle)"),
    Flag("prefix-cache", bool, True,
         "on: full KV pages stay cached after their request and a later prompt with the same prefix "
         "reuses them (evicted, least recently used first, when the pool needs pages); off: no reuse",
         aliases=("enable-prefix-caching",), off_names=("no-enable-prefix-caching", "disable-radix-cache")),
    Flag("kv-checksum", bool, True,
         "on: prefill sends an XXH3-64 checksum of each room's KV pages and aux row, decode verifies it "
         "before the room's first step and fails the room (DATA_LOSS, the router fails over) on a mismatch; "
         "off: prefill sends none and decode checks none"),
    Flag("kv-read-held-prefix", bool, True,
         "prefill READs (NIXL) the prompt pages decode holds beyond its own prefix-cache hit (a conversation's "
         "previous prompt and reply) instead of computing them; decode offers them in its Attach, with a KV "
         "checksum per page under --kv-checksum. Off on either side: prefill computes them"),
    Flag("drain-timeout", float, 30.0,
         "seconds a stopping worker (SIGTERM) waits for the rooms it holds to finish or move away while it "
         "refuses new ones and reports NOT_SERVING (the router ejects it and migrates decode streams)"),
    Flag("forward-timeout", float, 300.0,
         "seconds one forward (one chunk, not a whole prompt) may run before its rooms fail and the worker turns NOT_SERVING"),
    Flag("grammar-step-budget", float, 0.2,
         "seconds of CPU one request's grammar may take to compute one token's mask (decode and colocated "
         "prompts); past it that request alone fails (INVALID_ARGUMENT) and the batch goes on; 0: no budget"),
    Flag("faults", str, "", "fault injection spec, e.g. 'delay_forward=5,stall_transfer' (off by default)"),
    *LOG_FLAGS,
    # --- across hosts (docs/transfer.md "Across hosts") ---
    Flag("advertise-host", str, "",
         "address peers use to reach this worker (default: --host, or this host name's address when "
         "--host is a wildcard); shown in /health and logs, and names the interface for "
         "--transfer-net-devices auto. Never 127.0.0.1 outside one host"),
    Flag("transfer-tls", str, "",
         "UCX transports for the KV transfer (sets UCX_TLS), e.g. 'tcp' or 'rc,cuda_copy'; empty: UCX's choice"),
    Flag("transfer-net-devices", str, "",
         "UCX network devices (sets UCX_NET_DEVICES), e.g. 'eth0' or 'mlx5_0:1'; 'auto': the interface "
         "holding --advertise-host; empty: UCX's choice"),
    Flag("transfer-tcp-user-timeout", float, 10.0,
         "seconds unacknowledged KV data may wait before a WRITE over TCP fails (sets UCX_TCP_USER_TIMEOUT): "
         "how fast prefill notices a partitioned decode; 0 leaves Linux's retries (minutes)"),
    Flag("internal-token-file", str, "",
         "file holding the shared secret every internal gRPC call must carry (Health excepted); wins over "
         "--internal-token; neither set: no authentication"),
    Flag("internal-token", str, "",
         "the shared secret itself; give it through the env twin (a flag shows in the process list)"),
    Flag("allow-insecure-bind", bool, False,
         "start even when --host is not a loopback address and no internal token is set (anyone who reaches "
         "the port may then use the worker); without it such a worker refuses to start"),
]

PREFILL_FLAGS = [
    *WORKER_FLAGS,
    Flag("grpc-port", int, 50051, "gRPC port (Prefill, KVBootstrap, Health)"),
    Flag("http-port", int, 8081, "HTTP port (/metrics, /health)"),
    Flag("chunked-prefill-size", int, 512,
         "token budget of one prefill forward (the prompts of one batch together); longer prompts are chunked",
         aliases=("max-num-batched-tokens",)),
    Flag("bootstrap-timeout", float, 300.0, "seconds a request may wait in the bootstrap queue for decode to attach"),
    Flag("inflight-timeout", float, 60.0, "seconds a request may stay in the inflight queue (KV being sent)"),
    Flag("kv-read-timeout", float, 5.0,
         "seconds from the start of a READ of decode's held prefix (--kv-read-held-prefix) until it is given up "
         "and those tokens are computed (a frozen decode never answers a READ)"),
]

DECODE_FLAGS = [
    *WORKER_FLAGS,
    Flag("grpc-port", int, 50052, "gRPC port (Decode, Health)"),
    Flag("http-port", int, 8082, "HTTP port (/metrics, /health)"),
    Flag("max-running-requests", int, 64, "largest decode batch", aliases=("max-num-seqs",)),
    Flag("chunked-prefill-size", int, 512,
         "token budget of one local prefill forward for colocated requests (router --mode colocated, or a "
         "PD router's conditional disaggregation, --local-prefill-max-tokens): "
         "longer prompts are chunked between decode steps",
         aliases=("max-num-batched-tokens",)),
    Flag("prealloc-timeout", float, 300.0, "seconds a request may wait in the prealloc queue for KV pages"),
    Flag("transfer-timeout", float, 60.0, "seconds from prefill's forward-done signal until the KV must have arrived"),
    Flag("heartbeat-interval", float, 2.0, "seconds between heartbeats to each prefill this worker waits on"),
    Flag("heartbeat-max-failures", int, 3, "failed heartbeats in a row after which a prefill's rooms fail"),
    Flag("keepalive-interval", float, 1.0,
         "seconds between keep-alive chunks on a Decode stream whose room waits (pages, KV, retracted)"),
]

ROUTER_FLAGS = [
    Flag("host", str, "127.0.0.1", "address the HTTP server binds to"),
    Flag("port", int, 8000, "HTTP port of the OpenAI-compatible API"),
    Flag("model", str, "builtin", "model folder for the tokenizer and chat template, or 'builtin'"),
    TOKENIZER_FLAG,
    *LORA_FLAGS,
    Flag("allow-runtime-lora-updating", bool, False,
         "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA updates, which "
         "it allows with VLLM_ALLOW_RUNTIME_LORA_UPDATING): the router's adapter list is then what every "
         "worker serves, brought to a restarted worker at its next health probe. Needs --enable-lora and "
         "--processes 1"),
    Flag("served-model-name", str, [],
         "model names clients may send, repeatable (env: comma-separated); the first names responses and "
         "labels metrics (default: the model folder's name)", repeatable=True),
    Flag("max-model-len", int, 0,
         "longest prompt + completion accepted, in tokens (vLLM's flag; longer requests get 400); 0: the "
         "model's max_position_embeddings. Give the workers the same value"),
    Flag("chat-template", str, "",
         "a file holding a Jinja chat template, or the template itself, used instead of the model's"),
    Flag("generation-config", str, "auto",
         "auto: the model folder's generation_config.json sampling defaults apply to requests that do not "
         "set them (vLLM's rule); vllm: none; or a folder holding a generation_config.json"),
    Flag("override-generation-config", str, "",
         "a JSON object of sampling defaults that sets or replaces --generation-config's, as vLLM's flag: "
         "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens (the default max_tokens); "
         "e.g. '{\"temperature\": 0.6, \"top_p\": 0.95}'. A request's own value still wins"),
    Flag("prefill", str, [], "prefill worker host:port (repeatable)", repeatable=True),
    Flag("decode", str, [], "decode worker host:port (repeatable)", repeatable=True),
    Flag("policy", str, "cache_aware",
         "worker selection policy; cache_aware: the worker holding the longest prefix of the request "
         "unless load is imbalanced (docs/router.md \"Cache-aware routing\"), else least loaded",
         choices=("cache_aware", "round_robin", "least_loaded", "power_of_two")),
    Flag("cache-threshold", float, 0.3,
         "cache_aware: the fraction of a prompt's tokens a worker must hold (as far as the router knows) "
         "for the prefix to decide where the request goes; below it the least loaded worker gets it"),
    Flag("balance-abs-threshold", int, 32,
         "cache_aware: load is imbalanced, and the least loaded worker gets the request whatever it holds, "
         "when the busiest worker's in-flight load exceeds the idlest's by more than this..."),
    Flag("balance-rel-threshold", float, 1.5,
         "...and is more than this many times the idlest's (both must hold)"),
    Flag("prefix-index-max-pages", int, 65536,
         "cache_aware: page keys the router remembers per worker (about 150 bytes each; never more than "
         "the worker's KV pool holds); the least recently routed go first"),
    Flag("local-prefill-max-tokens", int, 512,
         "pd + cache_aware: a request whose chosen decode already holds (as far as the router knows) at "
         "least one page of its prompt and all but at most this many tokens skips prefill: decode computes "
         "the rest itself, no KV transfer (conditional disaggregation, docs/router.md); the default is one "
         "chunk, the workers' --chunked-prefill-size; 0: every request goes through prefill"),
    Flag("mode", str, "pd",
         "pd: prefill and decode workers, KV over NIXL; colocated: decode workers only, each computing "
         "the prompt itself (the baseline PD is measured against; --prefill is ignored)",
         choices=("pd", "colocated")),
    log_requests_flag(
        "a JSON line per request as it ends ('request done': status, tokens, TTFT, latency, attempts, "
        "migrations) and one per attempt on a worker pair ('attempt'), both at info; off, the router keeps "
        "its other lines (a failed request, fail-overs, refusals by the workers, the pool's changes) and its "
        "metrics, and spends less CPU per request (docs/bench.md)."),
    Flag("enable-force-include-usage", bool, False,
         "every streamed response ends with a usage chunk, as if the request had asked for one "
         "(stream_options.include_usage), as vLLM's flag: for proxies and billing that count tokens from "
         "streams whatever the client sent"),
    Flag("return-tokens-as-token-ids", bool, False,
         "logprobs name each token 'token_id:N' instead of its text unless a request says otherwise "
         "(its return_tokens_as_token_ids), as vLLM's flag: tokens whose bytes are not whole characters "
         "stay identifiable"),
    Flag("tool-call-parser", str, "auto",
         "format of tool calls in the model's replies: hermes (<tool_call> JSON: Hermes, Qwen2.5/3), "
         "llama3_json (Llama 3.1+ JSON), auto (detected from the chat template) or none (tools only with "
         "tool_choice none)",
         choices=("auto", "none", "hermes", "llama3_json")),
    Flag("enable-auto-tool-choice", bool, True,
         "serve tool_choice auto (the default when a request has tools: the reply is free and parsed for "
         "calls in --tool-call-parser's format), as vLLM's flag; --no-enable-auto-tool-choice refuses it with "
         "a 400, as vLLM without the flag, while required, a named function and none still work"),
    Flag("responses-store-size", int, 0,
         "Responses API responses kept in memory for previous_response_id and GET/DELETE /v1/responses/{id} "
         "(vLLM keeps them with VLLM_ENABLE_RESPONSES_API_STORE), the least recently used dropped first; with "
         "it a request's `store` defaults to true, as OpenAI's. 0: stateless, `store: true` and "
         "previous_response_id are 400s. Needs --processes 1 (the store is one process's memory)"),
    Flag("responses-store-bytes", int, 256 << 20,
         "the most bytes (their JSON text) the stored responses take together (--responses-store-size)"),
    Flag("scheduling-policy", str, "fcfs",
         "the order in which the workers take waiting requests, as vLLM's flag: fcfs, arrival order (a request's "
         "priority must be 0); priority, a request's `priority` first (lower is sooner; ties in arrival order), "
         "and when decode's KV pool runs dry the highest value, latest arrival is retracted first",
         choices=("fcfs", "priority")),
    Flag("seed", int, -1,
         "the seed of the generator that gives a request without a `seed` its own, as vLLM's flag: the same "
         "requests in the same order then sample the same text after a restart; negative: the OS's randomness "
         "(each --processes process seeds with this plus its index)"),
    Flag("response-role", str, "assistant",
         "the role of a chat reply (message.role, the first delta's role) when the chat template adds a "
         "generation prompt, as vLLM's flag; a request that continues its last message (continue_final_message, "
         "add_generation_prompt false) gets that message's role"),
    Flag("max-logprobs", int, 20,
         "the most alternatives a request may ask for per token (logprobs, top_logprobs, prompt_logprobs), as "
         "vLLM's flag: more is a 400 naming the field; 0 to 20 (the workers return at most 20)"),
    Flag("reasoning-parser", str, "",
         "tell a reasoning model's thinking (<think>...</think>) apart from its answer in chat replies, as "
         "vLLM's flag: deepseek_r1 (the reply starts thinking; DeepSeek-R1, QwQ), qwen3, deepseek_v3 or glm45 "
         "(thinking when the reply opens <think> or the prompt leaves one open; Qwen3, DeepSeek-V3.1, "
         "GLM-4.5); the thinking goes to message.reasoning and reasoning_content; empty: replies are left whole",
         choices=("", "deepseek_r1", "deepseek-r1", "qwen3", "deepseek_v3", "deepseek-v3", "glm45")),
    Flag("api-key", str, "",
         "require 'Authorization: Bearer KEY' (or 'x-api-key: KEY', as Anthropic's clients send it) when set; "
         "several keys, comma-separated (or a JSON list), are each accepted, as vLLM's flag takes several: a "
         "rotation accepts the old key and the new one until clients have moved"),
    Flag("allowed-origins", str, ["*"],
         "origins whose web pages may call the API from a browser (CORS), as vLLM's flag: * is every "
         "origin, an empty value none.", repeatable=True),
    Flag("allowed-methods", str, ["*"], "HTTP methods a cross-origin request may use (CORS); * is all.",
         repeatable=True),
    Flag("allowed-headers", str, ["*"], "request headers a cross-origin request may send (CORS); * is any.",
         repeatable=True),
    Flag("allow-credentials", bool, False,
         "cross-origin requests may carry cookies and HTTP authentication (CORS); with --allowed-origins * "
         "the response names the request's origin instead of *"),
    Flag("ssl-keyfile", str, "",
         "the TLS private key (PEM); with --ssl-certfile the router serves HTTPS (TLS 1.2 or later) instead of "
         "plain HTTP. A handshake not done within --header-timeout is dropped"),
    Flag("ssl-certfile", str, "", "the TLS certificate chain (PEM) that goes with --ssl-keyfile"),
    Flag("ssl-ca-certs", str, "",
         "CA certificates (PEM) that client certificates are verified against (with --ssl-cert-reqs)"),
    Flag("ssl-cert-reqs", int, 0,
         "client certificates over TLS: 0 not asked for, 1 verified when given, 2 required "
         "(Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED); 1 and 2 need --ssl-ca-certs"),
    Flag("root-path", str, "",
         "the path prefix a reverse proxy serves the router under (e.g. /llm), as vLLM's flag: requests are "
         "answered with or without it (a proxy that strips it, or one that passes it on), and /openapi.json "
         "names it as the server's URL so /docs calls the API through the proxy"),
    Flag("disable-fastapi-docs", bool, False,
         "no /openapi.json and no /docs (Swagger UI): both answer 404, as vLLM's flag, for a deployment that "
         "does not publish its schema"),
    Flag("enable-ssl-refresh", bool, False,
         "serve a renewed certificate without a restart: the key, certificate and CA files are looked at every "
         "second, and when one changed the TLS context is built again for new connections (a pair that does "
         "not load, half-written say, leaves the previous one served and is tried again at the next change)"),
    Flag("request-timeout", float, 600.0, "seconds after which a request fails with 504"),
    Flag("shutdown-timeout", float, 60.0,
         "seconds a stopping router (SIGTERM) keeps serving the requests it holds, streams included, while "
         "it admits no new ones (503) and /health reports draining; what is left after it is cut. Keep it "
         "under the termination grace period minus any preStop delay"),
    Flag("max-concurrent-requests", int, 256,
         "the router's admission budget, in choices (what the workers hold: a request with n = 4 takes 4): "
         "a request that would take it past the budget gets 429, one with n above the whole budget 400"),
    Flag("max-body-bytes", int, 8 * 1024 * 1024, "largest request body in bytes; larger ones get 413 unparsed"),
    Flag("header-timeout", float, 10.0,
         "seconds a connection may take from its first byte (or from opening) to the end of a request's "
         "headers; past it the router answers 408 and closes it"),
    Flag("max-header-bytes", int, 64 * 1024,
         "largest request line plus headers of one request, in bytes, and what a chunked body's framing "
         "and trailers may add to its content; past it the router answers 431 and closes the connection "
         "(without a bound they are buffered whole, whatever their size)",
         aliases=("h11-max-incomplete-event-size",)),
    Flag("body-timeout", float, 30.0,
         "seconds a request body may take to arrive in full, counted from the end of its headers; past it "
         "408 and the connection is closed (no admission slot is held while a body arrives)"),
    Flag("max-body-reads", int, 512,
         "request bodies the router reads at once; beyond it new requests get 429 without their body read"),
    Flag("client-write-timeout", float, 30.0,
         "seconds a response may stay blocked on a client that reads nothing; past it the connection is "
         "cut, the request's rooms are aborted and its admission slot freed"),
    Flag("max-buffered-tokens", int, 1024,
         "tokens per choice a stream may hold in the router, generated but not yet written to a client that "
         "reads too slowly (past the socket's own buffers); past it the client is cut off as a stalled reader"),
    Flag("keep-alive-timeout", float, 75.0, "seconds an idle keep-alive connection stays open"),
    Flag("max-connections", int, 4096,
         "open client connections (per router process); at the limit a new one closes the longest-idle one (between requests "
         "or still sending headers), or is refused when none is idle. The router raises its open-files limit to "
         "hold them (fewer, with a warning, where the hard limit is lower)"),
    Flag("max-grammar-bytes", int, 1024 * 1024,
         "largest grammar one request may carry (a response_format / structured_outputs schema, regex or "
         "grammar, or the tools' parameter schemas of a forced tool call); larger ones get 400"),
    Flag("max-request-worker-bytes", int, 16 * 1024 * 1024,
         "most bytes one request may send the workers, n × (prompt ids + grammar): every choice is a "
         "call on a worker's lane; more gets 400"),
    Flag("grammar-compile-budget", float, 2.0,
         "seconds of CPU compiling a request's grammar over the model's tokenizer may take before the request "
         "gets 400 (measured on a router thread, once per distinct grammar)"),
    Flag("grammar-mask-budget", float, 0.1,
         "seconds of CPU a request's grammar may take for its first token's mask before the request gets 400 "
         "(a short regex like ((a{60}){60}){60} costs a second per token on every worker)"),
    Flag("health-check-interval", float, 1.0, "seconds between gRPC health probes of each worker"),
    Flag("health-check-timeout", float, 1.0, "seconds one gRPC health probe may take"),
    Flag("health-failure-threshold", int, 2, "failed probes in a row that eject a worker (one success re-admits)"),
    Flag("max-migrations", int, 2,
         "times one request may move to another worker pair after its first token when its decode fails, "
         "is ejected or stalls (0: never; the stream then ends with an error)"),
    Flag("stream-stall-timeout", float, 30.0,
         "seconds a Decode stream may stay silent (no tokens, no keep-alive) before the router treats its "
         "decode as stalled and fails over or migrates"),
    Flag("stream-keepalive-interval", float, 15.0,
         "seconds a stream may stay silent (a long prefill or a wait for a pair before its first token, a "
         "stalled decode, a migration, a retraction) before the router writes an SSE comment (': keep-alive'), "
         "which clients skip, so that proxies and load balancers in between keep the connection open; again "
         "every interval while it lasts; before the first token the status (200) goes out with the first "
         "comment, and a later failure is an error event (0: never)"),
    Flag("internal-token-file", str, "",
         "file holding the shared secret presented on every call to the workers"),
    Flag("internal-token", str, "",
         "the shared secret itself; give it through the env twin (a flag shows in the process list)"),
    Flag("canary-interval", float, 0.0,
         "seconds a (prefill, decode) pair may stay idle before the router sends a one-token canary "
         "request through it (a real attach and KV move); a failed or slow canary marks the pair, a "
         "passing one clears it; marked pairs are re-tested every interval (0: no canary; "
         "deploy/pdmesh.env and the Kubernetes manifests set 30)"),
    Flag("canary-timeout", float, 10.0, "seconds one canary request may take before it counts as failed"),
    Flag("pair-hold", float, 30.0,
         "seconds a (prefill, decode) pair whose KV path failed stays avoided after its latest failure, "
         "when no canary clears it sooner (0: until a canary or a request on it passes)"),
    Flag("dns-refresh-interval", float, 5.0,
         "seconds between re-resolving worker names (a headless Service name stands for all its pods)"),
    Flag("worker-lane", bool, True,
         "send Prefill / Decode calls to each worker over one multiplexed stream (the lane) instead of "
         "one gRPC call each (false: one call each; a worker without the lane gets that anyway)"),
    Flag("worker-keepalive-time", float, 2.0,
         "seconds without a frame from a worker before the router pings it (HTTP/2 keep-alive on each "
         "connection to a worker)"),
    Flag("worker-keepalive-timeout", float, 2.0,
         "seconds a worker has to answer a keep-alive ping; a worker that answers nothing is taken as "
         "gone (frozen, or cut off): its lane's calls fail UNAVAILABLE and fail over or migrate"),
    Flag("worker-lane-client", str, "h2",
         "what carries each lane: h2, the router's own HTTP/2 connection in its event loop (a worker "
         "address that is not host:port uses grpc); grpc, a grpc.aio stream (gRPC C-core's threads)",
         choices=("h2", "grpc")),
    Flag("processes", int, 1,
         "router processes serving the port together (SO_REUSEPORT), under one supervisor that restarts "
         "any that dies; they share admission (--max-concurrent-requests is for all), each worker's "
         "in-flight load and ejections, and one /metrics. More than 1 needs as many free cores to help"),
    Flag("process-stall-timeout", float, 10.0,
         "with --processes > 1: seconds a router process's event loop may go without a heartbeat (every "
         "20 ms) before the supervisor kills and replaces it (a frozen process would keep its share of "
         "new connections unanswered)"),
    Flag("process-start-timeout", float, 60.0,
         "with --processes > 1: seconds a router process may take from its start to its first heartbeat "
         "before the supervisor kills and replaces it (one frozen or stuck while starting)"),
    *LOG_FLAGS,
]


# Kubernetes injects `<SERVICE>_PORT=tcp://10.0.0.1:8000` (and `udp://`, `sctp://`) into every pod
# for every Service in the namespace unless the pod sets `enableServiceLinks: false`; a Service
# named `pdmesh` therefore sets PDMESH_PORT, the router's --port twin. Such a value is never a
# setting someone meant for us.
SERVICE_LINK = re.compile(r"(tcp|udp|sctp)://[^\s/]+:\d+")
_ignored_env: list[str] = []


@dataclass(frozen=True)
class _MalformedTwin:
    """An env twin that did not parse; it only matters if its flag is not given."""

    flag: Flag
    raw: str
    reason: str

    @property
    def service_link(self) -> bool:
        return bool(SERVICE_LINK.fullmatch(self.raw.strip()))


def list_items(text: str) -> list[str]:
    """A repeatable flag's values in one text: comma-separated, or a JSON list of strings (how vLLM
    takes --allowed-origins). A bracketed text that is not such a list ("[::1]:50051") is one value."""
    stripped = text.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        return [stripped]  # a JSON object is one value (vLLM's --lora-modules form)
    if stripped.startswith("[") and stripped.endswith("]"):
        try:
            items = json.loads(stripped)
        except ValueError:
            items = None
        if isinstance(items, list) and all(isinstance(x, str) for x in items):
            return [x.strip() for x in items if x.strip()]
    return [x.strip() for x in text.split(",") if x.strip()]


def _parse_env(flag: Flag, raw: str) -> Any:
    if flag.repeatable:
        return [flag.type(x) for x in list_items(raw)]
    return (_bool if flag.type is bool else flag.type)(raw)


def _from_env(flag: Flag) -> Any:
    raw = os.environ.get(flag.env)
    if raw is None:
        return flag.default
    try:
        return _parse_env(flag, raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        return _MalformedTwin(flag, raw, str(e))


def ignored_env_twins() -> list[str]:
    """Env twins this process ignored as Kubernetes service links (one sentence each), for the
    service to log once logging is set up."""
    return list(_ignored_env)


def _resolve_malformed(parser: argparse.ArgumentParser, bad: _MalformedTwin) -> Any:
    """A twin that did not parse, for a flag not given: a service link falls back to the
    default (and is reported); anything else stops the service with a message naming it."""
    f = bad.flag
    if bad.service_link:
        notice = (f"{f.env}={bad.raw!r} looks like a Kubernetes service link, not a setting: "
                  f"ignored, --{f.name} is {f.default!r} (set enableServiceLinks: false)")
        if notice not in _ignored_env:  # a service parses its command line twice (COMMANDS): one notice
            _ignored_env.append(notice)
        return f.default
    parser.error(f"environment variable {f.env}={bad.raw!r} is not a valid value for --{f.name} "
                 f"({bad.reason}); fix or unset it, or give --{f.name}")


def build_parser(prog: str, description: str, flags: Sequence[Flag]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for flag in flags:
        kwargs: dict[str, Any] = {
            "dest": flag.dest,
            "default": _from_env(flag),
            "help": f"{flag.help} [env {flag.env}; default: {flag.default!r}]",
            "type": _bool if flag.type is bool else flag.type,
        }
        if flag.choices:
            kwargs["choices"] = flag.choices
        if flag.repeatable:
            kwargs["action"] = "extend" if flag.several else "append"
            kwargs["default"] = None
            if flag.several:
                kwargs["nargs"] = "+"
        if flag.type is bool:  # a switch, as vLLM's and SGLang's: alone it turns on, --no-NAME off
            kwargs.update(nargs="?", const=True, metavar="{true,false}")
        parser.add_argument(f"--{flag.name}", *(f"--{n}" for n in flag.aliases), **kwargs)
        if flag.type is bool:
            parser.add_argument(f"--no-{flag.name}", *(f"--{n}" for n in flag.off_names), dest=flag.dest,
                                action="store_false", help=f"--{flag.name} false", default=kwargs["default"])
    return parser


def parse_args(prog: str, description: str, flags: Sequence[Flag], argv: Sequence[str] | None = None):
    """Flags win; an env twin counts only for a flag not given, so a malformed twin (a Kubernetes
    service link in PDMESH_PORT) never stops a service that was given the flag."""
    parser = build_parser(prog, description, flags)
    args = parser.parse_args(argv)
    for f in flags:
        value = getattr(args, f.dest)
        if f.repeatable:
            # command-line values replace the env twin; commas separate values in both (or a JSON list)
            values = _from_env(f) if value is None else value
            if isinstance(values, _MalformedTwin):
                values = _resolve_malformed(parser, values)
            setattr(args, f.dest, [x for v in values for x in list_items(str(v))])
        elif isinstance(value, _MalformedTwin):
            setattr(args, f.dest, _resolve_malformed(parser, value))
        elif f.choices and value not in f.choices:
            parser.error(f"environment variable {f.env}={value!r} is not one of {list(f.choices)}")
    return args


def _settings_class(name: str, flags: Sequence[Flag], extra: Sequence[tuple[str, type, Any]] = ()) -> type:
    """A frozen dataclass with one typed field per flag (its `dest`, defaulting to the flag's
    default), so a typo in a setting's name fails at once and nothing can change a setting after
    start-up. `extra`: (name, type, default) of settings that are not flags."""
    fields = [(f.dest, list[f.type] if f.repeatable else f.type,
               field(default_factory=lambda f=f: list(f.default)) if f.repeatable else field(default=f.default))
              for f in flags]
    fields += [(n, t, field(default=d)) for n, t, d in extra]
    cls = make_dataclass(name, fields, frozen=True)
    cls.FLAGS = tuple(flags)
    cls.from_args = classmethod(lambda c, args: c(**{k: v for k, v in vars(args).items() if k in c.__dataclass_fields__}))
    cls.__doc__ = f"Settings of one service, generated from its flag table ({len(flags)} flags)."
    return cls


# Each service's command line, answerable from this module alone: a service's own modules load
# torch and NIXL (seconds, a minute on a loaded machine) before argparse could print --help or
# refuse a bad flag, so each `__main__` parses first (`parse_command_line`) and imports after.
COMMANDS = {
    "prefill": ("python -m services.prefill",
                "pdmesh prefill worker: computes prompts' KV cache and sends it to decode over NIXL.",
                PREFILL_FLAGS),
    "decode": ("python -m services.decode",
               "pdmesh decode worker: receives prompts' KV from prefill over NIXL and generates tokens.",
               DECODE_FLAGS),
    "router": ("python -m services.router",
               "pdmesh router: the OpenAI-compatible HTTP API in front of prefill and decode workers "
               "(tokenization, chat template, worker selection, retries, streaming).",
               ROUTER_FLAGS),
}


def parse_command_line(service: str, argv: Sequence[str] | None = None):
    """`service`'s flags (and env twins) parsed; --help and a bad flag exit here, as argparse does."""
    prog, description, flags = COMMANDS[service]
    return parse_args(prog, description, flags, argv)


PrefillSettings = _settings_class("PrefillSettings", PREFILL_FLAGS)
DecodeSettings = _settings_class("DecodeSettings", DECODE_FLAGS)
# With --processes N the supervisor tells each router process its place and their shared folder
# (services/router/processes.py): settings of the process, not flags.
RouterSettings = _settings_class("RouterSettings", ROUTER_FLAGS, extra=(("process_index", int, 0), ("shared_dir", str, "")))


def parse_settings(cls: type, prog: str, description: str, argv: Sequence[str] | None = None):
    """Flags, then their env twins, then defaults -> an instance of `cls` (e.g. PrefillSettings)."""
    return cls(**vars(parse_args(prog, description, cls.FLAGS, argv)))


def service_settings(service: str, cls: type, argv: Sequence[str] | None = None):
    """`parse_settings` with the service's own program name and description (`COMMANDS`)."""
    prog, description, _ = COMMANDS[service]
    return parse_settings(cls, prog, description, argv)
