"""Moved: the image policy is engines/images.py. This alias remains only until
clients/loadgen.py and bench/ (plain_server.py, run.py, serving_overhead.py) import `decode`
from there; delete it then."""

from engines.images import decode

__all__ = ["decode"]
