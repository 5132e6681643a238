"""A ucx operation given up on is never left with an exception nobody retrieves.

The peer closes its connection while a receive waits; the receive's caller is cancelled within
the grace the close leaves for the peer's last message (a pull's timeout), then the endpoint is
aborted, which fails the UCX receive still pending with UCXXCanceledError. That task used to
be left alone: asyncio logged "Task exception was never retrieved" when the server's clients
closed.
"""

from __future__ import annotations

import asyncio
import gc
import socket
from typing import Any

import numpy as np
import pytest
import torch

from kvtransfer import KVLayout, TensorBlockSource, available_transports
from kvtransfer import framing as fr

pytestmark = pytest.mark.skipif("ucx" not in available_transports(), reason="no ucxx here")

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
TOKEN = "t0k3n"


def test_a_receive_given_up_within_the_grace_leaves_no_unretrieved_exception() -> None:
    from kvtransfer.ucx import LOST_GRACE_SECONDS, UcxKVClient, UcxKVServer

    async def run() -> list[dict[str, Any]]:
        errors: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
        source = TensorBlockSource(torch.zeros(8, *LAYOUT.block_shape), 60.0)
        server, client = UcxKVServer(source, LAYOUT, TOKEN), UcxKVClient(TOKEN)
        try:
            host, port, _ = fr.parse_address(await server.start(), "ucx")
            ep = await client._connect((host, port), 5.0)
            while not server._endpoints:
                await asyncio.sleep(0.01)
            receive = asyncio.ensure_future(ep.recv(np.empty(8, dtype=np.uint8)))  # never sent
            await asyncio.sleep(0.05)
            next(iter(server._endpoints)).sock.shutdown(socket.SHUT_RDWR)  # the peer closes
            await asyncio.wait_for(ep.lost.wait(), 2.0)
            await asyncio.sleep(LOST_GRACE_SECONDS / 2)
            receive.cancel()  # within the grace
            await asyncio.gather(receive, return_exceptions=True)
            ep.abort()  # fails the UCX receive still pending
            await asyncio.sleep(0.5)
        finally:
            await client.close()
            await server.stop()
        del ep, receive
        gc.collect()  # an unretrieved exception is reported when its task is collected
        await asyncio.sleep(0.1)
        return errors

    errors = asyncio.run(run())
    assert not errors, [(e["message"], e.get("exception")) for e in errors]
