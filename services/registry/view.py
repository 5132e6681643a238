"""The router's picture of the live workers (`RegistryView`), read from Redis: never raises for
Redis, keeps its last good view through an outage or a Redis restart."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from services.registry.connection import (
    REDIS_ERRORS,
    RegistryConfig,
    bounded,
    connect,
    describe_error,
)
from services.registry.records import (
    Fingerprint,
    RecordError,
    Role,
    WorkerRecord,
    incompatibility_reason,
    read_record,
)

logger = logging.getLogger(__name__)


class RegistryView:
    """The router's picture of the live workers, refreshed from Redis; never raises for Redis."""

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self._client = connect(config)
        self._records: dict[str, WorkerRecord] = {}
        # The records sorted by id, built once per refresh: routing asks for them several times
        # per request, and sorting every record each time grew its cost with the workers.
        self._sorted: tuple[WorkerRecord, ...] = ()
        self._generation = 0  # bumped by every refresh that installs records
        self._last_error: str | None = "not refreshed yet"
        self._refreshed_at: float | None = None  # time.monotonic() of the last good refresh
        self._run_id = ""  # Redis's run_id: a new one means Redis restarted and lost the records
        self._grace_until = 0.0  # time.monotonic() until which the last view's workers are kept
        self._task: asyncio.Task[None] | None = None
        self._closing = False  # the watch loop's own stop signal (a cancel can be lost)
        self._rejected: dict[str, str] = {}  # id -> why the last refresh skipped its record

    @property
    def is_stale(self) -> bool:
        """True when the last refresh failed (or none succeeded yet): the view may be outdated."""
        return self._last_error is not None

    @property
    def last_error(self) -> str | None:
        """Why the last refresh failed, None after a good one."""
        return self._last_error

    @property
    def rejected(self) -> dict[str, str]:
        """Worker ids whose record the last refresh skipped, and why (for logs and metrics)."""
        return dict(self._rejected)

    @property
    def num_rejected(self) -> int:
        """How many records the last refresh skipped as invalid or unsigned."""
        return len(self._rejected)

    @property
    def generation(self) -> int:
        """Changes whenever the records may have changed (what a reader caching them checks)."""
        return self._generation

    @property
    def age_seconds(self) -> float | None:
        """Seconds since the last good refresh (None if there was none)."""
        return None if self._refreshed_at is None else time.monotonic() - self._refreshed_at

    async def refresh(self) -> bool:
        """Read every live record; on failure keep the last good view. Returns success."""
        try:
            run_id, records, dead = await bounded(self._read_all(), self.config)
        except Exception as exc:  # never raises: the router keeps routing on the last view
            error = describe_error(exc, self.config)
            if self._last_error != error:  # one line per new failure, not one per refresh
                logger.warning("registry view stale (keeping the last one): %s", error)
            self._last_error = error
            return False
        self._install(run_id, records)
        if dead:
            await self._prune(dead)
        return True

    def watch(self, interval: float = 0.5) -> asyncio.Task[None]:
        """Start (once) a background task that refreshes every ``interval`` seconds."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch_loop(interval), name="registry-watch")
        return self._task

    async def close(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._client.aclose()

    async def __aenter__(self) -> RegistryView:
        await self.refresh()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._records.get(worker_id)

    def workers(
        self, role: Role | None = None, *, include_draining: bool = False
    ) -> list[WorkerRecord]:
        """Live workers of ``role`` (all roles if None), sorted by id; draining ones on request."""
        return [
            r
            for r in self._sorted
            if (role is None or r.role == role) and (include_draining or not r.draining)
        ]

    def is_compatible(self, prefill: WorkerRecord | str, decode: WorkerRecord | str) -> bool:
        return self.incompatibility_reason(prefill, decode) is None

    def incompatibility_reason(
        self, prefill: WorkerRecord | str, decode: WorkerRecord | str
    ) -> str | None:
        """Why the pair cannot work together (unknown worker, fingerprints differ), or None."""
        p, d = self._resolve(prefill), self._resolve(decode)
        if isinstance(p, str) or isinstance(d, str):
            return f"unknown worker {p if isinstance(p, str) else d}"
        return incompatibility_reason(p, d)

    def compatible_pairs(self) -> list[tuple[WorkerRecord, WorkerRecord]]:
        """Every (prefill, decode) pair of routable workers with equal fingerprints."""
        decode = _by_fingerprint(self.workers("decode"))
        return [(p, d) for p in self.workers("prefill") for d in decode.get(p.fingerprint, ())]

    def incompatible_pairs(self) -> list[tuple[WorkerRecord, WorkerRecord, str]]:
        """Every (prefill, decode, reason) pair that will never be paired (for /v1/workers).
        Compared per distinct fingerprint, not per pair: 75 x 225 workers of one model are one
        comparison."""
        prefill, decode = (_by_fingerprint(self.workers(r)) for r in ("prefill", "decode"))
        pairs = []
        for pf, ps in prefill.items():
            for df, ds in decode.items():
                if pf != df:
                    pairs += [(p, d, incompatibility_reason(p, d) or "") for p in ps for d in ds]
        return sorted(pairs, key=lambda t: (t[0].worker_id, t[1].worker_id))

    async def prefix_match(
        self, worker_ids: Sequence[str], block_hashes: Sequence[int], timeout: float | None = None
    ) -> dict[str, int]:
        """For each worker, how many leading ``block_hashes`` it caches (0s if Redis is down or
        slower than ``timeout``, default the command timeout)."""
        matches = dict.fromkeys(worker_ids, 0)
        if not worker_ids or not block_hashes:
            return matches
        pipe = self._client.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.smismember(self.config.prefix_key(worker_id), list(block_hashes))
        try:
            limit = self.config.command_timeout_seconds if timeout is None else timeout
            results = await asyncio.wait_for(pipe.execute(), limit)
        except REDIS_ERRORS as exc:
            logger.debug("prefix_match: %s", describe_error(exc, self.config))
            return matches
        for worker_id, hits in zip(worker_ids, results):
            matches[worker_id] = _leading_true(hits)
        return matches

    # -- internals -----------------------------------------------------------------------------

    def _install(self, run_id: str, records: dict[str, WorkerRecord]) -> None:
        """Make a good read the view. After an outage or a Redis restart (new run_id) the workers
        of the last view stay for ``ttl_seconds`` while they register again by themselves."""
        now = time.monotonic()
        restarted = run_id != self._run_id
        if self._refreshed_at is not None and (self.is_stale or restarted):
            self._grace_until = now + self.config.ttl_seconds
            missing = len(self._records.keys() - records.keys())
            logger.warning(
                "registry view fresh again%s: %d workers, keeping %d others for %.1fs",
                " (Redis restarted)" if restarted else "",
                len(records),
                missing,
                self.config.ttl_seconds,
            )
        if now < self._grace_until:
            records = {**self._records, **records}
        self._records, self._run_id, self._last_error = records, run_id, None
        self._sorted = tuple(r for _, r in sorted(records.items()))
        self._generation += 1
        self._refreshed_at = now

    def _resolve(self, worker: WorkerRecord | str) -> WorkerRecord | str:
        if isinstance(worker, WorkerRecord):
            return worker
        return self._records.get(worker, worker)

    async def _read_all(self) -> tuple[str, dict[str, WorkerRecord], list[str]]:
        """Redis's run_id, live records by id, and the indexed ids whose record is gone."""
        pipe = self._client.pipeline(transaction=False)
        pipe.info("server")
        pipe.smembers(self.config.index_key)
        info, members = await pipe.execute()
        run_id = str(info.get("run_id", ""))
        rejected: dict[str, str] = {}
        ids = []
        for member in sorted(str(m) for m in members):
            if _WORKER_ID.fullmatch(member):
                ids.append(member)
            else:
                rejected[member] = "the index names an invalid worker id"
        values = await self._client.mget([self.config.worker_key(i) for i in ids]) if ids else []
        records: dict[str, WorkerRecord] = {}
        dead: list[str] = []
        for worker_id, value in zip(ids, values):
            if value is None:
                dead.append(worker_id)
                continue
            try:
                records[worker_id] = read_record(worker_id, value, self.config.cluster_token)
            except RecordError as exc:
                rejected[worker_id] = str(exc)
        self._note_rejected(rejected)
        return run_id, records, dead

    def _note_rejected(self, rejected: dict[str, str]) -> None:
        """Log each skipped record once per worker id and reason, not at every refresh."""
        for worker_id, reason in rejected.items():
            if self._rejected.get(worker_id) != reason:
                logger.warning("skipping the registry record of %s: %s", _shown(worker_id), reason)
        self._rejected = rejected

    async def _prune(self, dead: list[str]) -> None:
        """SREM dead ids from the index (a live worker that races this re-adds itself)."""
        try:
            await bounded(self._client.srem(self.config.index_key, *dead), self.config)
        except REDIS_ERRORS as exc:
            logger.debug("pruning the index failed: %s", describe_error(exc, self.config))

    async def _watch_loop(self, interval: float) -> None:
        # Not `while True`: see WorkerRegistration._heartbeat_loop (a cancel lost in wait_for).
        while not self._closing:
            await self.refresh()
            await asyncio.sleep(interval)


_WORKER_ID = re.compile(r"[!-~]{1,256}")  # RecordModel.worker_id


def _by_fingerprint(workers: Iterable[WorkerRecord]) -> dict[Fingerprint, list[WorkerRecord]]:
    groups: dict[Fingerprint, list[WorkerRecord]] = {}
    for w in workers:
        groups.setdefault(w.fingerprint, []).append(w)
    return groups


def _shown(worker_id: str) -> str:
    return repr(worker_id if len(worker_id) <= 80 else worker_id[:77] + "...")


def _leading_true(hits: Sequence[Any]) -> int:
    """Length of the leading run of truthy entries (SMISMEMBER gives 1/0)."""
    count = 0
    for hit in hits:
        if not int(hit):
            break
        count += 1
    return count
