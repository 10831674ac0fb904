"""Crops on the GPU handed from a Preprocess replica to an Inference replica on the same GPU
by CUDA IPC: a stage call over a port (serve_app/stage_port.py) carries a handle to the
tensor's memory, not its bytes. Two Ray actors sharing an H200 handed 224x224 crops over
this way at 35,192 img/s in batches of 32, against 12,625 through the host and Ray's object
store.

The caller keeps the tensor until the call answers; the callee lets go of it before it
answers (the batch lives as long as the call), so the caller's memory is free again when
the answer comes. A callee that cannot see the caller's GPU (another GPU, a replica of
another node) refuses the call with CropsNotHere, and the caller sends that replica the
crops' bytes from then on (`on_host`); Serve handle calls always carry the bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve_app.messages import Batch

# reduce_tensor's arguments for a CUDA tensor: this one is the device's index in the
# producer's process, which the consumer's numbering (CUDA_VISIBLE_DEVICES) may not share.
_DEVICE_ARG = 6


class CropsNotHere(Exception):
    """The callee cannot open the caller's GPU memory: send it the crops' bytes."""


def is_cuda_tensor(obj: object) -> bool:
    return getattr(obj, "is_cuda", False) is True


def reduce(tensor) -> tuple:
    """The pickle reduction of a CUDA tensor: its IPC handle, and its GPU's UUID."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    return _rebuild, (str(torch.cuda.get_device_properties(tensor.device).uuid), rebuild, args)


def _rebuild(uuid: str, rebuild, args: tuple):
    index = _visible_index(uuid)
    if index is None:
        raise CropsNotHere(f"GPU {uuid} is not visible to this replica")
    args = (*args[:_DEVICE_ARG], index, *args[_DEVICE_ARG + 1 :])
    return rebuild(*args)


def _visible_index(uuid: str) -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


def on_host(batch: Batch) -> Batch:
    """`batch` with its crops as a host array, for a callee that cannot open them."""
    crops: Any = batch.crops
    if not is_cuda_tensor(crops):
        return batch
    return batch.replace(crops=crops.cpu().numpy())
