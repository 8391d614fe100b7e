import os
import time

import pytest

from services.launch.ports import free_port
from tests.compose.stack import NoEngine, Stack, find_engine, prepare_wheelhouse

# Test settings, passed to the containers by tests/compose/docker-compose.test.yml.
SETTINGS = {
    "TEST_INFLIGHT_TIMEOUT": "4",
    "TEST_WATCHDOG_INTERVAL": "0.5",
    "TEST_DELAY_FORWARD": "2",
    "TEST_ROUTER_HEALTH_FAILURES": "10",
}
HEALTHY_WITHIN = 240  # s from `up` (a cold start of three torch processes on two busy cores)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The compose mesh, up and healthy; always taken down (and anything left force-removed)."""
    try:
        engine, compose = find_engine()
    except NoEngine as e:
        pytest.skip(f"compose tests need a container engine: {e}")
    env = {
        **os.environ,
        **SETTINGS,
        "DEPLOY_ROUTER_PORT": str(free_port()),
        # podman: OCI images drop HEALTHCHECK; the docker format keeps it
        "BUILDAH_FORMAT": "docker",
    }
    s = Stack(engine, compose, env, tmp_path_factory.mktemp("compose"))
    print(f"compose: {' '.join(compose)} ({engine}); {prepare_wheelhouse()}")
    s.down()  # a stack a previous, killed run left behind
    try:
        s.build()
        s.up()
        t = time.monotonic()
        s.wait_healthy(HEALTHY_WITHIN)
        s.timings["healthy_after_up_s"] = time.monotonic() - t
        print("compose timings: " + ", ".join(f"{k}={v:.1f}" for k, v in s.timings.items()))
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        s.down()
        left = s.leftovers()
        if left:
            s.force_remove(left)
