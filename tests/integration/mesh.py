"""The integration tests' mesh: services/launch's Launcher on this machine, every process on free
127.0.0.1 ports with its own log file under the test's tmp_path, all killed by `Mesh.close()`
(use the `mesh` fixture from tests/conftest.py, which always closes).

The probes and helpers the tests share are re-exported here so that a test imports one module.
"""

from __future__ import annotations

import contextlib
import pathlib
import threading
from collections.abc import Callable, Iterator

from services.launch.launcher import Launcher
from services.launch.probes import QUEUE_GAUGES, attempts_in_log, labelled_samples, scrape_metrics, wait_for
from services.launch.proc import ROOT, Proc

__all__ = ["QUEUE_GAUGES", "ROOT", "Mesh", "Proc", "attempts_in_log", "in_background", "labelled_samples",
           "mesh_with_router", "scrape_metrics", "wait_for"]


def in_background(fn: Callable[[], object]) -> tuple[threading.Thread, dict]:
    """Run fn() on a thread; its result lands in box["out"] (the test waits on the thread)."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    thread.start()
    return thread, box


class Mesh(Launcher):
    def __init__(self, tmp_path: pathlib.Path):
        super().__init__(log_dir=tmp_path)
        self.tmp_path = tmp_path


@contextlib.contextmanager
def mesh_with_router(tmp_path: pathlib.Path, prefills: int = 1, decodes: int = 1,
                     prefill_flags: tuple[str, ...] = (), decode_flags: tuple[str, ...] = (),
                     router_flags: tuple[str, ...] = ()) -> Iterator[tuple[Mesh, list[Proc], list[Proc], Proc]]:
    """For a module's fixture: the workers started side by side, then one router over all of them.
    Gives (mesh, prefills, decodes, router); the mesh is closed whatever happens."""
    m = Mesh(tmp_path)
    try:
        ps, ds = m.start_workers(prefills, decodes, prefill_flags, decode_flags)
        yield m, ps, ds, m.start_router(ps, ds, *router_flags)
    finally:
        m.close()
