"""The chaos soak, short (`make test`'s form of `make chaos`): router + 2P + 2D on the built-in
model, one client and one multi-round conversation, with one fault of every kind, one after
another: a decode SIGKILLed mid-load (streams migrate), a prefill that stalls its KV transfers
for 6 s, past its 3 s inflight deadline (its watchdog evicts the rooms and the router fails
over), a decode frozen past the heartbeat and transfer deadlines, and a router restart. Every
invariant of chaos/soak.py must hold, and be exercised: no failed request beyond those in
flight at the router restart, the conversation's quiet rounds from round 2 on judged (before
the first fault), the drained pools whole. `make chaos` is the long form (docs/chaos.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chaos.soak_plan import KINDS
from services.launch.proc import ROOT

pytestmark = pytest.mark.integration

# Each kind once; the first fault leaves the conversation a few quiet rounds from round 2 on.
SCHEDULE = "kill:decode:0@6,inject:prefill:0:stall_transfer~6@7,freeze:decode:1:~5@8,router_restart@9"
# The soak's own bound: the short form takes ~2 min on an idle 2-core machine, and `make test`
# runs another test file beside it
SOAK_TIMEOUT = 420


@pytest.mark.timeout(SOAK_TIMEOUT + 40)
def test_short_soak_every_fault_kind_loses_nothing_and_leaks_nothing(tmp_path):
    cmd = [sys.executable, "-m", "chaos.soak", "--seed", "3", "--duration", "10", "--clients", "1",
           "--conversations", "1", "--think", "0.3", "--request-timeout", "10", "--schedule", SCHEDULE, "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=SOAK_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the soak's SIGTERM handler stops every process it started
            proc.wait(30)
    report_path = tmp_path / "report-seed3.json"
    assert report_path.exists(), f"the soak wrote no report (exit {proc.returncode}):\n{out[-4000:]}"
    report = json.loads(report_path.read_text())
    assert proc.returncode == 0 and report["ok"], json.dumps(
        {k: report[k] for k in ("invariants", "errors", "requests", "conversations", "faults", "timings_s")}, indent=1)
    assert {f["kind"] for f in report["faults"]} == set(KINDS)
    assert all(f["outcome"] == "done" for f in report["faults"])
    req = report["requests"]
    assert req["failed"] == req["failed_in_flight_at_router_restart"] and req["sent"] > 30, req
    conv = report["conversations"]
    # invariant 6 judged, not vacuous: quiet rounds from round 2 on, and they hit the cache
    assert conv["quiet_rounds_from_2"] > 0 and conv["deepest_round"] >= 3, conv
    assert report["kv_pages_cached_after_drain"] and report["leaked_pages"] == 0
