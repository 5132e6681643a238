"""What the registry stores about a worker (`WorkerRecord`, its `Fingerprint` and load), and
how a record read from Redis is validated (`read_record`): records are untrusted input, see the
package docstring."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[Role, ...] = get_args(Role)


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
    # As bytes: compare_digest refuses str holding non-ASCII, which a corrupted proof may.
    expected = record_proof(record, token).encode() if token else b""
    if token and not hmac.compare_digest(record.proof.encode(), expected):
        what = "no proof" if not record.proof else "a proof that does not match its identity"
        raise RecordError(f"{what} under this cluster token (forged, or another token's)")
    return record


def _describe(exc: ValidationError) -> str:
    """The first few errors, ``field: message``, without the offending values."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    text = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in errors[:3])
    return text[:300] + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else "")
