import os
import pathlib

import pytest

from services.launch.compose import Compose, NoEngine, prepare_wheelhouse
from services.launch.ports import free_port

# Test settings, passed to the containers by tests/compose/docker-compose.test.yml.
SETTINGS = {
    "TEST_INFLIGHT_TIMEOUT": "4",
    "TEST_WATCHDOG_INTERVAL": "0.5",
    "TEST_DELAY_FORWARD": "2",
    "TEST_ROUTER_HEALTH_FAILURES": "10",
    "TEST_ROUTER_KEEPALIVE_TIMEOUT": "30",
}
HEALTHY_WITHIN = 240  # s from `up` (a cold start of three torch processes on two busy cores)


# the test settings above, passed into the containers (a path from the repository root)
TEST_OVERRIDE = pathlib.Path("tests/compose/docker-compose.test.yml")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The compose mesh (services/launch/compose.py), up and healthy; always taken down (and
    anything left force-removed)."""
    env = {
        **os.environ,
        **SETTINGS,
        "DEPLOY_ROUTER_PORT": str(free_port()),
        # podman: OCI images drop HEALTHCHECK; the docker format keeps it
        "BUILDAH_FORMAT": "docker",
    }
    try:
        s = Compose.found(env, tmp_path_factory.mktemp("compose"), overrides=(TEST_OVERRIDE,))
    except NoEngine as e:
        pytest.skip(f"compose tests need a container engine: {e}")
    print(f"compose: {' '.join(s.compose)} ({s.engine}); {prepare_wheelhouse()}")
    s.start(HEALTHY_WITHIN)
    print("compose timings: " + ", ".join(f"{k}={v:.1f}" for k, v in s.timings.items()))
    try:
        yield s
    finally:
        s.stop()
