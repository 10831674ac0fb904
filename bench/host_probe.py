"""How promptly the machine runs a thread that asks for a core, over a load's window.

A process of its own sleeps 1 ms at a time and records how late each wake-up came, and every
tenth wake-up times a fixed piece of Python work (about 0.2 ms on a quiet core), reported
against the fastest run of it in the window. With cores
to spare, a late wake-up or a slow piece of work is time the whole machine lost: its cores
held by the hypervisor (which a guest may not be told of as stolen time) or by a CPU quota.
Also read: the kernel's CPU pressure (/proc/pressure/cpu: the share of the window in which
some runnable task waited for a core).

    python bench/host_probe.py --seconds 5          (JSON on stdout)
    python bench/host_probe.py --start T0 --end T1  (wall-clock times, as bench/run.py runs it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SLEEP_S = 0.001
WORK_EVERY = 10
PRESSURE = Path("/proc/pressure/cpu")


def work(rounds: int) -> int:
    total = 0
    for i in range(rounds):
        total += i * i
    return total


def calibrate(target_s: float = 0.0002) -> int:
    """The rounds of `work` that take `target_s` on this core (the fastest of a few tries)."""
    rounds = 1000
    fastest = min(_timed(rounds) for _ in range(20))
    return max(int(rounds * target_s / fastest), 1)


def _timed(rounds: int) -> float:
    start = time.perf_counter()
    work(rounds)
    return time.perf_counter() - start


def stalled_us() -> int | None:
    """Microseconds so far in which some runnable task waited for a core (None without PSI)."""
    try:
        some = PRESSURE.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    return int(dict(field.split("=") for field in some[1:])["total"])


def quantiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {}
    cuts = statistics.quantiles(values, n=1000, method="inclusive")
    return {"p50": cuts[499], "p99": cuts[989], "p999": cuts[998], "max": max(values)}


def probe(start: float, end: float) -> dict:
    rounds = calibrate()
    time.sleep(max(start - time.time(), 0))
    pressure_before, window_start = stalled_us(), time.monotonic()
    late_ms, work_s = [], []
    while time.time() < end:
        asked = time.perf_counter()
        time.sleep(SLEEP_S)
        late_ms.append((time.perf_counter() - asked - SLEEP_S) * 1000)
        if len(late_ms) % WORK_EVERY == 0:
            work_s.append(_timed(rounds))
    window = time.monotonic() - window_start
    pressure_after = stalled_us()
    report = {
        "wake_late_ms": {k: round(v, 3) for k, v in quantiles(late_ms).items()},
        "wake_late_over_5ms": sum(late > 5 for late in late_ms),
        "wakes": len(late_ms),
        # a fixed piece of work's time over its fastest in the window
        "work_slowdown": {k: round(v / min(work_s), 2) for k, v in quantiles(work_s).items()},
    }
    if pressure_before is not None and pressure_after is not None:
        report["cpu_pressure_share"] = round((pressure_after - pressure_before) / 1e6 / window, 4)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, help="probe from now for this long")
    parser.add_argument("--start", type=float, help="wall-clock time to start at")
    parser.add_argument("--end", type=float, help="wall-clock time to stop at")
    args = parser.parse_args()
    start = args.start if args.start is not None else time.time()
    end = args.end if args.end is not None else start + (args.seconds or 5.0)
    print(json.dumps(probe(start, end)))


if __name__ == "__main__":
    main()
