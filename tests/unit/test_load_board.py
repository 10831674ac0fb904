"""Stage replicas' loads in shared memory (serve_app/transport/load_board.py): what a stage port
publishes, a caller on the node reads; a slot goes when its port closes or its process dies."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from serve_app.transport import load_board
from serve_app.transport.load_board import LoadBoard, LoadSlot, remove_orphans, slot_name


@pytest.fixture(autouse=True)
def shm(tmp_path, monkeypatch):
    """The slots in a folder of the test's own, not beside live servers' in /dev/shm."""
    monkeypatch.setattr(load_board, "SHM_DIR", tmp_path)
    return tmp_path


def test_a_caller_reads_the_images_a_replica_holds_until_it_closes(shm) -> None:
    slot, board = LoadSlot("127.0.0.1:50001"), LoadBoard()
    assert board.images("127.0.0.1:50001") == 0
    slot.add(64)
    slot.add(8)
    assert board.images("127.0.0.1:50001") == 72
    slot.add(-64)
    assert board.images("127.0.0.1:50001") == 8
    slot.close()  # a caller that has not dropped the address yet reads that it holds nothing
    assert board.images("127.0.0.1:50001") == 0
    assert not (shm / slot_name("127.0.0.1:50001")).exists()
    board.forget("127.0.0.1:50001")  # the address dropped: not mapped again until it reports
    assert board.images("127.0.0.1:50001") is None
    board.close()


def test_an_address_that_publishes_nothing_here_reads_none() -> None:
    assert LoadBoard().images("10.1.2.3:4567") is None


def test_the_slots_of_dead_processes_are_removed(shm) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = shm / slot_name("127.0.0.1:50002")
    orphan.write_bytes(struct.pack("<qq", int(dead.stdout), 5))
    live = LoadSlot("127.0.0.1:50003")
    remove_orphans()
    assert not orphan.exists()
    assert (shm / slot_name("127.0.0.1:50003")).exists()
    live.close()


def test_a_new_replica_on_a_stopped_ones_address_is_read_once_mapped_anew() -> None:
    old, board = LoadSlot("127.0.0.1:50004"), LoadBoard()
    old.add(3)
    assert board.images("127.0.0.1:50004") == 3
    old.close()
    new = LoadSlot("127.0.0.1:50004")  # a file of its own
    new.add(7)
    assert board.images("127.0.0.1:50004") == 0  # the old file, still mapped
    board.close()  # as PortCalls does at each read of the addresses
    assert board.images("127.0.0.1:50004") == 7
    new.close()
    board.close()
