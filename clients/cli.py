"""`raystream`: serve, classify, embed, similar, export, info. Expected failures print one
line, no traceback."""

# ruff: noqa: E402  (GRPC_VERBOSITY is set before grpc is first imported)
from __future__ import annotations

import os

# grpc's C core logs each failed TLS handshake on stderr (at INFO), ahead of the one line
# that says what failed. It reads GRPC_VERBOSITY once, when first imported. `raystream
# serve` hands the server the setting as it was (serve_command._restore_grpc_verbosity).
INHERITED_GRPC_VERBOSITY = os.environ.get("GRPC_VERBOSITY")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import asyncio
import json
import logging
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import grpc

from clients import serve_command
from clients.catalog_errors import CatalogError
from clients.client import status_name
from clients.embed_command import FORMATS, EmbedError
from engines.base import EngineError
from engines.calibration import IMAGE_SUFFIXES
from engines.repository import LOAD_FAILED, ModelNotFoundError

DEFAULT_SERVER = "127.0.0.1:9000"
DEFAULT_CONFIG = Path("deploy/serve_config.yaml")


class CliError(Exception):
    """An expected failure: printed as one line, exit code 2."""


# -- numeric flags -------------------------------------------------------------------------
# Each numeric flag parses through one of these: a value out of range is a usage error (one
# line, exit code 2), not a traceback from deep inside the client, and not a silent no-op.

MAX_COUNT = 2**31 - 1  # past this, counts overflow protobuf, islice or the OS
MAX_SECONDS = 1e6  # ~11 days; gRPC turns much longer deadlines into immediate expiry


def count(minimum: int = 1, maximum: int = MAX_COUNT):
    """An argparse `type`: an integer in minimum..maximum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return parse


def port(text: str) -> int:
    """An argparse `type`: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def seconds(text: str) -> float:
    """An argparse `type`: a positive, finite number of seconds (at most MAX_SECONDS)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0 and at most {MAX_SECONDS:.0f}, got {text}"
        )
    return value


def rate(text: str) -> float:
    """An argparse `type`: a positive, finite rate (per second)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def sweep(text: str) -> list[float]:
    """An argparse `type` for bench --sweep: comma-separated positive numbers."""
    values = [rate(item.strip()) for item in text.split(",") if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


class Parser(argparse.ArgumentParser):
    """Usage errors in one line, as the CLI's other expected failures (exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


# -- classify ------------------------------------------------------------------------------


def _image_paths(paths: Sequence[str]) -> list[Path]:
    found: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
            )
        elif path.is_file():
            found.append(path)
        else:
            raise CliError(f"{name}: no such file or directory")
    if not found:
        raise CliError(f"no images found in {', '.join(paths)}")
    return found


async def _classify_traced(args: argparse.Namespace) -> int:
    """`classify --trace`: each request a unary call with a fresh W3C traceparent (sampled),
    its trace id printed before each of its files' labels."""
    from clients.client import Client

    paths, failed = _image_paths(args.paths), 0
    async with Client(args.server, timeout=args.timeout, **_connection(args)) as client:
        for start in range(0, len(paths), args.batch_size):
            batch = paths[start : start + args.batch_size]
            trace_id = os.urandom(16).hex()
            traceparent = f"00-{trace_id}-{os.urandom(8).hex()}-01"
            response = await client.classify_once(
                [path.read_bytes() for path in batch],
                top_k=args.top_k,
                model=args.model,
                metadata=(("traceparent", traceparent),),
            )
            for path, result in zip(batch, response.results, strict=True):
                if result.HasField("error") and result.error.code:
                    failed += 1
                    text = f"ERROR {status_name(result.error.code)}: {result.error.message}"
                else:
                    text = "  ".join(f"{lb.name} {lb.score:.3f}" for lb in result.labels)
                print(f"trace {trace_id}  {path}  {text}", flush=True)
    return 1 if failed else 0


async def _classify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.trace:
        return await _classify_traced(args)

    from clients.client import Client

    paths = _image_paths(args.paths)
    failed = 0
    progress = tqdm(
        total=len(paths), unit="img", disable=not sys.stderr.isatty() or args.json, file=sys.stderr
    )
    rows = []
    async with Client(
        args.server, connections=args.connections, timeout=args.timeout, **_connection(args)
    ) as client:
        async for result in client.classify(
            paths, batch_size=args.batch_size, top_k=args.top_k, model=args.model
        ):
            progress.update(1)
            failed += not result.ok
            if args.json:
                print(
                    json.dumps(
                        {
                            "file": str(result.key),
                            "labels": [vars(label) for label in result.labels],
                            **(
                                {"error": {"code": result.error_code, "message": result.error}}
                                if not result.ok
                                else {}
                            ),
                        }
                    ),
                    flush=True,
                )
            else:
                rows.append(result)
    progress.close()
    if not args.json:
        _print_table(sorted(rows, key=lambda r: str(r.key)))
    return 1 if failed else 0


def _print_table(results: list) -> None:
    width = max(len(str(r.key)) for r in results)
    for r in results:
        if r.ok:
            text = "  ".join(f"{lb.name} {lb.score:.3f}" for lb in r.labels)
        else:
            text = f"ERROR {status_name(r.error_code)}: {r.error}"
        print(f"{r.key!s:<{width}}  {text}")


def cmd_classify(args: argparse.Namespace) -> int:
    return asyncio.run(_classify(args))


# -- embed, similar (clients/embed_command.py) -----------------------------------------------


def cmd_embed(args: argparse.Namespace) -> int:
    from clients import embed_command
    from clients.catalog_inputs import CatalogInputs

    if bool(args.paths) == bool(args.manifest):
        raise CliError("give image files or folders, or --manifest: one or the other")
    if embed_command.writes_one_file(args.out):
        if args.manifest or args.senders > 1:
            option = "--manifest" if args.manifest else "--senders"
            raise CliError(f"{option} writes an output folder: give --out a folder")
        paths = _image_paths(args.paths)
        return asyncio.run(embed_command.embed(args, paths, _connection(args)))
    inputs = CatalogInputs(
        args.paths,
        manifest=args.manifest,
        path_column=args.path_column,
        key_column=args.key_column,
        image_suffixes=IMAGE_SUFFIXES,
    )
    return asyncio.run(embed_command.embed_to_folder(args, inputs, _connection(args)))


def cmd_index_build(args: argparse.Namespace) -> int:
    from clients import embed_command

    return asyncio.run(embed_command.index_build(args))


def cmd_similar(args: argparse.Namespace) -> int:
    from clients import embed_command

    return asyncio.run(embed_command.similar(args, _connection(args)))


# -- info, export --------------------------------------------------------------------------


async def _info(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from clients.client import Client

    async with Client(args.server, **_connection(args)) as client:
        info = await client.model_info(args.model, timeout=args.timeout)
    print(json.dumps(MessageToDict(info, always_print_fields_with_no_presence=True), indent=2))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    return asyncio.run(_info(args))


async def _models(args: argparse.Namespace) -> int:
    from clients.client import Client

    async with Client(args.server, **_connection(args)) as client:
        try:
            if args.action == "load":
                versions = args.versions.split(",") if args.versions else ()
                if any(not version.strip() for version in versions):
                    raise CliError(f"--versions {args.versions!r}: a version is empty")
                await client.load_model(
                    args.name, latest=args.latest, versions=versions, timeout=args.timeout
                )
            elif args.action == "unload":
                await client.unload_model(args.name, timeout=args.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                if args.timeout is None:  # no client deadline: the server's own gave out
                    gave_up = f"the server gave up on {args.action} {args.name}: {exc.details()}"
                    raise CliError(gave_up) from None
                raise CliError(
                    f"no answer within --timeout {args.timeout:g} s; the server goes on "
                    f"with {args.action} {args.name}: `raystream models list` shows its state"
                ) from None
            if exc.details() and exc.details().startswith(LOAD_FAILED):  # not "down"
                raise CliError(f"the server could not load {args.name}: {exc.details()}") from None
            raise
        rows = await client.models()
    for name, version, state, reason in rows:
        print(f"{name:<28} {version:>8}  {state:<12} {reason}".rstrip())
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.action != "list" and not args.name:
        raise CliError(f"models {args.action} needs a model name")
    return asyncio.run(_models(args))


def cmd_export(args: argparse.Namespace) -> int:
    from engines.export import export_model, is_current
    from engines.repository import list_versions

    existing = list_versions(args.repository, args.model)
    if args.if_missing and is_current(args.repository, args.model):
        print(f"{args.model} is in {args.repository} (versions {', '.join(existing)})")
        return 0
    if args.if_missing and existing:
        print(
            f"{args.model} version {existing[-1]} in {args.repository} has no embedding output "
            f"(an older export format): exporting a new version"
        )
    ref = export_model(args.repository, args.model, args.version, with_torch=not args.onnx_only)
    print(f"exported {args.model} version {ref.spec.version} to {ref.path}")
    return 0


# -- bench, build-engine ------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from clients import loadgen

    streams = [args.streams] if args.rate or not args.sweep else args.sweep
    if any(n != int(n) for n in streams):
        raise CliError(f"--sweep: stream counts must be whole numbers, got {streams}")
    if min(streams) < args.processes:
        raise CliError(f"--processes {args.processes} needs at least as many --streams")
    images = loadgen.folder_images(args.images) if args.images else loadgen.builtin_photos()
    base = loadgen.Workload(
        images=images,
        batch_size=args.batch_size,
        streams=args.streams,
        in_flight=args.in_flight,
        rate=args.rate,
        duration_s=args.duration,
        max_requests=args.requests,
        unary=args.unary,
        top_k=args.top_k,
        connections=args.connections,
        spread=args.spread,
        pixels=loadgen.model_input(args.repository, args.model, images) if args.pixels else None,
    )
    if args.sweep:
        field = "rate" if args.rate else "streams"
        loads = [replace(base, **{field: v if field == "rate" else int(v)}) for v in args.sweep]
    else:
        loads = [base]

    def baseline() -> dict[str, float]:
        return loadgen.in_process_baseline(
            args.repository,
            args.model,
            args.engine,
            images,
            args.batch_size,
            args.duration / 4,
            threads=args.threads,
        )

    # Half of the baseline before the loads and half after: an engine's speed drifts on a
    # shared box (120-160 img/s from one minute to the next on the 2-core CPU box), so the
    # ratio uses the mean of both and the report shows how far apart they were.
    before = baseline() if args.baseline else None
    reports = []
    for load in loads:
        report = asyncio.run(
            loadgen.run_load(args.server, load, args.processes, **_connection(args))
        )
        label = (
            f"rate {load.rate:.0f}/s" if load.rate else f"{load.streams} streams x {load.in_flight}"
        )
        print(f"{label:>22}: {report.line()}", flush=True)
        reports.append(report)
    result = {"server": args.server, "reports": [vars(r) for r in reports]}
    if before is not None:
        after = baseline()
        mean = {key: (before[key] + after[key]) / 2 for key in before}
        best = max(r.images_per_s for r in reports)
        result["baseline"] = mean
        result["baseline_before_after"] = {key: [before[key], after[key]] for key in before}
        for key, value in mean.items():
            print(
                f"in-process {key}: {value:.1f} (before {before[key]:.1f}, after "
                f"{after[key]:.1f})  (server / in-process = {best / value:.2f})"
            )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
        if len(reports) > 1:
            loadgen.plot_sweep(
                reports,
                args.out / "sweep.png",
                f"raystream at {args.server}, batch {args.batch_size}",
            )
        print(f"wrote {args.out}/bench.json" + (" and sweep.png" if len(reports) > 1 else ""))
    return 0


def cmd_build_engine(args: argparse.Namespace) -> int:
    from engines.repository import resolve
    from engines.tensorrt import TensorRTEngine

    ref = resolve(args.repository, args.model, args.version)
    engine = TensorRTEngine(
        ref,
        max_batch_size=args.max_batch_size,
        precision=args.precision,
        calibration_dir=args.calibration_dir,
        slots=1,
    )
    print(f"TensorRT engine ready for {ref.path} ({engine.info})")
    engine.close()
    return 0


def _connection(args: argparse.Namespace) -> dict:
    """TLS and token options for Client; the token may also come from RAYSTREAM_TOKEN."""
    return {
        "token": args.token or os.environ.get("RAYSTREAM_TOKEN"),
        "tls_ca": args.tls_ca,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
    }


def _add_stream_options(p: argparse.ArgumentParser) -> None:
    """The options of the commands that send files over one stream (classify, embed)."""
    p.add_argument("--server", default=DEFAULT_SERVER, help="host:port (default %(default)s)")
    p.add_argument("--batch-size", type=count(), default=16, help="images per request")
    p.add_argument(
        "--model", default="", help="NAME or NAME/VERSION (default: the server's default model)"
    )
    p.add_argument("--timeout", type=seconds, default=None, help="stream deadline in seconds")
    p.add_argument(
        "--connections",
        type=count(),
        default=1,
        help="spread the stream over up to this many connections, each on another ingress "
        "replica (topology direct with several replicas)",
    )
    _add_connection_options(p)


def _add_connection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", help="bearer token (default: $RAYSTREAM_TOKEN)")
    p.add_argument("--tls-ca", help="connect with TLS, trusting this CA certificate (PEM)")
    p.add_argument("--tls-cert", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", help="client private key (PEM) for mutual TLS")


# -- entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="raystream", description="gRPC streaming image classification on Ray Serve."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "serve",
        help="start the server (serve run) and wait until it answers",
        description="Validate the Serve config, start `serve run` on it in the "
        "foreground, and print a line once gRPC answers.",
    )
    _add_serve_config_options(p)
    p.add_argument(
        "--ready-timeout",
        type=seconds,
        default=900.0,
        help="give up (and stop) if not serving after this many seconds",
    )
    p.add_argument(
        "--expose-metrics",
        metavar="[HOST:]PORT",
        help="also serve Ray's Prometheus metrics (every raystream metric; no "
        "authentication) at http://HOST:PORT/metrics for a Prometheus on another machine; "
        "HOST defaults to 0.0.0.0, every interface (default: $RAYSTREAM_EXPOSE_METRICS, "
        "else off: the local Ray and its metrics listen on 127.0.0.1 only)",
    )
    p.add_argument(
        "--probe-tls-cert",
        help="with security.tls_client_ca: a client certificate (PEM) that the readiness "
        "probe presents (without one, readiness is not probed)",
    )
    p.add_argument("--probe-tls-key", help="the private key (PEM) of --probe-tls-cert")
    p.set_defaults(func=serve_command.cmd_serve, grpc_verbosity=INHERITED_GRPC_VERBOSITY)

    p = sub.add_parser(
        "reconfigure",
        help="change a running server's batching user_config, without a restart",
        description="Apply KEY=VALUE changes (YAML values; null for the default) to the "
        "batching user_config of the server that `raystream serve` runs (Inference, or "
        "Ingress in topology direct), the way `serve deploy` applies an edited config: "
        "each replica's reconfigure, no restart. Give the config and flags the server was "
        "started with (any other difference would restart replicas); each run starts from "
        "the config's user_config. Keys: see README, Configuration.",
    )
    p.add_argument("changes", nargs="+", metavar="KEY=VALUE")
    _add_serve_config_options(p)
    p.add_argument(
        "--address",
        default="auto",
        help="the Ray cluster (raystream serve's ready line names it; default: this "
        "machine's latest)",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=120.0,
        help="give up if the application is not running again after this many seconds "
        "(default %(default)s)",
    )
    p.set_defaults(func=serve_command.cmd_reconfigure)

    p = sub.add_parser(
        "classify",
        help="classify image files or folders over one stream",
        description="Send every image (files, or folders recursively) over one "
        "bidirectional stream and print the top labels per file.",
    )
    p.add_argument("paths", nargs="+", help="image files or folders")
    p.add_argument("--top-k", type=count(), default=5, help="labels per image (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.add_argument(
        "--trace",
        action="store_true",
        help="send each request as a unary call with a fresh W3C traceparent and print its "
        "trace id (the server's spans join it where tracing is on)",
    )
    _add_stream_options(p)
    p.set_defaults(func=cmd_classify)

    p = sub.add_parser(
        "embed",
        help="embed a catalog of images into Parquet shards (resumable), or one vector file",
        description="Send every image (files, folders recursively, or the paths of a "
        "--manifest) for its embedding over one bidirectional stream, and write a row per "
        "image (key, vector, model, version, embedding_space). --out FOLDER: Parquet shards "
        "written as the vectors arrive; run the same command again after a crash or a kill "
        "and it goes on where it stopped; images that fail are listed in FOLDER/"
        "failures.jsonl. --out FILE.parquet or FILE.npy: one file at the end, every vector "
        "in memory (small sets). Exit code 1 if any image failed.",
    )
    p.add_argument("paths", nargs="*", help="image files or folders")
    p.add_argument(
        "--manifest",
        type=Path,
        help="a file listing the images: a text file of paths (one a line), or a .csv or "
        ".parquet file with a column of paths; relative paths are relative to its folder",
    )
    p.add_argument("--path-column", default="path", help="the manifest's column of paths")
    p.add_argument(
        "--key-column", help="the manifest's column of keys (default: the path is the key)"
    )
    p.add_argument(
        "--out", type=Path, required=True, help="an output folder, or a .parquet/.npy file"
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        help="for one vector file: parquet (needs pyarrow: pip install 'raystream[parquet]') "
        "or npy (a NumPy structured array); default: npy for a .npy --out, else parquet",
    )
    p.add_argument(
        "--shard-rows", type=count(), default=50_000, help="rows per shard (default 50,000)"
    )
    p.add_argument(
        "--row-group-rows",
        type=count(),
        default=10_000,
        help="rows per Parquet row group (default 10,000: ~50 MB of 1,280 floats)",
    )
    p.add_argument(
        "--in-flight",
        type=count(),
        default=None,
        help="requests outstanding (default 64 per connection)",
    )
    p.add_argument(
        "--senders",
        type=count(),
        default=1,
        help="processes that send the images, each with its own --connections and "
        "--in-flight (default 1; a GPU server answers faster than one process sends: "
        "docs/embeddings.md)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float16"),
        default="float32",
        help="the vectors as stored in an output folder: float16 takes half the bytes "
        "(rounded from the server's float32; cosine to it at least 0.9999)",
    )
    p.add_argument(
        "--attempts",
        type=count(),
        default=5,
        help="tries per image answered UNAVAILABLE or RESOURCE_EXHAUSTED, with backoff, "
        "before it is listed as failed (default 5)",
    )
    _add_stream_options(p)
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser(
        "index",
        help="build a nearest-neighbour index over the output folder of `raystream embed`",
        description="`raystream index build VECTORS --out INDEX`: a FAISS index (pip install "
        "'raystream[index]') over every shard of VECTORS, for `raystream similar --index "
        "INDEX`. Exact below 50,000 vectors; above, an inverted file of 8-bit vectors.",
    )
    index_sub = p.add_subparsers(dest="index_command", required=True)
    b = index_sub.add_parser("build", help="build an index over an output folder")
    b.add_argument("vectors", type=Path, help="an output folder of `raystream embed`")
    b.add_argument("--out", type=Path, required=True, help="the index folder to write")
    b.add_argument("--kind", help="a FAISS index factory string (default: chosen by size)")
    b.add_argument(
        "--nprobe", type=count(), default=32, help="lists searched per query (IVF; default 32)"
    )
    b.set_defaults(func=cmd_index_build)

    p = sub.add_parser(
        "similar",
        help="the nearest neighbours of an image in a vector file, by cosine",
        description="Embed QUERY_IMAGE with the server and print the -k rows of --index "
        "(a file of `raystream embed`) most similar to it by cosine, best first. Only "
        "vectors of the server's embedding space are compared.",
    )
    p.add_argument("query", metavar="QUERY_IMAGE", help="an image file")
    p.add_argument(
        "--index",
        type=Path,
        required=True,
        help="an index folder (raystream index build), or a vector file (.parquet, .npy)",
    )
    p.add_argument("-k", type=count(), default=5, help="neighbours to print (default 5)")
    p.add_argument(
        "--model",
        default="",
        help="NAME or NAME/VERSION that embeds the query (default: the index's model version "
        "where the server serves it, else the server's default model)",
    )
    p.add_argument("--server", default=DEFAULT_SERVER, help="host:port (default %(default)s)")
    p.add_argument("--timeout", type=seconds, default=30.0, help="seconds (default 30)")
    _add_connection_options(p)
    p.set_defaults(func=cmd_similar)

    p = sub.add_parser("info", help="show the served model (GetModelInfo)")
    p.add_argument("--server", default=DEFAULT_SERVER, help="host:port (default %(default)s)")
    p.add_argument("--model", default="", help="model name to ask about")
    p.add_argument("--timeout", type=seconds, default=10.0, help="seconds (default 10)")
    _add_connection_options(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "models",
        help="list, load or unload model versions on a running server",
        description=(
            "list: every version in the server's repository and its state. load NAME: serve "
            "the versions of a policy (--versions or --latest; none: the server's config), "
            "warmed before they take traffic, then unload NAME's other versions. unload NAME "
            "(or NAME/VERSION): stop serving it once its requests in flight are answered."
        ),
    )
    p.add_argument("action", choices=("list", "load", "unload"))
    p.add_argument("name", nargs="?", default="", help="model name (unload: NAME/VERSION too)")
    policy = p.add_mutually_exclusive_group()
    policy.add_argument("--versions", help="load these versions, comma-separated: 1,2")
    policy.add_argument("--latest", type=count(), help="load the latest N versions")
    p.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        help="load, unload: stop waiting after this many seconds (the server goes on; "
        "default: wait, up to the server's load timeout, 600 s, for a load)",
    )
    p.add_argument("--server", default=DEFAULT_SERVER, help="host:port (default %(default)s)")
    _add_connection_options(p)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser(
        "export",
        help="export a torch model into the model repository",
        description="Export to ONNX (+ torch.export program), check ONNX Runtime "
        "against torch on real photos, then write the version.",
    )
    p.add_argument(
        "--model",
        default="efficientnet-lite0",
        help="efficientnet-lite0 (pretrained) or resnet50-random (benchmarks)",
    )
    p.add_argument("--repository", type=Path, default=Path("models"))
    p.add_argument("--version", default="", help="version name (default: next integer)")
    p.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing if the newest version exists in the current export format (one "
        "from before embeddings gets a new version)",
    )
    p.add_argument("--onnx-only", action="store_true", help="skip the torch.export program")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "bench",
        help="load-generate against a server: throughput, latency",
        description="Open concurrent bidi streams (or unary calls) sending "
        "requests of --batch-size images, closed-loop (--in-flight "
        "per stream) or open-loop (--rate, Poisson), and report "
        "images/s, latency percentiles, errors and the server's "
        "timing breakdown.",
    )
    p.add_argument("--server", default=DEFAULT_SERVER)
    p.add_argument("--images", type=Path, help="folder of images (default: built-in photos)")
    p.add_argument("--batch-size", type=count(), default=8, help="images per request")
    p.add_argument("--streams", type=count(), default=1, help="concurrent streams")
    p.add_argument("--in-flight", type=count(), default=1, help="closed loop: requests per stream")
    p.add_argument("--rate", type=rate, help="open loop: requests/s over all streams")
    p.add_argument("--duration", type=seconds, default=10.0, help="seconds per load")
    p.add_argument("--requests", type=count(), help="stop each stream after this many requests")
    p.add_argument("--unary", action="store_true", help="ClassifyOnce calls instead of streams")
    p.add_argument(
        "--pixels",
        action="store_true",
        help="send the model input (preprocessed here with --model's spec in --repository) "
        "instead of the encoded images: the server then runs no decode",
    )
    p.add_argument(
        "--connections",
        type=count(),
        default=1,
        help="spread the streams over this many TCP connections (several ingress replicas)",
    )
    p.add_argument(
        "--spread",
        action="store_true",
        help="each stream sends over all of its process' --connections (one logical stream "
        "reaching several direct replicas) instead of keeping to one",
    )
    p.add_argument(
        "--processes",
        type=count(),
        default=1,
        help="split the streams over this many load-generator processes (one Python "
        "process tops out at a few thousand images/s)",
    )
    p.add_argument("--top-k", type=count(), default=5, help="labels per image (default 5)")
    p.add_argument(
        "--sweep", type=sweep, help="comma-separated stream counts (or rates with --rate)"
    )
    p.add_argument("--out", type=Path, help="write bench.json (and sweep.png) here")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also run the same model in-process (no gRPC, no Ray)",
    )
    p.add_argument("--repository", type=Path, default=Path("models"))
    p.add_argument("--model", default="efficientnet-lite0")
    p.add_argument("--engine", default="auto", help="engine for --baseline")
    p.add_argument("--threads", type=count(1, 64), default=2, help="decode threads for --baseline")
    _add_connection_options(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "build-engine",
        help="build (or find) the TensorRT engine for this GPU",
        description="ONNX -> TensorRT engine for this GPU and TensorRT version, "
        "cached in the model repository. Needs tensorrt and a GPU.",
    )
    p.add_argument("--repository", type=Path, default=Path("models"))
    p.add_argument("--model", default="efficientnet-lite0")
    p.add_argument("--version", default="")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16", "int8"], default="fp16")
    p.add_argument("--max-batch-size", type=count(1, 4096), default=64, help="1 to 4096")
    p.add_argument("--calibration-dir", help="INT8: folder of representative images")
    p.set_defaults(func=cmd_build_engine)
    return parser


def _add_serve_config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="Serve config YAML")
    p.add_argument("--host", help="bind address (default from config: 127.0.0.1)")
    p.add_argument("--port", type=port, help="gRPC port (default from config: 9000)")
    p.add_argument("--engine", choices=["auto", "onnxruntime", "torch-cuda", "tensorrt", "echo"])
    p.add_argument("--model-repository", help="model repository directory")
    p.add_argument(
        "--topology", choices=["chained", "fused", "direct"], help="see README, Architecture"
    )
    p.add_argument("--decode", choices=["cpu", "gpu"], help="where JPEGs are decoded")


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # `raystream ... | head`: the reader stopped reading, so stop quietly, as Unix tools
        # do (the Python docs' note on SIGPIPE); stdout goes nowhere so that exit's flush
        # cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (CliError, serve_command.ConfigError, EmbedError, CatalogError) as exc:
        print(f"raystream: {exc}", file=sys.stderr)
        return 2
    except (EngineError, ModelNotFoundError, FileNotFoundError) as exc:
        print(f"raystream: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a client-only install running a server command
        print(
            f"raystream: this command needs the server's packages ({exc}): "
            "pip install 'raystream[server]' (make serve installs everything)",
            file=sys.stderr,
        )
        return 2
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            print(f"raystream: {_unavailable(args, exc.details() or '')}", file=sys.stderr)
        else:
            print(f"raystream: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2


# grpc's details when the TLS handshake fails: a TLS client meeting a plaintext server
# (WRONG_VERSION_NUMBER), a certificate that does not verify or name the host, ...
_HANDSHAKE_FAILED = re.compile(r"(Ssl|Tls) handshake failed|SSL_ERROR|WRONG_VERSION_NUMBER", re.I)


def _unavailable(args: argparse.Namespace, details: str) -> str:
    """The line for a server that could not be reached: down, or speaking TLS to a
    plaintext client (grpc says only "Socket closed"), or the other way round."""
    server = getattr(args, "server", "")
    tls = bool(getattr(args, "tls_ca", None) or getattr(args, "tls_cert", None))
    if tls and _HANDSHAKE_FAILED.search(details):
        if "WRONG_VERSION_NUMBER" in details:
            return (
                f"the TLS handshake with {server} failed ({details}); the server may not use "
                f"TLS: connect without --tls-ca/--tls-cert/--tls-key"
            )
        return (
            f"the TLS handshake with {server} failed ({details}); check --tls-ca (the CA that "
            f"signed the server's certificate) and, if the server requires client "
            f"certificates, --tls-cert and --tls-key"
        )
    if not tls and "Connection refused" not in details and _speaks_tls(server):
        return (
            f"the server at {server} closed the connection ({details}); it expects TLS: pass "
            f"--tls-ca CA.pem (the server's certificate, or the CA that signed it), and "
            f"--tls-cert/--tls-key if it requires client certificates"
        )
    return (
        f"cannot reach the server at {server} ({details}); is it running? Start it with "
        f"`make serve`."
    )


def _speaks_tls(server: str, timeout: float = 3.0) -> bool:
    """Whether something at host:port answers a TLS ClientHello (certificates unchecked:
    this only tells a TLS server from a plaintext one)."""
    import socket
    import ssl

    host, _, port = server.rpartition(":")
    if not port.isdigit():
        return False
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    host = host.strip("[]") or "127.0.0.1"
    try:
        with (
            socket.create_connection((host, int(port)), timeout) as plain,
            context.wrap_socket(plain, server_hostname=host),
        ):
            return True  # a ServerHello came back
    except ssl.SSLError as exc:
        # a TLS server that wants a client certificate may refuse in the handshake
        return "CERTIFICATE" in str(exc).upper()
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
