"""Streamed pulls: KV blocks pulled while the prompt is still being computed.

A decode worker with a streaming KVHandle sends ``OP_PULL_READY`` pulls for the blocks it still
lacks. The server answers each with the leading ones computed so far (waiting, the lease renewed,
until at least one is, or ``STREAM_WAIT_SECONDS``; it looks again when the source announces
progress, :mod:`kvtransfer.progress`, not by polling), their checksums in the reply's message
(the handle has none: they did not exist yet), and, with the prompt's last block, what the
prefill ended with (its first token, taken by the decode worker as if the router had sent it). The
client loops until it has every block. Any transport serves them: each passes a streamed pull
through :func:`ready_pull` and then sends the blocks it returns like a plain pull's.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kvtransfer import framing
from kvtransfer.base import KVTransferServer, StreamedSource, TransferError, block_checksums

# A pull waits this long for a block, then answers with none; well under any pull timeout: the
# client asks again, so a long prefill is no timeout (the prefill's own deadline bounds it).
STREAM_WAIT_SECONDS = 2.0
# A waiting pull also looks again this often without an announcement: a bound on what a missed
# one could cost, not the way progress is seen.
STREAM_RECHECK_SECONDS = 0.25
MAX_PART_BLOCKS = 1024  # blocks one reply carries at most (their checksums fit the message)


async def ready_pull(
    server: KVTransferServer, request: framing.Request
) -> tuple[framing.Request, str]:
    """A streamed pull as the plain pull of its ready blocks, and the reply message to send
    (JSON: checksums, seconds waited, the final answer); a plain pull as it is, message ""."""
    if request.op != framing.OP_PULL_READY:
        return request, ""
    source, rid, ids = server.source, request.request_id, request.block_ids
    if not isinstance(source, StreamedSource):
        raise TransferError("protocol", "this server's blocks are not streamed")
    start = time.monotonic()
    try:
        mark = source.progress.mark()  # before the look: progress after it ends the wait
        ready, final = source.ready_count(rid, ids)
        while ready == 0 and final is None:
            left = STREAM_WAIT_SECONDS - (time.monotonic() - start)
            if left <= 0:
                break
            source.renew_lease(rid)
            await source.progress.wait(mark, min(left, STREAM_RECHECK_SECONDS))
            mark = source.progress.mark()
            ready, final = source.ready_count(rid, ids)
        if ready > MAX_PART_BLOCKS:  # the rest, and the final answer, in the next part
            ready, final = MAX_PART_BLOCKS, None
        sent = ids[:ready]
        checksums = block_checksums(source.read_blocks(rid, sent)) if sent else []
    except KeyError as exc:
        raise server.unknown(rid) from exc
    message: dict[str, Any] = {
        "blocks": len(sent),
        "checksums": checksums,
        "waited_s": time.monotonic() - start,
    }
    if final is not None:
        message["final"] = final
    plain = framing.Request(framing.OP_PULL, request.token, rid, sent, request.bytes_per_block)
    return plain, json.dumps(message)
