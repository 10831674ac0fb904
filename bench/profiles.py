"""Where a server's CPU goes during a load: py-spy samples one process per kind (the busiest
Ingress replica, the busiest Inference replica, ...) over the load's measured window, and the
samples are summed per function.

    python bench/run.py SCENARIO --profile [native|gil]   (py-spy on PATH: pip install py-spy)

`native` adds C frames (torch, nvJPEG, gRPC, Ray's core worker) and pauses the process for
each sample; `gil` samples only the thread holding the GIL: where a replica whose Python
runs near one core spends it. `threads` samples nothing: it reads each thread's CPU time
from /proc at the window's start and end, and names the threads (the OS name that gRPC,
CUDA and Ray give theirs; for Python's, its name and innermost function from one `py-spy
dump` in mid-window): which threads of a replica use its cores, native ones included.

Each profiled process leaves `<load>.<process>.txt` in the server's results folder: its busiest
functions by own time and by time including callees, as shares of the samples taken (with
`threads`: its threads by CPU).
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

RATE = 97  # samples per second, off the beat of periodic work
MODES = ("python", "native", "gil", "threads")


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
        if self._mode == "threads":
            self._thread_times(pids_by_name, begin, end, prefix)
            return
        seconds = str(max(int(end - time.time()), 1))
        for name, pid in pids_by_name.items():
            raw = prefix.with_name(f"{prefix.name}.{_slug(name)}.raw")
            command = ["py-spy", "record", "--pid", str(pid), "--duration", seconds]
            command += ["--rate", str(RATE), "--format", "raw", "-o", str(raw)]
            # native stacks need the process paused for each sample
            command += ["--native"] if self._mode == "native" else ["--nonblocking"]
            command += ["--gil"] if self._mode == "gil" else []
            child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self._started.append((child, raw))

    def _thread_times(
        self, pids_by_name: dict[str, int], begin: float, end: float, prefix: Path
    ) -> None:
        before = {pid: _thread_ticks(pid) for pid in pids_by_name.values()}
        time.sleep(max(begin + (end - begin) / 2 - time.time(), 0))
        python = {pid: _python_threads(pid) for pid in pids_by_name.values()}
        time.sleep(max(end - time.time(), 0))
        seconds = max(time.time() - begin, 1e-3)
        for name, pid in pids_by_name.items():
            after = _thread_ticks(pid)
            rows = []
            for tid, (comm, ticks) in after.items():
                cores = (ticks - before[pid].get(tid, (comm, 0))[1]) / TICK / seconds
                rows.append((cores, tid, comm, python[pid].get(tid, "")))
            rows.sort(reverse=True)
            lines = [f"{name} (pid {pid}): CPU by thread over {seconds:.1f} s", ""]
            lines += ["cores  tid      OS name          Python thread: innermost function"]
            lines += [f"{c:5.2f}  {t:<8} {n:16} {p}" for c, t, n, p in rows if c >= 0.005]
            by_name: collections.Counter = collections.Counter()
            for cores, _, comm, _ in rows:
                by_name[comm] += cores
            lines += ["", "cores  OS name (all its threads)"]
            lines += [f"{c:5.2f}  {n}" for n, c in by_name.most_common() if c >= 0.005]
            lines += [f"{sum(r[0] for r in rows):5.2f}  (the process)"]
            prefix.with_name(f"{prefix.name}.{_slug(name)}.txt").write_text("\n".join(lines) + "\n")

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


TICK = os.sysconf("SC_CLK_TCK")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")[-40:]


def _thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """{tid: (OS thread name, user + system clock ticks)} of a process's threads now."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        threads[int(task.name)] = (
            stat[stat.index("(") + 1 : stat.rindex(")")],
            int(fields[11]) + int(fields[12]),
        )
    return threads


def _python_threads(pid: int) -> dict[int, str]:
    """{tid: "name: innermost function"} of a process's Python threads (`py-spy dump`);
    empty without py-spy."""
    if not available():
        return {}
    command = ["py-spy", "dump", "--json", "--nonblocking", "--pid", str(pid)]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
        threads = json.loads(out)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return {}
    named = {}
    for thread in threads:
        frames = thread.get("frames") or [{}]
        top = frames[0]
        where = f"{top.get('name', '?')} ({_short_path(top.get('filename', ''))})" if top else ""
        named[thread.get("os_thread_id")] = f"{thread.get('thread_name', '')}: {where}"
    return named


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
    return f"{function} ({_short_path(path)})"


def _short_path(path: str) -> str:
    path = re.sub(r".*/(site-packages|dist-packages|python3\.\d+)/", "", path)
    for root in ("serve_app/", "engines/", "clients/", "protos/"):
        if root in path:
            path = path[path.index(root) :]
    return path
