"""The compose image's background build (`make test` runs it while the suite runs): on a
machine without the asked-for engine it says why and exits 0, since the container tests that
follow skip (or build) and report it themselves."""

import os
import subprocess
import sys

from services.launch.proc import ROOT


def test_without_the_engine_it_builds_nothing_and_says_why(tmp_path):
    # a docker CLI without an engine behind it (or none at all) is what these machines have
    env = {**os.environ, "PDMESH_COMPOSE": "docker", "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    out = subprocess.run([sys.executable, "-m", "services.launch.prebuild_image", "--log-dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no image built" in out.stdout and "docker" in out.stdout
    assert not (tmp_path / "compose.log").exists()
