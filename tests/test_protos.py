"""The committed Python stubs must match what protoc generates from the .proto today."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUBS = ("classifier_pb2.py", "classifier_pb2.pyi", "classifier_pb2_grpc.py")


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    shutil.copytree(
        ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("*_pb2*", "__pycache__")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iprotos",
            "--python_out=protos",
            "--pyi_out=protos",
            "--grpc_python_out=protos",
            "protos/raystream/v1/classifier.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in STUBS:
        fresh = (tmp_path / "protos/raystream/v1" / name).read_text()
        committed = (ROOT / "protos/raystream/v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run `make protos` and commit"
