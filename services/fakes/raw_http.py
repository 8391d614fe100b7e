"""HTTP/1.1 on a bare asyncio protocol with httptools' parser: the least a Python server can do
per request, for the fakes and benches that must cost the process they measure next to nothing
(services/fakes/sglang_worker.py, bench/http_fronts.py's `raw` front). No limits, no timeouts:
never a front for real clients."""

from __future__ import annotations

import asyncio

import httptools


class RawHttpConnection(asyncio.Protocol):
    """One client connection; a subclass answers each whole request in `on_request`, writing to
    `self.transport` (a parse error closes the connection)."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.on_request(self.parser.get_method(), self.url.split(b"?", 1)[0].decode(), b"".join(self.body))

    def on_request(self, method: bytes, path: str, body: bytes) -> None:
        raise NotImplementedError
