"""HTTPS on the router itself (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
--ssl-cert-reqs), for deployments with no proxy in front to terminate TLS.

The context is built once at start, so a missing file, a key that does not match its
certificate or a bad combination of flags ends the router with one line naming it instead of a
traceback when the first client connects. TLS 1.2 is the least it speaks (what browsers, the
openai SDK's httpx and curl all offer), ALPN says HTTP/1.1 (the router speaks nothing else).

A connection is counted in --max-connections from the moment it is accepted, its handshake
included, as a plain one is. The loop's own TLS server (`create_server(ssl=...)`, what uvicorn
asks for) would keep each handshake out of the connection guard's sight until it is done (the
protocol's `connection_made` comes only then), and one client opening connections without ever
finishing a handshake could hold every descriptor the router has. So the router's `TLSServer`
accepts plain sockets itself and counts each as a `Handshake` among the router's connections
(`connection_guard.make_room`: idle, so at the limit the longest-waiting one makes room) while
the loop runs its handshake (`connect_accepted_socket`), bounded by --header-timeout (asyncio's
default waits 60 s); the HTTP protocol takes its place when the handshake is done. A client that
speaks plain HTTP to the port (its first byte is not a TLS record's) gets a 400 saying so, with
an OpenAI error body, as nginx answers there, instead of a connection closed without a word.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import Callable

from services.common.listening import listening_socket
from services.router.connection_guard import closing_error, make_room

ACCEPT_RETRY = 0.1  # seconds before accepting again after accept() failed (out of descriptors, say)
# seconds a closing connection waits for the client's close_notify before it is cut: an idle
# keep-alive client reads nothing, and the loop's default (30 s) would hold a stopping router
# that long for each such connection
SHUTDOWN_WAIT = 2.0
TLS_HANDSHAKE_RECORD = b"\x16"  # the first byte of every TLS ClientHello
PLAIN_HTTP = closing_error(400, "https_required", "This port serves HTTPS: the request was sent as plain "
                           "HTTP. Use an https:// URL.")

CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}


def server_context(keyfile: str, certfile: str, ca_certs: str = "", cert_reqs: int = 0) -> ssl.SSLContext | None:
    """The router's TLS context, or None for plain HTTP (neither file named). ValueError, with a
    sentence naming the flag, for what cannot serve."""
    if not keyfile and not certfile:
        if ca_certs or cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile")
        return None
    if not (keyfile and certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: name both to serve HTTPS")
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, not {cert_reqs}")
    if cert_reqs and not ca_certs:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to verify client certificates against")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load --ssl-certfile {certfile} with --ssl-keyfile {keyfile}: {e}") from e
    if ca_certs:
        try:
            ctx.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot load --ssl-ca-certs {ca_certs}: {e}") from e
    ctx.verify_mode = CERT_REQS[cert_reqs]
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class Handshake:
    """An accepted connection whose TLS handshake is under way, in the router's connections."""

    transport = None  # the loop's TLS transport comes with the handshake's end, to the HTTP protocol

    def __init__(self, connections: set, on_cutoff: Callable[[str], None], conn: socket.socket):
        self.connections, self.on_cutoff, self.conn = connections, on_cutoff, conn
        self._idle_since = time.monotonic()  # no request yet: idle, the first to make room at the limit
        self._aborted = False
        self.running = False  # its task began: the task closes the socket, or the loop does for it
        self.task: asyncio.Task | None = None

    def _cut(self, reason: str) -> None:
        if not self._aborted:
            self.on_cutoff(reason)
        self.abort()

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        self.connections.discard(self)
        if not self.running:
            self.conn.close()
        if self.task is not None:
            self.task.cancel()

    def shutdown(self) -> None:
        """The server is stopping (uvicorn tells every connection): a handshake is dropped."""
        self.abort()


class TLSServer:
    """What the loop's create_server gives uvicorn, serving TLS with every handshake counted
    (the module's docstring): `sockets`, `close()`, `wait_closed()` and `is_serving()` as an
    asyncio Server's."""

    def __init__(self, protocol_factory: Callable, sock: socket.socket, context: Callable[[], ssl.SSLContext],
                 handshake_timeout: float, backlog: int):
        # `context` is asked at each handshake: a renewed certificate (tls_refresh.py) takes effect at once
        self.protocol_factory, self.context, self.handshake_timeout = protocol_factory, context, handshake_timeout
        sock.listen(backlog)
        sock.setblocking(False)
        self.sockets = [sock]
        self._loop = asyncio.get_running_loop()
        self._accepting = self._loop.create_task(self._accept(sock))

    async def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = await self._loop.sock_accept(sock)
            except OSError:  # out of descriptors, say: the connection bound keeps it rare
                await asyncio.sleep(ACCEPT_RETRY)
                continue
            self._begin(conn)

    def _begin(self, conn: socket.socket) -> None:
        http = self.protocol_factory()  # the guarded HTTP protocol (connection_guard.py), not yet connected
        entry = Handshake(http.connections, http.on_cutoff, conn)
        if not make_room(http.connections, http.limits.max_connections):
            http.on_cutoff("connection_limit")
            conn.close()
            return
        http.connections.add(entry)
        http.handshake = entry  # its connection_made takes the entry's place
        entry.task = self._loop.create_task(self._handshake(http, entry))

    async def _first_byte(self, conn: socket.socket) -> bytes:
        """The connection's first byte, left unread (b"": closed, or nothing within the handshake's time)."""
        readable, fd = self._loop.create_future(), conn.fileno()
        self._loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, self.handshake_timeout)
            return conn.recv(1, socket.MSG_PEEK)
        except (TimeoutError, OSError):
            return b""
        finally:
            self._loop.remove_reader(fd)

    def _refuse_plain_http(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.recv(65536)  # the request as far as it came: a close with it unread would reset the answer
            conn.send(PLAIN_HTTP)
            conn.shutdown(socket.SHUT_WR)

    async def _handshake(self, http, entry: Handshake) -> None:
        entry.running = True
        until = self._loop.time() + self.handshake_timeout  # the first byte and the handshake, together
        try:
            first = await self._first_byte(entry.conn)
        except asyncio.CancelledError:  # cut at the limit, or the server stopping
            entry.conn.close()
            raise
        if first != TLS_HANDSHAKE_RECORD:  # plain HTTP, or nothing in time, or the client gone
            if first:
                self._refuse_plain_http(entry.conn)
            entry.conn.close()
            entry.abort()
            return
        try:  # the loop owns the socket from here, and closes it
            await self._loop.connect_accepted_socket(lambda: http, entry.conn, ssl=self.context(),
                                                     ssl_handshake_timeout=max(0.001, until - self._loop.time()),
                                                     ssl_shutdown_timeout=SHUTDOWN_WAIT)
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the loop closed the connection
            pass  # a failed or late handshake, the client gone, cut at the limit, the server stopping
        finally:
            entry.connections.discard(entry)

    def close(self) -> None:
        self._accepting.cancel()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._accepting

    def is_serving(self) -> bool:
        return not self._accepting.done()


def tls_server(context: Callable[[], ssl.SSLContext], handshake_timeout: float) -> Callable:
    """A stand-in for the loop's create_server, as uvicorn calls it (its protocol factory, with
    `sock=` or `host=`/`port=`, `ssl=` and `backlog=`), that serves TLS through a TLSServer with
    the context `context()` gives at each handshake."""

    async def create_server(protocol_factory: Callable, host: str | None = None, port: int | None = None, *,
                            sock: socket.socket | None = None, ssl=None, backlog: int = 100, **_) -> TLSServer:  # noqa: ARG001
        if sock is None:
            sock = listening_socket(host or "", port or 0, reuse_port=False)
        return TLSServer(protocol_factory, sock, context, handshake_timeout, backlog)

    return create_server
