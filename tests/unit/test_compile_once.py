"""compile_once: of the processes that reach one shape together, one compiles and the others
wait for it, then run from its cache; a failed compile leaves the next process to try."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from engines.compile_once import compile_key, compile_once


def _compile(folder: Path, log: Path, key: str) -> None:
    def work() -> int:
        with open(log, "a") as out:
            out.write(f"start {os.getpid()}\n")
        time.sleep(0.3)
        with open(log, "a") as out:
            out.write(f"end {os.getpid()}\n")
        return os.getpid()

    assert compile_once(key, work, folder) == os.getpid()


def test_one_process_compiles_before_the_others_start(tmp_path: Path) -> None:
    log, key = tmp_path / "log", compile_key("program", "fp16", 64)
    fork = multiprocessing.get_context("fork")
    processes = [
        fork.Process(target=_compile, args=(tmp_path / "marks", log, key)) for _ in range(4)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    events = log.read_text().split("\n")[:-1]
    first = events[0].split()[1]
    # The first compile ran alone: its end comes before every other start.
    assert events[:2] == [f"start {first}", f"end {first}"]
    assert sorted(e.split()[1] for e in events if e.startswith("start")) == sorted(
        str(p.pid) for p in processes
    )


def _from_cache(folder: Path, log: Path) -> None:
    def work() -> None:
        with open(log, "a") as out:
            out.write("start\n")
        time.sleep(0.5)
        with open(log, "a") as out:
            out.write("end\n")

    compile_once("k", work, folder, at_once=2)


def test_at_once_bounds_the_processes_compiling_from_the_cache(tmp_path: Path) -> None:
    """Six processes reach a shape another compiled: never more than two at a time run."""
    (tmp_path / "k.done").touch()
    log = tmp_path / "log"
    fork = multiprocessing.get_context("fork")
    processes = [fork.Process(target=_from_cache, args=(tmp_path, log)) for _ in range(6)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    running, most = 0, 0
    for event in log.read_text().split():
        running += 1 if event == "start" else -1
        most = max(most, running)
    assert most == 2  # six of 0.5 s each: two at once, never three


def test_a_failed_compile_leaves_the_next_process_to_compile(tmp_path: Path) -> None:
    def fails() -> None:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        compile_once("k", fails, tmp_path)
    assert not (tmp_path / "k.done").exists()
    assert compile_once("k", lambda: "compiled", tmp_path) == "compiled"
    assert (tmp_path / "k.done").exists()


def test_a_shape_compiled_before_takes_no_lock(tmp_path: Path) -> None:
    (tmp_path / "k.done").touch()
    assert compile_once("k", lambda: "from the cache", tmp_path) == "from the cache"
    assert not (tmp_path / "k.lock").exists()


def test_the_key_names_every_part() -> None:
    assert compile_key("program", "fp16", 64) != compile_key("program", "fp16", 32)
    assert compile_key("program", "fp16", 64) == compile_key("program", "fp16", 64)
