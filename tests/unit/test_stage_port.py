"""Stage calls over the replicas' own ports (serve_app/transport/stage_port.py): real link servers
(serve_app/transport/call_link.py) on loopback ports, the registry in memory. The answer or the
stage's own exception comes back; with no address, or a port that fails, the call goes by
handle and loses nothing."""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import weakref

import pytest
from support import until

from serve_app.core.messages import Batch, Job
from serve_app.errors import Code, ModelNotFound, code_for
from serve_app.models.registry import MemoryStore, ModelRegistry
from serve_app.transport import call_link, codec, device_crops, shared_images
from serve_app.transport.call_link import (
    CALL,
    HELLO,
    MAC_BYTES,
    NONCE_BYTES,
    Link,
    deployment_key,
)
from serve_app.transport.load_board import LoadBoard
from serve_app.transport.stage_port import PortCalls, StagePort

TOKEN = "app secret"


def _batch(model: str = "") -> Batch:
    return Batch(jobs=(Job(id="a", images=(b"jpeg bytes",)),), model=model)


class Stage:
    """A stage replica's `run`: the batch's job ids and this replica's name; a batch for
    model "gone" raises as a replica that does not hold it would."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.running = 0

    async def run(self, batch: Batch) -> list[str]:
        if batch.model == "gone":
            raise ModelNotFound("model version 'gone' is not loaded in this replica")
        self.running += 1
        await asyncio.sleep(0.05)  # simulated work
        self.running -= 1
        return [self.name, *(job.id for job in batch.jobs)]


class Fallback:
    """The handle call: counts the batches it took."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []

    async def __call__(self, batch: Batch) -> list[str]:
        self.batches.append(batch)
        return ["handle", *(job.id for job in batch.jobs)]


async def _ports(registry: ModelRegistry, names: list[str]) -> list[tuple[Stage, StagePort]]:
    started = []
    for name in names:
        stage = Stage(name)
        port = StagePort(stage.run, TOKEN, "Inference")
        registry.report("Inference", name, [], address=await port.start("127.0.0.1"))
        started.append((stage, port))
    return started


async def test_calls_go_over_the_ports_and_spread_over_the_replicas() -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    replicas = await _ports(registry, ["r1", "r2"])
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, TOKEN)
    calls.update(registry.ports("Inference"))
    answers = await asyncio.gather(*(calls.run(_batch()) for _ in range(8)))
    assert {answer[0] for answer in answers} == {"r1", "r2"}  # the least busy takes each
    assert all(answer[1:] == ["a"] for answer in answers)
    assert [port.calls for _, port in replicas] == [4, 4]
    assert fallback.batches == []
    await calls.close()
    for _, port in replicas:
        await port.stop(0)


async def test_calls_go_to_the_replicas_that_hold_their_model_version() -> None:
    """A replica that started after a version was loaded, and loads it still, reports
    without it: no call for that version goes there (it would fail with NOT_FOUND)."""
    registry = ModelRegistry(MemoryStore(), "app")
    replicas = await _ports(registry, ["old", "new"])
    registry.report("Inference", "old", ["m/1", "m/2"], address=replicas[0][1].address)
    registry.report("Inference", "new", ["m/1"], address=replicas[1][1].address)
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN)
    calls.update(registry.ports("Inference"))
    answers = await asyncio.gather(*(calls.run(_batch(model="m/2")) for _ in range(6)))
    assert {answer[0] for answer in answers} == {"old"}
    answers = await asyncio.gather(*(calls.run(_batch(model="m/1")) for _ in range(6)))
    assert {answer[0] for answer in answers} == {"old", "new"}
    # a version that no replica reports yet: any replica (it answers for itself)
    answers = await asyncio.gather(*(calls.run(_batch(model="m/3")) for _ in range(6)))
    assert {answer[0] for answer in answers} == {"old", "new"}
    await calls.close()
    for _, port in replicas:
        await port.stop(0)


async def test_a_stage_error_comes_back_as_itself() -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    ((_, port),) = await _ports(registry, ["r1"])
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN)
    calls.update(registry.ports("Inference"))
    with pytest.raises(ModelNotFound, match="'gone' is not loaded"):
        await calls.run(_batch(model="gone"))
    await calls.close()
    await port.stop(0)


async def test_a_failed_call_lets_go_of_its_batch_at_once() -> None:
    """The batch (crops on the GPU, under preprocess_decodes_on_gpu) is freed when the error
    has been handled, not when the garbage collector next runs."""
    registry = ModelRegistry(MemoryStore(), "app")
    ((_, port),) = await _ports(registry, ["r1"])
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN)
    calls.update(registry.ports("Inference"))
    batch = _batch(model="gone")
    freed = weakref.ref(batch)
    gc.disable()
    try:
        with pytest.raises(ModelNotFound):
            await calls.run(batch)
        del batch
        assert freed() is None
    finally:
        gc.enable()
        await calls.close()
        await port.stop(0)


async def test_a_failing_stage_lets_go_of_the_batch_it_was_sent_at_once() -> None:
    seen = []

    async def run(batch: Batch) -> None:
        seen.append(weakref.ref(batch))
        raise ModelNotFound("model version 'gone' is not loaded in this replica")

    registry = ModelRegistry(MemoryStore(), "app")
    port = StagePort(run, TOKEN, "Inference")
    registry.report("Inference", "r1", [], address=await port.start("127.0.0.1"))
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN)
    calls.update(registry.ports("Inference"))
    gc.disable()
    try:
        with pytest.raises(ModelNotFound):
            await calls.run(_batch())
        assert seen[0]() is None
    finally:
        gc.enable()
        await calls.close()
        await port.stop(0)


async def test_without_an_address_or_with_a_dead_port_the_call_goes_by_handle() -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, TOKEN)
    assert await calls.run(_batch()) == ["handle", "a"]  # no replica has reported yet
    ((_, port),) = await _ports(registry, ["r1"])
    calls.update(registry.ports("Inference"))
    await port.stop(0)  # the replica stops; its report is still fresh
    assert await calls.run(_batch()) == ["handle", "a"]
    assert len(fallback.batches) == 2 and calls.by_handle == 2
    assert calls._pick() is None  # dropped until the replica reports again
    await calls.close()


async def test_a_call_without_the_token_is_refused_before_it_is_read() -> None:
    """A connection that cannot prove the app's token is closed before a call of it is
    read, and the raystream caller with a wrong token goes by handle."""
    registry = ModelRegistry(MemoryStore(), "app")
    ((_, port),) = await _ports(registry, ["r1"])
    host, number = port.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(number))
    writer.write(HELLO + bytes(NONCE_BYTES))
    assert len(await reader.readexactly(NONCE_BYTES + MAC_BYTES)) == NONCE_BYTES + MAC_BYTES
    writer.write(b"a guessed proof".ljust(MAC_BYTES, b"!"))
    writer.write(CALL.pack(0, 1, 17) + b"a call never read")
    assert await reader.read() == b""  # closed, nothing answered
    writer.close()
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, "another app's secret")
    calls.update(registry.ports("Inference"))
    assert await calls.run(_batch()) == ["handle", "a"]
    assert port.calls == 0
    await calls.close()
    await port.stop(0)


def test_reports_carry_the_address_and_only_live_ones_count() -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    registry.report("Inference", "r1", ["m/1"], address="10.0.0.5:4242")
    registry.report("Inference", "r2", ["m/1"])  # serves no port (no stage_ports)
    assert list(registry.ports("Inference")) == ["10.0.0.5:4242"]
    assert registry.ports("Postprocess") == {}


async def test_a_stopped_caller_reads_no_more_addresses_and_its_calls_go_on() -> None:
    """As its replica stops, a caller stops reading the addresses (no read may run into the
    process's shutdown, when its thread pool is gone) and keeps calling the ports it has."""

    class CountingRegistry(ModelRegistry):
        reads = 0

        def ports(self, deployment: str) -> dict[str, frozenset[str]]:
            CountingRegistry.reads += 1
            return super().ports(deployment)

    registry = CountingRegistry(MemoryStore(), "app")
    ((_, port),) = await _ports(registry, ["r1"])
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN)
    calls.update(registry.ports("Inference"))
    assert (await calls.run(_batch()))[0] == "r1"  # starts the reads
    await until(lambda: CountingRegistry.reads > 1)  # the first read ran
    calls.stop()
    await until(calls._refresh_task.done)
    reads = CountingRegistry.reads
    assert calls._refresh_task.cancelled()
    assert (await calls.run(_batch()))[0] == "r1" and port.calls == 2
    assert CountingRegistry.reads == reads
    await calls.close()
    await port.stop(0)


class ImagesStage(Stage):
    """Answers with the images it was given."""

    async def run(self, batch: Batch) -> list[bytes]:
        return [image for job in batch.jobs for image in job.images]


class SizedPort(StagePort):
    """Records the size of each call it receives."""

    sizes: list[int]

    async def _call(self, request: bytes, images: int) -> bytes:
        self.sizes.append(len(request))
        return await super()._call(request, images)


def _photos_batch() -> Batch:
    jpeg, png = b"\xff\xd8" + bytes(range(256)) * 400, b"\x89PNG" + b"x" * 50_000
    return Batch(
        jobs=(Job(id="a", images=(jpeg, png)), Job(id="b", images=(png + b"2", jpeg + b"2")))
    )


async def _sized_port(registry: ModelRegistry) -> SizedPort:
    port = SizedPort(ImagesStage("r1").run, TOKEN, "Inference")
    port.sizes = []
    registry.report("Inference", "r1", [], address=await port.start("127.0.0.1"))
    return port


def _segments() -> set[str]:
    return {p.name for p in shared_images.SHM_DIR.glob(f"{shared_images.PREFIX}{os.getpid()}-*")}


async def test_images_for_a_replica_on_this_node_go_through_shared_memory() -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    port = await _sized_port(registry)
    before = _segments()
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN, "127.0.0.1", 64 << 20)
    calls.update(registry.ports("Inference"))
    batch = _photos_batch()
    images = [image for job in batch.jobs for image in job.images]
    for _ in range(3):  # the segment is lent to each call in turn
        assert await calls.run(batch) == images
    assert len(_segments() - before) == 1
    assert max(port.sizes) < 2_000 < sum(map(len, images))  # the call carried no image
    await calls.close()
    assert _segments() == before  # unlinked as the caller closes
    await port.stop(0)


async def test_images_travel_in_the_call_to_another_node_or_where_they_cannot_be_mapped():
    registry = ModelRegistry(MemoryStore(), "app")
    port = await _sized_port(registry)
    batch = _photos_batch()
    images = [image for job in batch.jobs for image in job.images]
    elsewhere = PortCalls(registry, "Inference", Fallback(), TOKEN, "10.1.2.3", 64 << 20)
    elsewhere.update(registry.ports("Inference"))
    assert await elsewhere.run(batch) == images
    assert min(port.sizes) > sum(map(len, images))
    await elsewhere.close()

    def cannot_map(name: str):
        raise shared_images.SharedImagesMissing(f"no {name} here")

    port._images._map = cannot_map  # as a replica in another container would fail
    port.sizes.clear()
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN, "127.0.0.1", 64 << 20)
    calls.update(registry.ports("Inference"))
    before = _segments()
    assert await calls.run(batch) == images  # sent again with the images
    assert await calls.run(batch) == images  # and from then on with them
    small, *big = port.sizes
    assert small < 2_000 and all(size > sum(map(len, images)) for size in big) and len(big) == 2
    assert _segments() <= before  # the segment it could not map is gone
    await calls.close()
    await port.stop(0)


async def test_a_call_cut_off_by_its_closing_link_goes_by_handle(monkeypatch) -> None:
    """An address dropped while a call runs closes its link after a grace; a call still
    running then fails. It goes by handle (not a CancelledError that leaves
    its requests unanswered), and the address, reported again, starts from no calls."""
    import serve_app.transport.stage_port as stage_port

    started = asyncio.Event()

    class SlowStage(Stage):
        async def run(self, batch: Batch) -> list[str]:
            started.set()
            await asyncio.sleep(1.0)  # simulated work, past the close grace
            return await super().run(batch)

    monkeypatch.setattr(stage_port, "CLOSE_GRACE_S", 0.05)
    registry = ModelRegistry(MemoryStore(), "app")
    port = StagePort(SlowStage("r1").run, TOKEN, "Inference")
    registry.report("Inference", "r1", [], address=await port.start("127.0.0.1"))
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, TOKEN)
    calls.stop()  # the test says which addresses it has
    calls.update(registry.ports("Inference"))
    running = asyncio.create_task(calls.run(_batch()))
    await asyncio.wait_for(started.wait(), 10)  # the call runs in the replica
    calls.update({})  # the replica's report went stale: the address is dropped
    calls.update(registry.ports("Inference"))  # ... and reported again
    assert await asyncio.wait_for(running, 5) == ["handle", "a"]
    assert calls._in_flight == {next(iter(registry.ports("Inference"))): 0}
    await calls.close()
    await port.stop(0)


class _CropsOnAnotherGpu:
    """Stands for a CUDA tensor whose GPU the callee cannot see: its IPC handle, opened
    there, raises CropsNotHere (serve_app/transport/device_crops.py); its bytes are 'host
    crops'."""

    is_cuda = True
    nbytes = 10

    def cpu(self):
        return self

    def numpy(self) -> str:
        return "host crops"


def _refuse(fields: tuple) -> None:
    raise device_crops.CropsNotHere(f"GPU {fields[0]} is not visible to this replica")


def _crops_elsewhere(monkeypatch) -> None:
    monkeypatch.setattr(device_crops, "handle", lambda tensor: ("GPU-1234",))
    monkeypatch.setattr(device_crops, "open_handle", _refuse)


async def _port_noting_crops(registry: ModelRegistry) -> tuple[list[object], StagePort]:
    """A replica's port whose stage notes the crops of each batch it runs."""
    seen: list[object] = []

    async def run(batch: Batch) -> str:
        seen.append(batch.crops)
        return "answered"

    port = StagePort(run, TOKEN, "Inference")
    registry.report("Inference", "r1", [], address=await port.start("127.0.0.1"))
    return seen, port


async def test_crops_a_replica_cannot_open_go_to_it_as_bytes_from_then_on(monkeypatch) -> None:
    """Crops on the GPU go by CUDA IPC handle; a replica that cannot open the caller's GPU
    refuses the call, which goes again with the crops' bytes, as every later call to it
    does. The call is answered once, and by the port."""
    _crops_elsewhere(monkeypatch)
    registry = ModelRegistry(MemoryStore(), "app")
    seen, port = await _port_noting_crops(registry)
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, TOKEN, node="127.0.0.1")
    calls.update(registry.ports("Inference"))
    batch = _batch().replace(crops=_CropsOnAnotherGpu())
    assert await calls.run(batch) == "answered"
    assert await calls.run(batch) == "answered"
    assert seen == ["host crops", "host crops"] and port.calls == 3  # one refused
    assert fallback.batches == []
    await calls.close()
    await port.stop(0)


def test_crops_on_a_gpu_this_process_cannot_see_are_refused() -> None:
    fields = ("GPU-0000", (1,), (1,), 0, "uint8", b"handle", 1, 0, False, b"counter", 0, b"", 0)
    with pytest.raises(device_crops.CropsNotHere, match="GPU-0000 is not visible"):
        device_crops.open_handle(fields)


async def test_crops_on_the_gpu_go_to_another_node_as_bytes(monkeypatch) -> None:
    """A replica on another node cannot open this GPU's memory: its calls carry the bytes
    from the first, and no handle is made."""
    _crops_elsewhere(monkeypatch)
    registry = ModelRegistry(MemoryStore(), "app")
    seen, port = await _port_noting_crops(registry)
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN, node="10.0.0.9")
    calls.update(registry.ports("Inference"))
    assert await calls.run(_batch().replace(crops=_CropsOnAnotherGpu())) == "answered"
    assert seen == ["host crops"] and port.calls == 1
    await calls.close()
    await port.stop(0)


class HeldStage(Stage):
    """A replica whose calls for job "hold" wait until `release` is set."""

    def __init__(self, name: str, release: asyncio.Event) -> None:
        super().__init__(name)
        self.release = release

    async def run(self, batch: Batch) -> list[str]:
        if batch.jobs[0].id == "hold":
            self.running += 1
            await self.release.wait()
            self.running -= 1
        return [self.name, *(job.id for job in batch.jobs)]


async def test_a_caller_avoids_the_replica_another_caller_keeps_busy() -> None:
    """Two callers on one node (two ingress replicas): while one caller's call of 64 images
    holds a replica, the other, with nothing of its own in flight, sends every call to the
    replica that holds none (it reads the load the busy one publishes)."""
    registry = ModelRegistry(MemoryStore(), "app")
    release = asyncio.Event()
    stages, ports = [HeldStage(name, release) for name in ("r1", "r2")], []
    for stage in stages:
        port = StagePort(stage.run, TOKEN, "Inference")
        registry.report("Inference", stage.name, [], address=await port.start("127.0.0.1"))
        ports.append(port)
    busy_caller, idle_caller = (
        PortCalls(registry, "Inference", Fallback(), TOKEN, node="127.0.0.1") for _ in range(2)
    )
    for calls in (busy_caller, idle_caller):
        calls.update(registry.ports("Inference"))
    held = asyncio.ensure_future(
        busy_caller.run(Batch(jobs=(Job(id="hold", images=(b"jpeg",) * 64),)))
    )
    await until(lambda: any(stage.running for stage in stages))  # the held call arrived
    idle = next(stage.name for stage in stages if not stage.running)
    answers = [await idle_caller.run(_batch()) for _ in range(10)]
    assert [answer[0] for answer in answers] == [idle] * 10
    release.set()
    assert (await held)[1] == "hold"
    for calls in (busy_caller, idle_caller):
        await calls.close()
    for port in ports:
        await port.stop(0)


async def test_a_replica_publishes_no_load_once_its_calls_failed_or_returned() -> None:
    registry = ModelRegistry(MemoryStore(), "app")
    ((_, port),) = await _ports(registry, ["r1"])
    calls = PortCalls(registry, "Inference", Fallback(), TOKEN, node="127.0.0.1")
    calls.update(registry.ports("Inference"))
    board = LoadBoard()
    with pytest.raises(ModelNotFound):
        await calls.run(_batch(model="gone"))
    assert board.images(port.address) == 0
    assert (await calls.run(_batch()))[0] == "r1"
    assert board.images(port.address) == 0
    board.close()
    await calls.close()
    await port.stop(0)


async def test_beside_a_replica_on_another_node_the_caller_counts_its_own_images() -> None:
    """Another node's replica publishes no load here: beside a local one's published load
    it would read as idle, so where the candidates span nodes only the caller's own images
    count; where all are local, the published loads do."""
    calls = PortCalls(
        ModelRegistry(MemoryStore(), "app"), "Inference", Fallback(), TOKEN, node="10.0.0.1"
    )
    calls._board.images = lambda address: 50 if address == "10.0.0.1:1" else 0
    calls.update({"10.0.0.1:1": [], "10.0.0.2:1": []})
    calls._in_flight.update({"10.0.0.1:1": 1, "10.0.0.2:1": 2})
    assert {calls._pick() for _ in range(20)} == {"10.0.0.1:1"}
    calls.update({"10.0.0.1:1": [], "10.0.0.1:2": []})
    calls._in_flight.update({"10.0.0.1:1": 1, "10.0.0.1:2": 2})
    assert {calls._pick() for _ in range(20)} == {"10.0.0.1:2"}
    await calls.close()


class _Planted:
    """A pickle that would create a file where it is unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


async def test_bytes_from_a_peer_with_the_token_never_become_code(tmp_path) -> None:
    """Even a caller that proves the token cannot make a replica run code: a call is data of
    serve_app/transport/codec.py or an error, never a pickle."""
    registry = ModelRegistry(MemoryStore(), "app")
    ((stage, port),) = await _ports(registry, ["r1"])
    planted = tmp_path / "planted"
    link = Link(port.address, deployment_key(TOKEN, "Inference"))
    for request in (
        pickle.dumps(_Planted(str(planted))),
        codec.dumps({"\0message": "Popen", "values": ()}),
        codec.dumps({"\0array": "object", "shape": (1,), "data": b"\0" * 8}),
    ):
        ok, value = codec.loads(await link.call(request, 1))
        assert not ok and code_for(value) == Code.INTERNAL
    assert not planted.exists() and port.calls == 3 and stage.running == 0
    await link.close()
    await port.stop(0)


async def test_a_port_of_another_deployment_fails_the_handshake_so_the_call_goes_by_handle() -> (
    None
):
    """Stage ports take the first free port of a fixed range, so a replica of another
    deployment can come to listen where a stopped one did: it proves another key, and the
    call meant for Inference never runs there."""
    registry = ModelRegistry(MemoryStore(), "app")
    stage = Stage("postprocess")
    port = StagePort(stage.run, TOKEN, "Postprocess")
    address = await port.start("127.0.0.1", range(29100, 29164))
    registry.report("Inference", "r1", [], address=address)  # a stale report
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, TOKEN)
    calls.update(registry.ports("Inference"))
    assert await calls.run(_batch()) == ["handle", "a"]
    assert port.calls == 0 and len(fallback.batches) == 1
    second = StagePort(stage.run, TOKEN, "Postprocess")
    assert await second.start("127.0.0.1", range(29100, 29164)) != address  # the next one free
    await calls.close()
    await port.stop(0)
    await second.stop(0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_replica_cut_off_costs_a_call_the_connect_timeout_then_waits_its_backoff(
    monkeypatch,
) -> None:
    """A replica alive but cut off (it reports, answers nothing): the call goes to another
    replica's port within the connect timeout, and the address is not picked again until
    its backoff has passed, however often the registry reports it; then it is probed (a
    connect, no call waits on it) and, still cut off, its backoff doubles."""
    monkeypatch.setattr(call_link, "CONNECT_TIMEOUT_S", 0.3)
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # never answers
    cut = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    registry = ModelRegistry(MemoryStore(), "app")
    ((_, port),) = await _ports(registry, ["r1"])
    registry.report("Inference", "cut", [], address=cut)
    clock = Clock()
    fallback = Fallback()
    calls = PortCalls(registry, "Inference", fallback, TOKEN, clock=clock)
    calls.update(registry.ports("Inference"))
    loop = asyncio.get_running_loop()
    for _ in range(6):
        started = loop.time()
        assert await calls.run(_batch()) == ["r1", "a"]
        assert loop.time() - started < 1.0
        calls.update(registry.ports("Inference"))  # the cut replica still reports
    assert port.calls == 6 and fallback.batches == []
    assert calls._backoff[cut] == (1.0, 1.0)  # tried once, then left alone
    clock.now = 1.0
    calls.update(registry.ports("Inference"))
    assert cut in calls._links  # its backoff passed: tried again, by a connect...
    calls._in_flight[port.address] = 99  # ...not a call, though r1 looks busy
    started = loop.time()
    assert await calls.run(_batch()) == ["r1", "a"]
    assert loop.time() - started < 0.2 and port.calls == 7
    await until(lambda: cut not in calls._links)
    assert calls._backoff[cut] == (3.0, 2.0)  # failed again: twice as long
    await calls.close()
    await port.stop(0)
    silent.close()
