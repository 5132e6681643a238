"""The KV pulls of a simulated worker: the real tcp transport, timed as a given link.

Simulated workers keep KV blocks of a few hundred bytes (``SimulatedModel``'s chained token
states), and move them with the real tcp transport: the real pull protocol, checksums, leases,
reader counts and streamed pulls all run, and a block that arrives wrong changes the tokens. What
the tiny blocks cannot show is the time the real model's blocks would take on the real link, so
each pull (or each part of a streamed pull) is followed by a wait of
``latency_s + blocks x seconds_per_block`` before it counts as arrived, inside the pull's timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvtransfer.base import PullRequest
from kvtransfer.tcp import TcpKVClient


class SimulatedLinkClient(TcpKVClient):
    """:class:`TcpKVClient` whose pulls take as long as a link of ``latency_s`` and
    ``seconds_per_block`` would for the blocks they bring."""

    def __init__(
        self, *args: Any, latency_s: float = 0.0, seconds_per_block: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.latency_s = latency_s
        self.seconds_per_block = seconds_per_block

    async def _pull_into(self, pull: PullRequest) -> tuple[int, str]:
        num, message = await super()._pull_into(pull)
        if num:
            await asyncio.sleep(self.latency_s + num * self.seconds_per_block)
        return num, message
