"""raystream's own log lines in the replica's Serve log file. Inside a replica Serve sets up
only its own logger ("ray.serve"); without this, the INFO lines of `serve_app` and `engines`
(a model version loaded, the batching in force, which transport the stage calls take) went
nowhere, and their warnings only to the worker's stderr."""

from __future__ import annotations

import logging

OWN_LOGGERS = ("serve_app", "engines")


def to_serve_log() -> None:
    """From now on this process's raystream loggers write where Serve's own logger does
    (called in each replica's constructor, once Serve has set that logger up)."""
    handlers = logging.getLogger("ray.serve").handlers
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.handlers = list(handlers)
        logger.propagate = False
