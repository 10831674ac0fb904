"""Where a server's CPU goes during a load: py-spy samples one process per kind (the busiest
Ingress replica, the busiest Inference replica, ...) over the load's measured window, and the
samples are summed per function.

    python bench/run.py SCENARIO --profile [native|gil]   (py-spy on PATH: pip install py-spy)

`native` adds C frames (torch, nvJPEG, gRPC, Ray's core worker) and pauses the process for
each sample; `gil` samples only the thread holding the GIL: where a replica whose Python
runs near one core spends it.

Each profiled process leaves `<load>.<process>.txt` in the server's results folder: its busiest
functions by own time and by time including callees, as shares of the samples taken.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

RATE = 97  # samples per second, off the beat of periodic work
MODES = ("python", "native", "gil")


def available() -> bool:
    return shutil.which("py-spy") is not None


class Recording:
    """`py-spy record` of each process in `pids_by_name` from `begin` to `end` (epoch
    seconds), started in the background; `finish()` waits and writes the summaries."""

    def __init__(
        self,
        pids_by_name: dict[str, int],
        begin: float,
        end: float,
        prefix: Path,
        mode: str = "python",
    ) -> None:
        self._mode = mode
        self._started: list[tuple[subprocess.Popen, Path]] = []
        self._thread = threading.Thread(
            target=self._record, args=(pids_by_name, begin, end, prefix), daemon=True
        )
        self._thread.start()

    def _record(self, pids_by_name: dict[str, int], begin: float, end: float, prefix: Path):
        time.sleep(max(begin - time.time(), 0))
        seconds = str(max(int(end - time.time()), 1))
        for name, pid in pids_by_name.items():
            slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")[-40:]
            raw = prefix.with_name(f"{prefix.name}.{slug}.raw")
            command = ["py-spy", "record", "--pid", str(pid), "--duration", seconds]
            command += ["--rate", str(RATE), "--format", "raw", "-o", str(raw)]
            # native stacks need the process paused for each sample
            command += ["--native"] if self._mode == "native" else ["--nonblocking"]
            command += ["--gil"] if self._mode == "gil" else []
            child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self._started.append((child, raw))

    def finish(self, top: int = 25) -> None:
        self._thread.join(120)
        for child, raw in self._started:
            try:
                _, err = child.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                continue
            text = summary(raw, top) if raw.exists() else f"py-spy failed: {err.decode()[-500:]}\n"
            raw.with_suffix(".txt").write_text(text)


def summary(raw: Path, top: int) -> str:
    """Functions by own samples and by samples including callees (py-spy's raw format: one
    line per distinct stack, frames separated by ';', then the count)."""
    own: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = [_short(f) for f in stack.split(";") if f]
        if frames:
            own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    lines = [f"{samples} samples at {RATE}/s", "", "own %  function"]
    lines += [f"{100 * n / samples:5.1f}  {f}" for f, n in own.most_common(top)]
    lines += ["", "total %  function"]
    lines += [f"{100 * n / samples:5.1f}  {f}" for f, n in total.most_common(top)]
    return "\n".join(lines) + "\n"


def _short(frame: str) -> str:
    """`func (path/to/site-packages/pkg/mod.py:12)` -> `func (pkg/mod.py)`."""
    match = re.match(r"(.*) \((.*?):?\d*\)$", frame)
    if not match:
        return frame
    function, path = match.groups()
    path = re.sub(r".*/(site-packages|dist-packages|python3\.\d+)/", "", path)
    for root in ("serve_app/", "engines/", "clients/", "protos/"):
        if root in path:
            path = path[path.index(root) :]
    return f"{function} ({path})"
