"""Where a stage port listens for callers on its own node: a Unix socket beside its TCP port.

A call to a replica on the caller's node skips the TCP/IP stack over a Unix socket
(serve_app/transport/call_link.py speaks the same handshake and frames over both). The
sockets live in one directory per user, `<tmp>/raystream-<uid>`, made mode 0700 and refused
where it is another user's or open to others (a directory planted in a shared /tmp); each
socket is mode 0600 and named by its process' id, so the sockets of processes killed
without removing theirs are removed by the next port that starts on the node. The
handshake still runs over them: the modes are defence in depth, not the proof.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path

from serve_app.transport.shared_images import alive

logger = logging.getLogger(__name__)

# A socket address holds 108 bytes on Linux, its terminating NUL included.
MAX_PATH_BYTES = 107
_NAME = re.compile(r"stage-(\d+)-[0-9a-f]+\.sock")


def socket_directory() -> Path:
    """This user's directory for stage sockets, made if missing. PermissionError where it
    is not a directory of this user's alone."""
    directory = Path(tempfile.gettempdir()) / f"raystream-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    found = os.lstat(directory)  # a symlink is not followed: it is refused below
    if (
        not stat.S_ISDIR(found.st_mode)
        or found.st_uid != os.getuid()
        or stat.S_IMODE(found.st_mode) & 0o077
    ):
        raise PermissionError(f"{directory} is not a directory of this user's alone (mode 0700)")
    return directory


def new_socket_path() -> str:
    """A path for a new stage socket of this process; the orphans of dead processes are
    removed first. OSError where no directory or no short enough path is to be had."""
    directory = socket_directory()
    remove_orphans(directory)
    path = str(directory / f"stage-{os.getpid()}-{secrets.token_hex(4)}.sock")
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise OSError(f"the socket path {path} is longer than {MAX_PATH_BYTES} bytes")
    return path


def remove_orphans(directory: Path) -> None:
    """Unlink the sockets of processes no longer alive."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _NAME.fullmatch(name)
        if match is not None and not alive(int(match.group(1))):
            (directory / name).unlink(missing_ok=True)
