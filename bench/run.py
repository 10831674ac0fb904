"""The benchmark runner: declarative scenarios (bench/scenarios/*.yaml) against real servers,
measured with the plain grpcio load generator (bench/load.py).

    python bench/run.py bench/scenarios/cpu.yaml [--only direct] [--loads low,saturated] \
        [--duration 5] [--warmup 1] [--out DIR] [--port 9200]

For each server of a scenario (a Serve config from deploy/, `raystream serve` flags, CUDA MPS
or not) the runner starts `raystream serve` on its own port (under an MPS daemon of its own
where asked), times its start up to the `raystream ready:` line, runs the server's loads in
order and stops it with SIGINT. During each load's measured window it samples the CPU time
(utime + stime, /proc/PID/stat) of every server process: see `ServerProcesses`. Loads that
need no raystream server run after it stops: `baseline` (the same photos decoded and
classified in one process, no gRPC, no Ray) and `plain_server` (bench/plain_server.py, a
plain grpc.aio server with canned answers, loaded and measured like raystream).

It prints a table last and writes results.json plus every load's report and every server's
log under --out (default bench/results/<time>, or $OUT/bench when OUT is set). The format of a
scenario file is in docs/benchmarking.md and in bench/scenarios/cpu.yaml.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import load  # noqa: E402  (bench/load.py: the plain load generator)
import profiles  # noqa: E402  (bench/profiles.py: py-spy per process kind)

TICK = os.sysconf("SC_CLK_TCK")
LOAD_FIELDS = {
    "connections",
    "in_flight",
    "images",
    "unary",
    "rate",
    "duration",
    "warmup",
    "processes",
    "top_k",
    "timeout_ms",
    "drain",
    "outputs",
    "pixels",
    "repeat_fraction",
    "traced_connections",
}
EXTRA_FIELDS = {
    "name",
    "kind",
    "compare",
    "photos",
    "decode_threads",
    "decode_size",
    "hash_images",
    "rows",
    "senders",
}
# grpc: bench/load.py; embed: `raystream embed` of `rows` photos into Parquet shards (against
# the server); baseline and plain_server: no Serve server (see run_server)
KINDS = {"grpc", "embed", "baseline", "plain_server"}
REMOTE_KINDS = {"grpc", "embed"}


# --- CPU time of a server's processes -----------------------------------------------------


def _proc_stat(pid: str) -> tuple[int, int, int] | None:
    """(ppid, starttime, utime + stime in ticks) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19]), int(fields[11]) + int(fields[12])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _process_name(pid: int) -> str:
    """A short name: `ray::ServeReplica:raystream:Ingress`, `raylet`, `gcs_server`, or the
    module or script a Python process runs (`ray.serve.scripts`, `clients.cli`, ...)."""
    args = [a for a in _cmdline(pid) if a]
    if not args:
        return "?"
    if args[0].startswith("ray::") or not Path(args[0]).name.startswith("python"):
        return Path(args[0].split()[0]).name
    rest = args[1:]
    for i, arg in enumerate(rest):
        if arg == "-m" and i + 1 < len(rest):
            return rest[i + 1]
        if arg == "-c":
            return "python -c"
        if not arg.startswith("-"):
            return Path(arg).name
    return "python"


class ServerProcesses:
    """The processes of one server, and their CPU time over a window.

    Counted: the `raystream serve` process (or the plain server) and every process whose
    ancestors include it, found afresh at each sample. That is the whole Ray instance that
    `serve run` starts: its driver, gcs_server, raylet, the dashboard and its agents, the log
    monitor, and (children of the raylet) the ServeController, every replica and idle worker.
    A Ray process reparented away from that tree is still counted: a `ray::` worker whose
    RAY_RAYLET_PID names a raylet of this tree, or any process whose command line names this
    instance's session directory. Processes of any other Ray instance on the machine (tests,
    another user's) are never counted, which a rule such as "every `ray::` process started
    after the server" would not ensure. With mps=True the CUDA MPS daemon and server that
    the runner started for this server count too (reported apart as well).

    Each process' utime + stime (all its threads) is read at the window's start, every
    `interval` seconds during it, and at its end; a process that exits during the window
    counts up to its last sample (at most `interval` of it is lost); a process that starts
    during the window counts from zero. The CPU of exited children that the kernel adds to a
    parent's cutime is not read, so nothing counts twice."""

    def __init__(self, root: int, mps: bool = False, interval: float = 0.5) -> None:
        self.root, self.mps, self.interval = root, mps, interval
        self.session: str | None = None
        self.raylets: set[int] = set()

    def scan(self) -> dict[tuple[int, int], tuple[int, str]]:
        """{(pid, starttime): (cpu ticks, name)} of every process of this server now."""
        stats, children = {}, {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                stat = _proc_stat(entry.name)
                if stat is not None:
                    pid = int(entry.name)
                    stats[pid] = stat
                    children.setdefault(stat[0], []).append(pid)
        mine, todo = set(), [self.root] if self.root in stats else []
        while todo:
            pid = todo.pop()
            mine.add(pid)
            todo.extend(children.get(pid, ()))
        for pid in mine:
            if self.session is None or not self.raylets:
                self._learn(pid)
        for pid in stats.keys() - mine:
            if self._stray(pid):
                mine.add(pid)
        return {(pid, stats[pid][1]): (stats[pid][2], _process_name(pid)) for pid in mine}

    def _learn(self, pid: int) -> None:
        args = _cmdline(pid)
        if args and Path(args[0]).name == "raylet":
            self.raylets.add(pid)
        for arg in args:
            if "/session_" in arg and self.session is None:
                start = arg.index("/session_") + 1
                self.session = arg[start:].split("/")[0]

    def _stray(self, pid: int) -> bool:
        args = _cmdline(pid)
        if not args or not args[0]:
            return False
        if self.mps and Path(args[0]).name.startswith("nvidia-cuda-mps"):
            return True
        if self.session and any(self.session in a for a in args):
            return True
        if args[0].startswith("ray::") and self.raylets:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                return False
            return any(f"RAY_RAYLET_PID={r}".encode() in env for r in self.raylets)
        return False

    def busiest_per_kind(self, containing: str = "", seconds: float = 0.5) -> dict[str, int]:
        """{process name: pid}: of each name that holds `containing`, the process that used
        the most CPU over the next `seconds` (one replica per deployment: on a one-connection
        load, the ingress replica that holds the connection)."""
        before = self.scan()
        time.sleep(seconds)
        busiest: dict[str, tuple[int, int]] = {}  # name: (ticks, pid)
        for (pid, start), (ticks, name) in sorted(self.scan().items()):
            if containing in name:
                spent = ticks - before.get((pid, start), (ticks, name))[0]
                busiest[name] = max(busiest.get(name, (-1, pid)), (spent, pid))
        return {name: pid for name, (_, pid) in busiest.items()}

    def settle(
        self, most_s: float, quiet_cores: float = 2.0, step_s: float = 3.0, quiet_steps: int = 2
    ) -> float:
        """Waits until the server's processes use under `quiet_cores` in each of `quiet_steps`
        steps of `step_s` in a row (the GPU replicas capture and compile their smaller
        buckets after ready, on many cores; one quiet step came while twelve replicas were
        still capturing their last buckets), at most `most_s` in all; returns the seconds
        waited."""
        start = time.time()
        before = self.scan()
        quiet = 0
        while (step := min(step_s, start + most_s - time.time())) > 0:
            time.sleep(step)
            now = self.scan()
            spent = sum(ticks - before.get(key, (0, ""))[0] for key, (ticks, _) in now.items())
            quiet = quiet + 1 if spent / TICK < quiet_cores * step else 0
            if quiet >= quiet_steps:
                break
            before = now
        return time.time() - start

    def measure(self, start: float, end: float, stop: threading.Event) -> dict:
        """Sleeps until `start`, samples until `end` (or `stop`); the CPU seconds spent in
        between."""
        time.sleep(max(start - time.time(), 0))
        first, host_before, throttled_before = self.scan(), _host_ticks(), _throttled()
        last = dict(first)
        while time.time() < end and not stop.is_set():
            time.sleep(min(self.interval, max(end - time.time(), 0)))
            last.update(self.scan())
        seconds = min(time.time(), end) - start
        by_name: dict[str, float] = {}
        busiest = ("", 0.0)  # one process's CPU bounds what its connections get
        for key, (ticks, name) in last.items():
            spent = (ticks - first.get(key, (0, ""))[0]) / TICK
            by_name[name] = by_name.get(name, 0.0) + spent
            busiest = max(busiest, (name, spent), key=lambda pair: pair[1])
        host = {
            kind: (after - before) / TICK / seconds
            for kind, before, after in zip(HOST_TICKS, host_before, _host_ticks(), strict=True)
        }
        throttled = {
            kind: round(after - throttled_before[kind], 3)
            for kind, after in _throttled().items()
            if kind in throttled_before
        }
        return {
            "cpu_s": sum(by_name.values()),
            # The whole machine's cores busy (the load client's included) and stolen by its
            # hypervisor, on average over the window; and, where this process' cgroup has a
            # CPU quota, the quota periods in which it was throttled and the time throttled.
            "host_cores": {kind: round(cores, 2) for kind, cores in host.items()},
            **({"cgroup_throttled": throttled} if throttled else {}),
            "processes": len(last),
            "cpu_s_by_process": dict(sorted(by_name.items(), key=lambda kv: -kv[1])),
            "busiest_process": {"name": busiest[0], "cores": busiest[1] / seconds},
        }


HOST_TICKS = ("busy", "steal")


def _host_ticks() -> tuple[int, int]:
    """The machine's busy (user, nice, system, irq, softirq) and stolen clock ticks so far,
    over all cores (/proc/stat's first line)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return user + nice + system + irq + softirq, steal


# cgroup v2, then v1: (cpu.stat, its throttled time's key, that key's unit in seconds)
CPU_STATS = (
    ("/sys/fs/cgroup/cpu.stat", "throttled_usec", 1e-6),
    ("/sys/fs/cgroup/cpu/cpu.stat", "throttled_time", 1e-9),
    ("/sys/fs/cgroup/cpu,cpuacct/cpu.stat", "throttled_time", 1e-9),
)


def _throttled() -> dict[str, float]:
    """The CPU quota periods this process' cgroup was throttled in, and the seconds
    throttled, so far ({} where no cpu.stat is readable)."""
    for path, key, unit in CPU_STATS:
        try:
            stats = dict(line.split() for line in Path(path).read_text().splitlines())
        except (OSError, ValueError):
            continue
        if key in stats and "nr_throttled" in stats:
            return {"periods": float(stats["nr_throttled"]), "s": int(stats[key]) * unit}
    return {}


def _tcp_connections(port: int) -> int:
    """Established TCP connections to `port` on this machine (the client side of each)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def gpu_busy(seconds: int) -> dict:
    """Over the next `seconds`: the share of each second that kernels ran (`sm`) and that
    the JPEG decode engines were busy (`jpg`), in %, averaged over the seconds and the GPUs
    (`nvidia-smi dmon -s u`). Empty without nvidia-smi or when it fails."""
    if shutil.which("nvidia-smi") is None:
        return {}
    command = ["nvidia-smi", "dmon", "-s", "u", "-d", "1", "-c", str(max(seconds, 1))]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_dmon(out.stdout)


def parse_dmon(text: str) -> dict:
    """`nvidia-smi dmon` output -> the mean of each column asked for, over its rows."""
    columns, rows = [], []
    for line in text.splitlines():
        fields = line.lstrip("#").split()
        if line.startswith("#") and "sm" in fields:
            columns = fields
        elif columns and not line.startswith("#") and len(fields) == len(columns):
            rows.append(dict(zip(columns, fields, strict=True)))
    means = {}
    for column in ("sm", "jpg"):
        values = [float(row[column]) for row in rows if row.get(column, "-").isdigit()]
        if values:
            means[column] = round(sum(values) / len(values), 1)
    return means | ({"samples": len(rows)} if means else {})


# --- loads -----------------------------------------------------------------------------


def tiny_photos(folder: Path) -> Path:
    """Seven 8x8 PNGs (for `photos: tiny`): decoding them costs next to nothing."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(7):
        Image.new("RGB", (8, 8), (30 * i, 255 - 30 * i, 128)).save(folder / f"tiny{i}.png")
    return folder


_PHOTOS: list[Path] = []


def builtin_photos() -> Path:
    """load.py's built-in photos as files in their order, made once per run (outside --out,
    which a GPU host sends back)."""
    if not _PHOTOS:
        folder = Path(tempfile.mkdtemp(prefix="raystream-photos-"))
        for i, (name, data) in enumerate(zip(load.PHOTOS, load.builtin_photos(), strict=True)):
            (folder / f"{i}-{name}.jpg").write_bytes(data)
        _PHOTOS.append(folder)
    return _PHOTOS[0]


def run_embed_load(load_def: dict, target: str, tree: ServerProcesses, path: Path) -> dict:
    """One `raystream embed` command over a manifest of `rows` keys (the built-in photos over
    and over), into Parquet shards in a fresh folder, with the command's own choice of
    connections, requests in flight and sender processes unless the load sets them;
    images/s over its whole run, start and the last shard's write included; the CPU the
    command and its sender processes spent (in cores over that run), and the server's and
    the machine's over the same time (is the host's CPU what holds the job back?)."""
    rows = int(load_def.get("rows", 20_000))
    work = Path(tempfile.mkdtemp(prefix="raystream-embed-"))
    photos = sorted(builtin_photos().iterdir())
    manifest = work / "manifest.csv"
    manifest.write_text(
        "key,path\n" + "".join(f"k{i},{photos[i % len(photos)]}\n" for i in range(rows))
    )
    command = [sys.executable, "-m", "clients.cli", "embed", "--manifest", str(manifest)]
    command += ["--key-column", "key", "--path-column", "path", "--out", str(work / "out")]
    command += ["--server", target, "--timeout", "120"]
    for field in ("connections", "in_flight", "senders"):
        if load_def.get(field):
            command += [f"--{field.replace('_', '-')}", str(load_def[field])]
    measured: dict = {}
    stop = threading.Event()
    now = time.time()
    sampler = threading.Thread(
        target=lambda: measured.update(tree.measure(now, now + 1800, stop)), daemon=True
    )
    sampler.start()
    start, cpu_before = time.perf_counter(), _children_cpu_s()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    finally:
        stop.set()
        sampler.join(30)
    seconds = time.perf_counter() - start
    client_cores = (_children_cpu_s() - cpu_before) / seconds
    shutil.rmtree(work, ignore_errors=True)
    if done.returncode != 0:
        report = {"failed": f"raystream embed exited {done.returncode}: {done.stderr[-300:]}"}
    else:
        report = {"images_per_s": rows / seconds, "seconds": seconds, "rows": rows}
        report["client_cores"] = client_cores
        report["server_cpu"] = measured
        if measured:
            report["cpu_ms_per_image"] = measured["cpu_s"] * 1000.0 / rows
        senders = load_def.get("senders", 1)
        report["summary"] = (
            f"{rows} keys in {seconds:.1f} s by one raystream embed command"
            + (f" ({senders} sender processes)" if senders > 1 else "")
            + f", {client_cores:.2f} cores of its own"
        )
    path.write_text(json.dumps(report, indent=1))
    return report


def _children_cpu_s() -> float:
    """CPU seconds of this process' finished children and theirs (a command's senders)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run_grpc_load(
    load_def: dict,
    target: str,
    tree: ServerProcesses,
    path: Path,
    profile: str | None = None,
    host_probe: bool = False,
) -> dict:
    """bench/load.py against the server, as a child process; the server's CPU over the
    window that it announces (with `profile`, py-spy profiles of its processes; with
    `host_probe`, bench/host_probe.py's account of how promptly the machine ran a thread)."""
    spec = _spec(load_def, target)
    port = int(spec.target.rsplit(":", 1)[1])
    command = [sys.executable, str(HERE / "load.py"), "--target", spec.target]
    photos = load_def.get("photos", "builtin")
    if photos == "tiny":
        command += ["--photos", str(tiny_photos(path.parent / "tiny-photos"))]
    elif photos == "builtin":  # encoded once per run, not once per load
        command += ["--photos", str(builtin_photos())]
    else:
        command += ["--photos", str(ROOT / photos)]
    for field in sorted(LOAD_FIELDS):
        value = getattr(spec, field)
        if isinstance(value, bool):
            command += [f"--{field.replace('_', '-')}"] if value else []
        elif value is not None:
            command += [f"--{field.replace('_', '-')}", str(value)]
    command += ["--announce-window", "--json", str(path)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    measured: dict = {}
    stop = threading.Event()
    sampler = gpu_sampler = prober = None
    lines = []
    recording = None

    def sample(start: float, end: float) -> None:
        time.sleep(max(start + (end - start) / 2 - time.time(), 0))
        measured["tcp_connections"] = _tcp_connections(port)

    gpu: dict = {}

    def sample_gpu(start: float, end: float) -> None:
        time.sleep(max(start - time.time(), 0))
        gpu.update(gpu_busy(int(end - start)))

    for line in child.stdout:
        if line.startswith("window "):
            start, end = map(float, line.split()[1:3])

            def watch(start=start, end=end) -> None:
                measured.update(tree.measure(start, end, stop))

            sampler = threading.Thread(target=watch, daemon=True)
            sampler.start()
            if profile:
                replicas = tree.busiest_per_kind("ServeReplica")
                recording = profiles.Recording(replicas, start, end, path.with_suffix(""), profile)
            threading.Thread(target=sample, args=(start, end), daemon=True).start()
            gpu_sampler = threading.Thread(target=sample_gpu, args=(start, end), daemon=True)
            gpu_sampler.start()
            if host_probe:
                window = ["--start", str(start), "--end", str(end)]
                probe = [sys.executable, str(HERE / "host_probe.py"), *window]
                prober = subprocess.Popen(probe, stdout=subprocess.PIPE, text=True)
        else:
            lines.append(line.rstrip())
    child.wait()
    stop.set()
    for thread in (sampler, gpu_sampler):
        if thread is not None:
            thread.join(30)
    if recording is not None:
        recording.finish()
    probed = _probe_result(prober)
    if not path.exists():
        return {"failed": f"load.py exited {child.returncode}: " + " | ".join(lines[-3:])}
    report = json.loads(path.read_text())
    report["summary"] = lines[0] if lines else ""
    report["server_cpu"] = measured
    if probed:
        report["host_probe"] = probed
    if gpu:
        report["gpu_busy_percent"] = gpu
    if measured and report["images_answered"]:
        report["cpu_ms_per_image"] = measured["cpu_s"] * 1000.0 / report["images_answered"]
    if measured and report["requests_answered"]:
        report["cpu_ms_per_request"] = measured["cpu_s"] * 1000.0 / report["requests_answered"]
    path.write_text(json.dumps(report, indent=1))
    return report


def _baseline_worker(params: dict) -> dict:
    """In this process, no gRPC, no Ray: `images`-image batches of the load's photos decoded
    with engines.images.decode (in DEFAULT_PREPROCESS_THREADS threads) and
    classified by the config's engine, back to back; then the engine alone on the crops."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    sys.path.insert(0, str(ROOT))
    from engines import create_engine, pick_engine
    from engines.images import decode
    from engines.repository import resolve
    from serve_app.config import AppConfig
    from serve_app.tuning import DEFAULT_PREPROCESS_THREADS as threads

    config = AppConfig.model_validate(params["args"])
    pinned = config.default_model_versions
    ref = resolve(config.model_repository, config.model, pinned[0] if pinned else "")
    spec = ref.spec.preprocess
    mean, std = spec.mean_array, spec.std_array
    photos = load.builtin_photos()
    batch = params["images"]
    batches = [
        [photos[(start + j) % len(photos)] for j in range(batch)] for start in range(len(photos))
    ]
    engine_config = config.engine
    with (
        create_engine(
            engine_config.kind,
            ref,
            max_batch_size=max(batch, engine_config.batch_capacity),
            precision=engine_config.precision,
            **engine_config.options,
        ) as engine,
        ThreadPoolExecutor(threads) as pool,
    ):
        engine.warmup()

        def full(i: int) -> None:
            crops = np.stack(list(pool.map(lambda d: decode(d, spec), batches[i % len(batches)])))
            engine.infer_uint8(crops, mean, std)

        def timed(fn, seconds: float) -> tuple[int, float, float]:
            i, start, cpu = 0, time.perf_counter(), time.process_time()
            while time.perf_counter() - start < seconds:
                fn(i)
                i += 1
            return i * batch, time.perf_counter() - start, time.process_time() - cpu

        timed(full, params["warmup"])
        images, wall, cpu = timed(full, params["duration"])
        crops = np.stack([decode(d, spec) for d in batches[0]])
        engine_images, engine_wall, _ = timed(
            lambda i: engine.infer_uint8(crops, mean, std), params["duration"] / 2
        )
    return {
        "images_per_s": images / wall,
        "cpu_ms_per_image": cpu * 1000.0 / images,
        "engine_images_per_s": engine_images / engine_wall,
        "engine": pick_engine(engine_config.kind),
        "decode_threads": threads,
        "batch": batch,
        "note": "decode on the CPU (PIL) whatever the config's `decode`",
    }


def run_baseline(load_def: dict, app_args: dict, path: Path) -> dict:
    params = {
        "args": app_args,
        "images": load_def.get("images", 8),
        "duration": load_def["duration"],
        "warmup": load_def["warmup"],
    }
    done = subprocess.run(
        [sys.executable, str(HERE / "run.py"), "--baseline-worker", json.dumps(params)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"failed": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    report = json.loads(lines[-1])
    path.write_text(json.dumps(report, indent=1))
    return report


@contextlib.contextmanager
def plain_server(port: int, decode_threads: int, decode_size: int, hash_images: bool, log: Path):
    command = [sys.executable, str(HERE / "plain_server.py"), "--port", str(port)]
    command += ["--decode-threads", str(decode_threads), "--decode-size", str(decode_size)]
    command += ["--hash-images"] if hash_images else []
    with log.open("w") as out:
        child = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
    try:
        if not _wait_for_line(log, "plain server ready", child, 60):
            raise RuntimeError(f"the plain server did not start: see {log}")
        yield child
    finally:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# --- raystream servers ---------------------------------------------------------------------


def _wait_for_line(log: Path, marker: str, child: subprocess.Popen, timeout: float) -> str | None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith(marker):
                    return line
        if child.poll() is not None:
            return None
        time.sleep(0.5)
    return None


REPLICA_STARTED = re.compile(
    r"deployment='(?P<deployment>[^']+)'.*\) started successfully .* after (?P<s>[\d.]+)s"
)


def replica_starts(since: float, logs: Path = Path("/tmp/ray/session_latest/logs/serve")) -> dict:
    """Seconds from Serve starting each replica to its running, by deployment, as the Serve
    controller logs them (controller logs written since `since`, a time.time())."""
    starts: dict[str, list[float]] = {}
    for path in sorted(logs.glob("controller_*.log")):
        if path.stat().st_mtime < since:
            continue
        for line in path.read_text(errors="replace").splitlines():
            if match := REPLICA_STARTED.search(line):
                starts.setdefault(match["deployment"], []).append(float(match["s"]))
    return starts


DEPLOY_BEGAN = re.compile(
    r"^\w+ (?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* Deploying new app "
)


def deploy_began(since: float, logs: Path = Path("/tmp/ray/session_latest/logs/serve")) -> float:
    """Seconds from `since` (a time.time()) to the Serve controller's first "Deploying new
    app" line written after it: how much of a start goes to Ray and Serve's own, before any
    replica of ours is started. NaN where no controller log says."""
    for path in sorted(logs.glob("controller_*.log")):
        if path.stat().st_mtime < since:
            continue
        for line in path.read_text(errors="replace").splitlines():
            if match := DEPLOY_BEGAN.search(line):
                at = datetime.datetime.strptime(match["at"], "%Y-%m-%d %H:%M:%S,%f")
                return at.timestamp() - since  # the log's local time, as timestamp() reads it
    return float("nan")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def _set(config: dict, path: str, value: object) -> None:
    """Sets a dotted path in a Serve config: `args.engine.kind`, or `deployments.Ingress.
    num_replicas` (a deployment by name), relative to its first application."""
    node: object = config["applications"][0]
    keys = path.split(".")
    for key in keys[:-1]:
        if isinstance(node, list):
            node = next(d for d in node if d.get("name") == key)
        else:
            node = node.setdefault(key, {})
    node[keys[-1]] = value


def _identity_repository(source: Path, model: str, root: Path) -> Path:
    """A repository holding `identity`: `model`'s labels and an 8x8 input, no weights (only
    the echo engine serves it): tiny images are then decoded but not resized, so what is
    left is the serving path's own cost."""
    sys.path.insert(0, str(ROOT))
    from engines.repository import resolve

    spec = resolve(source, model).spec
    tiny = replace(spec.preprocess, input_size=8, resize_size=8)
    identity = replace(spec, name="identity", version="1", preprocess=tiny)
    (root / "identity" / "1").mkdir(parents=True, exist_ok=True)
    (root / "identity" / "1" / "model.json").write_text(identity.to_json())
    return root


def server_config(server: dict, out: Path, repository: Path) -> tuple[Path, dict]:
    """The Serve config file to start (the scenario's, or a copy with its `set` changes) and
    the application args the baseline uses."""
    path = ROOT / server["config"]
    config = yaml.safe_load(path.read_text())
    args = config["applications"][0].setdefault("args", {})
    args["model_repository"] = str(repository)
    changes = dict(server.get("set") or {})
    if server.get("identity_model"):
        identity = _identity_repository(repository, args.get("model", "efficientnet-lite0"), out)
        changes |= {"args.model_repository": str(identity), "args.model": "identity"}
        changes |= {"args.engine.kind": "echo"}
    for key, value in changes.items():
        _set(config, key, value)
    if changes:
        path = out / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, config["applications"][0]["args"]


@contextlib.contextmanager
def mps_daemon(enabled: bool):
    """CUDA MPS for the server's processes: a daemon of our own (pipe and log folders under
    /tmp), stopped afterwards; no GPU setting is changed. Yields the environment to add."""
    if not enabled:
        yield {}
        return
    if shutil.which("nvidia-cuda-mps-control") is None:
        raise RuntimeError("the scenario asks for CUDA MPS but nvidia-cuda-mps-control is absent")
    base = Path(tempfile.mkdtemp(prefix="raystream-mps-"))
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(base / "log"),
    }
    for folder in env.values():
        Path(folder).mkdir(parents=True)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **env}, check=True)
    try:
        yield env
    finally:
        subprocess.run(
            ["nvidia-cuda-mps-control"], input="quit\n", text=True, env={**os.environ, **env}
        )
        time.sleep(1)


def _stop(child: subprocess.Popen, tree: ServerProcesses, timeout: float = 90) -> None:
    """SIGINT to `raystream serve` (it drains and stops Ray); what is left after `timeout`
    (only processes of this server) gets SIGKILL."""
    if child.poll() is None:
        child.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout)
    # What is left of this server, less the MPS daemon, which mps_daemon() stops itself.
    left = [pid for (pid, _), (_, name) in tree.scan().items() if "mps" not in name]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if child.poll() is None:
        child.wait()


def run_server(scenario: str, server: dict, loads: list[dict], port: int, args) -> list[dict]:
    """Starts one server, runs its loads, stops it; one row per load."""
    name = server["name"]
    out = args.out / f"{scenario}-{name}"  # shallow: a GPU host's $OUT returns 3 levels
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    remote = [d for d in loads if d["kind"] in REMOTE_KINDS]
    local = [d for d in loads if d["kind"] not in REMOTE_KINDS]
    app_args: dict = {}
    if server.get("config"):
        config_path, app_args = server_config(server, out, args.repository.resolve())
    if remote and server.get("config"):
        for _ in range(60):
            if _port_free(port):
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"port {port} is still served; choose another --port")
        command = [sys.executable, "-m", "clients.cli", "serve", "--config", str(config_path)]
        command += ["--port", str(port), "--model-repository", app_args["model_repository"]]
        command += [str(a) for a in server.get("args") or []]
        log = out / "serve.log"
        env = {"PYTHONUNBUFFERED": "1"}
        if server.get("fresh_compile_cache"):
            # an empty inductor cache of its own: this start compiles as a host's first does
            env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="raystream-inductor-")
        with mps_daemon(bool(server.get("mps"))) as mps_env, log.open("w") as log_file:
            started = time.time()
            child = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, **mps_env, **env},
                start_new_session=True,  # a Ctrl-C of the runner reaches it through _stop
            )
            tree = ServerProcesses(child.pid, mps=bool(mps_env))
            try:
                timeout = float(server.get("ready_timeout", 600))
                ready = _wait_for_line(log, "raystream ready:", child, timeout)
                ready_after = time.time() - started
                if ready is None:
                    tail = log.read_text(errors="replace").splitlines()[-5:]
                    print(f"{scenario}/{name}: not ready: " + " | ".join(tail), flush=True)
                    rows += [
                        _row(scenario, name, d, {"failed": "server not ready"}) for d in remote
                    ]
                else:
                    starts = replica_starts(started)
                    spans = ", ".join(
                        f"{d} {min(s):.1f}-{max(s):.1f} s ({len(s)})" for d, s in starts.items()
                    )
                    print(
                        f"{scenario}/{name}: ready after {ready_after:.0f} s; Serve began "
                        f"deploying after {deploy_began(started):.1f} s; replicas started to "
                        f"running: {spans}",
                        flush=True,
                    )
                    (out / "ready.txt").write_text(f"{ready_after:.1f}\n{ready}\n{spans}\n")
                    # The GPU engines capture their smaller buckets in the background once
                    # ready (engines/cuda_graphs.py): loads measure the settled server.
                    if server.get("settle_s"):
                        settled = tree.settle(float(server["settle_s"]))
                        print(f"{scenario}/{name}: settled after {settled:.0f} s", flush=True)
                    for load_def in remote:
                        target, path = f"127.0.0.1:{port}", out / f"{load_def['name']}.json"
                        if load_def["kind"] == "embed":
                            report = run_embed_load(load_def, target, tree, path)
                        else:
                            report = run_grpc_load(
                                load_def, target, tree, path, args.profile, args.host_probe
                            )
                        report["ready_after_s"] = ready_after
                        report["replica_start_s"] = starts
                        rows.append(_row(scenario, name, load_def, report))
            finally:
                _stop(child, tree)
    for load_def in local:
        path = out / f"{load_def['name']}.json"
        if load_def["kind"] == "baseline":
            if not app_args:
                report = {"failed": "a baseline needs the server's `config`"}
            else:
                report = run_baseline(load_def, app_args, path)
        else:
            plain_port = port + 50
            log = out / f"{load_def['name']}.server.log"
            threads = int(load_def.get("decode_threads", 0))
            size = int(load_def.get("decode_size", 0))
            hash_images = bool(load_def.get("hash_images", False))
            with plain_server(plain_port, threads, size, hash_images, log) as child:
                tree = ServerProcesses(child.pid)
                target = f"127.0.0.1:{plain_port}"
                report = run_grpc_load(load_def, target, tree, path, host_probe=args.host_probe)
        rows.append(_row(scenario, name, load_def, report))
    return rows


def _spec(load_def: dict, target: str) -> load.LoadSpec:
    fields = {k: v for k, v in load_def.items() if k in LOAD_FIELDS}
    return load.LoadSpec(target=target, **fields)


def _probe_result(prober: subprocess.Popen | None) -> dict:
    """bench/host_probe.py's report over the load's window ({} where it did not run)."""
    if prober is None:
        return {}
    try:
        out, _ = prober.communicate(timeout=30)
        return json.loads(out)
    except (subprocess.TimeoutExpired, ValueError):
        prober.kill()
        return {}


def _row(scenario: str, server: str, load_def: dict, report: dict) -> dict:
    row = {"scenario": scenario, "server": server, "load": load_def["name"]}
    row |= {"kind": load_def["kind"], "compare": load_def.get("compare"), "report": report}
    print(f"  {server} {load_def['name']}: " + _line(row), flush=True)
    return row


def _line(row: dict) -> str:
    report = row["report"]
    if "failed" in report:
        return f"FAILED: {report['failed']}"
    if row["kind"] == "baseline":
        return (
            f"{report['images_per_s']:.1f} img/s decode + {report['engine']} in one process, "
            f"{report['cpu_ms_per_image']:.2f} CPU ms/img; engine alone "
            f"{report['engine_images_per_s']:.1f} img/s"
        )
    cpu = report.get("cpu_ms_per_image")
    gpu = report.get("gpu_busy_percent", {})
    return (
        report.get("summary", "")
        + (f"; server CPU {cpu:.2f} ms/img" if cpu else "")
        + (_busiest(report.get("server_cpu", {}).get("busiest_process")))
        + (f"; GPU kernels running {gpu['sm']:.0f}% of the time" if "sm" in gpu else "")
        + (f", JPEG engines busy {gpu['jpg']:.0f}%" if "jpg" in gpu else "")
        + _host(report.get("server_cpu", {}))
        + _probe_line(report.get("host_probe", {}))
    )


def _host(cpu: dict) -> str:
    cores, throttled = cpu.get("host_cores"), cpu.get("cgroup_throttled")
    if not cores:
        return ""
    line = f"; the machine {cores['busy']:.1f} cores busy, {cores['steal']:.2f} stolen"
    if throttled:
        line += (
            f", its cgroup throttled {throttled['s']:.2f} s in {throttled['periods']:.0f} periods"
        )
    return line


def _probe_line(probe: dict) -> str:
    if not probe:
        return ""
    late, slow = probe["wake_late_ms"], probe["work_slowdown"]
    line = f"; a 1 ms sleep woke late p99 {late['p99']:.2f} ms (max {late['max']:.1f})"
    if slow:
        line += f", fixed work slowed p99 {slow['p99']:.1f}x"
    if "cpu_pressure_share" in probe:
        line += f", a task waiting for a core {probe['cpu_pressure_share']:.0%} of the time"
    return line


def _busiest(process: dict | None) -> str:
    if not process or not process["name"]:
        return ""
    name = process["name"].split(":")[-1]  # ray::ServeReplica:APP:Ingress -> Ingress
    return f", the busiest process ({name}) {process['cores']:.2f} cores"


# --- scenarios and the table ---------------------------------------------------------------


def load_scenario(path: Path, args) -> tuple[str, list[tuple[dict, list[dict]]]]:
    scenario = yaml.safe_load(path.read_text())
    for entry in (scenario.get("loads") or []) + scenario["servers"]:
        if not isinstance(entry.get("name"), str):  # YAML reads off, on, yes, no as booleans
            raise SystemExit(f"{path}: name {entry.get('name')!r} must be a string: quote it")
    defaults = {"duration": 10.0, "warmup": 2.0, **(scenario.get("defaults") or {})}
    by_name = {}
    for entry in scenario.get("loads") or []:
        merged = {**defaults, "kind": "grpc", **entry}
        if args.duration is not None:
            merged["duration"] = args.duration
        if args.warmup is not None:
            merged["warmup"] = args.warmup
        if merged["kind"] not in KINDS:
            raise SystemExit(f"{path}: load {entry['name']}: kind must be one of {sorted(KINDS)}")
        unknown = set(merged) - LOAD_FIELDS - EXTRA_FIELDS
        if unknown:
            raise SystemExit(f"{path}: load {entry['name']}: unknown keys {sorted(unknown)}")
        by_name[entry["name"]] = merged
    servers = []
    for server in scenario["servers"]:
        if args.only and not any(fnmatch.fnmatch(server["name"], p) for p in args.only):
            continue
        names = server.get("loads") or list(by_name)
        chosen = [by_name[n] for n in names]
        if args.loads:
            chosen = [d for d in chosen if any(fnmatch.fnmatch(d["name"], p) for p in args.loads)]
        servers.append((server, chosen))
    return path.stem, servers


def _ratio(row: dict, rows: list[dict]) -> str:
    """`compare: NAME`: this load's img/s (and CPU per image) against load NAME of the same
    server (or `SERVER/NAME`)."""
    target = row.get("compare")
    if not target or "failed" in row["report"]:
        return ""
    server, _, name = target.rpartition("/")
    other = next(
        (
            r
            for r in rows
            if r["scenario"] == row["scenario"]
            and r["server"] == (server or row["server"])
            and r["load"] == name
            and "failed" not in r["report"]
        ),
        None,
    )
    if other is None:
        return ""
    mine, theirs = row["report"], other["report"]
    text = f"{mine['images_per_s'] / max(theirs['images_per_s'], 1e-9):.2f}x {target} img/s"
    if mine.get("cpu_ms_per_image") and theirs.get("cpu_ms_per_image"):
        text += f", {mine['cpu_ms_per_image'] / theirs['cpu_ms_per_image']:.2f}x CPU/img"
    return text


def table(rows: list[dict]) -> str:
    header = (
        "scenario",
        "load",
        "img/s",
        "p50 ms",
        "p99 ms",
        "server p99",
        "CPU ms/img",
        "errors",
        "note",
    )
    lines = []
    for row in rows:
        report = row["report"]
        cells = [f"{row['scenario']}/{row['server']}", row["load"]]
        if "failed" in report:
            cells += ["-", "-", "-", "-", "-", "FAILED", report["failed"][:60]]
        else:
            lat = report.get("latency_ms") or {}
            server = report.get("server_total_ms") or {}
            errors = load.errors(report) if "request_codes" in report else {}
            error_count = sum(errors.values())
            if "request_codes" in report and not report["exactly_once"]:
                errors_text = f"{error_count} (answers!)"
            else:
                errors_text = str(error_count)
            note = _ratio(row, rows)
            if row["kind"] == "baseline":
                note = f"in process, engine alone {report['engine_images_per_s']:.0f} img/s"
            elif row["kind"] == "plain_server":
                note = ("plain grpc.aio; " + note).strip("; ")
            if report.get("ready_after_s") is not None and row is _first_of(row, rows):
                note = (f"ready after {report['ready_after_s']:.0f} s; " + note).strip("; ")
            cells += [
                f"{report['images_per_s']:.1f}",
                f"{lat['p50']:.1f}" if lat else "-",
                f"{lat['p99']:.1f}" if lat else "-",
                f"{server['p99']:.1f}" if server else "-",
                f"{report['cpu_ms_per_image']:.2f}" if report.get("cpu_ms_per_image") else "-",
                errors_text if row["kind"] != "baseline" else "-",
                note,
            ]
        lines.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines, strict=True)]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True))]
    out += [
        "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) for cells in lines
    ]
    return "\n".join(line.rstrip() for line in out)


def _first_of(row: dict, rows: list[dict]) -> dict:
    return next(
        r for r in rows if r["scenario"] == row["scenario"] and r["server"] == row["server"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", type=Path, help="bench/scenarios/*.yaml")
    parser.add_argument("--only", type=lambda s: s.split(","), help="servers (names, globs)")
    parser.add_argument("--loads", type=lambda s: s.split(","), help="loads (names, globs)")
    parser.add_argument("--duration", type=float, help="seconds measured, every load")
    parser.add_argument("--warmup", type=float, help="seconds of warm-up, every load")
    parser.add_argument("--out", type=Path, help="results folder")
    parser.add_argument("--port", type=int, default=9200, help="first server's port")
    parser.add_argument("--repository", type=Path, default=ROOT / "models")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="python",
        choices=profiles.MODES,
        help="py-spy one replica per deployment (native: C frames too; gil: only the "
        "thread holding the GIL, what the process' Python waits for; threads: CPU by thread)",
    )
    parser.add_argument(
        "--host-probe",
        action="store_true",
        help="during each load, how late a thread's 1 ms sleeps wake and how much slower a "
        "fixed piece of work runs (bench/host_probe.py; a few %% of one core)",
    )
    parser.add_argument("--baseline-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_worker:
        print(json.dumps(_baseline_worker(json.loads(args.baseline_worker))))
        return
    if not args.scenarios:
        parser.error("name at least one scenario file")
    if args.profile in ("python", "native", "gil") and not profiles.available():
        parser.error("--profile needs py-spy on PATH (pip install py-spy)")
    if args.out is None:
        if os.environ.get("OUT"):
            args.out = Path(os.environ["OUT"]) / "bench"
        else:
            args.out = HERE / "results" / time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    port = args.port
    for path in args.scenarios:
        name, servers = load_scenario(path, args)
        for server, loads in servers:
            if loads:
                rows += run_server(name, server, loads, port, args)
                port += 1  # a new port per server: a replica still draining cannot share it
            (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"\nresults in {args.out}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
