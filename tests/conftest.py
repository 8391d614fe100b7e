import pytest

from tests.integration.mesh import Mesh


@pytest.fixture
def mesh(tmp_path):
    m = Mesh(tmp_path)
    try:
        yield m
    finally:
        m.close()
