"""One `/metrics` for all the router's processes (`--processes N`, N > 1); `OwnMetrics` is the
same interface for a router of one process (services/router/load_view.py picks one at start).

A scrape reaches whichever process the kernel hands the connection to, so each process also
serves its own exposition on a Unix socket in the router's shared folder, and the process that
was scraped answers with every process's series: each carries its own `worker` label
(`router-HOST-PORT-pI`), so sums over the router are what dashboards already write. A process
that does not answer within `SIBLING_TIMEOUT` (being restarted, frozen) is left out of that
scrape rather than failing it, and the scrape says so in `pdmesh:router_processes_scraped`.

The Prometheus text format wants each family's lines together, so the expositions are merged
family by family: one `# HELP` / `# TYPE` header, then every process's samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from services.common.logging_setup import get_logger
from services.common.metrics import router_processes_exposition

log = get_logger("router.siblings")

SIBLING_TIMEOUT = 1.0  # seconds one sibling may take to hand over its exposition


def socket_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"metrics-{index}.sock")


class OwnMetrics:
    """A router of one process: `/metrics` is its own exposition; nothing to serve or merge."""

    def __init__(self, own: Callable[[], bytes]):
        self.own = own

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def exposition(self) -> bytes:
        return self.own()


class SiblingMetrics:
    def __init__(self, folder: str, processes: int, index: int, own: Callable[[], bytes]):
        self.folder, self.processes, self.index, self.own = folder, processes, index, own
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        path = socket_path(self.folder, self.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by the process this one replaces
        self._server = await asyncio.start_unix_server(self._serve, path=path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(self.own())
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _fetch(self, index: int) -> bytes | None:
        try:
            async with asyncio.timeout(SIBLING_TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(socket_path(self.folder, index))
                try:
                    return await reader.read()
                finally:
                    writer.close()
        except (TimeoutError, OSError) as e:
            log.warning("a router process did not hand over its metrics", process=index, error=repr(e))
            return None

    async def exposition(self) -> bytes:
        others = [i for i in range(self.processes) if i != self.index]
        texts = await asyncio.gather(*(self._fetch(i) for i in others))
        got = [self.own(), *(t for t in texts if t)]
        return merge_expositions(got) + router_processes_exposition(self.processes, len(got))


def merge_expositions(texts: list[bytes]) -> bytes:
    """Prometheus text expositions with disjoint series merged into one: each family's header once
    (from the first text that has it), then the samples of every text, in the first text's order
    of families."""
    order: list[bytes] = []
    headers: dict[bytes, list[bytes]] = {}
    samples: dict[bytes, list[bytes]] = {}
    for text in texts:
        family, seen_header = None, False
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith(b"# HELP ") or line.startswith(b"# TYPE "):
                name = line.split(b" ", 3)[2]
                if name != family:
                    family = name
                    if family not in headers:
                        order.append(family)
                        headers[family], samples[family] = [], []
                        seen_header = False
                    else:
                        seen_header = True
                if not seen_header:
                    headers[family].append(line)
                continue
            if line.startswith(b"#") or family is None:
                continue
            samples[family].append(line)
    out = []
    for name in order:
        out.extend(headers[name])
        out.extend(samples[name])
    return b"\n".join(out) + b"\n" if out else b""
