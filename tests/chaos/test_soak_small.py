"""The chaos soak, small: 30 s of load through router + 2P + 2D with a decode SIGKILLed
mid-load (streams migrate), a prefill that stalls its KV transfers for 20 s, longer than the
router's 15 s request deadline (its watchdog evicts them and the router fails over), and a
decode frozen past the deadlines, while two multi-round conversations keep the workers' prefix
caches warm. Every invariant of chaos/soak.py must hold, with zero failed requests. The same run fails with
`--without migration` (streams on the killed decode end in errors) and with `--without
watchdog` (stalled transfers hold requests until the router's deadline): docs/chaos.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.mesh import ROOT

pytestmark = pytest.mark.integration

SCHEDULE = "kill:decode:0@4,inject:prefill:0:stall_transfer~20@8,freeze:decode:1@20"


@pytest.mark.timeout(400)
def test_small_soak_loses_nothing_and_leaks_nothing(tmp_path):
    cmd = [sys.executable, "-m", "chaos.soak", "--seed", "3", "--duration", "30", "--clients", "3",
           "--conversations", "2", "--request-timeout", "15", "--schedule", SCHEDULE, "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=380)
    report = json.loads((tmp_path / "report-seed3.json").read_text())
    assert run.returncode == 0 and report["ok"], json.dumps(
        {k: report[k] for k in ("invariants", "errors", "requests", "conversations", "faults")}, indent=1)
    assert report["requests"]["failed"] == 0 and report["requests"]["sent"] > 50
    conv = report["conversations"]
    # the conversations ran into the faults, and reused their history while they did
    assert conv["rounds_ok"] >= 8 and conv["deepest_round"] >= 3 and conv["hits_all_rounds_from_2"] > 0, conv
    assert len(report["faults"]) == 3 and all(f["outcome"] == "done" for f in report["faults"])
