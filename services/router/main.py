"""Router process: parse flags (each with a PDMESH_* env twin), load the tokenizer, serve HTTP."""

from __future__ import annotations

import asyncio
import gc
import ssl
import sys
from dataclasses import replace

import uvicorn

from services.common.bind_guard import EXIT_CONFIG
from services.common.config import RouterSettings, ignored_env_twins, parse_command_line
from services.common.grpc_server import configure_internal_token
from services.common.listening import listening_socket
from services.common.logging_setup import configure_logging, get_logger
from services.common.open_files import RESERVED, connections_within, raise_soft_limit, reserved_within
from services.common.parent_death import die_with
from services.router.app import create_app
from services.router.connection_guard import ConnectionLimits, guarded_protocol
from services.router.discovery import split_host_port
from services.router.processes import STOP_MARGIN, Supervisor, child_identity
from services.router.tls import server_context, tls_server
from services.router.tls_refresh import CertificateRefresher


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_command_line("router", argv)
    child = child_identity()  # (index, shared folder, supervisor pid) in one of --processes N
    if child is not None:
        die_with(child[2])
    name = f"router-{args.host}-{args.port}" + (f"-p{child[0]}" if child else "")
    configure_logging(args.log_level, args.log_format, service="router", worker=name)
    log = get_logger("router")
    for notice in ignored_env_twins():
        log.warning(notice)
    if not args.decode or (args.mode == "pd" and not args.prefill):
        log.error("at least one --decode and (in --mode pd) one --prefill worker address are required")
        sys.exit(2)
    if args.mode == "colocated" and args.prefill:
        log.warning("--mode colocated: the --prefill workers are not used", prefill=args.prefill)
    if (args.request_timeout <= 0 or args.max_concurrent_requests < 1 or args.max_body_bytes < 1
            or args.shutdown_timeout <= 0):
        log.error("--request-timeout, --max-concurrent-requests, --max-body-bytes and --shutdown-timeout must be "
                  "positive")
        sys.exit(2)
    if (args.max_grammar_bytes < 1 or args.max_request_worker_bytes < 1 or args.grammar_compile_budget <= 0
            or args.grammar_mask_budget <= 0):
        log.error("--max-grammar-bytes, --max-request-worker-bytes, --grammar-compile-budget and "
                  "--grammar-mask-budget must be positive")
        sys.exit(2)
    if args.canary_interval < 0 or args.canary_timeout <= 0 or args.pair_hold < 0:
        log.error("--canary-interval and --pair-hold must be 0 or more and --canary-timeout positive")
        sys.exit(2)
    if min(args.header_timeout, args.body_timeout, args.client_write_timeout, args.keep_alive_timeout) <= 0 or min(
            args.max_body_reads, args.max_buffered_tokens, args.max_connections) < 1:
        log.error("--header-timeout, --body-timeout, --client-write-timeout, --keep-alive-timeout, "
                  "--max-body-reads, --max-buffered-tokens and --max-connections must be positive")
        sys.exit(2)
    if args.max_header_bytes < 1024:
        log.error("--max-header-bytes must be at least 1024 (a request line and the headers every client sends)")
        sys.exit(2)
    if args.max_migrations < 0 or args.stream_stall_timeout <= 0 or args.stream_keepalive_interval < 0:
        log.error("--max-migrations and --stream-keepalive-interval must be 0 or more and --stream-stall-timeout "
                  "positive")
        sys.exit(2)
    if (not 0.0 <= args.cache_threshold <= 1.0 or args.balance_abs_threshold < 0 or args.balance_rel_threshold < 1.0
            or args.prefix_index_max_pages < 1 or args.local_prefill_max_tokens < 0):
        log.error("--cache-threshold must be within [0, 1], --balance-abs-threshold 0 or more, "
                  "--balance-rel-threshold 1 or more, --prefix-index-max-pages positive and "
                  "--local-prefill-max-tokens 0 or more")
        sys.exit(2)
    if (args.processes < 1 or (args.processes > 1 and args.port == 0) or args.process_stall_timeout <= 0
            or args.process_start_timeout <= 0):
        log.error("--processes must be 1 or more, more than 1 needs a fixed --port (not 0), and "
                  "--process-stall-timeout and --process-start-timeout must be positive")
        sys.exit(2)
    try:
        for spec in (*args.prefill, *args.decode):
            split_host_port(spec)
    except ValueError as e:
        log.error(str(e))
        sys.exit(2)
    try:
        tls = server_context(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    except ValueError as e:
        log.error(str(e))
        sys.exit(EXIT_CONFIG)
    if args.enable_ssl_refresh and tls is None:
        log.error("--enable-ssl-refresh needs --ssl-keyfile and --ssl-certfile: there is no certificate to refresh")
        sys.exit(EXIT_CONFIG)
    if args.processes > 1 and child is None:
        sys.exit(Supervisor(argv, args.processes, args.host, args.port, log, args.process_stall_timeout,
                            args.process_start_timeout, stop_grace=args.shutdown_timeout + STOP_MARGIN).run())
    configure_internal_token(args.internal_token_file, args.internal_token)  # presented on every call to the workers
    settings = RouterSettings.from_args(args)
    sockets = None
    if child is not None:
        settings = replace(settings, process_index=child[0], shared_dir=child[1])
        sockets = [listening_socket(args.host, args.port, reuse_port=True)]
    try:
        app = create_app(settings)
    except (ValueError, OSError) as e:  # the tokenizer, chat template or generation defaults the settings name
        log.error(f"cannot set up the served model: {e}", error=type(e).__name__)
        sys.exit(EXIT_CONFIG)
    soft, hard = raise_soft_limit(args.max_connections + RESERVED)
    max_connections = connections_within(args.max_connections, soft)
    if max_connections < args.max_connections:
        log.warning(f"the open-files limit is {soft} (hard {hard}): below --max-connections {args.max_connections} "
                    f"plus {reserved_within(soft)} for the router's own files, so it serves at most "
                    f"{max_connections} connections at once; raise the limit (ulimit -n; compose: ulimits: nofile; "
                    "the container runtime's default) to allow more",
                    open_files=soft, open_files_hard=hard, max_connections=max_connections)
    refresher = None
    if args.enable_ssl_refresh:
        try:  # the files looked at, then read again: a change since the check above is caught by the first look
            refresher = CertificateRefresher(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
        except ValueError as e:
            log.error(str(e))
            sys.exit(EXIT_CONFIG)
        refresher.report = tls_reload_reporter(app.state.router, log)
        tls = refresher.context
    limits = ConnectionLimits(args.header_timeout, args.client_write_timeout, max_connections,
                              args.max_header_bytes)
    config = server_config(app, limits, host=args.host, port=args.port,
                           log_level="debug" if args.log_level == "debug" else "warning",
                           keep_alive_timeout=args.keep_alive_timeout, shutdown_timeout=args.shutdown_timeout,
                           tls=tls)
    # What exists by now (modules, the tokenizer, the app) lives as long as the process: frozen, it
    # is out of the cyclic garbage collector's sight, whose collections otherwise walk all of it
    # again and again under load (measured, non-streamed at c=32: their CPU fell from ~8% of the
    # router's to under 1%).
    gc.freeze()
    DrainingServer(config, app.state.router, handshake_timeout=args.header_timeout,
                   refresher=refresher).run(sockets=sockets)


def tls_reload_reporter(router, log):
    """Each reload's outcome, as a log line, in pdmesh:router_tls_reloads_total and in
    pdmesh:router_tls_reload_failing (1 from a failed reload until one succeeds)."""

    def report(outcome: str, sentence: str) -> None:
        (log.info if outcome == "reloaded" else log.warning)(sentence, outcome=outcome)
        router.metrics.inc(router.metrics.router_tls_reloads, outcome=outcome)
        router.metrics.child(router.metrics.router_tls_reload_failing).set(0 if outcome == "reloaded" else 1)

    return report


def server_config(app, limits: ConnectionLimits, *, host: str, port: int, log_level: str = "warning",
                  keep_alive_timeout: float = 75.0, shutdown_timeout: float | None = None,
                  tls: ssl.SSLContext | None = None) -> uvicorn.Config:
    """uvicorn's configuration for the router's app: its HTTP protocol with the connection guards
    (services/router/connection_guard.py), the router's own logging, HTTPS with `tls`
    (services/router/tls.py). Tests serve the app with it too."""
    router = app.state.router
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits, lambda reason: router.metrics.inc(router.metrics.router_client_cutoffs,
                                                                         reason=reason)),
        host=host,
        port=port,
        log_config=None,  # keep our JSON logging; uvicorn's own plain-text lines only for problems
        log_level=log_level,
        access_log=False,  # one structured line per request comes from the router itself
        # nothing reads the client's address (no access log): no X-Forwarded-For middleware per request
        proxy_headers=False,
        timeout_keep_alive=keep_alive_timeout,
        timeout_graceful_shutdown=shutdown_timeout,
        ssl_context_factory=None if tls is None else (lambda _config, _default: tls),
    )


class DrainingServer(uvicorn.Server):
    """uvicorn, told of the stop signal first: the router stops admitting as uvicorn stops
    accepting, and uvicorn waits (--shutdown-timeout) for what the router holds. Over HTTPS each
    handshake is bounded by `handshake_timeout`, and with a `refresher` (--enable-ssl-refresh) each
    one uses the certificate the files hold then."""

    def __init__(self, config: uvicorn.Config, router, handshake_timeout: float = 60.0,
                 refresher: CertificateRefresher | None = None):
        super().__init__(config)
        self.router = router
        self.handshake_timeout = handshake_timeout
        self.refresher = refresher

    async def startup(self, sockets=None) -> None:
        if self.config.ssl is None:
            return await super().startup(sockets=sockets)
        # uvicorn hands its context to the loop's TLS server, which would keep handshakes out of
        # the connection guard's sight: its listening sockets are served by a TLSServer instead
        # (services/router/tls.py), given in place of the loop's create_server while it starts
        loop = asyncio.get_running_loop()
        fixed, refresher = self.config.ssl, self.refresher
        current = (lambda: fixed) if refresher is None else (lambda: refresher.context)
        loop.create_server = tls_server(current, self.handshake_timeout)
        try:
            await super().startup(sockets=sockets)
        finally:
            del loop.create_server
        if self.refresher is not None:
            self.refresher.start()

    async def shutdown(self, sockets=None) -> None:
        if self.refresher is not None:
            self.refresher.stop()
        await super().shutdown(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        self.router.begin_drain()
        super().handle_exit(sig, frame)
