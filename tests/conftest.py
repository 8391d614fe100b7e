import os

import pytest

from tests.integration.mesh import Mesh


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
