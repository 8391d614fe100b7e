import pytest

from tests.clients.clients_venv import require_clients_venv
from tests.integration.mesh import mesh_with_router


@pytest.fixture(scope="session")
def pd_router(tmp_path_factory):
    """Router + prefill + decode on the built-in model (models/pdmesh-tiny), one mesh for all of tests/clients
    (each test ends with the invariants, so the next starts from an idle mesh)."""
    require_clients_venv()
    with mesh_with_router(tmp_path_factory.mktemp("clients-mesh"), router_flags=("--request-timeout", "120")) as (
        m, _, _, router
    ):
        yield m, router
