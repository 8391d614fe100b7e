"""Chaos soak: router + 2 prefills + 2 decodes on the built-in model, steady load from several
clients, faults on a seeded schedule; then the invariants (docs/chaos.md):

  1. every request ends — success or an OpenAI-style error — within its deadline; none hangs;
  2. every successful request returns exactly the text of single-process generation;
  3. after load stops, with no further traffic: every queue gauge 0, every KV page free or
     cached with no holder, no NIXL handle outstanding, no quarantined page, every aux slot
     free, on every worker; the router admits nothing;
  4. no worker that the soak did not kill has died or restarted;
  5. the router's counters agree with what the clients saw;
  6. multi-round conversations (soak_conversations.py) beside the clients: most of their rounds
     from round 2 on, away from faults, report cached prompt tokens;
  7. (hosts mode) a partial partition — one prefill cut from one decode, every other pair up —
     is marked by the router on exactly that pair, both workers keep serving through their
     other peers while it lasts, and the mark clears after the heal.

    python -m chaos.soak --seed 1 --duration 120 --out bench/out/chaos
    python -m chaos.soak --hosts --seed 1 --duration 90   # each service in its own network
        namespace (root; services/launch/netns.py), plus partitions and partial partitions
        between a prefill and a decode

Prints the JSON report (also written to OUT/report-seedN.json, with a timeline PNG beside it)
and exits non-zero when an invariant fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict

import httpx

from chaos.soak_conversations import cache_hits, conversation_loop
from chaos.soak_load import LoadState, client_loop
from chaos.soak_marks import OtherMarks
from chaos.soak_plan import CUTS, HOST_KINDS, KINDS, Fault, parse_schedule, plan_faults
from chaos.soak_verify import check_counts, check_outputs, scrape
from services.launch.launcher import Launcher
from services.launch.probes import QUEUE_GAUGES, attempts_by_room, marked_pairs, served_in_log, wait_for
from services.launch.proc import Proc

# The random test model: its logits are well separated, so sampled tokens do not sit on the
# near-ties that float rounding (batch composition, prefill vs decode) can flip — invariant 2
# compares exact texts. (The trained default model is exact too, up to such near-ties.)
MODEL = "builtin-random"
# Cache-aware routing (the default policy) keeps each conversation on the workers holding its
# history; the soak's router passes --local-prefill-max-tokens from its own flag (default 0: every
# round goes through prefill, so restarts hit prefill's cache and decode's delta transfer too).
# Deadlines short enough that a 120 s run sees faults end, long enough for this 2-core machine.
PREFILL_FLAGS = ("--model", MODEL, "--bootstrap-timeout", "10", "--inflight-timeout", "3", "--watchdog-interval", "0.5",
                 "--forward-timeout", "3", "--num-pages", "512")
DECODE_FLAGS = ("--model", MODEL, "--prealloc-timeout", "10", "--transfer-timeout", "3", "--heartbeat-interval", "0.5",
                "--heartbeat-max-failures", "3", "--watchdog-interval", "0.5", "--forward-timeout", "3",
                "--keepalive-interval", "0.5", "--num-pages", "512")
ROUTER_FLAGS = ("--model", MODEL, "--served-model-name", MODEL, "--health-check-interval", "0.5", "--health-check-timeout", "0.5", "--health-failure-threshold", "2",
                "--stream-stall-timeout", "3", "--max-migrations", "4", "--policy", "cache_aware")
WATCHDOG_OFF = ("--watchdog-interval", "100000")  # --without watchdog: the sweep never runs
# Hosts mode: the router's canary (services/router/canary.py) tests each idle pair, and every
# marked pair each interval, so a healed pair is cleared within an interval plus a canary's time
CANARY_FLAGS = ("--canary-interval", "1", "--canary-timeout", "5")
# a partial partition's pair is marked within this long after the cut, and cleared within this
# long after the heal: the canary's interval and timeout, plus a loaded machine's slack
MARK_WITHIN_S, CLEAR_WITHIN_S = 10.0, 15.0


class Soak:
    def __init__(self, args, workdir: pathlib.Path):
        self.args = args
        if args.hosts:
            from chaos.soak_hosts import HostsMesh
            self.mesh = HostsMesh(workdir)
        else:
            self.mesh = Launcher(log_dir=workdir)
        self.workers: dict[str, list[Proc]] = {"prefill": [], "decode": []}
        self.router: Proc | None = None
        self.killed: list[Proc] = []  # processes the soak itself killed (invariant 4 spares them)
        self.fault_log: list[dict] = []
        self.router_counts: list[dict[str, float]] = []  # router_requests_total by status, per generation
        self.router_killed_at: list[float] = []  # when each generation's router was killed
        self.worker_counters: dict[str, float] = {}
        self.partial_partitions: list[dict] = []  # what each partial_partition fault observed
        self.errors: list[str] = []

    # --- the mesh ------------------------------------------------------------------------------
    def worker_flags(self, role: str) -> tuple[str, ...]:
        flags = PREFILL_FLAGS if role == "prefill" else DECODE_FLAGS
        return flags + (WATCHDOG_OFF if "watchdog" in self.args.without else ())

    def start(self) -> None:
        for role in ("prefill", "decode"):
            for _ in range(2):
                self.workers[role].append(self.mesh.start_worker(role, *self.worker_flags(role), wait=False))
        for proc in self.workers["prefill"] + self.workers["decode"]:
            self.mesh.wait_healthy(proc)
        migrations = ("--max-migrations", "0") if "migration" in self.args.without else ()
        canary = CANARY_FLAGS if self.args.hosts else ()
        self.router = self.mesh.start_router(
            self.workers["prefill"], self.workers["decode"], *ROUTER_FLAGS, *migrations, *canary,
            "--request-timeout", str(self.args.request_timeout), "--processes", str(self.args.router_processes),
            "--local-prefill-max-tokens", str(self.args.local_prefill_max_tokens))

    def _bank_counters(self, proc: Proc) -> None:
        """Counters reset when a process restarts: keep what it counted so far."""
        try:
            m = scrape(proc.http_url)
        except Exception:  # noqa: BLE001 - frozen or dead: its counts are lost, say so
            self.errors.append(f"could not read {proc.role} {proc.grpc_addr or proc.http_port} counters before restart")
            return
        if proc.role == "router":
            self.router_counts.append({k: v for k, v in m.items() if k.startswith("pdmesh:router_requests_total")})
            keys = [k for k in m if k.startswith("pdmesh:router_migrations_total")]
        else:
            keys = [k for k in m if k.startswith("pdmesh:watchdog_evictions_total")]
        for k in keys:
            self.worker_counters[k] = self.worker_counters.get(k, 0) + m[k]

    def _replace(self, proc: Proc, add: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> Proc:
        self._bank_counters(proc)
        self.killed.append(proc)
        new = self.mesh.restart(proc, wait=True, drop_flags=drop, add_args=add)
        if proc.role == "router":
            self.router = new
        else:
            group = self.workers[proc.role]
            group[group.index(proc)] = new
        return new

    # --- faults ----------------------------------------------------------------------------------
    def apply(self, f: Fault, state: LoadState) -> None:
        if f.kind == "router_restart":
            self.router_killed_at.append(time.monotonic())
            self._replace(self.router)
            # after the new router is up: a request stamped with the new generation can only
            # have been answered by it (one that straddles the restart counts as cut)
            state.router_gen += 1
            return
        if f.kind == "partition":
            self.mesh.partition(f.index, f.peer, f.spec)
            try:
                time.sleep(f.hold)
            finally:
                self.mesh.heal(f.index, f.peer)
            return
        if f.kind == "partial_partition":
            self.partial_partitions.append(self.partial_partition(f))
            return
        proc = self.workers[f.role][f.index]
        if f.kind == "kill":
            self._replace(proc)
        elif f.kind == "freeze":
            proc.stop()
            time.sleep(f.hold)
            proc.cont()
        elif f.kind == "inject":
            faulty = self._replace(proc, add=("--faults", f.spec))
            time.sleep(f.hold)
            self._replace(faulty, drop=("--faults",))

    def partial_partition(self, f: Fault) -> dict:
        """Cut prefill#index <-> decode#peer only, for f.hold seconds, then heal; meanwhile watch
        the router's pair marks. What it saw: how soon the pair was marked and cleared, any
        other pair marked during the cut (a mark an earlier fault left standing counts only if it
        cleared and came back), and what each pair and worker served during it."""
        p, d = self.workers["prefill"][f.index], self.workers["decode"][f.peer]
        cut = (p.grpc_addr, d.grpc_addr)
        received = lambda: {w.name: w.metrics().get("pdmesh:num_requests_total", 0.0)  # noqa: E731
                            for w in self.workers["prefill"] + self.workers["decode"]}
        before, log_before = received(), self.router.log()
        other_marks = OtherMarks(cut, marked_pairs(self.router.get("/metrics", timeout=2).text))
        marked_at = cleared_at = None
        self.mesh.partition(f.index, f.peer, "both")
        t0 = time.monotonic()
        try:
            while time.monotonic() < t0 + f.hold:
                marks = marked_pairs(self.router.get("/metrics", timeout=2).text)
                other_marks.see(marks)
                if cut in marks and marked_at is None:
                    marked_at = time.monotonic() - t0
                time.sleep(0.1)
        finally:
            self.mesh.heal(f.index, f.peer)
        t1 = time.monotonic()
        during = set(attempts_by_room(self.router.log())) - set(attempts_by_room(log_before))
        after = received()
        while time.monotonic() < t1 + CLEAR_WITHIN_S:
            marks = marked_pairs(self.router.get("/metrics", timeout=2).text)
            if cut not in marks:
                cleared_at = time.monotonic() - t1
                break
            time.sleep(0.1)
        # the attempts begun during the cut, judged by the log now (a failure may be logged late)
        served = served_in_log(self.router.log(), rooms=during)
        names = {w.grpc_addr: w.name for w in self.workers["prefill"] + self.workers["decode"]}
        return {
            "what": f.describe(), "pair": [p.name, d.name],
            "marked_after_cut_s": None if marked_at is None else round(marked_at, 2),
            "cleared_after_heal_s": None if cleared_at is None else round(cleared_at, 2),
            "other_pairs_marked": sorted(f"{names.get(a, a)}-{names.get(b, b)}" for a, b in other_marks.marked),
            "marks_standing_at_cut": sorted(f"{names.get(a, a)}-{names.get(b, b)}" for a, b in other_marks.standing_at_start),
            # attempts that ended with no failure line in the router's log, per pair, during the cut
            "served_per_pair_during_cut": {f"{names.get(a, a)}-{names.get(b, b)}": n
                                           for (a, b), n in sorted(served.items()) if n},
            "served_on_the_cut_pair": served.get(cut, 0),
            "p_served_through_other_decodes": sum(n for (a, b), n in served.items() if a == cut[0] and b != cut[1]),
            "d_served_through_other_prefills": sum(n for (a, b), n in served.items() if b == cut[1] and a != cut[0]),
            "requests_received_per_worker_during_cut": {k: after[k] - before.get(k, 0) for k in after},
        }

    def wait_all_healthy(self, timeout: float = 60) -> None:
        """Faults come one at a time: the next waits until the router sees every worker healthy
        again (two workers of a role down at once is an outage, which 503s rightly report)."""
        def all_healthy():
            body = httpx.get(self.router.http_url + "/health", timeout=2).json()
            return all(w["healthy"] for role in ("prefill", "decode") for w in body[role].values())

        wait_for(all_healthy, timeout, "the router to see every worker healthy", poll=0.1)

    def run_faults(self, plan: list[Fault], t0: float, state: LoadState) -> None:
        for f in plan:
            time.sleep(max(0.0, t0 + f.at - time.monotonic()))
            began = time.monotonic() - t0
            try:
                self.apply(f, state)
                self.wait_all_healthy()
                outcome = "done"
            except Exception as e:  # noqa: BLE001 - recorded; the invariants decide
                outcome = f"failed: {e!r}"
                self.errors.append(f"fault {f.describe()} {outcome}")
            self.fault_log.append({**asdict(f), "what": f.describe(), "began": round(began, 2),
                                   "ended": round(time.monotonic() - t0, 2), "outcome": outcome})
        state.faults_done = True  # every fault hit a loaded mesh: the clients may stop now

    # --- the run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        began = time.monotonic()
        self.start()
        kinds = tuple(a.kinds or (HOST_KINDS if a.hosts else KINDS))
        # hosts mode: a partition at least twice (when the count allows)
        must = (*kinds, "partition") if "partition" in kinds else kinds
        plan = (parse_schedule(a.schedule) if a.schedule
                else plan_faults(a.seed, a.duration, a.faults, kinds=kinds, must=must))
        state = LoadState(self.router.http_url, think=a.think)
        t0 = time.monotonic()
        state.stop_at = t0 + a.duration
        state.hard_stop_at = state.stop_at + 180  # restarts under load can push the last faults late
        faults = threading.Thread(target=self.run_faults, args=(plan, t0, state), daemon=True)
        faults.start()

        async def load():
            await asyncio.gather(*(client_loop(state, c, a.seed, a.request_timeout) for c in range(a.clients)),
                                 *(conversation_loop(state, c, a.seed, a.request_timeout) for c in range(a.conversations)))

        asyncio.run(load())
        self.results_for_plot, self.t0 = state.results, t0
        load_end = time.monotonic()
        faults.join(timeout=120)
        last_fault_end = t0 + max((f["ended"] for f in self.fault_log), default=0.0)
        drain = self.check_drained()
        drained_at = time.monotonic()
        self._bank_counters(self.router)
        self.timings = {"start_s": t0 - began, "load_s": load_end - t0, "faults_after_load_s": max(0.0, last_fault_end - load_end),
                        "drain_s": drained_at - max(load_end, last_fault_end)}
        return self.report(state, plan, t0, load_end, last_fault_end, drained_at, drain)

    def check_drained(self) -> bool:
        """Invariant 3 (no traffic after the load): gauges 0, every page free or cached with no
        holder, no handle, no quarantine, aux slots free; the router holds no admission."""
        ok = True
        self.cached_pages: dict[str, int] = {}
        for proc in self.workers["prefill"] + self.workers["decode"]:
            def settled(proc=proc):
                m, h = proc.metrics(), proc.health()
                return (all(m.get(g, 0) == 0 for g in QUEUE_GAUGES[proc.role])
                        and h["kv_pages_free"] == h["kv_pages_total"] and h["kv_pool_ok"]
                        and h.get("nixl_live_handles", 0) == 0 and h.get("kv_pages_quarantined", 0) == 0
                        and h["aux_slots_free"] == h["aux_slots_total"])
            try:
                wait_for(settled, self.args.drain_timeout, f"{proc.role} {proc.grpc_addr} drained")
                self.cached_pages[f"{proc.role} {proc.grpc_addr}"] = proc.health().get("kv_pages_cached", 0)
            except AssertionError as e:
                ok = False
                self.errors.append(f"invariant 3: {e}; health={proc.health()}")
        try:
            wait_for(lambda: httpx.get(self.router.http_url + "/health", timeout=2).json()["running_requests"] == 0,
                     self.args.drain_timeout, "the router's admitted requests back to 0")
        except AssertionError as e:
            ok = False
            self.errors.append(f"invariant 3: {e}")
        return ok

    def report(self, state: LoadState, plan, t0, load_end, last_fault_end, drained_at, drained) -> dict:
        results = state.results
        restarts = [(t0 + f["began"], t0 + f["ended"]) for f in self.fault_log if f["kind"] == "router_restart"]

        def at_router_restart(r) -> bool:
            return r.router_gen[0] != r.router_gen[1] or any(b <= r.ended and r.started <= e for b, e in restarts)

        failed = [r for r in results if not r.ok]
        excused = [r for r in failed if at_router_restart(r) and r.cause.startswith("connection")]
        unexcused = [r for r in failed if r not in excused]
        hung = [r for r in results if r.cause == "client_timeout" or r.ended - r.started > self.args.request_timeout + 5]
        verify_began = time.monotonic()
        ties: list[str] = []
        mismatched = check_outputs(results, ties=ties)
        self.timings["verify_s"] = time.monotonic() - verify_began
        count_errors = check_counts(results, self.router_counts, self.router_killed_at)
        conversations = cache_hits(results, self.fault_log, t0)
        died = [f"{p.role} {p.grpc_addr or p.http_port} exit {p.popen.poll()}" for p in self.mesh.procs
                if p not in self.killed and not p.alive()]
        causes: dict[str, int] = {}
        for r in failed:
            causes[r.cause] = causes.get(r.cause, 0) + 1
        invariants = {
            "1_every_request_ended_in_time": not hung,
            "2_outputs_equal_single_process": not mismatched,
            "3_drained_pools_whole": drained,
            "4_no_unexpected_worker_death": not died,
            "5_metrics_agree_with_clients": not count_errors,
            "6_conversations_hit_cache_when_quiet": conversations.pop("ok"),
            "7_partial_partition_marks_only_its_pair": all(map(self.partial_partition_ok, self.partial_partitions)),
            "no_failed_requests_beyond_router_restarts": len(unexcused) <= self.args.allow_failures,
        }
        report = {
            "seed": self.args.seed, "duration_s": self.args.duration, "clients": self.args.clients,
            "think_s": self.args.think,
            "hosts": self.args.hosts,
            "without": self.args.without,
            "requests": {"sent": len(results), "succeeded": len(results) - len(failed), "failed": len(failed),
                         "failed_in_flight_at_router_restart": len(excused), "failed_by_cause": causes,
                         "streamed": sum(r.stream for r in results),
                         "stream_interval_above_1": sum(r.stream_interval > 1 for r in results),
                         "greedy": sum(r.seed is None for r in results),
                         "structured": sum(r.grammar is not None for r in results), "near_ties": len(ties)},
            "conversations": conversations,
            "faults": self.fault_log,
            "partial_partitions": self.partial_partitions,
            "longest_request_s": round(max((r.ended - r.started for r in results), default=0), 3),
            "drain_after_last_fault_s": round(drained_at - max(last_fault_end, load_end), 3),
            "migrations": {k: v for k, v in self.worker_counters.items() if "migrations" in k},
            "watchdog_evictions": {k: v for k, v in self.worker_counters.items() if "evictions" in k},
            "leaked_pages": 0 if drained else "see errors",
            "kv_pages_cached_after_drain": self.cached_pages,
            "invariants": invariants,
            "timings_s": {k: round(v, 1) for k, v in self.timings.items()},
            "ok": all(invariants.values()),
            "errors": self.errors + count_errors + [f"died: {d}" for d in died]
                      + [f"hung: request {r.id} {r.cause} {r.ended - r.started:.1f}s" for r in hung]
                      + [f"mismatch: {m}" for m in mismatched[:10]]
                      + [f"failed: request {r.id} {r.cause} at {r.started - t0:.1f}s" for r in unexcused[:20]],
        }
        return report

    @staticmethod
    def partial_partition_ok(seen: dict) -> bool:
        """Invariant 7: the cut pair marked soon after the cut and cleared soon after the heal,
        no other pair marked meanwhile, and both of its workers served through their other peers."""
        return (seen["marked_after_cut_s"] is not None and seen["marked_after_cut_s"] <= MARK_WITHIN_S
                and seen["cleared_after_heal_s"] is not None and not seen["other_pairs_marked"]
                and seen["p_served_through_other_decodes"] > 0 and seen["d_served_through_other_prefills"] > 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=3,
                    help="multi-round conversations beside the clients (chaos/soak_conversations.py)")
    ap.add_argument("--think", type=float, default=0.0,
                    help="seconds each client and conversation waits between its requests (0: back to back); "
                         "fewer requests for the single-process check to replay")
    ap.add_argument("--local-prefill-max-tokens", type=int, default=0,
                    help="the router's flag (conditional disaggregation); 0: every round goes through prefill")
    ap.add_argument("--faults", type=int, default=10, help="faults injected during the load")
    ap.add_argument("--hosts", action="store_true",
                    help="each service in its own network namespace (root; services/launch/netns.py), partitions among the faults")
    ap.add_argument("--kinds", nargs="+", default=None, choices=HOST_KINDS,
                    help=f"fault kinds to draw from (default {' '.join(KINDS)}; with --hosts also partition and "
                         "partial_partition)")
    ap.add_argument("--schedule", default="",
                    help="explicit faults instead of a drawn plan, e.g. 'kill:decode:0@8,inject:prefill:0:stall_transfer@15'"
                         " (--hosts: also 'partition:P:D[:both|to_decode|to_prefill][~hold]@seconds' and"
                         " 'partial_partition:P:D[~hold]@seconds')")
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--allow-failures", type=int, default=0)
    ap.add_argument("--router-processes", type=int, default=1,
                    help="the router's --processes (a router restart kills its supervisor, and so all of them)")
    ap.add_argument("--without", nargs="*", default=[], choices=("watchdog", "migration"),
                    help="switch a protection off, to show that the soak then fails")
    ap.add_argument("--out", default="bench/out/chaos")
    args = ap.parse_args(argv)
    if not args.hosts and (set(args.kinds or ()) & set(CUTS) or "partition" in args.schedule):
        ap.error("partition and partial_partition faults need --hosts (network namespaces)")
    if args.hosts:
        from services.launch.netns import unsupported_reason
        if (why := unsupported_reason()) is not None:
            ap.error(f"--hosts: {why}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = ("hosts-" if args.hosts else "") + f"seed{args.seed}" + "".join(f"-no-{w}" for w in args.without)
    logs = out / f"logs-{name}"  # every process's log, kept for reading a failure
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    # SIGTERM tears down like an exception: processes killed, namespaces deleted
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    soak = Soak(args, logs)
    try:
        if args.hosts:  # the clients and every HTTP call of the soak, from inside the client host
            from chaos.soak_hosts import run_inside
            report = run_inside(soak.mesh.topo.ns("client"), soak.run)
        else:
            report = soak.run()
    finally:
        soak.mesh.close()
    report["logs"] = str(logs)
    (out / f"report-{name}.json").write_text(json.dumps(report, indent=2))
    with (out / f"requests-{name}.jsonl").open("w") as f:  # every request, to re-check offline
        for r in soak.results_for_plot:
            f.write(json.dumps(asdict(r)) + "\n")
    try:
        from chaos.soak_plot import plot_timeline
        plot_timeline(report, soak.results_for_plot, soak.t0, out / f"timeline-{name}.png")
        report["timeline_png"] = str(out / f"timeline-{name}.png")
    except ImportError as e:
        report["timeline_png"] = f"not drawn: {e}"
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
