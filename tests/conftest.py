import os

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


def pytest_runtest_logreport(report):
    """With PDMESH_TEST_TIMES=FILE, each test phase's duration is appended to FILE as it ends
    (one line: seconds, phase, outcome, node id), so a slow suite can be read while it runs."""
    path = os.environ.get("PDMESH_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")
