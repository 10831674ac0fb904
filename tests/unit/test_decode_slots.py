"""Decode slots (engines/decode_slots.py): at most N processes hold one at once, a holder
that dies frees its slot, a process's threads take turns, and the GPU decoder decodes only
while it holds one (with a stand-in for nvJPEG)."""

from __future__ import annotations

import fcntl
import multiprocessing
import threading
import time
from pathlib import Path

import pytest

from engines.decode_slots import DecodeSlots

HOLD_S = 0.05


def _hold_and_record(folder: str, count: int, log: str, times: int, start) -> None:
    """A process that takes a slot `times` times (once all have started), writing when it
    held each."""
    slots = DecodeSlots(Path(folder), count)
    start.wait(60)
    for _ in range(times):
        with slots.held():
            start = time.monotonic()
            time.sleep(HOLD_S)
            end = time.monotonic()
        with open(log, "a") as out:
            out.write(f"{start} {end}\n")
    slots.close()


def _hold_forever(folder: str, holding) -> None:
    slots = DecodeSlots(Path(folder), 1)
    with slots.held():
        holding.set()
        time.sleep(600)


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    at_once = most = 0
    for _, change in events:  # an end sorts before a start at the same instant
        at_once += change
        most = max(most, at_once)
    return most


def _intervals(log: Path) -> list[tuple[float, float]]:
    return [tuple(map(float, line.split())) for line in log.read_text().splitlines()]


def test_at_most_count_processes_hold_a_slot(tmp_path) -> None:
    context = multiprocessing.get_context("spawn")
    log = tmp_path / "held.txt"
    start = context.Barrier(5)
    workers = [
        context.Process(
            target=_hold_and_record, args=(str(tmp_path / "slots"), 2, str(log), 6, start)
        )
        for _ in range(5)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    intervals = _intervals(log)
    assert len(intervals) == 30
    assert _most_at_once(intervals) == 2  # never more than the slots, and both were used


def test_a_holder_that_dies_frees_its_slot(tmp_path) -> None:
    context = multiprocessing.get_context("spawn")
    holding = context.Event()
    holder = context.Process(target=_hold_forever, args=(str(tmp_path), holding))
    holder.start()
    assert holding.wait(60)
    slots = DecodeSlots(tmp_path, 1)
    taken = threading.Event()

    def take() -> None:
        with slots.held():
            taken.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    assert not taken.wait(0.3)  # the other process holds the only slot
    holder.kill()
    holder.join(10)
    assert taken.wait(10)
    waiter.join(10)  # out of held() before its files close
    slots.close()


def test_a_waiter_takes_whichever_slot_frees_first(tmp_path) -> None:
    """Three holders (separate opens of the slots count as separate processes to flock)
    and two slots: the third gets the one freed first, while the other stays held."""
    holders = [DecodeSlots(tmp_path, 2) for _ in range(3)]
    entered = [threading.Event() for _ in holders]
    release = [threading.Event() for _ in holders]

    def hold(index: int) -> None:
        with holders[index].held():
            entered[index].set()
            release[index].wait(10)

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(3)]
    for index in (0, 1):
        threads[index].start()
        assert entered[index].wait(5)
    release[2].set()
    threads[2].start()
    assert not entered[2].wait(0.3)  # both slots held
    release[1].set()
    assert entered[2].wait(5)  # the second holder's slot, the first still holding its own
    assert threads[0].is_alive()
    release[0].set()
    for thread in threads:
        thread.join(5)
    for slots in holders:
        slots.close()


def test_threads_of_one_process_take_turns(tmp_path) -> None:
    slots = DecodeSlots(tmp_path, 2)
    intervals: list[tuple[float, float]] = []

    def hold() -> None:
        for _ in range(4):
            with slots.held():
                start = time.monotonic()
                time.sleep(HOLD_S / 5)
                intervals.append((start, time.monotonic()))

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(intervals) == 12 and _most_at_once(intervals) == 1
    slots.close()


def test_count_must_be_positive(tmp_path) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        DecodeSlots(tmp_path, 0)


def test_the_gpu_decoder_decodes_while_it_holds_a_slot(tmp_path, model, photos) -> None:
    import numpy as np
    import torch

    from engines.gpu_decode import GpuJpegDecoder
    from engines.images import DecodeLimits

    slot_file = tmp_path / "slot-0"
    free_during_decode = []

    def stand_in(jpegs: list[bytes]) -> list[torch.Tensor]:
        with open(slot_file, "ab") as other:  # another open file: another process's view
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                free_during_decode.append(True)
            except BlockingIOError:
                free_during_decode.append(False)
        return [torch.zeros((3, 300, 400), dtype=torch.uint8) for _ in jpegs]

    slots = DecodeSlots(tmp_path, 1)
    decoder = GpuJpegDecoder(
        model.spec.preprocess, DecodeLimits(), device="cpu", decode_batch=stand_in, slots=slots
    )
    crops = decoder.crops_many([[photos["chelsea"], photos["coffee"]]])
    assert free_during_decode == [False]
    assert np.asarray(crops[0].pixels).shape == (2, 224, 224, 3)
    with slots.held():  # and the decoder let go of it
        pass
    slots.close()
