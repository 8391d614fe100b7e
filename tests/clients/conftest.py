import pytest

from tests.clients.clients_venv import require_clients_venv
from tests.integration.http_client import router_with_one_pair
from tests.integration.mesh import Mesh


@pytest.fixture(scope="session")
def pd_router(tmp_path_factory):
    """Router + prefill + decode on the built-in model (models/pdmesh-tiny), one mesh for all of tests/clients
    (each test ends with the invariants, so the next starts from an idle mesh)."""
    require_clients_venv()
    m = Mesh(tmp_path_factory.mktemp("clients-mesh"))
    try:
        _, _, router = router_with_one_pair(m, "--request-timeout", "120")
        yield m, router
    finally:
        m.close()
