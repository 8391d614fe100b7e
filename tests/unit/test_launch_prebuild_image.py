"""The compose image's background build (`make test` runs it while the suite runs): on a
machine without the asked-for engine it says why and exits 0, since the container tests that
follow skip (or build) and report it themselves."""

from services.launch.proc import run_service


def test_without_the_engine_it_builds_nothing_and_says_why(tmp_path):
    # a docker CLI without an engine behind it (or none at all) is what these machines have
    env = {"PDMESH_COMPOSE": "docker", "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    out = run_service("launch.prebuild_image", ["--log-dir", str(tmp_path)], timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "no image built" in out.stdout and "docker" in out.stdout
    assert not (tmp_path / "compose.log").exists()
