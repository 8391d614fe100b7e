"""Item 4a: a long-lived task that ends takes its worker down (NOT_SERVING, non-zero exit), so
compose / Kubernetes restart it instead of leaving rooms without a clock."""

from __future__ import annotations

import time

import httpx
import pytest

from services.common.supervision import EXIT_TASK_ENDED
from tests.integration.mesh import wait_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("role", "task"),
    [("decode", "decode-loop"), pytest.param("decode", "kv-heartbeat", marks=pytest.mark.long),
     pytest.param("prefill", "poller", marks=pytest.mark.long), ("prefill", "watchdog")],
)
def test_a_crashed_task_takes_the_worker_down(mesh, role, task):
    proc = mesh.start_worker(role, "--faults", f"crash_task={task}", wait=False)
    t0 = time.monotonic()
    seen: list[dict] = []  # /health bodies while the worker goes down

    def exited():
        try:
            r = httpx.get(proc.http_url + "/health", timeout=1)
            seen.append({"code": r.status_code, **r.json()})
        except httpx.HTTPError:
            pass
        return not proc.alive()

    wait_for(exited, 60, f"{role} to exit after {task} crashed", poll=0.01)
    assert proc.popen.returncode == EXIT_TASK_ENDED, proc.log()[-2000:]
    log = proc.log()
    ended = [line for line in log.splitlines() if "long-lived task ended" in line]
    assert ended and f'"task": "{task}"' in ended[0] and '"how": "raised"' in ended[0], log[-2000:]
    assert "fault injection: crash_task" in log
    # health turned NOT_SERVING (503, naming the task) before the process went
    down = [h for h in seen if h["code"] == 503 and "task" in h.get("problems", {})]  # not a 503 while loading
    assert down and task in down[-1]["problems"]["task"], seen[-3:]
    # the crash fires 0.5 s after the task starts; start-up (model, NIXL) dominates the rest
    assert time.monotonic() - t0 < 60
