"""Several model versions at once, and loading and unloading them at run time: the real
stages and engines in one process, the registry in memory (no Ray)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest
from support import until

from engines.repository import ModelNotFoundError, resolve, select_versions
from raystream.oip import grpc_predict_v2_pb2 as oip
from serve_app import tuning
from serve_app.config import STAGES, AppConfig, BatchingConfig
from serve_app.core.messages import Answer, Batch, Job
from serve_app.core.serving import ServingCore
from serve_app.errors import Code, InvalidArgument, ModelNotFound
from serve_app.models.lifecycle import ModelLifecycle
from serve_app.models.registry import MemoryStore, ModelRegistry
from serve_app.pipeline.topology import StageGroup
from serve_app.protocol.oip import OpenInferenceService
from serve_app.protocol.streams import StreamRunner

MODEL = "efficientnet-lite0"
CAT = range(281, 286)


@pytest.fixture(scope="module")
def versions(model) -> tuple[str, str]:
    """two_versions' versions: the one below the model's own, and the model's own."""
    return str(int(model.spec.version) - 1), model.spec.version


def test_version_policies(two_versions, versions) -> None:
    old, new = versions
    assert select_versions(two_versions, MODEL) == [new]
    assert select_versions(two_versions, MODEL, latest=5) == [old, new]
    assert select_versions(two_versions, MODEL, versions=(new, old)) == [old, new]
    with pytest.raises(ModelNotFoundError, match="no version"):
        select_versions(two_versions, MODEL, versions=(str(int(new) + 1),))
    for latest in (0, -1):  # a policy that picks no version, or all but N, is refused
        with pytest.raises(ValueError, match="latest must be 1 or more"):
            select_versions(two_versions, MODEL, latest=latest)
    for name in ("..", ".", "a/b", "x" * 300, "", "a\0b"):  # never outside the repository
        with pytest.raises(ModelNotFoundError):
            select_versions(two_versions / MODEL, name)
    with pytest.raises(ValueError, match="not both"):
        AppConfig(models=[{"name": MODEL, "latest": 1, "versions": ["1"]}])
    with pytest.raises(ValueError, match="not in models"):
        AppConfig(models=[{"name": "other"}])
    pinned = AppConfig(models=[{"name": MODEL, "versions": [old]}])  # what model_version was
    assert pinned.default_model_versions == (old,)
    assert AppConfig().default_model_versions == ()  # the highest


def test_a_version_directory_copied_by_hand_is_the_version_it_is_named(
    two_versions, versions, tmp_path
) -> None:
    """`cp -r 2 4` keeps version 2's model.json: the directory names the version (as in
    Triton's repository), or a load of 4 would route as 2 and never be ready."""
    import shutil

    new = versions[1]
    shutil.copytree(two_versions, tmp_path, dirs_exist_ok=True, symlinks=True)
    shutil.copytree(tmp_path / MODEL / new, tmp_path / MODEL / "9", symlinks=True)
    spec = resolve(tmp_path, MODEL, "9").spec
    assert (spec.name, spec.version) == (MODEL, "9")
    assert spec.embedding_space.startswith(f"{MODEL}/9/")
    assert resolve(tmp_path, MODEL, new).spec.version == new


def test_a_model_file_changed_since_export_is_refused(two_versions, versions, tmp_path) -> None:
    """model.json's onnx_sha256 is checked when the engine loads: a model.onnx edited
    since export (it may still parse, and answer nonsense) does not load."""
    import shutil

    from engines import create_engine
    from engines.base import EngineError

    target = tmp_path / MODEL / "1"
    shutil.copytree(two_versions / MODEL / versions[1], target)  # the files, not links
    onnx_file = target / "model.onnx"
    onnx_file.write_bytes(onnx_file.read_bytes() + b"\0")
    with pytest.raises(EngineError, match="changed since export"):
        create_engine("onnxruntime", resolve(tmp_path, MODEL, "1"))


def test_a_torch_program_changed_since_export_is_named(model, tmp_path) -> None:
    """model.json's program_sha256 names model.pt2 (the torch-cuda engine checks it before
    loading); a model.json without it (an older export) checks nothing."""
    import json
    import shutil

    from engines.repository import SPEC_FILE, TORCH_FILE, sha256_file

    if not model.torch_path.is_file():
        pytest.skip("the model was exported without its torch program")
    target = tmp_path / MODEL / "1"
    shutil.copytree(model.path, target)
    spec = json.loads((target / SPEC_FILE).read_text())
    (target / SPEC_FILE).write_text(
        json.dumps({**spec, "program_sha256": sha256_file(model.torch_path)})
    )
    ref = resolve(tmp_path, MODEL, "1")
    assert ref.changed_since_export(ref.torch_path) == ""
    with (target / TORCH_FILE).open("ab") as program:
        program.write(b"\0")
    assert "changed since export" in ref.changed_since_export(ref.torch_path)
    (target / SPEC_FILE).write_text(json.dumps({**spec, "program_sha256": ""}))
    assert resolve(tmp_path, MODEL, "1").changed_since_export(ref.torch_path) == ""


@contextlib.asynccontextmanager
async def served(
    repository,
    versions: list[str],
    store=None,
    drain_timeout_s: float = 5,
    load_timeout_s: float = 600,
):
    """An ingress' core and lifecycle over one StageGroup (as in topology direct)."""
    config = AppConfig(
        model_repository=repository,
        models=[{"name": MODEL, "versions": versions}],
        engine={"kind": "onnxruntime", "batch_capacity": 8},
    )
    registry = ModelRegistry(store or MemoryStore(), "test")
    group = await StageGroup.create(config, STAGES, registry, "Ingress", "r1")
    core = ServingCore(config, [], group.run)

    async def info(key: str):
        return group.info(key)

    life = ModelLifecycle(
        core,
        registry,
        {"Ingress"},
        "r1",
        info,
        repository,
        config.models,
        drain_timeout_s=drain_timeout_s,
        load_timeout_s=load_timeout_s,
    )
    await life.follow_once()
    life.start()
    try:
        yield core, life, group
    finally:
        life.stop()
        group.stop()


async def ask(core: ServingCore, photo: bytes, model: str) -> Answer:
    future = asyncio.get_running_loop().create_future()
    try:
        key = core.check_model(model).key
    except ModelNotFound as exc:
        await asyncio.sleep(0.01)  # refused at once: let the others run
        return Answer(b"", int(exc.code), str(exc))
    core.submit(Job(id="x", images=(photo,), model=key), future.set_result, "s", 30.0)
    return await future


async def test_requests_route_by_name_and_version(two_versions, versions, photos) -> None:
    old, new = versions
    async with served(two_versions, [old, new]) as (core, _, group):
        assert sorted(core.models) == [f"{MODEL}/{old}", f"{MODEL}/{new}"]
        assert core.check_model("").version == new  # the default model's highest version
        assert core.check_model(f"{MODEL}/{old}").version == old
        assert core.check_model(MODEL, old).version == old
        for model in ("", MODEL, f"{MODEL}/{old}", f"{MODEL}/{new}"):
            answer = await ask(core, photos["chelsea"], model)
            assert answer.code == 0, answer.message
        missing = f"{MODEL}/{int(new) + 1}"
        assert (await ask(core, photos["chelsea"], missing)).code == Code.NOT_FOUND
        assert (await ask(core, photos["chelsea"], "resnet")).code == Code.NOT_FOUND
        for malformed in ("/", f"/{old}", f"{MODEL}/"):  # not the default model, nor latest
            with pytest.raises(ModelNotFound, match='is not "name" or "name/version"'):
                core.check_model(malformed)
        with pytest.raises(ModelNotFound, match="no model named"):  # OIP names its model
            core.check_model("", default=False)
        assert core.check_model(MODEL, default=False).version == new
        assert [s.version for s in group.infos()] == [old, new]


async def test_migration_loses_nothing_and_pinned_requests_never_switch(
    two_versions, versions, photos
) -> None:
    """Steady load on v1, on the default and (once it serves) on v2, while v2 loads and v1
    unloads: every request that asked for a loaded version is answered OK; a request pinned
    to v1 after its unload gets NOT_FOUND, never v2's answer."""
    old, new = versions
    async with served(two_versions, [old]) as (core, life, group):
        answers: list[tuple[str, bool, Answer]] = []
        stop = asyncio.Event()

        async def client(model: str) -> None:
            while not stop.is_set():
                loaded = model == "" or model.rsplit("/", 1)[-1] in {
                    m.version for m in core.versions(MODEL)
                }
                answers.append((model, loaded, await ask(core, photos["chelsea"], model)))

        def answered(model: str, code: int = 0) -> bool:
            return any(m == model and a.code == code for m, _, a in answers)

        clients = [asyncio.create_task(client(m)) for m in ("", f"{MODEL}/{old}", f"{MODEL}/{new}")]
        await until(lambda: answered("") and answered(f"{MODEL}/{old}"), 60)
        assert await life.load(MODEL, versions=(old, new)) == [old, new]
        assert sorted(core.models) == [f"{MODEL}/{old}", f"{MODEL}/{new}"]
        await until(lambda: answered(f"{MODEL}/{new}"), 60)
        assert await life.unload(MODEL, old) == [old]
        await until(lambda: answered(f"{MODEL}/{old}", Code.NOT_FOUND), 60)
        stop.set()
        await asyncio.gather(*clients)
        assert sorted(core.models) == [f"{MODEL}/{new}"]
        assert sorted(group.models) == [f"{MODEL}/{new}"]
        for model, loaded, answer in answers:
            if loaded:  # it asked for a version loaded when it was sent
                assert answer.code in (0, Code.NOT_FOUND), answer.message
                if answer.code == Code.NOT_FOUND:  # v1, retired before it was sent
                    assert model.endswith(f"/{old}")
                    assert "in this replica" not in answer.message  # never once in flight
        ok = {m: sum(1 for mm, _, a in answers if mm == m and a.code == 0) for m, _, _ in answers}
        assert ok[""] > 0 and ok[f"{MODEL}/{old}"] > 0 and ok[f"{MODEL}/{new}"] > 0
        assert all(a.code == 0 for m, _, a in answers if m == "")  # the default never failed
        last_v1 = [a for m, _, a in answers if m == f"{MODEL}/{old}"][-1]
        assert last_v1.code == Code.NOT_FOUND
        index = {(e.version, e.state) for e in life.index()}
        assert index == {(old, "UNAVAILABLE"), (new, "READY")}


async def test_an_unload_past_its_drain_timeout_still_answers_every_request(
    two_versions, versions, photos
) -> None:
    """Requests pinned to v1 that are still running when the unload's drain timeout passes
    each get an answer: theirs, or UNAVAILABLE once v1's engine is dropped; none waits
    for good (the batcher closed under them)."""
    old, new = versions
    async with served(two_versions, [old, new], drain_timeout_s=0.1) as (core, life, group):
        group.reconfigure(BatchingConfig(max_batch_size=8).model_dump())  # the engine's
        futures = []
        for i in range(40):  # about 640 images: seconds of work on 2 cores
            future = asyncio.get_running_loop().create_future()
            job = Job(id=str(i), images=(photos["chelsea"],) * 16, model=f"{MODEL}/{old}")
            core.submit(job, future.set_result, "s", 120.0)
            futures.append(future)
        await until(lambda: any(f.done() for f in futures), 60)  # the engine works through them
        assert await life.unload(MODEL, old) == [old]
        answers = await asyncio.wait_for(asyncio.gather(*futures), 60)
        codes = [answer.code for answer in answers]
        assert set(codes) <= {0, Code.UNAVAILABLE}, {a.message for a in answers}
        assert Code.UNAVAILABLE in codes  # the unload cut some short
        cut = next(a for a in answers if a.code == Code.UNAVAILABLE)
        assert "unloaded" in cut.message
        assert sorted(group.models) == [f"{MODEL}/{new}"]


async def test_unload_and_load_refuse_malformed_names_and_policies(two_versions, versions) -> None:
    """ "name/" is no version (it must not unload every version), and a policy of latest
    < 1 is refused: neither changes what is served."""
    old, new = versions
    async with served(two_versions, [old, new]) as (core, life, _):
        with pytest.raises(ModelNotFound, match="malformed"):
            await life.unload(f"{MODEL}/")
        with pytest.raises(ModelNotFound):
            await life.unload("..")
        for latest in (0, -9):
            with pytest.raises(InvalidArgument, match="latest must be 1 or more"):
                await life.load(MODEL, latest=latest)
        with pytest.raises(ModelNotFound, match="not in the model repository") as missing:
            await life.load("resnet")
        assert str(two_versions) not in str(missing.value)  # no server path to clients
        assert sorted(core.models) == [f"{MODEL}/{old}", f"{MODEL}/{new}"]


def test_oip_version_policies_are_checked() -> None:
    """The `config` parameter of RepositoryModelLoad, as tritonclient sends it: a count
    that is no positive integer, or versions that are no list, are INVALID_ARGUMENT."""
    import json

    from raystream.oip import grpc_predict_v2_pb2 as oip
    from serve_app.protocol.oip import _version_policy

    def policy(version_policy) -> tuple:
        config = json.dumps({"version_policy": version_policy})
        request = oip.RepositoryModelLoadRequest(model_name=MODEL)
        request.parameters["config"].string_param = config
        return _version_policy(request.parameters)

    assert policy({"latest": {"num_versions": 2}}) == (2, ())
    assert policy({"specific": {"versions": [1, 2]}}) == (None, ("1", "2"))
    for bad in (
        {"latest": {"num_versions": -5}},
        {"latest": {"num_versions": 0}},
        {"latest": {"num_versions": 2.5}},
        {"latest": {"num_versions": True}},
        {"specific": {"versions": "12"}},
        {"specific": {"versions": []}},
    ):
        with pytest.raises(InvalidArgument):
            policy(bad)
    request = oip.RepositoryModelLoadRequest(model_name=MODEL)
    request.parameters[
        "config"
    ].string_param = '{"version_policy": {"latest": {"num_versions": 1e400}}}'
    with pytest.raises(InvalidArgument):
        _version_policy(request.parameters)


class SlowStore(MemoryStore):
    """Every read takes a moment, as a GCS round trip does: replicas that change the state
    at once read it before either has written."""

    def get(self, key: str) -> bytes | None:
        time.sleep(0.02)  # simulated GCS latency
        return super().get(key)


async def test_two_ingresses_unloading_at_once_both_take_effect(
    two_versions, versions, caplog
) -> None:
    """Unloads of two versions sent through two ingress replicas at once: each changes only
    its own version's state, so neither undoes the other and neither waits out the drain
    timeout for a version the other put back."""
    old, new = versions
    store = SlowStore()
    async with served(two_versions, [old, new], store) as (core, life, group):
        assert sorted(core.models) == [f"{MODEL}/{old}", f"{MODEL}/{new}"]

        async def info(key: str):
            return group.info(key)

        other = ModelLifecycle(
            core,
            ModelRegistry(store, "test"),
            {"Ingress"},
            "r2",
            info,
            two_versions,
            drain_timeout_s=5,
        )
        unloaded = await asyncio.gather(life.unload(MODEL, old), other.unload(MODEL, new))
        assert unloaded == [[old], [new]]
        assert "with requests still in flight" not in caplog.text  # no drain ran out
        assert ModelRegistry(store, "test").desired() == {}
        await life.follow_once()
        assert core.models == {}


async def test_loads_of_two_versions_beside_the_others_at_once_both_take_effect(
    two_versions, versions
) -> None:
    """`RepositoryModelLoad("name/version")` keeps the versions loaded: two sent at once
    each keep the other's (neither unloads a version the other has just loaded)."""
    old, new = versions
    async with served(two_versions, [old]) as (core, life, _):
        service = OpenInferenceService(core, StreamRunner(8), life, model_control=True)
        await asyncio.gather(
            *(
                service.RepositoryModelLoad(
                    oip.RepositoryModelLoadRequest(model_name=f"{MODEL}/{version}"), None
                )
                for version in (new, old)
            )
        )
        await life.follow_once()
        assert sorted(core.models) == [f"{MODEL}/{old}", f"{MODEL}/{new}"]


async def test_a_poll_that_read_the_registry_before_an_unload_does_not_route_to_it_after(
    two_versions, versions
) -> None:
    """An ingress' poll reads a version as wanted, then its unload runs while the poll waits
    for the version's info: the poll must not route to it once the unload is done."""
    old, new = versions
    store = MemoryStore()
    async with served(two_versions, [old, new], store) as (core, _, group):
        asked, answer = asyncio.Event(), asyncio.Event()

        async def slow_info(key: str):
            asked.set()
            await answer.wait()
            return group.info(key)

        life = ModelLifecycle(
            core, ModelRegistry(store, "test"), {"Ingress"}, "r2", slow_info, two_versions
        )
        core.retire(f"{MODEL}/{new}")  # not routed here yet: the next poll routes it
        poll = asyncio.create_task(life.follow_once())
        await asyncio.wait_for(asked.wait(), 10)
        unload = asyncio.create_task(life.unload(MODEL, new))
        await asyncio.wait({unload}, timeout=2)  # unlocked, the unload ends meanwhile
        answer.set()
        await asyncio.wait_for(asyncio.gather(poll, unload), 20)
        assert sorted(core.models) == [f"{MODEL}/{old}"]


async def test_a_load_whose_client_leaves_still_runs_to_its_end(two_versions, versions) -> None:
    """A client that cancels its load (or whose deadline passes) while the version warms up
    leaves the same server as one that waited: the new version serves, the old is unloaded."""
    old, new = versions
    async with served(two_versions, [old]) as (core, life, _):
        load = asyncio.create_task(life.load(MODEL, versions=(new,)))
        await until(lambda: (new, "LOADING") in {(e.version, e.state) for e in life.index()})
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        loaded = {(old, "UNAVAILABLE"), (new, "READY")}
        await until(lambda: {(e.version, e.state) for e in life.index()} == loaded, 20)
        assert sorted(core.models) == [f"{MODEL}/{new}"]


async def test_a_replica_loading_a_version_still_reports_what_it_holds(
    two_versions, versions, monkeypatch
) -> None:
    """A version loads for seconds (minutes with CUDA graphs); meanwhile the replica goes on
    reporting, holding the others and not yet this one. Silent past FRESH_S it read as gone:
    a load would route past it, and callers would drop its port."""
    import serve_app.models.registry as registry_module
    from serve_app.pipeline.topology import ModelStages

    old, new = versions
    monkeypatch.setattr(registry_module, "FRESH_S", 0.5)
    release = asyncio.Event()
    create = ModelStages.create

    async def slow_create(config, stages, model, preprocess):
        if model.spec.version == new:
            await release.wait()
        return await create(config, stages, model, preprocess)

    monkeypatch.setattr(ModelStages, "create", slow_create)
    store = MemoryStore()
    async with served(two_versions, [old], store) as (_, life, group):
        registry = ModelRegistry(store, "test")
        load = asyncio.create_task(life.load(MODEL, versions=(old, new)))
        await asyncio.sleep(1.5)  # not a sync: past FRESH_S is what is tested (three times)
        (report,) = registry.reports("Ingress")
        assert report.holds == {f"{MODEL}/{old}"}
        assert registry.held_everywhere(["Ingress"]) == {f"{MODEL}/{old}"}
        assert not load.done()
        release.set()
        assert await asyncio.wait_for(load, 30) == [old, new]
        assert sorted(group.models) == [f"{MODEL}/{old}", f"{MODEL}/{new}"]


async def test_a_load_past_its_timeout_is_withdrawn(two_versions, versions) -> None:
    """A load not ready everywhere in its load timeout fails and is no longer wanted: the
    replicas that had not loaded it never serve it later beside the versions it was to
    replace (its unload step never ran)."""
    from serve_app.errors import DeadlineExceeded

    old, new = versions
    store = MemoryStore()
    async with served(two_versions, [old], store, load_timeout_s=1.0) as (core, life, _):
        registry = ModelRegistry(store, "test")

        async def stuck_replica() -> None:  # alive, never loads the new version
            while True:
                registry.report("Ingress", "r-stuck", [f"{MODEL}/{old}"])
                await asyncio.sleep(0.1)  # pacing: a replica reports now and then

        stuck = asyncio.create_task(stuck_replica())
        try:
            with pytest.raises(DeadlineExceeded):
                await life.load(MODEL, versions=(new,))
            assert registry.desired() == {f"{MODEL}/{old}": "serve"}
            await life.follow_once()  # what a poll of the state routes after the withdrawal
            assert sorted(core.models) == [f"{MODEL}/{old}"]
        finally:
            stuck.cancel()


async def test_a_load_that_never_becomes_ready_holds_up_no_other_model(
    two_versions, versions, model, tmp_path
) -> None:
    """A load waits until every stage replica holds the version (up to 600 s for GPU
    engines); one that some replica never reports held must not hold up loads and unloads
    of the other models meanwhile."""
    import shutil

    old, new = versions
    shutil.copytree(two_versions, tmp_path, dirs_exist_ok=True, symlinks=True)
    shutil.copytree(model.path, tmp_path / "other" / "1")
    store = MemoryStore()
    async with served(tmp_path, [old, new], store) as (core, life, _):
        registry = ModelRegistry(store, "test")

        async def stuck_replica() -> None:  # alive, holds MODEL's versions, never "other"
            while True:
                registry.report("Ingress", "r-stuck", [f"{MODEL}/{old}", f"{MODEL}/{new}"])
                await asyncio.sleep(0.1)  # pacing: a replica reports now and then

        stuck = asyncio.create_task(stuck_replica())
        load = asyncio.create_task(life.load("other"))
        try:
            await until(lambda: registry.desired().get("other/1") == "serve")  # it waits
            assert not load.done() and "other/1" not in core.models
            assert await asyncio.wait_for(life.unload(MODEL, old), 10) == [old]
            assert sorted(core.models) == [f"{MODEL}/{new}"]
        finally:
            load.cancel()
            stuck.cancel()


def test_the_desired_state_is_one_key_per_version(monkeypatch) -> None:
    store = MemoryStore()
    first, second = ModelRegistry(store, "app"), ModelRegistry(store, "app")
    assert first.start(["m/1"]) == {"m/1": "serve"}
    assert second.start(["m/1", "m/9"]) == {"m/1": "serve"}  # the first replica's, kept
    first.set_state(["m/2"], "serve")  # two replicas change two versions at once
    second.set_state(["m/1"], "drain")
    assert first.desired() == second.desired() == {"m/1": "drain", "m/2": "serve"}
    first.set_state(["m/2"], "drain")
    second.set_state(["m/2"], "serve")  # loaded again while the first drained it
    first.remove(["m/1", "m/2"], only="drain")
    assert first.desired() == {"m/2": "serve"}
    # a replica that starts later does not bring back what was unloaded
    assert ModelRegistry(store, "app").start(["m/1"]) == {"m/2": "serve"}
    # one that finds the state claimed but never written (its writer died) writes it
    monkeypatch.setattr("serve_app.models.registry.START_WAIT_S", 0.1)
    store.put("dead/start/claimed", b"")
    assert ModelRegistry(store, "dead").start(["m/1"]) == {"m/1": "serve"}


class _StuckWarmUps:
    """Engine warm-ups past the first `loads` hang (a hung GPU while capturing, say) until
    `release` is set; then they go on as usual. `started`: the warm-ups begun."""

    def __init__(self, loads: int, monkeypatch) -> None:
        import serve_app.stages.inference as inference

        real = inference._warm_engine
        self.release, self.started = threading.Event(), 0

        def warm(config, model):
            self.started += 1
            if self.started > loads:
                self.release.wait(30)
            return real(config, model)

        monkeypatch.setattr(inference, "_warm_engine", warm)


def _echo_config(repository, versions: list[str], load_timeout_s: float, monkeypatch) -> AppConfig:
    monkeypatch.setattr(tuning, "LOAD_TIMEOUT_S", load_timeout_s)
    return AppConfig(
        model_repository=repository,
        models=[{"name": MODEL, "versions": versions}],
        engine={"kind": "echo"},
    )


async def test_a_replica_whose_model_load_is_stuck_fails_to_start(
    two_versions, versions, monkeypatch
) -> None:
    """A load past LOAD_TIMEOUT_S is stuck for good (its thread cannot be stopped):
    the replica's constructor fails, and Serve starts another in its place. It loads
    nothing more meanwhile (the next version would wait out the limit too)."""
    old, new = versions
    stuck = _StuckWarmUps(0, monkeypatch)
    config = _echo_config(two_versions, [old, new], 0.5, monkeypatch)
    try:
        with pytest.raises(
            RuntimeError, match=rf"loading model {MODEL}/{old} ran past its load timeout"
        ):
            await asyncio.wait_for(StageGroup.create(config, STAGES), 10)
        assert stuck.started == 1
    finally:
        stuck.release.set()


async def test_a_stuck_load_is_given_up_even_where_its_cleanup_waits_for_the_stuck_thread(
    two_versions, versions, monkeypatch
) -> None:
    """A stage's cleanup on cancel may wait for its stuck thread (a decode thread's shutdown
    does): the load is given up at its limit all the same, not when the thread ends."""
    import serve_app.pipeline.topology as topology

    release = threading.Event()

    async def stuck_load(*args, **kwargs):
        try:
            await asyncio.to_thread(release.wait, 30)
        finally:
            await asyncio.to_thread(release.wait, 30)

    monkeypatch.setattr(topology.ModelStages, "create", staticmethod(stuck_load))
    config = _echo_config(two_versions, [versions[0]], 0.5, monkeypatch)
    try:
        with pytest.raises(RuntimeError, match=r"ran past its load timeout \(0.5 s\)"):
            await asyncio.wait_for(StageGroup.create(config, STAGES), 10)
    finally:
        release.set()


async def test_a_load_stuck_at_run_time_fails_and_is_withdrawn_and_the_replica_replaced(
    two_versions, versions, monkeypatch
) -> None:
    """A version that never finishes loading in a running replica fails (reported, with
    why, for the ingress that asked), is no longer wanted (else each replacement would get
    stuck on it again), and fails the replica's health check, so that Serve replaces the
    replica; the version it already held answers meanwhile."""
    old, new = versions
    stuck = _StuckWarmUps(1, monkeypatch)
    registry = ModelRegistry(MemoryStore(), "test")
    config = _echo_config(two_versions, [old], 0.5, monkeypatch)
    group = await StageGroup.create(config, STAGES, registry, "Inference", "r1")
    try:
        group.check_health()
        registry.set_state([f"{MODEL}/{new}"], "serve")
        await until(lambda: f"{MODEL}/{new}" in registry.failures(["Inference"]))
        failure = registry.failures(["Inference"])[f"{MODEL}/{new}"]
        assert "ran past its load timeout" in failure
        assert list(registry.desired()) == [f"{MODEL}/{old}"]
        with pytest.raises(RuntimeError, match=rf"loading model {MODEL}/{new} ran past"):
            group.check_health()
        job = Job(id="a", pixels=np.zeros((1, 3, 224, 224), np.float32))
        (answer,) = await group.run(Batch(jobs=(job,), model=f"{MODEL}/{old}"))
        assert answer.code == Code.OK, answer.message
        assert stuck.started == 2
    finally:
        stuck.release.set()
        group.stop()
