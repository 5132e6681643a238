"""Worker registry in Redis: who is alive, how loaded, what it caches (metadata only, never KV).

Workers (prefill, decode, colocated) register a record with a TTL and refresh it every heartbeat
with their latest load; the router reads all live records into a `RegistryView`, pairs prefill
and decode workers only when their compatibility fingerprints are equal, and asks the prefix
index how many leading blocks of a prompt each worker already caches.

Key schema (``P`` = `RegistryConfig.prefix`: ``P worker:<id>`` is ``pdserve:worker:<id>``):

| key               | type                     | TTL                   | content                   |
|-------------------|--------------------------|-----------------------|---------------------------|
| ``P worker:<id>`` | string (JSON)            | ttl_seconds, renewed  | `WorkerRecord`: addresses,|
|                   |                          | by every heartbeat    | fingerprint, state, load  |
| ``P workers``     | set of worker ids        | none (see below)      | index of the workers      |
| ``P prefix:<id>`` | set of block hashes      | ttl_seconds, renewed  | the worker's cached full- |
|                   | (decimal strings)        | by every heartbeat    | block hashes, at most     |
|                   |                          |                       | ``max_prefix_hashes``     |

Liveness is the record's TTL, kept by Redis: a worker that stops heartbeating disappears within
``ttl_seconds``. Set members cannot expire, so the index may name dead workers for a while: a
view drops ids whose record is gone (and SREMs them), and each heartbeat SADDs its id again.

Prefix index: one bounded, expiring set per worker rather than an inverted ``hash -> workers``
index, because a set member cannot carry its own TTL: per-worker sets vanish with their worker,
are bounded per worker, and are updated by their single writer with a delta (SADD/SREM). A lookup
is one SMISMEMBER per candidate worker, pipelined into one round trip (Redis >= 6.2); the leading
run of hits is the number of cached prompt blocks (hashes are chained, so a hit after a miss does
not count).

Worker lifecycle (`WorkerRegistration`)::

    register() -> heartbeat every heartbeat_seconds (SET record PX ttl, SADD index, PEXPIRE prefix)
      -> [Redis lost: one log line, retry with backoff; the first beat after it returns writes
          everything again, prefix set included] -> set_draining(True) -> deregister()

Router side (`RegistryView`): ``refresh()`` never raises; when Redis is unreachable it keeps the
last good view and reports ``is_stale`` / ``last_error``; ``watch()`` refreshes in the background.
When Redis answers again after an outage, or answers with a new ``run_id`` (it restarted and lost
every key), the workers of the last view are kept for ``ttl_seconds`` while they re-register, so
the router never sees an empty pool just because Redis came back before the heartbeats did.
Every Redis call is bounded by socket timeouts and by ``asyncio.wait_for``.

Records are untrusted input (whoever can write to Redis writes them): the view validates each one
as a typed model (`RecordModel`: types, ranges, parseable addresses, known role and transport,
at most ``MAX_RECORD_CHARS``) and skips a bad one, logged once per worker id and reason and
listed in `RegistryView.rejected`. A worker holding the cluster token signs its record's identity
(`record_proof`: HMAC-SHA256 under the token of its id, role, addresses, transport, model and
fingerprint), and a view holding the token lists only records with a valid proof, so the token is
only ever sent to addresses that a holder of the token registered.

The package: `records` (what a record holds, and how one read from Redis is validated),
`connection` (the configuration, a bounded client, error lines), `registration` (the worker's
side), `view` (the router's side).
"""

from __future__ import annotations

from services.registry.connection import (
    REDIS_ERRORS,
    RegistryConfig,
    RegistryError,
    connect,
    describe_error,
    redact_url,
)
from services.registry.records import (
    KV_TRANSPORTS,
    MAX_RECORD_CHARS,
    ROLES,
    Fingerprint,
    FingerprintModel,
    KVTransport,
    LoadSnapshot,
    RecordError,
    RecordModel,
    Role,
    WorkerRecord,
    check_kv_address,
    file_digest,
    incompatibility_reason,
    new_worker_id,
    parse_host_port,
    read_record,
    record_proof,
    tokenizer_hash,
)
from services.registry.registration import WorkerRegistration
from services.registry.view import RegistryView

__all__ = [
    "KV_TRANSPORTS",
    "MAX_RECORD_CHARS",
    "REDIS_ERRORS",
    "ROLES",
    "Fingerprint",
    "FingerprintModel",
    "KVTransport",
    "LoadSnapshot",
    "RecordError",
    "RecordModel",
    "RegistryConfig",
    "RegistryError",
    "RegistryView",
    "Role",
    "WorkerRecord",
    "WorkerRegistration",
    "check_kv_address",
    "connect",
    "describe_error",
    "file_digest",
    "incompatibility_reason",
    "new_worker_id",
    "parse_host_port",
    "read_record",
    "record_proof",
    "redact_url",
    "tokenizer_hash",
]
