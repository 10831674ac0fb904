"""The Python interpreter's settings in a replica process, from the application's config."""

from __future__ import annotations

import sys

from serve_app.config import AppConfig


def configure(config: AppConfig) -> None:
    """Called in each replica's constructor: the GIL's switch interval, where the config
    sets one (every replica of the application shares it, so the process's last word is
    the config's)."""
    if config.gil_switch_interval_ms is not None:
        sys.setswitchinterval(config.gil_switch_interval_ms / 1000.0)
