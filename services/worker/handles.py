"""Which KV handles a decode worker accepts: only those naming a registered prefill (or
colocated) worker with this worker's fingerprint, at the addresses that worker registered.

A handle comes in a Generate call; its addresses are where this worker is about to connect
(to pull) and call (to release). Without this check, whoever can call Generate could make the
decode worker connect anywhere its network reaches. The registry view is refreshed in the
background; a handle naming a worker the view does not know yet (it registered a moment ago)
triggers one refresh before it is refused. Without a registry (a worker started without
``--redis-url``: tests, a single process) only the fingerprint is checked.
"""

from __future__ import annotations

from protos import pdserve_pb2 as pb
from services.registry import RegistryView, WorkerRecord


class HandleChecker:
    """Says why a KVHandle is not acceptable (None: it is)."""

    def __init__(self, fingerprint: str, view: RegistryView | None):
        self.fingerprint = fingerprint
        self.view = view

    async def rejection(self, handle: pb.KVHandle) -> str | None:
        if handle.fingerprint != self.fingerprint:
            return "its fingerprint differs from this worker's (another model, layout or dtype)"
        if self.view is None:
            return None
        if self._registered(handle) is None:
            await self.view.refresh()  # it may have registered since the last refresh
        if self._registered(handle) is None:
            return (
                f"it names {handle.prefill_worker_id!r} at {handle.address} / "
                f"{handle.release_address}, which is no registered prefill worker"
            )
        return None

    def live_addresses(self) -> set[str]:
        """The gRPC addresses of every registered worker (channels to others can go)."""
        if self.view is None:
            return set()
        return {w.grpc_address for w in self.view.workers(include_draining=True)}

    def _registered(self, handle: pb.KVHandle) -> WorkerRecord | None:
        assert self.view is not None
        for worker in self.view.workers(include_draining=True):  # draining: still serving pulls
            if (
                worker.worker_id == handle.prefill_worker_id
                and worker.role in ("prefill", "colocated")
                and worker.fingerprint.key() == self.fingerprint
                and worker.kv_address == handle.address
                and worker.grpc_address == handle.release_address
            ):
                return worker
        return None
