"""A JPEG's header read without decoding anything: enough to send it to nvJPEG.

With `decode: gpu` most images are catalogue JPEGs that nvJPEG decodes on the GPU. Reading
their headers with PIL (twice: cost, then the checks) cost more CPU per image than the GPU
decode itself; walking the marker segments here costs a few microseconds. Anything this
reader is unsure of goes to the CPU path, which decodes it with PIL or explains why not.
"""

from __future__ import annotations

import struct

SOI, EOI = b"\xff\xd8", b"\xff\xd9"
HUFFMAN_FRAMES = {0xC0, 0xC1, 0xC2}  # baseline, extended, progressive (8-bit, Huffman)
OTHER_FRAMES = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
NO_LENGTH = {0x01, *range(0xD0, 0xD8)}  # TEM and RSTn: markers without a segment
MAX_SEGMENTS = 64
ORIENTATION = 0x0112


def gpu_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG that nvJPEG decodes to the pixels the CPU path would see:
    8-bit Huffman (baseline or progressive), grayscale or YCbCr colour, no EXIF rotation, a
    single picture, ending with its end-of-image marker (nvJPEG decodes truncated JPEGs
    without an error). None for anything else."""
    if data[:2] != SOI or data.rstrip(b"\0\r\n ")[-2:] != EOI:
        return None
    position, size = 2, None
    for _ in range(MAX_SEGMENTS):
        while position < len(data) and data[position] == 0xFF:
            position += 1  # the marker's 0xFF and any fill bytes
        if position + 3 > len(data) or data[position - 1] != 0xFF:
            return None
        marker = data[position]
        position += 1
        if marker in NO_LENGTH:
            continue
        (length,) = struct.unpack_from(">H", data, position)
        segment = data[position + 2 : position + length]
        if length < 2 or len(segment) != length - 2:
            return None
        position += length
        if marker in HUFFMAN_FRAMES:
            size = _frame_size(segment)
            if size is None:
                return None
        elif marker in OTHER_FRAMES:
            return None  # lossless, hierarchical or arithmetic-coded: the CPU path
        elif marker == 0xDA:  # start of scan: every header segment has been seen
            return size
        elif marker == 0xE1 and segment[:6] == b"Exif\0\0":
            if _orientation(segment[6:]) not in (None, 1):
                return None
        elif marker == 0xE2 and segment[:4] == b"MPF\0":
            return None  # multi-picture (MPO)
        elif marker == 0xEE and segment[:5] == b"Adobe" and segment[11:12] != b"\x01":
            return None  # colour transform 0 (RGB or CMYK) or 2 (YCCK), not YCbCr
    return None


def nvjpeg_size(data: bytes, resize_size: int) -> tuple[int, int] | None:
    """`gpu_size` of a JPEG that `decode: gpu` gives nvJPEG: one whose short side is at least
    the resize size. nvJPEG's decode differs from PIL's in the last bits, and a smaller JPEG
    is enlarged to the resize size, difference and all: a 300x200 photo came out at cosine
    0.9978 to the reference preprocessing (an H100), every photo at its size or larger at
    0.998 or more. Those go to the CPU path, where their decode is cheap."""
    size = gpu_size(data)
    return size if size is not None and min(size) >= resize_size else None


def _frame_size(frame: bytes) -> tuple[int, int] | None:
    if len(frame) < 6:
        return None
    precision, height, width, components = struct.unpack_from(">BHHB", frame)
    if precision != 8 or components not in (1, 3) or not height or not width:
        return None
    return width, height


def _orientation(tiff: bytes) -> int | None:
    """The EXIF orientation tag of IFD0 (None if absent); 0 when the block is unreadable,
    which sends the image to the CPU path."""
    try:
        order = {b"II": "<", b"MM": ">"}[tiff[:2]]
        (ifd,) = struct.unpack_from(order + "I", tiff, 4)
        (entries,) = struct.unpack_from(order + "H", tiff, ifd)
        for entry in range(entries):
            tag, kind, _, value = struct.unpack_from(order + "HHI4s", tiff, ifd + 2 + 12 * entry)
            if tag == ORIENTATION:
                return struct.unpack_from(order + "H", value)[0] if kind == 3 else 0
    except (KeyError, struct.error):
        return 0
    return None
