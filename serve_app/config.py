"""The application's configuration: one validated model, read from the Serve config's `args`.

Per-deployment settings (replicas, autoscaling, `num_cpus`/`num_gpus`, batching through
`user_config`) live in the Serve config's `deployments:` section; see deploy/serve_config.yaml.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines import EngineKind

STAGES = ("preprocess", "inference", "postprocess")
# Serve's limit on the messages of its gRPC transport between replicas, raised so that stage
# calls can go by value (serve_app/pipeline/topology.py, StageHandle): the shipped configs and
# `raystream serve` set BY_VALUE_ENV in the application's runtime_env.
MESSAGE_LIMIT_ENV = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"
BY_VALUE_ENV = {MESSAGE_LIMIT_ENV: str(1 << 30)}
Stage = Literal["preprocess", "inference", "postprocess"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Settings that went, and what to write instead: a config that still sets one is
    # refused with this hint rather than pydantic's bare "extra inputs are not permitted".
    MOVED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _no_moved_settings(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, hint in cls.MOVED.items():
                if name in data:
                    raise ValueError(f"{name!r} is no longer a setting: {hint}")
        return data


class EngineConfig(_Strict):
    """The engine, built once per inference replica (changing it restarts the replicas)."""

    # auto: torch-cuda on a GPU, else onnxruntime (never tensorrt: experimental, by name
    # only). echo: no model, fixed logits; for transport benchmarks and tests only.
    kind: EngineKind = "auto"
    precision: Literal["fp32", "fp16", "bf16", "int8"] = "fp16"  # GPU engines only
    batch_capacity: int = Field(
        64,
        ge=1,
        le=4096,
        description=(
            "The engine's capacity: the largest batch it accepts, fixed when the replica "
            "starts (GPU engines capture CUDA graphs for batch buckets up to it). Not the "
            "batch size the batcher aims for: that is the batching user_config's "
            "max_batch_size, at most this."
        ),
    )
    options: dict[str, object] = Field(default_factory=dict)  # engine-specific keywords


class LimitsConfig(_Strict):
    """What one client may ask of a replica; past these, requests are refused."""

    MOVED: ClassVar[dict[str, str]] = {
        "drain_timeout_s": "the ingress drains for its deployment's graceful_shutdown_timeout_s "
        "less a margin (serve_app/tuning.py)",
        "max_stream_buffer_bytes": "a stream buffers at most limits.max_message_bytes",
        "max_request_id_chars": "a constant now (serve_app/tuning.py)",
        "max_request_pixels": "a constant now (serve_app/tuning.py)",
        "engine_stall_timeout_s": "a constant now (serve_app/tuning.py)",
        "load_timeout_s": "a constant now (serve_app/tuning.py)",
    }

    max_images_per_request: int = Field(256, ge=1)
    max_image_bytes: int = Field(20 * 1024 * 1024, ge=1)
    max_image_pixels: int = Field(40_000_000, ge=1)
    # gRPC's receive limit, and the bytes of requests a stream holds read and not yet answered
    max_message_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # A stream holds at most this many requests read and not yet answered; past it (or past
    # max_message_bytes of them) it is not read, and HTTP/2 flow control slows the client.
    max_in_flight_per_stream: int = Field(64, ge=1)
    max_in_flight_requests: int = Field(4096, ge=1)  # all streams and calls; past it: refused


class SecurityConfig(_Strict):
    """TLS and token authentication for the gRPC ingress (README: Deploying safely)."""

    tls_cert: Path | None = None  # PEM certificate chain of the server
    tls_key: Path | None = None  # PEM private key of the server
    tls_client_ca: Path | None = None  # if set, clients must present a certificate it signed
    auth_token_file: Path | None = None  # if set, calls need "authorization: Bearer <token>"

    @model_validator(mode="after")
    def _pairs(self) -> SecurityConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be set together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        for path in (self.tls_cert, self.tls_key, self.tls_client_ca, self.auth_token_file):
            if path is not None and not path.is_file():
                raise ValueError(f"{path} does not exist")
        return self


class ModelControlConfig(_Strict):
    """Loading and unloading model versions at run time: the Open Inference Protocol's
    RepositoryModelLoad and RepositoryModelUnload (`raystream models load|unload`). Off by
    default, as in Triton's default model control mode: else any client that may infer
    could unload the model served."""

    MOVED: ClassVar[dict[str, str]] = {
        "enabled": "set model_control.token_file: loads and unloads are allowed with its token"
    }

    # Set: loads and unloads are allowed, with "authorization: Bearer <this token>" (the
    # inference token does not do). Unset: they are refused (FAILED_PRECONDITION).
    token_file: Path | None = None

    @model_validator(mode="after")
    def _token_exists(self) -> ModelControlConfig:
        if self.token_file is not None and not self.token_file.is_file():
            raise ValueError(f"{self.token_file} does not exist")
        return self

    @property
    def enabled(self) -> bool:
        return self.token_file is not None


class CacheConfig(_Strict):
    """The ingress' result cache (serve_app/core/result_cache.py): answers of images already seen,
    per ingress replica, and one engine pass for identical images in flight at once."""

    MOVED: ClassVar[dict[str, str]] = {"enabled": "set cache.max_bytes (0: off)"}

    # The cache's bound: its keys and answers' bytes (with a per-entry overhead) past this
    # evict the least recently used. 0, the default, is off: with few repeated images it
    # costs a hash per image for nothing, and memory on every ingress replica.
    max_bytes: int = Field(0, ge=0)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0


class TracingConfig(_Strict):
    """OpenTelemetry traces of requests (serve_app/observability/tracing.py): spans from the
    ingress and every stage replica, exported over OTLP gRPC to a collector. Off by default."""

    MOVED: ClassVar[dict[str, str]] = {
        "enabled": "set tracing.otlp_endpoint (null: off)",
        "export_delay_s": "a constant now (serve_app/tuning.py)",
    }

    # host:port of an OTLP gRPC collector (plaintext); null, the default, is off
    otlp_endpoint: str | None = None
    # Head sampling of requests that come without a sampled W3C traceparent; a request whose
    # client sends a sampled one is always traced (parent-based), one sent unsampled never.
    sample_ratio: float = Field(0.01, ge=0.0, le=1.0)

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None


class ExperimentalConfig(_Strict):
    """Options measured on one GPU host only: they may change or go without notice."""

    # With decode: gpu and Preprocess a deployment of its own: nvJPEG runs in the Preprocess
    # replicas instead (give them num_gpus), whose crops reach Inference on the same GPU by
    # CUDA IPC (serve_app/transport/device_crops.py).
    preprocess_decodes_on_gpu: bool = False
    # With decode: gpu, this share of nvJPEG's full calls (64 JPEGs; true: all of them) use
    # its GPU_HYBRID backend (Huffman decoding in CUDA kernels, a tenth of the CPU) instead of
    # the JPEG hardware decoder, whose thread polls the hardware all call long
    # (engines/nvjpeg.py): between 0 and 1, both decode at once, the hardware and the SMs.
    # Smaller calls, which GPU_HYBRID would decode on the CPU, stay on the hardware. Every
    # GPU wait of the inference replicas then sleeps (as torch-cuda's blocking_sync).
    gpu_hybrid_decode: float = Field(0.0, ge=0.0, le=1.0)


class ModelEntry(_Strict):
    """A model the application serves, and which of its versions (its version policy):
    the `latest` N versions in the repository (default 1), or the `versions` listed."""

    name: str = Field(min_length=1, pattern=r"^[^/]+$")
    latest: int | None = Field(None, ge=1)
    versions: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _one_policy(self) -> ModelEntry:
        if self.latest is not None and self.versions:
            raise ValueError(
                f"model {self.name!r}: set latest or versions, not both "
                f"(got latest={self.latest}, versions={list(self.versions)})"
            )
        return self


class AppConfig(_Strict):
    """The application's `args`: what a person deploying raystream sets (docs/configuration.md).
    What build_app works out for the replicas (the route, the shared secrets) is not here:
    see serve_app/pipeline/route.py, `Wiring`."""

    MOVED: ClassVar[dict[str, str]] = {
        "model_version": "pin versions in a models entry: models: [{name: ..., versions: [...]}]",
        "stage_calls": "set stage_ports: [first, last] for calls over the replicas' ports "
        "(null: by Serve handle)",
        "shared_images_bytes": "images go through shared memory by themselves with "
        "stage_ports, on one node",
        "preprocess_threads": "the decode threads follow the replica's num_cpus "
        "(ray_actor_options)",
        "preprocess_decodes_on_gpu": "set it under experimental:",
        "gpu_hybrid_decode": "set it under experimental:",
        "nvjpeg_chunk": "removed: nvJPEG takes a piece's JPEGs in one call",
        "instance": "build_app makes it; it is not a setting",
        "stage_token": "build_app makes it; it is not a setting",
        **dict.fromkeys(
            (
                "requests_per_call",
                "max_calls_in_flight",
                "max_call_wait_s",
                "spread_min_images",
                "max_images_per_call",
            ),
            "the dispatcher works it out (serve_app/core/dispatch_rule.py)",
        ),
    }

    host: str = "127.0.0.1"  # loopback by default: binding elsewhere is a deliberate choice
    port: int = Field(9000, ge=0, le=65535)  # 0 picks a free port (tests)
    model_repository: Path = Path("models")
    model: str = "efficientnet-lite0"  # the default model: requests that name none get it
    # Several models (and versions) at once: each with its version policy. Empty: `model`,
    # its highest version in the repository.
    models: tuple[ModelEntry, ...] = ()
    engine: EngineConfig = EngineConfig()
    limits: LimitsConfig = LimitsConfig()
    security: SecurityConfig = SecurityConfig()
    model_control: ModelControlConfig = ModelControlConfig()
    cache: CacheConfig = CacheConfig()
    tracing: TracingConfig = TracingConfig()
    # Which deployments run the stages (serve_app/pipeline/topology.py): chained (Preprocess,
    # Inference, Postprocess: three deployments), fused (one deployment runs all three),
    # direct (the ingress replica runs all three), or groups written out, such as
    # [[preprocess, inference], [postprocess]].
    topology: Literal["chained", "fused", "direct"] | tuple[tuple[Stage, ...], ...] = "chained"
    # cpu: PIL decodes every image. gpu: JPEGs are decoded by nvJPEG in the inference replica
    # (needs torchvision and a GPU there); the CPU stage only checks headers.
    decode: Literal["cpu", "gpu"] = "cpu"
    # Structured request logs (JSON lines in the ingress replica's Serve log): every failed
    # request or image, and this fraction of the successful ones.
    log_sample_rate: float = Field(0.01, ge=0.0, le=1.0)
    # null: stage calls go by Serve handle. [first, last]: each stage replica also listens on
    # the first free port of this range on its node's address, and the stages call each
    # other over these ports (serve_app/transport/stage_port.py), with the handle as fallback.
    stage_ports: tuple[int, int] | None = None
    experimental: ExperimentalConfig = ExperimentalConfig()

    @model_validator(mode="after")
    def _stage_ports_a_range(self) -> AppConfig:
        if self.stage_ports is None:
            return self
        first, last = self.stage_ports
        if not 1024 <= first <= last <= 65535:
            raise ValueError(
                f"stage_ports must be [first, last] in 1024..65535, got {first}, {last}"
            )
        return self

    @model_validator(mode="after")
    def _stages_in_order(self) -> AppConfig:
        if not isinstance(self.topology, str):
            flat = [stage for group in self.topology for stage in group]
            if flat != list(STAGES) or not all(self.topology):
                raise ValueError(
                    f"topology groups must hold {', '.join(STAGES)} once each, in that "
                    f"order, in non-empty groups; got {[list(g) for g in self.topology]}"
                )
        return self

    @model_validator(mode="after")
    def _hybrid_decode_on_the_gpu(self) -> AppConfig:
        if self.experimental.gpu_hybrid_decode and self.decode != "gpu":
            raise ValueError("experimental.gpu_hybrid_decode needs decode: gpu")
        return self

    @model_validator(mode="after")
    def _preprocess_decodes_apart(self) -> AppConfig:
        if not self.experimental.preprocess_decodes_on_gpu:
            return self
        if self.decode != "gpu" or self.experimental.gpu_hybrid_decode:
            raise ValueError(
                "experimental.preprocess_decodes_on_gpu needs decode: gpu, without "
                "gpu_hybrid_decode"
            )
        stage_groups = groups(self)  # direct: none, the ingress runs all three
        if not stage_groups or any("preprocess" in g and "inference" in g for g in stage_groups):
            raise ValueError(
                "experimental.preprocess_decodes_on_gpu needs Preprocess a deployment apart "
                "from Inference (topology chained, or groups such as "
                "[[preprocess], [inference, postprocess]])"
            )
        if self.stage_ports is None:  # a handle call would pickle the crops through the host
            raise ValueError(
                "experimental.preprocess_decodes_on_gpu needs stage_ports (the crops' CUDA "
                "IPC handle travels over the replicas' ports)"
            )
        return self

    @model_validator(mode="after")
    def _model_policies(self) -> AppConfig:
        names = [entry.name for entry in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"models lists a model twice: {names}")
        if self.models and self.model not in names:
            raise ValueError(f"the default model {self.model!r} is not in models: {names}")
        return self

    @property
    def model_entries(self) -> tuple[ModelEntry, ...]:
        """The models served at start, each with its version policy."""
        return self.models or (ModelEntry(name=self.model),)

    @property
    def default_model_versions(self) -> tuple[str, ...]:
        """The versions pinned for the default model (empty: its highest)."""
        return next(entry.versions for entry in self.model_entries if entry.name == self.model)

    @model_validator(mode="after")
    def _absolute_repository(self) -> AppConfig:
        # Replicas may run in another working directory: resolve where the app is built.
        object.__setattr__(self, "model_repository", self.model_repository.expanduser().resolve())
        return self


class BatchingConfig(_Strict):
    """The inference deployment's `user_config`: changed at run time without a restart."""

    MOVED: ClassVar[dict[str, str]] = {
        "batcher": "removed: the dynamic batcher is the only one",
        "max_concurrent_batches": "the engine's own (2 a GPU or ONNX Runtime engine, 1 echo)",
    }

    max_batch_size: int = Field(
        32,
        ge=1,
        description=(
            "The batcher's limit: at most this many images go into one engine batch, and "
            "larger requests are cut into pieces of this size. At most the engine's "
            "capacity, engine.batch_capacity in the application args (a user_config over it "
            "is refused and the settings in force stay)."
        ),
    )
    # 0: a batch starts as soon as the engine is free and takes everything queued meanwhile
    # (under load batches fill by themselves; at low load nothing waits).
    batch_wait_timeout_s: float = Field(0.0, ge=0.0, le=10.0)
    max_queued_images: int = Field(4096, ge=1)  # past this, requests get RESOURCE_EXHAUSTED


# -- the topology: which deployments run the stages (serve_app/pipeline/topology.py runs them) -----

NAMED = {
    "chained": (("preprocess",), ("inference",), ("postprocess",)),
    "fused": (STAGES,),
    "direct": (),
}
Group = tuple[str, ...]


def groups(config: AppConfig) -> tuple[Group, ...]:
    topology = config.topology
    return NAMED[topology] if isinstance(topology, str) else tuple(map(tuple, topology))


def deployment_name(group: Group) -> str:
    return "Inference" if "inference" in group else group[0].title()


def deployment_names(topology: str | list) -> set[str]:
    """The stage deployments that `topology` (a config value) makes."""
    named = NAMED.get(topology) if isinstance(topology, str) else topology
    return {deployment_name(tuple(group)) for group in named or ()}
