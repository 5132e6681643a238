"""Which KV handles a decode worker accepts: only those naming a registered prefill (or
colocated) worker with this worker's fingerprint, at the addresses that worker registered.

A handle comes in a Generate call; its addresses are where this worker is about to connect
(to pull) and call (to release). Without this check, whoever can call Generate could make the
decode worker connect anywhere its network reaches. Without a registry (a worker started
without ``--redis-url``: tests, a single process) only the fingerprint is checked.

The records come from `PeerRecords`: the record of the worker a handle names, read from Redis
when a handle names it (one GET) and kept for ``ttl_seconds``, the time a record lives in Redis
after its worker's last heartbeat. A decode worker used to keep a view of the whole registry,
re-read every heartbeat; that cost grew as decode workers x all workers (docs/simulation.md,
"Control-plane scale"), while an idle decode worker now reads nothing and a busy one one record
per prefill peer per ``ttl_seconds``.

A cached record's lifecycle::

    handle names an unknown id -> GET -> valid: cached (confirmed now) | absent or invalid:
    refused, nothing cached -> later handles naming it: answered from the cache while confirmed
    within ttl_seconds, else GET again (absent now: refused and forgotten) -> a handle whose
    addresses differ from the cached record's: GET again (the worker may have registered anew)
    -> Redis unreachable: the cached record, however old (the router too routes on its last
    view then) -> Redis answers again, or a restarted Redis (a new run_id) answers without the
    record: the cached record for ``ttl_seconds`` more, while its worker registers again ->
    least recently used records beyond ``max_records`` are dropped.

So a worker counts as registered until ``ttl_seconds`` after this worker last read its record:
one that deregistered (its pins all done) or crashed is refused at most that long after, as
long as its record would have lived after a crash; and an outage or restart of Redis refuses
none of the workers in use while they register again (each within a heartbeat), as the
router's `RegistryView` keeps them too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from protos import pdserve_pb2 as pb
from services.registry import (
    REDIS_ERRORS,
    RecordError,
    RegistryConfig,
    WorkerRecord,
    connect,
    describe_error,
    read_record,
)

log = logging.getLogger(__name__)

MAX_RECORDS = 4096  # prefill workers a decode worker remembers (it rarely talks to more)


@dataclass(frozen=True)
class _Cached:
    record: WorkerRecord
    confirmed_at: float  # time.monotonic() of the read that returned it


class PeerRecords:
    """Registry records of the workers KV handles name, read one at a time and cached."""

    def __init__(self, config: RegistryConfig, max_records: int = MAX_RECORDS):
        self.config = config
        self.max_records = max_records
        self._client = connect(config)
        self._cache: OrderedDict[str, _Cached] = OrderedDict()  # least recently used first
        self._last_error: str | None = None
        self._run_id = ""  # Redis's: a new one means it restarted and lost every record
        self._grace_until = 0.0  # time.monotonic() until which records Redis lost still count

    async def get(self, worker_id: str, *, cached: bool = True) -> WorkerRecord | None:
        """``worker_id``'s record: the cached one while confirmed within ``ttl_seconds`` (unless
        ``cached`` is False), else read now; None when it is not registered (or not valid)."""
        entry = self._cache.get(worker_id)
        if entry is not None:
            self._cache.move_to_end(worker_id)
            if cached and time.monotonic() - entry.confirmed_at < self.config.ttl_seconds:
                return entry.record
        try:
            run_id, text = await asyncio.wait_for(
                self._read(worker_id), self.config.command_timeout_seconds
            )
        except REDIS_ERRORS as exc:  # keep what we had: the router routes on its last view too
            self._note_error(describe_error(exc, self.config))
            return entry.record if entry is not None else None
        self._note_answer(run_id)
        record = self._parse(worker_id, text)
        if record is None:
            if entry is not None and time.monotonic() < self._grace_until:
                return entry.record  # Redis came back without it: it is registering again
            self._cache.pop(worker_id, None)
            return None
        self._cache[worker_id] = _Cached(record, time.monotonic())
        self._cache.move_to_end(worker_id)
        while len(self._cache) > self.max_records:
            self._cache.popitem(last=False)
        return record

    def addresses(self, within_seconds: float) -> set[str]:
        """gRPC addresses of the records confirmed within ``within_seconds``; older ones are
        forgotten (their channels can go: a handle naming the worker reads it again)."""
        oldest = time.monotonic() - within_seconds
        for worker_id in [k for k, v in self._cache.items() if v.confirmed_at < oldest]:
            del self._cache[worker_id]
        return {entry.record.grpc_address for entry in self._cache.values()}

    async def close(self) -> None:
        await self._client.aclose()

    async def _read(self, worker_id: str) -> tuple[str, str | None]:
        """Redis's run_id and the record's text (None: no such key), in one round trip."""
        pipe = self._client.pipeline(transaction=False)
        pipe.info("server")
        pipe.get(self.config.worker_key(worker_id))
        info, text = await pipe.execute()
        return str(info.get("run_id", "")), text

    def _parse(self, worker_id: str, text: str | None) -> WorkerRecord | None:
        if text is None:
            return None
        try:
            return read_record(worker_id, text, self.config.cluster_token)
        except RecordError as exc:
            log.debug("the registry record of %r is not usable: %s", worker_id[:80], exc)
            return None

    def _note_error(self, error: str) -> None:
        """One line per new Redis failure, not one per handle."""
        if error != self._last_error:
            log.warning("registry unreachable, checking KV handles on cached records: %s", error)
        self._last_error = error

    def _note_answer(self, run_id: str) -> None:
        """Redis answered: after an outage, or from a restarted Redis (a new run_id), the
        cached workers count for ``ttl_seconds`` more while they register again (as the
        router's view keeps them)."""
        if self._last_error is not None or (self._run_id and run_id != self._run_id):
            self._grace_until = time.monotonic() + self.config.ttl_seconds
        self._run_id, self._last_error = run_id, None


class HandleChecker:
    """Says why a KVHandle is not acceptable (None: it is)."""

    def __init__(self, fingerprint: str, records: PeerRecords | None):
        self.fingerprint = fingerprint
        self.records = records

    async def rejection(self, handle: pb.KVHandle) -> str | None:
        if handle.fingerprint != self.fingerprint:
            return (
                "its fingerprint differs from this worker's "
                "(another model, layout, dtype or quantization)"
            )
        if self.records is None:
            return None
        worker_id = handle.prefill_worker_id
        record = await self.records.get(worker_id)
        if record is not None and not self._matches(record, handle):
            record = await self.records.get(worker_id, cached=False)  # registered anew since?
        if record is None or not self._matches(record, handle):
            return (
                f"it names {worker_id!r} at {handle.address} / "
                f"{handle.release_address}, which is no registered prefill worker"
            )
        return None

    def live_addresses(self, within_seconds: float) -> set[str]:
        """The gRPC addresses of the workers whose records were read within ``within_seconds``
        (channels to others can go)."""
        return set() if self.records is None else self.records.addresses(within_seconds)

    def _matches(self, worker: WorkerRecord, handle: pb.KVHandle) -> bool:
        return (
            worker.worker_id == handle.prefill_worker_id
            and worker.role in ("prefill", "colocated")  # draining or not: it serves its pulls
            and worker.fingerprint.key() == self.fingerprint
            and worker.kv_address == handle.address
            and worker.grpc_address == handle.release_address
        )
