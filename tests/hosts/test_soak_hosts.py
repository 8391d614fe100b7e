"""The chaos soak in hosts mode, small: router + 2P + 2D each in its own network namespace,
30 s of load from 3 clients and 2 conversations, with a partition both ways (prefill#0 <-x->
decode#0, 12 s, longer than every deadline), a one-way partition (prefill#1 -x-> decode#1), a
decode SIGKILLed and restarted inside its namespace, and a partial partition (prefill#1 <-x->
decode#0 only, 10 s, every other pair up). Every invariant of chaos/soak.py holds with zero
failed requests — the router marked exactly the partially cut pair and cleared it after the
heal, while both of its workers served through their other peers — and no namespace of the run
is left behind (docs/chaos.md, "Hosts mode")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.launch.netns import run
from tests.integration.mesh import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.long]  # `make chaos-hosts` is the full soak

SCHEDULE = "partition:0:0~12@3,kill:decode:1@17,partition:1:1:to_decode~12@21,partial_partition:1:0~10@35"


@pytest.mark.timeout(480)
def test_small_hosts_soak_with_partitions_loses_nothing(tmp_path):
    cmd = [sys.executable, "-m", "chaos.soak", "--hosts", "--seed", "4", "--duration", "30", "--clients", "3",
           "--conversations", "2", "--request-timeout", "20", "--schedule", SCHEDULE, "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=460)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the soak's SIGTERM handler kills its processes and deletes its namespaces
            proc.wait(30)
    prefix = f"pdm{proc.pid}-"
    assert not [n for n in run("ip", "netns", "list", check=False).stdout.split() if n.startswith(prefix)]
    report = json.loads((tmp_path / "report-hosts-seed4.json").read_text())
    assert proc.returncode == 0 and report["ok"], json.dumps(
        {k: report[k] for k in ("invariants", "errors", "requests", "faults")}, indent=1)
    assert report["requests"]["failed"] == 0 and report["requests"]["sent"] > 50
    parts = [f for f in report["faults"] if f["kind"] == "partition"]
    assert len(parts) == 2 and all(f["outcome"] == "done" and f["ended"] - f["began"] >= 12 for f in parts)
    [cut] = report["partial_partitions"]
    assert cut["pair"] == ["prefill@p1", "decode@d0"] and not cut["other_pairs_marked"], cut
    assert cut["marked_after_cut_s"] is not None and cut["cleared_after_heal_s"] is not None, cut
    assert cut["p_served_through_other_decodes"] > 0 and cut["d_served_through_other_prefills"] > 0, cut
