"""A worker's presence in the registry (`WorkerRegistration`): its record under a TTL, renewed by
every heartbeat with its latest load, and its set of cached block hashes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterable
from types import TracebackType

from services.registry.connection import (
    REDIS_ERRORS,
    RegistryConfig,
    RegistryError,
    bounded,
    connect,
    describe_error,
)
from services.registry.records import LoadSnapshot, WorkerRecord, record_proof

logger = logging.getLogger(__name__)
_CHUNK = 10_000  # members per SADD/SREM command


class WorkerRegistration:
    """A worker's presence in the registry; see the module docstring for the lifecycle."""

    def __init__(
        self,
        config: RegistryConfig,
        record: WorkerRecord,
        load_fn: Callable[[], LoadSnapshot] | None = None,
    ) -> None:
        self.config = config
        self.load_fn = load_fn
        if config.cluster_token:  # readers holding the token list only signed records
            record = dataclasses.replace(record, proof=record_proof(record, config.cluster_token))
        self._record = record
        self._client = connect(config)
        self._task: asyncio.Task[None] | None = None
        self._prefix_hashes: list[int] = []  # last snapshot asked for, written again after loss
        self._prefix_synced = False  # the Redis set equals _prefix_hashes
        self._is_connected = False
        self._is_closed = False  # deregistered or closed: Redis is not touched any more

    @property
    def record(self) -> WorkerRecord:
        """The record as last written (or about to be written) to Redis."""
        return self._record

    @property
    def is_connected(self) -> bool:
        """Whether the last heartbeat reached Redis."""
        return self._is_connected

    async def register(self) -> None:
        """Write the record and start heartbeating; raises RegistryError if Redis refuses."""
        if self._is_closed:
            raise RegistryError(f"{self._record.worker_id} was deregistered; make a new one")
        try:
            await self._beat()
        except REDIS_ERRORS as exc:
            raise RegistryError(
                f"cannot register {self._record.worker_id}: {describe_error(exc, self.config)}"
            ) from exc
        self._is_connected = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._heartbeat_loop(), name="registry-heartbeat")
        logger.info(
            "registered %s (%s) at %s",
            self._record.worker_id,
            self._record.role,
            self.config.redacted_url,
        )

    async def set_draining(self, draining: bool = True) -> None:
        """Mark the worker draining (routers stop picking it); written now if Redis is up."""
        self._record = dataclasses.replace(self._record, draining=draining)
        if self._task is None:  # not registered (or deregistered): nothing to publish
            return
        try:
            await self._beat()
        except REDIS_ERRORS as exc:
            error = describe_error(exc, self.config)
            logger.warning("set_draining: %s (the next heartbeat retries)", error)

    async def publish_prefix_hashes(self, hashes: Iterable[int]) -> bool:
        """Replace this worker's published set of cached block hashes with ``hashes``.

        Pass the most valuable hashes first: only the first ``max_prefix_hashes`` are kept. Only
        the difference from the previous snapshot is sent. Returns False (and keeps the snapshot
        for the next heartbeat to write) when Redis is unreachable; never raises for that.
        """
        if self._is_closed:
            return False
        new = list(dict.fromkeys(hashes))[: self.config.max_prefix_hashes]
        if self._prefix_synced and new == self._prefix_hashes:
            return True  # nothing to send: the heartbeat keeps the set alive (or rewrites it)
        old = set(self._prefix_hashes) if self._prefix_synced else None
        self._prefix_hashes, self._prefix_synced = new, False
        try:
            await bounded(self._write_prefix(new, old), self.config)
        except REDIS_ERRORS as exc:
            logger.debug("prefix hashes not published: %s", describe_error(exc, self.config))
            return False
        return True

    async def deregister(self) -> None:
        """Stop heartbeating and delete the worker's keys at once (SIGTERM, before draining)."""
        await self._stop_heartbeat()
        cfg, worker_id = self.config, self._record.worker_id
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(cfg.worker_key(worker_id), cfg.prefix_key(worker_id))
            pipe.srem(cfg.index_key, worker_id)
            await bounded(pipe.execute(), cfg)
            logger.info("deregistered %s", worker_id)
        except REDIS_ERRORS as exc:  # records expire by themselves within ttl_seconds
            logger.warning("deregister %s: %s", worker_id, describe_error(exc, cfg))
        await self._client.aclose()

    async def close(self) -> None:
        """Stop heartbeating without deleting anything: the records expire as after a crash."""
        await self._stop_heartbeat()
        await self._client.aclose()

    async def __aenter__(self) -> WorkerRegistration:
        await self.register()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.deregister()

    # -- internals -----------------------------------------------------------------------------

    async def _stop_heartbeat(self) -> None:
        self._is_closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _refresh_load(self) -> None:
        if self.load_fn is None:
            self._record = dataclasses.replace(self._record, updated_at=time.time())
            return
        try:
            self._record = self._record.with_load(self.load_fn())
        except Exception:  # a broken load callable must not stop the heartbeat
            logger.exception("load snapshot failed; publishing the previous one")

    async def _beat(self) -> None:
        """One heartbeat: record (with fresh load) and index; prefix set kept alive or rewritten."""
        self._refresh_load()
        cfg, worker_id = self.config, self._record.worker_id
        pipe = self._client.pipeline(transaction=True)
        pipe.set(cfg.worker_key(worker_id), self._record.to_json(), px=cfg.ttl_ms)
        pipe.sadd(cfg.index_key, worker_id)
        pipe.pexpire(cfg.prefix_key(worker_id), cfg.ttl_ms)
        _, _, prefix_alive = await bounded(pipe.execute(), cfg)
        if self._prefix_hashes and not (prefix_alive and self._prefix_synced):
            await bounded(self._write_prefix(self._prefix_hashes, None), cfg)

    async def _write_prefix(self, new: list[int], old: set[int] | None) -> None:
        """Write ``new`` as the prefix set: a delta from ``old``, or whole when ``old`` is None."""
        cfg, key = self.config, self.config.prefix_key(self._record.worker_id)
        pipe = self._client.pipeline(transaction=True)
        if old is None:
            pipe.delete(key)
            added, removed = new, []
        else:
            new_set = set(new)
            added = [h for h in new if h not in old]
            removed = [h for h in old if h not in new_set]
        for start in range(0, len(removed), _CHUNK):
            pipe.srem(key, *removed[start : start + _CHUNK])
        for start in range(0, len(added), _CHUNK):
            pipe.sadd(key, *added[start : start + _CHUNK])
        pipe.pexpire(key, cfg.ttl_ms)
        pipe.scard(key)
        size = (await pipe.execute())[-1]
        # A delta applied to a set Redis lost (restart, expiry) leaves it partial: rewrite it.
        self._prefix_synced = size == len(new)
        if not self._prefix_synced and old is not None:
            await self._write_prefix(new, None)

    async def _heartbeat_loop(self) -> None:
        cfg = self.config
        delay = cfg.heartbeat_seconds
        # Not `while True`: before Python 3.12, a cancel that lands as a wait_for in _beat
        # completes is lost, and the loop would beat on (and deregister() wait) for ever.
        while not self._is_closed:
            await asyncio.sleep(delay * random.uniform(0.9, 1.1))
            if self._is_closed:
                return
            try:
                await self._beat()
            except Exception as exc:  # never let the heartbeat die: the worker would vanish
                if self._is_connected:
                    logger.warning(
                        "registry heartbeat of %s failed, retrying with backoff: %s",
                        self._record.worker_id,
                        describe_error(exc, cfg),
                        exc_info=not isinstance(exc, REDIS_ERRORS),
                    )
                self._is_connected = False
                delay = min(delay * 2, cfg.max_backoff_seconds)
                continue
            if not self._is_connected:
                logger.warning("registry reachable again: %s re-registered", self._record.worker_id)
            self._is_connected = True
            delay = cfg.heartbeat_seconds
