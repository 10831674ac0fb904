"""Where each stage runs, at run time: the stage groups that the config's `topology` makes
(decided once, in serve_app/config.py: `groups`, `deployment_name`), and the calls between them.

The three stages (preprocess, inference, postprocess) always run in that order; a topology
groups them into Serve deployments, each group one deployment whose replicas run their stages
one after the other in-process:

    chained  [preprocess] [inference] [postprocess]   the design card: three deployments
    fused    [preprocess, inference, postprocess]     one deployment, one Ray call a batch
    direct   ()                                       no deployment: the ingress hosts all

or any grouping written out, e.g. `[[preprocess, inference], [postprocess]]`. A group is named
for its main stage (Inference if it holds inference), and that name is what the Serve
config's `deployments:` section configures. The ingress sends each micro-batch of requests
through the groups as a chain of handle calls (serve_app/ingress.py).
"""

from __future__ import annotations

import os

from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig, Group
from serve_app.inference import InferenceStage
from serve_app.messages import Answer, Batch, Served
from serve_app.metrics import resident_memory_bytes
from serve_app.postprocess import PostprocessStage
from serve_app.preprocess import PreprocessStage, load_model


class StageHandle:
    """Calls to a stage deployment, through Ray's object store. (Serve's gRPC transport,
    `_by_reference=False`, cost its caller a third of the CPU per call on a 2-core CPU
    machine, but answers past its 4 MiB message limit failed whole calls, and a soak grew
    the ingress by 100 MB: not used until both are solved.)"""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    async def run(self, batch: Batch) -> Batch | list[Answer]:
        return await self._handle.run.remote(batch)

    async def info(self) -> Served:
        return await self._handle.info.remote()


class StageGroup:
    """The stages of one group, run one after the other on each batch: the code behind a
    group's deployment (serve_app/app.py), or behind the ingress in topology direct."""

    @staticmethod
    def model_spec(config: AppConfig):
        return load_model(config).spec

    @classmethod
    async def create(cls, config: AppConfig, stages: Group) -> StageGroup:
        group = cls()
        model = load_model(config)
        group.model = model.spec
        group.preprocess = (
            PreprocessStage(config, model.spec.preprocess) if "preprocess" in stages else None
        )
        group.inference = (
            await InferenceStage.create(config, model) if "inference" in stages else None
        )
        group.postprocess = PostprocessStage(model.spec) if "postprocess" in stages else None
        return group

    async def run(self, batch: Batch) -> Batch | list[Answer]:
        if self.preprocess is not None:
            batch = await self.preprocess.run(batch)
        if self.inference is not None:
            batch = await self.inference.run(batch)
        if self.postprocess is not None:
            return await self.postprocess.run(batch)
        return batch

    def info(self) -> Served:
        """What is served: only the group that holds inference knows its engine."""
        if self.inference is None:
            raise ValueError("only the group that holds inference knows what is served")
        model = self.model
        return Served(model.name, model.version, self.inference.info, model.embedding_space)

    def reconfigure(self, user_config: dict) -> None:
        if self.inference is None:
            raise ValueError("only the group that holds inference takes a batching user_config")
        self.inference.reconfigure(user_config)

    def batching(self) -> dict:
        return self.inference.batching()

    def images_inferred(self) -> int:
        return self.inference.images_inferred

    @staticmethod
    def memory_bytes() -> int:
        return resident_memory_bytes()

    @staticmethod
    def pid() -> int:
        return os.getpid()
