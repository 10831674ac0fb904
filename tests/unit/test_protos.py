"""The committed Python stubs must match what protoc generates from the .proto files today."""

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

STUBS = {
    "v1/classifier.proto": ("classifier_pb2.py", "classifier_pb2.pyi", "classifier_pb2_grpc.py"),
    "oip/grpc_predict_v2.proto": (
        "grpc_predict_v2_pb2.py",
        "grpc_predict_v2_pb2.pyi",
        "grpc_predict_v2_pb2_grpc.py",
    ),
}


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    shutil.copytree(
        ROOT / "protos",
        tmp_path / "protos",
        ignore=shutil.ignore_patterns("*_pb2*", "__pycache__"),
    )
    protos = [f"protos/raystream/{proto}" for proto in STUBS]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iprotos",
            "--python_out=protos",
            "--pyi_out=protos",
            "--grpc_python_out=protos",
            *protos,
        ],
        cwd=tmp_path,
        check=True,
    )
    for proto, names in STUBS.items():
        folder = "protos/raystream/" + proto.split("/")[0]
        for name in names:
            fresh = (tmp_path / folder / name).read_text()
            committed = (ROOT / folder / name).read_text()
            assert fresh == committed, f"{name} is stale: run `make protos` and commit"
