"""Plots of bench/pd_vs_colocated.py's report (matplotlib, a bench-only dependency).

  latency_vs_load.png      TTFT p50/p99, ITL p99 and the share of requests within the SLO
                           against the request rate, PD and colocated
  mixed_itl_over_time.png  every inter-token gap of the mixed workload at the report's ITL
                           rate, at the time its token arrived, PD above colocated; dotted
                           lines mark the arrivals of the long prompts

Usage: python bench/plot.py [bench/out/pd_vs_colocated.json] [--out-dir docs/bench] [--spikes-ms 150]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODES = (("pd", "PD (prefill core 0, decode core 1)", "tab:blue"),
         ("colocated", "colocated (one worker, cores 0-1)", "tab:red"))


def caption(report: dict) -> str:
    m = report["machine"]
    return f"{m['cpu']}, {m['cores']} cores · load avg at start {m['load_avg_at_start'][0]:.1f} · {report['workload']}"


def latency_vs_load(report: dict, out: pathlib.Path) -> None:
    sweep = report["sweep"]
    rates = [p["rate"] for p in sweep]
    slo = report["slo"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for mode, label, color in MODES:
        axes[0].plot(rates, [p[mode]["ttft_ms"]["p50"] for p in sweep], "o--", color=color, label=f"{label} p50")
        axes[0].plot(rates, [p[mode]["ttft_ms"]["p99"] for p in sweep], "o-", color=color, label=f"{label} p99")
        axes[1].plot(rates, [p[mode]["itl_ms"]["p99"] for p in sweep], "o-", color=color, label=label)
        axes[2].plot(rates, [100 * p[mode]["goodput"]["fraction"] for p in sweep], "o-", color=color, label=label)
    axes[0].axhline(slo["ttft_ms"], color="grey", lw=0.8, ls=":")
    axes[1].axhline(slo["itl_p99_ms"], color="grey", lw=0.8, ls=":")
    axes[2].axhline(90, color="grey", lw=0.8, ls=":")
    axes[0].set(title="TTFT", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    axes[1].set(title="ITL p99", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    axes[2].set(title=f"within SLO (TTFT ≤ {slo['ttft_ms']:g} ms, ITL p99 ≤ {slo['itl_p99_ms']:g} ms)",
                xlabel="request rate (req/s)", ylabel="%", ylim=(0, 105))
    for p in sweep:  # the machine's load when the point started: other processes share the cores
        if "load_avg_1m_at_start" in p:
            axes[1].annotate(f"load {p['load_avg_1m_at_start']:.0f}", (p["rate"], 0.02), xycoords=("data", "axes fraction"),
                             fontsize=7, ha="center", color="grey")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("mixed workload: latency vs load — " + caption(report), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def itl_over_time(report: dict, out: pathlib.Path) -> None:
    at = next(p for p in report["sweep"] if p["rate"] == report["mixed_itl"]["rate"])
    fig, axes = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True, sharey=True)
    for ax, (mode, label, color) in zip(axes, MODES, strict=True):
        requests = json.loads(pathlib.Path(at[mode]["requests_file"]).read_text())
        xs, ys = [], []
        for r in requests:
            times = r["token_times"]
            xs += times[1:]
            ys += [1e3 * g for g in r["itls"]]
            if r["kind"] == "long":
                ax.axvline(r["arrival"], color="grey", lw=0.7, ls=":")
        ax.scatter(xs, ys, s=3, color=color, alpha=0.6)
        p99 = at[mode]["itl_ms"]["p99"]
        ax.axhline(p99, color="black", lw=0.8, ls="--")
        ax.set(title=f"{label}: ITL p99 {p99:g} ms (dashed); dotted: a long prompt arrives", ylabel="ITL (ms)",
               yscale="log")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time since the start of the run (s)")
    fig.suptitle(f"mixed workload at {at['rate']:g} req/s: every inter-token gap — " + caption(report), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def spikes(report: dict, threshold_ms: float) -> dict:
    """Inter-token gaps above `threshold_ms` at the ITL rate: how many fall while a long prompt
    is being computed (between its arrival and its first token) and how many outside."""
    at = next(p for p in report["sweep"] if p["rate"] == report["mixed_itl"]["rate"])
    out = {"rate": at["rate"], "threshold_ms": threshold_ms}
    for mode, _, _ in MODES:
        requests = json.loads(pathlib.Path(at[mode]["requests_file"]).read_text())
        windows = [(r["arrival"], r["arrival"] + r["ttft"]) for r in requests if r["kind"] == "long" and r["ok"]]
        inside = outside = total = 0
        for r in requests:
            t = r["token_times"]
            for a, b in zip(t, t[1:], strict=False):
                total += 1
                if (b - a) * 1e3 > threshold_ms:
                    if any(w0 <= b and a <= w1 for w0, w1 in windows):
                        inside += 1
                    else:
                        outside += 1
        out[mode] = {"gaps": total, "above_during_a_long_prefill": inside, "above_otherwise": outside}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", nargs="?", default="bench/out/pd_vs_colocated.json")
    ap.add_argument("--out-dir", default="docs/bench")
    ap.add_argument("--spikes-ms", type=float, default=0.0,
                    help="print where the gaps above this many ms fall (during a long prefill or not) and exit")
    args = ap.parse_args(argv)
    report = json.loads(pathlib.Path(args.report).read_text())
    if args.spikes_ms:
        print(json.dumps(spikes(report, args.spikes_ms)))
        return 0
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    latency_vs_load(report, out / "latency_vs_load.png")
    itl_over_time(report, out / "mixed_itl_over_time.png")
    print(f"wrote {out / 'latency_vs_load.png'} and {out / 'mixed_itl_over_time.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
