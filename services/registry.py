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
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import random
import re
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, Literal, TypeVar, get_args
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[Role, ...] = get_args(Role)
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
_T = TypeVar("_T")
_CHUNK = 10_000  # members per SADD/SREM command


class RegistryError(RuntimeError):
    """Registering with Redis failed (unreachable, wrong password, ...); the message says why."""


# -- records -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """What must be equal for a prefill worker's KV blocks to be usable by a decode worker."""

    model_id: str
    weights_hash: str
    tokenizer_hash: str
    block_size: int
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # --quantization: an int8 model's KV is not the float model's, though its layout is the same.
    quantization: str = "none"

    def key(self) -> str:
        """A stable 16-hex-digit hash of all fields (equal fingerprints, equal keys). Without
        quantization the field is left out, so such a worker's key is what it was before the
        field existed (a rolling upgrade keeps its pairs)."""
        fields = dataclasses.asdict(self)
        if fields["quantization"] == "none":
            del fields["quantization"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def diff(self, other: Fingerprint) -> list[str]:
        """Names of the fields that differ, in declaration order."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def describe_diff(self, other: Fingerprint) -> str:
        """Human-readable differences, e.g. ``"block_size 16 != 32, kv_dtype bf16 != f16"``."""
        return ", ".join(
            f"{name} {_short(getattr(self, name))} != {_short(getattr(other, name))}"
            for name in self.diff(other)
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fingerprint:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def file_digest(paths: Iterable[Path]) -> str:
    """sha256 of the files' bytes, in order (the fingerprint's weights and tokenizer hashes)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def tokenizer_hash(model_dir: Path) -> str:
    """The fingerprint's ``tokenizer_hash`` of a model directory."""
    return file_digest([model_dir / "tokenizer.json"])[:16]


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 16 else text[:12] + "..."


@dataclass(frozen=True)
class LoadSnapshot:
    """A worker's load at one instant, published with every heartbeat."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_total: int = 0


@dataclass(frozen=True)
class WorkerRecord:
    """One worker as the registry stores it: identity, addresses, fingerprint, state and load."""

    worker_id: str
    role: Role
    grpc_address: str
    kv_address: str
    kv_transport: str
    model: str
    fingerprint: Fingerprint
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_total: int = 0
    prefix_caching: bool = True  # False: the router must not expect a prompt to be cached here
    updated_at: float = 0.0
    proof: str = ""  # record_proof under the cluster token ("" from a worker without one)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")

    @property
    def capacity(self) -> int:
        """KV blocks the worker has in all (``kv_blocks_total``)."""
        return self.kv_blocks_total

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use by running requests (0 when unknown)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def with_load(self, load: LoadSnapshot, now: float | None = None) -> WorkerRecord:
        """A copy carrying ``load``, stamped ``updated_at = now``."""
        stamp = time.time() if now is None else now
        return dataclasses.replace(self, **dataclasses.asdict(load), updated_at=stamp)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        """Parse and validate a record (ValueError if bad); unknown keys (from a newer writer)
        are ignored."""
        return RecordModel.model_validate_json(text).to_record()


def new_worker_id(role: Role) -> str:
    """A unique, readable worker id: ``<role>-<host>-<pid>-<random>``."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def incompatibility_reason(prefill: WorkerRecord, decode: WorkerRecord) -> str | None:
    """Why ``decode`` cannot take KV from ``prefill``, or None when their fingerprints are equal."""
    if prefill.fingerprint == decode.fingerprint:
        return None
    diff = prefill.fingerprint.describe_diff(decode.fingerprint)
    return f"{prefill.worker_id} and {decode.worker_id} differ: {diff}"


# -- validation of records read from Redis -----------------------------------------------------

MAX_RECORD_CHARS = 16_384  # a real record is well under 1 KiB
KVTransport = Literal["ucx", "torch", "tcp", "shm"]  # kvtransfer.TRANSPORTS (kept torch-free)
KV_TRANSPORTS: tuple[str, ...] = get_args(KVTransport)
PROOF_FIELDS = ("worker_id", "role", "grpc_address", "kv_address", "kv_transport", "model")
_PROOF_CONTEXT = b"pdserve registry record v1\n"
_HOSTNAME = re.compile(r"(?:[A-Za-z0-9_-]{1,63}\.)*[A-Za-z0-9_-]{1,63}")
_QUERY = re.compile(r"[A-Za-z0-9._~%=&/+-]*")


class RecordError(ValueError):
    """A record read from Redis is not usable; the message says why (never echoes its bytes)."""


def parse_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets) -> (host, port); ValueError if malformed."""
    host, sep, port = address.rpartition(":")
    if not (sep and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError("not host:port with a port in 1..65535")
    try:
        if host.startswith("[") and host.endswith("]"):
            return str(ipaddress.IPv6Address(host[1:-1])), int(port)
        if re.fullmatch(r"[0-9.]+", host):
            return str(ipaddress.IPv4Address(host)), int(port)
    except ValueError:
        raise ValueError("its host is no valid IP address") from None
    if len(host) > 253 or not _HOSTNAME.fullmatch(host):
        raise ValueError("its host is no IP address or host name")
    return host, int(port)


def check_kv_address(address: str, transport: str) -> None:
    """``[transport://]host:port[?query]``, or "" (a worker that serves no KV)."""
    if not address:
        return
    scheme, sep, rest = address.partition("://")
    if sep and scheme != transport:
        raise ValueError(f"kv_address has scheme {scheme[:16]!r}, kv_transport is {transport!r}")
    rest, _, query = (rest if sep else address).partition("?")
    if not _QUERY.fullmatch(query):
        raise ValueError("kv_address has a malformed query")
    try:
        parse_host_port(rest)
    except ValueError as exc:
        raise ValueError(f"kv_address: {exc}") from None


def _host_port(address: str) -> str:
    parse_host_port(address)
    return address


Name = Annotated[str, Field(min_length=1, max_length=256)]
Token = Annotated[str, Field(pattern=r"^[!-~]{1,256}$")]  # printable ASCII, no blank
Count = Annotated[int, Field(ge=0, le=1 << 48)]
Size = Annotated[int, Field(ge=1, le=1 << 20)]
Stamp = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class FingerprintModel(_Strict):
    """`Fingerprint` as read from Redis: every field present, typed and in range."""

    model_id: Name
    weights_hash: Token
    tokenizer_hash: Token
    block_size: Size
    kv_dtype: Token
    num_layers: Size
    num_kv_heads: Size
    head_dim: Size
    quantization: Token = "none"  # absent from records of older workers


class RecordModel(_Strict):
    """`WorkerRecord` as read from Redis: every field present, typed and in range (strict: no
    "16" for 16, no 1 for true); unknown keys, from a newer writer, are ignored."""

    worker_id: Token
    role: Role
    grpc_address: Annotated[str, Field(max_length=300), AfterValidator(_host_port)]
    kv_address: Annotated[str, Field(max_length=1024)]
    kv_transport: KVTransport
    model: Name
    fingerprint: FingerprintModel
    pid: Count
    host: Annotated[str, Field(max_length=256)]
    started_at: Stamp
    draining: bool
    num_running: Count
    num_waiting: Count
    kv_blocks_used: Count
    kv_blocks_cached: Count
    kv_blocks_total: Count
    prefix_caching: bool
    updated_at: Stamp
    proof: Annotated[str, Field(max_length=128)] = ""  # absent from records of older workers

    @model_validator(mode="after")
    def _kv_address_fits_transport(self) -> RecordModel:
        check_kv_address(self.kv_address, self.kv_transport)
        return self

    def to_record(self) -> WorkerRecord:
        values = self.model_dump(exclude={"fingerprint"})
        return WorkerRecord(**values, fingerprint=Fingerprint(**self.fingerprint.model_dump()))


def record_proof(record: WorkerRecord, token: str) -> str:
    """HMAC-SHA256 under the cluster token of the record's identity: what a worker holding the
    token signs, so that a reader holding it trusts the addresses before sending it there."""
    identity: dict[str, Any] = {name: getattr(record, name) for name in PROOF_FIELDS}
    identity["fingerprint"] = dataclasses.asdict(record.fingerprint)
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hmac.new(token.encode(), _PROOF_CONTEXT + canonical.encode(), hashlib.sha256).hexdigest()


def read_record(worker_id: str, text: str | bytes, token: str | None) -> WorkerRecord:
    """The record stored under ``worker_id``'s key, validated (and its proof checked when the
    reader holds the cluster token); RecordError says why it is not usable."""
    if len(text) > MAX_RECORD_CHARS:
        raise RecordError(f"{len(text)} characters, over the {MAX_RECORD_CHARS} a record may have")
    try:
        record = RecordModel.model_validate_json(text).to_record()
    except ValidationError as exc:
        raise RecordError(_describe(exc)) from None
    if record.worker_id != worker_id:
        raise RecordError("its worker_id differs from the key it is stored under")
    if token and not hmac.compare_digest(record.proof, record_proof(record, token)):
        what = "no proof" if not record.proof else "a proof that does not match its identity"
        raise RecordError(f"{what} under this cluster token (forged, or another token's)")
    return record


def _describe(exc: ValidationError) -> str:
    """The first few errors, ``field: message``, without the offending values."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    text = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in errors[:3])
    return text[:300] + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else "")


# -- configuration and connection --------------------------------------------------------------


@dataclass(frozen=True)
class RegistryConfig:
    """Where the registry lives and how fast it reacts; built once at the entry point."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    password: str | None = field(default=None, repr=False)  # else the URL's, if any
    prefix: str = "pdserve:"
    ttl_seconds: float = 5.0
    heartbeat_seconds: float = 1.0
    socket_timeout_seconds: float = 1.0
    connect_timeout_seconds: float = 1.0
    max_backoff_seconds: float = 2.0
    max_prefix_hashes: int = 65_536
    # Workers sign their record with it; views list only records signed with it (None: neither).
    cluster_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_seconds < self.ttl_seconds:
            raise ValueError(
                f"need 0 < heartbeat_seconds ({self.heartbeat_seconds}) "
                f"< ttl_seconds ({self.ttl_seconds})"
            )

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_seconds * 1000))

    @property
    def command_timeout_seconds(self) -> float:
        """Upper bound for one Redis call or pipeline, reconnect included."""
        return 2 * (self.socket_timeout_seconds + self.connect_timeout_seconds)

    @property
    def redacted_url(self) -> str:
        """``redis_url`` with the password replaced by ``***`` (for logs and errors)."""
        return redact_url(self.redis_url)

    def worker_key(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    def prefix_key(self, worker_id: str) -> str:
        return f"{self.prefix}prefix:{worker_id}"

    @property
    def index_key(self) -> str:
        return f"{self.prefix}workers"


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(config: RegistryConfig) -> aioredis.Redis:
    """An asyncio Redis client with bounded timeouts and one immediate retry (a new connection)."""
    options: dict[str, Any] = {"password": config.password} if config.password else {}
    client: aioredis.Redis = aioredis.Redis.from_url(
        config.redis_url,
        **options,
        decode_responses=True,
        encoding_errors="replace",  # a value that is not UTF-8 fails validation, not the read
        socket_timeout=config.socket_timeout_seconds,
        socket_connect_timeout=config.connect_timeout_seconds,
        retry=Retry(NoBackoff(), 1),
    )
    return client


def describe_error(exc: BaseException, config: RegistryConfig) -> str:
    """One line saying what went wrong talking to Redis, without the password."""
    text = str(exc) or type(exc).__name__
    url = config.redacted_url
    if isinstance(exc, AuthenticationError) or text.startswith(("NOAUTH", "WRONGPASS")):
        return (
            f"Redis at {url} rejected authentication ({text}); "
            "give it as PDSERVE_REDIS_PASSWORD, --redis-password-file, or in the URL: "
            "redis://:PASSWORD@HOST:PORT/0"
        )
    if isinstance(exc, asyncio.TimeoutError):
        return f"Redis at {url} did not answer within {config.command_timeout_seconds:.1f}s"
    what = "unavailable" if isinstance(exc, REDIS_ERRORS) else "call failed"
    return f"Redis at {url} {what}: {type(exc).__name__}: {text}"


async def _bounded(awaitable: Awaitable[_T], config: RegistryConfig) -> _T:
    return await asyncio.wait_for(awaitable, config.command_timeout_seconds)


# -- worker side -------------------------------------------------------------------------------


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
            await _bounded(self._write_prefix(new, old), self.config)
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
            await _bounded(pipe.execute(), cfg)
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
        _, _, prefix_alive = await _bounded(pipe.execute(), cfg)
        if self._prefix_hashes and not (prefix_alive and self._prefix_synced):
            await _bounded(self._write_prefix(self._prefix_hashes, None), cfg)

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


# -- router side -------------------------------------------------------------------------------


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
            run_id, records, dead = await _bounded(self._read_all(), self.config)
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
            await _bounded(self._client.srem(self.config.index_key, *dead), self.config)
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
