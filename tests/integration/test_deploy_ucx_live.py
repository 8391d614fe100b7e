"""The UCX settings the compose files give the workers (UCX_TLS pinned to TCP between
containers) carry the KV cache correctly: a request through real prefill and decode processes
started with exactly that environment succeeds, with the same tokens under each setting, and
leaves both workers clean. (On a machine without GPUs, UCX drops `cuda_copy` with a warning;
the GPU path itself needs a GPU host.)"""

from __future__ import annotations

import asyncio

import pytest
import yaml

from services.common.sampling_params import SamplingParams
from services.fakes.worker_client import generate
from tests.unit.test_deploy_compose import COMPOSE, COMPOSE_CPU, _ResetLoader

pytestmark = pytest.mark.integration

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(10, 200))  # several KV pages


def ucx_env(path) -> dict[str, str]:
    raw = yaml.load(path.read_text(), Loader=_ResetLoader)  # noqa: S506 - SafeLoader subclass
    envs = [raw["services"][w].get("environment", {}) for w in ("prefill", "decode")]
    assert envs[0].get("UCX_TLS") == envs[1].get("UCX_TLS"), "both workers need the same UCX transports"
    return {k: str(v) for k, v in envs[0].items() if k.startswith("UCX_")}


def test_kv_moves_with_the_compose_ucx_settings(mesh):
    settings = {"docker-compose.yml": ucx_env(COMPOSE), "docker-compose.cpu.yml": ucx_env(COMPOSE_CPU)}
    assert settings["docker-compose.yml"]["UCX_TLS"] and settings["docker-compose.cpu.yml"]["UCX_TLS"]
    tokens = {}
    for name, env in settings.items():
        env = {**settings["docker-compose.yml"], **env}  # the override adds to the base
        p = mesh.start_prefill(env=env, wait=False)
        d = mesh.start_decode(env=env, wait=False)
        mesh.wait_healthy(p)
        mesh.wait_healthy(d)
        out = asyncio.run(generate(p.grpc_addr, d.grpc_addr, PROMPT, PARAMS, timeout=60))
        assert out.ok, f"{name} UCX settings {env}: {out.prefill_error} {out.decode_error}\n{p.log()[-2000:]}"
        assert out.prefill_reply.kv_bytes > 0
        tokens[name] = out.tokens
        mesh.assert_invariants()
        p.kill()
        d.kill()
    assert tokens["docker-compose.yml"] == tokens["docker-compose.cpu.yml"]
