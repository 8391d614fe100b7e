import os
import resource

# One OpenMP thread per process, idle threads asleep: a test runs several processes with torch
# (two pytest workers, each mesh's prefill, decode and reference model) on a machine of a few
# cores, and torch's default of one spinning thread per core in each of them oversubscribes
# the cores several times over (a batch test took 1.5x as long). Set before anything imports
# torch; the workers a test starts inherit it. The tiny test models gain nothing from threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from tests.integration.mesh import Mesh  # noqa: E402


@pytest.fixture
def mesh(tmp_path):
    m = Mesh(tmp_path)
    try:
        yield m
    finally:
        m.close()


def _cpu_seconds() -> float:
    """CPU this pytest process and its reaped children (the meshes a test started and stopped) used."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


_cpu_at_start: dict[str, float] = {}


def pytest_runtest_logstart(nodeid, location):
    _cpu_at_start[nodeid] = _cpu_seconds()


def pytest_runtest_logreport(report):
    """With PDMESH_TEST_TIMES=FILE, each test phase's duration is appended to FILE as it ends
    (one line: seconds, phase, outcome, node id), so a slow suite can be read while it runs. After
    the teardown line, a `cpu` line gives the CPU seconds the whole test cost (itself and the
    processes it stopped): on a loaded machine wall time says more about the neighbours, CPU
    about the test (a module's shared mesh is charged to the test that stops it)."""
    path = os.environ.get("PDMESH_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")
            if report.when == "teardown" and report.nodeid in _cpu_at_start:
                cpu = _cpu_seconds() - _cpu_at_start.pop(report.nodeid)
                f.write(f"{cpu:.2f}\tcpu\t{report.outcome}\t{report.nodeid}\n")
