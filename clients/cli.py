"""`raystream`: serve, classify, export, info. Expected failures print one line, no traceback."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import grpc

DEFAULT_SERVER = "127.0.0.1:9000"
DEFAULT_CONFIG = Path("deploy/serve_config.yaml")
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


class CliError(Exception):
    """An expected failure: printed as one line, exit code 2."""


# -- serve ---------------------------------------------------------------------------------


def _serve_config(path: Path, overrides: dict) -> tuple[dict, object]:
    import yaml

    from serve_app.config import AppConfig

    if not path.is_file():
        raise CliError(f"Serve config {path} not found")
    config = yaml.safe_load(path.read_text())
    app = config["applications"][0]
    app["args"] = {**(app.get("args") or {}), **overrides}
    try:
        validated = AppConfig.model_validate(app["args"])
    except ValueError as exc:
        raise CliError(f"invalid config {path}:\n{exc}") from None
    return config, validated


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate the config, start `serve run` in the foreground, print when it answers."""
    import yaml

    from engines.repository import ModelNotFoundError, resolve

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "model_repository": args.model_repository,
        }.items()
        if v
    }
    if args.engine:
        overrides["engine"] = {"kind": args.engine}
    config, app = _serve_config(args.config, overrides)
    try:
        resolve(app.model_repository, app.model, app.model_version)
    except ModelNotFoundError as exc:
        raise CliError(str(exc)) from None
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    serve_bin = Path(sys.executable).with_name("serve")
    child = subprocess.Popen([str(serve_bin), "run", f.name])
    address = f"{app.host}:{app.port}"

    async def wait_ready() -> object:
        from clients.client import Client

        async with Client(address) as client:
            while child.poll() is None:
                try:
                    return await client.model_info(timeout=1.0)
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.5)
        return None

    try:
        info = asyncio.run(wait_ready())
        if info is not None:
            print(
                f"raystream ready: gRPC on {address}, model {info.name}/{info.version}, "
                f"engine {info.engine} ({info.precision}); Ctrl-C stops",
                flush=True,
            )
        return child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)
        return child.wait()
    finally:
        os.unlink(f.name)


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


async def _classify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from clients.client import Client

    paths = _image_paths(args.paths)
    failed = 0
    progress = tqdm(
        total=len(paths), unit="img", disable=not sys.stderr.isatty() or args.json, file=sys.stderr
    )
    rows = []
    async with Client(args.server, timeout=args.timeout) as client:
        async for result in client.classify(paths, batch_size=args.batch_size, top_k=args.top_k):
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


def status_name(code: int) -> str:
    """google.rpc.Code value -> its name (3 -> INVALID_ARGUMENT)."""
    return next((s.name for s in grpc.StatusCode if s.value[0] == code), str(code))


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


# -- info, export --------------------------------------------------------------------------


async def _info(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from clients.client import Client

    async with Client(args.server) as client:
        info = await client.model_info(args.model, timeout=args.timeout)
    print(json.dumps(MessageToDict(info, always_print_fields_with_no_presence=True), indent=2))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    return asyncio.run(_info(args))


def cmd_export(args: argparse.Namespace) -> int:
    from engines.export import export_model
    from engines.repository import list_versions

    existing = list_versions(args.repository, args.model)
    if args.if_missing and existing:
        print(f"{args.model} is in {args.repository} (versions {', '.join(existing)})")
        return 0
    ref = export_model(args.repository, args.model, args.version, with_torch=not args.onnx_only)
    print(f"exported {args.model} version {ref.spec.version} to {ref.path}")
    return 0


# -- entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raystream", description="gRPC streaming image classification on Ray Serve."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "serve",
        help="start the server (serve run) and wait until it answers",
        description="Validate the Serve config, start `serve run` on it in the "
        "foreground, and print a line once gRPC answers.",
    )
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="Serve config YAML")
    p.add_argument("--host", help="bind address (default from config: 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (default from config: 9000)")
    p.add_argument("--engine", choices=["auto", "onnxruntime", "torch-cuda", "tensorrt"])
    p.add_argument("--model-repository", help="model repository directory")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "classify",
        help="classify image files or folders over one stream",
        description="Send every image (files, or folders recursively) over one "
        "bidirectional stream and print the top labels per file.",
    )
    p.add_argument("paths", nargs="+", help="image files or folders")
    p.add_argument("--server", default=DEFAULT_SERVER, help="host:port (default %(default)s)")
    p.add_argument("--top-k", type=int, default=5, help="labels per image (default 5)")
    p.add_argument("--batch-size", type=int, default=16, help="images per request")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.add_argument("--timeout", type=float, default=None, help="stream deadline in seconds")
    p.set_defaults(func=cmd_classify)

    p = sub.add_parser("info", help="show the served model (GetModelInfo)")
    p.add_argument("--server", default=DEFAULT_SERVER, help="host:port (default %(default)s)")
    p.add_argument("--model", default="", help="model name to ask about")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=cmd_info)

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
    p.add_argument("--if-missing", action="store_true", help="do nothing if a version exists")
    p.add_argument("--onnx-only", action="store_true", help="skip the torch.export program")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"raystream: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        server = getattr(args, "server", "")
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            print(
                f"raystream: cannot reach the server at {server} ({exc.details()}); is it "
                f"running? Start it with `make serve`.",
                file=sys.stderr,
            )
        else:
            print(f"raystream: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
