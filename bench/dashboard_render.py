"""Render deploy/grafana/raystream.json's panels from a Prometheus that scraped a real run:
each panel's own PromQL, evaluated by Prometheus over the run's window, drawn with matplotlib
(docs/images/dashboard.png; not a Grafana screenshot). docs/operations.md has the steps.

    python bench/dashboard_render.py --prometheus http://127.0.0.1:9090 \
        --start 1765000000 --end 1765000600 --out docs/images/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
UNITS = {"reqps": "per second", "ms": "ms", "short": "", "percentunit": "ratio"}


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    """Prometheus' answer to one range query: [{metric: labels, values: [[t, "v"], ...]}]."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as r:
        reply = json.load(r)
    if reply["status"] != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {reply}")
    return reply["data"]["result"]


def expand(expr: str, rate_interval: str, application: str) -> str:
    """The dashboard's variables as Grafana would fill them in."""
    return expr.replace("$__rate_interval", rate_interval).replace("$application", application)


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def _with_gaps(values: list, start: float, step: float) -> tuple[list[float], list[float]]:
    """Minutes since `start` and values, a NaN where Prometheus had no point (no line drawn
    across a gap, as Grafana draws none)."""
    times, points, last = [], [], None
    for t, v in values:
        t = float(t)
        if last is not None and t - last > 2 * step:
            times.append((last + step - start) / 60)
            points.append(float("nan"))
        times.append((t - start) / 60)
        points.append(float(v))
        last = t
    return times, points


def render(args: argparse.Namespace) -> None:
    dashboard = json.loads(args.dashboard.read_text())
    panels = sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 2.4 * rows), sharex=True, squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            expr = expand(target["expr"], args.rate_interval, args.application)
            for series in query_range(args.prometheus, expr, args.start, args.end, args.step):
                values = [float(v) for _, v in series["values"]]
                if not any(values):
                    continue  # a series that stays 0 (Grafana draws it; here it crowds)
                times, points = _with_gaps(series["values"], args.start, args.step)
                label = legend(target.get("legendFormat", ""), series["metric"])
                ax.plot(times, points, linewidth=1.2, label=label)
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.set_ylabel(UNITS.get(panel["fieldConfig"]["defaults"].get("unit"), ""), fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        if ax.lines:
            ax.legend(fontsize=6, loc="best", ncol=2, frameon=False)
    for ax in axes[-1]:
        ax.set_xlabel("minutes into the run", fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=args.dpi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--dashboard", type=Path, default=ROOT / "deploy/grafana/raystream.json")
    parser.add_argument("--start", type=float, help="unix time (default: --end - 10 minutes)")
    parser.add_argument("--end", type=float, default=None, help="unix time (default: now)")
    parser.add_argument("--step", type=float, default=5.0, help="seconds between points")
    parser.add_argument("--rate-interval", default="30s", help="$__rate_interval's value")
    parser.add_argument("--application", default=".*", help="$application's value (a regex)")
    parser.add_argument("--title", default="raystream (deploy/grafana/raystream.json)")
    parser.add_argument("--dpi", type=int, default=80)
    parser.add_argument("--out", type=Path, default=ROOT / "docs/images/dashboard.png")
    args = parser.parse_args()
    args.end = args.end or time.time()
    args.start = args.start or args.end - 600
    render(args)
    print(f"{args.out}: {args.out.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
