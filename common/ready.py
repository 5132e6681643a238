"""The ready line: a component that listens prints ``PDSERVE_READY {json}`` on stdout once, so
a launcher (``pdserve up``, tests, benchmarks) learns its addresses without guessing."""

from __future__ import annotations

import json
from typing import Any

READY_PREFIX = "PDSERVE_READY "


def announce_ready(info: dict[str, Any]) -> None:
    """Print the ready line for ``info`` (flushed: the launcher reads it through a pipe)."""
    print(READY_PREFIX + json.dumps(info), flush=True)
