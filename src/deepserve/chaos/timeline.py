"""A chaos report as a PNG timeline (matplotlib, Agg: no display needed).

    panel 1  completed / failed requests per RATE_BUCKET_S (report["rates"])
    panel 2  RSS (MiB): the whole node, and each component
    panel 3  open fds: the whole node
    every panel: a vertical line at each fault's injection, labelled on top
                 (dashed red: the fault was not proven)
"""

from __future__ import annotations

from pathlib import Path


def plot(report: dict, path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["resources"]["samples"]
    fig, (ax_rate, ax_rss, ax_fds) = plt.subplots(3, 1, figsize=(12, 8), sharex=True)
    rates = report["rates"]
    if rates:
        ts = [r[0] for r in rates]
        ax_rate.step(ts, [r[1] for r in rates], where="post", label="completed", color="tab:green")
        ax_rate.step(ts, [r[2] for r in rates], where="post", label="failed", color="tab:red")
    ax_rate.set_ylabel("requests / 10 s")
    ax_rate.legend(fontsize=7, loc="upper right")
    ts = [s["t"] for s in samples]
    ax_rss.plot(ts, [s["rss_bytes"] / 2**20 for s in samples], label="total", color="black")
    components = sorted({c for s in samples for c in s["by_component"]})
    for c in components:
        ax_rss.plot(ts, [s["by_component"].get(c, [0])[0] / 2**20 for s in samples], label=c,
                    linewidth=0.8)
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax_fds.plot(ts, [s["num_fds"] for s in samples], color="tab:blue")
    ax_fds.set_ylabel("open fds")
    ax_fds.set_xlabel("seconds since the load started")
    for f in report["faults"]:
        if f["at_s"] is None:
            continue
        style = dict(color="tab:gray", linestyle="-") if f["proven"] else dict(
            color="tab:red", linestyle="--")
        for ax in (ax_rate, ax_rss, ax_fds):
            ax.axvline(f["at_s"], linewidth=0.8, **style)
        ax_rate.annotate(f["kind"], (f["at_s"], 1.0), xycoords=("data", "axes fraction"),
                         rotation=60, fontsize=6, va="bottom")
    fig.suptitle(f"chaos seed {report.get('seed')}: sent {report['sent']}, completed "
                 f"{report['completed']}, failed {report['failed']}, lost {report['lost']}, "
                 f"bad streams {report['bad_streams']}", fontsize=10, y=0.995)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
