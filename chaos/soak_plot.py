"""The chaos soak's timeline PNG: requests in flight, failures, conversation rounds that hit or
missed the prefix cache, and the faults as shaded spans."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"kill": "tab:red", "freeze": "tab:blue", "router_restart": "tab:purple", "inject": "tab:orange",
          "partition": "tab:brown", "partial_partition": "tab:olive"}


def plot_timeline(report: dict, results, t0: float, path: pathlib.Path) -> None:
    end = max([r.ended - t0 for r in results] + [report["duration_s"]])
    steps = [i * 0.25 for i in range(int(end / 0.25) + 2)]
    in_flight = [sum(1 for r in results if r.started - t0 <= t < r.ended - t0) for t in steps]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.plot(steps, in_flight, color="black", lw=1, label="requests in flight")
    done = [r.ended - t0 for r in results if r.ok]
    ax.scatter(done, [0.05] * len(done), marker="|", color="tab:green", s=30, label="succeeded")
    rounds = [r for r in results if r.ok and getattr(r, "conversation", None) is not None and r.round >= 2]
    if rounds:  # conversation rounds from round 2 on: did the workers find the history cached?
        hit = [r.ended - t0 for r in rounds if (r.cached_tokens or 0) > 0]
        miss = [r.ended - t0 for r in rounds if not r.cached_tokens]
        ax.scatter(hit, [0.55] * len(hit), marker="o", color="tab:cyan", s=12, label=f"round hit cache ({len(hit)})")
        ax.scatter(miss, [0.55] * len(miss), marker="o", facecolors="none", edgecolors="gray", s=12,
                   label=f"round missed ({len(miss)})")
    failed = [r for r in results if not r.ok]
    if failed:
        ax.scatter([r.ended - t0 for r in failed], [0.3] * len(failed), marker="x", color="red", s=40,
                   label=f"failed ({len(failed)})")
    for f in report["faults"]:
        ax.axvspan(f["began"], max(f["ended"], f["began"] + 0.3), color=COLORS[f["kind"]], alpha=0.18)
        ax.text(f["began"], max(in_flight or [1]) + 0.3, f["what"], rotation=60, fontsize=7, va="bottom")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in COLORS.values()]
    first = ax.legend(loc="upper right", fontsize=8)
    ax.add_artist(first)
    ax.legend(handles, list(COLORS), loc="upper left", fontsize=8, title="faults")
    ok = "all invariants hold" if report["ok"] else "INVARIANT FAILED"
    ax.set_title(f"pdmesh chaos soak{' (hosts)' if report.get('hosts') else ''}, seed {report['seed']}: {report['requests']['sent']} requests, "
                 f"{len(report['faults'])} faults — {ok}", fontsize=10)
    ax.set_xlabel("seconds since load started")
    ax.set_ylabel("requests in flight")
    ax.set_ylim(0, max(in_flight or [1]) + 3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
