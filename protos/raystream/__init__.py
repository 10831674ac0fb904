"""raystream's client library and wire API.

    from raystream import Client

    async with Client("127.0.0.1:9000") as client:
        async for result in client.classify(["cat.jpg"]):
            print(result.key, result.labels[0].name)

`raystream.v1` and `raystream.oip` are the generated gRPC stubs of the two APIs. `Client`
needs only the base install (`pip install raystream`): no Ray, torch or ONNX Runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.client import Client, EmbeddingResult, ImageResult

__all__ = ["Client", "EmbeddingResult", "ImageResult"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the stubs (raystream.v1, raystream.oip) load without the client.
    if name in __all__:
        from clients import client

        return getattr(client, name)
    raise AttributeError(f"module 'raystream' has no attribute {name!r}")
