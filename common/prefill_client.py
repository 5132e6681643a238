"""The calls made to a prefill worker about a request's pinned KV blocks, by the decode worker
that pulls them and by the router when no decode worker took the request: ``Release`` (the
blocks may go now) and ``RenewLease`` (keep them a little longer: the pull has not started
yet). Both are best effort with a short timeout; the lease is what guarantees the blocks are
freed when a message is lost."""

from __future__ import annotations

import logging
import time

import grpc

from common.channels import ChannelPool
from common.wire import token_metadata
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
CALL_TIMEOUT_SECONDS = 2.0
RENEW_SECONDS = 1.0  # how often a holder waiting on a handle renews it, at most


def renew_delay(expires_unix_ms: int, interval: float = RENEW_SECONDS) -> float:
    """Seconds until a handle's holder renews its lease: at half the lease left, at most
    ``interval`` (the prefill worker's ``--lease-seconds`` may be the shorter), at least 50 ms.
    Whoever waits on a handle (a decode worker for room to pull, the router for the first token
    to ask again with) renews it: the lease alone frees blocks nobody waits on."""
    if expires_unix_ms:
        interval = min(interval, (expires_unix_ms / 1000 - time.time()) / 2)
    return max(0.05, interval)


class PrefillClient:
    """Release / RenewLease of KVHandles, over a shared channel pool."""

    def __init__(
        self,
        channels: ChannelPool,
        token: str | None,
        timeout: float = CALL_TIMEOUT_SECONDS,
    ):
        self.channels = channels
        self.metadata = token_metadata(token)
        self.timeout = timeout

    async def release(self, handle: pb.KVHandle, address: str | None = None) -> bool:
        """Tell the handle's prefill worker (at ``address``, else the handle's) to free the
        blocks; False when not delivered."""
        address = address or handle.release_address
        if not address:
            return False
        with self.channels.using(address) as channel:
            try:
                await pb_grpc.PrefillServiceStub(channel).Release(
                    pb.ReleaseRequest(request_id=handle.request_id),
                    timeout=self.timeout,
                    metadata=self.metadata,
                )
            except grpc.aio.AioRpcError as exc:  # the lease frees the blocks anyway
                log.info("Release of %s not delivered (%s)", handle.request_id, exc.code().name)
                return False
        return True

    async def renew_lease(self, handle: pb.KVHandle) -> int | None:
        """Extend the handle's lease: its new expiry (unix ms), or None when the blocks are
        gone or the call failed."""
        if not handle.release_address:
            return None
        with self.channels.using(handle.release_address) as channel:
            try:
                answer = await pb_grpc.PrefillServiceStub(channel).RenewLease(
                    pb.RenewLeaseRequest(request_id=handle.request_id),
                    timeout=self.timeout,
                    metadata=self.metadata,
                )
            except grpc.aio.AioRpcError as exc:
                log.info("RenewLease of %s failed (%s)", handle.request_id, exc.code().name)
                return None
        return int(answer.lease_expires_unix_ms) if answer.renewed else None
