"""The ``torch`` transport's rendezvous store, reached only through the KV listener with the token.

torch.distributed builds a group on a key-value store; its ``TCPStore`` has no authentication
(anyone who reaches its port can list, read, write and delete every key, so could join, disturb
or redirect a pair's group) and listens on every interface. So no store listens here: the prefill
side keeps one in-process ``HashStore`` per pair (created at the pair's CONNECT, dropped with its
control connection), and the decode side's :class:`RemoteStore` does each store operation as one
request on the prefill worker's KV listener, the same listener and limits as every pull
(:mod:`kvtransfer.framing`):

    request: OP_STORE frame (token | request id = JSON {pair, op, key/keys, ...} |
             bytes_per_block = length of the value bytes that follow) | value bytes
    reply:   OK + JSON {"result": ...} + payload (get, compare_set: the value), or an error

The token is checked first (refused: nothing else is read); the pair id is a 128-bit secret the
server gives only in its reply to an authenticated CONNECT, and a request naming no live pair is
refused. Blocking operations (``get``, ``wait``) poll the pair's store until the key is there, at
most ``min(timeout, the server's group timeout)``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
import time
from typing import Any

import torch.distributed as dist

from kvtransfer import framing
from kvtransfer.base import TransferError

MAX_VALUE_BYTES = 1 << 20  # a store value (gloo's addresses and NCCL's unique id are far less)
POLL_SECONDS = 0.002  # how often a waiting get / wait looks for its keys
OPS = ("set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys")


def new_pair_store(timeout: float) -> dist.HashStore:
    """An empty store for one pair, whose own blocking reads wait at most ``timeout``."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def _keys(fields: dict[str, Any]) -> list[str]:
    keys = fields.get("keys", [fields.get("key", "")])
    if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
        raise framing.ProtocolError("store keys must be strings")
    return keys


async def serve_op(
    store: dist.Store, fields: dict[str, Any], value: bytes, timeout: float
) -> tuple[Any, bytes]:
    """Apply one decoded operation to ``store``: (JSON result, payload bytes). TransferError
    ("internal") when a get / wait finds no key within ``timeout``."""
    op, keys = fields.get("op"), _keys(fields)
    if op in ("get", "wait"):
        deadline = time.monotonic() + timeout
        while not store.check(keys):
            if time.monotonic() > deadline:
                raise TransferError("internal", f"store keys {keys} not set in {timeout}s")
            await asyncio.sleep(POLL_SECONDS)
    # torch's stubs say str; the binding takes bytes (values are binary: gloo's addresses).
    if op == "set":
        store.set(keys[0], value)  # type: ignore[arg-type]
    elif op == "get":
        return None, bytes(store.get(keys[0]))
    elif op == "add":
        return store.add(keys[0], int(fields.get("amount", 0))), b""
    elif op == "compare_set":
        split = int(fields.get("expected_len", 0))
        old, new = value[:split], value[split:]
        return None, bytes(store.compare_set(keys[0], old, new))  # type: ignore[arg-type]
    elif op == "check":
        return bool(store.check(keys)), b""
    elif op == "delete_key":
        return bool(store.delete_key(keys[0])), b""
    elif op == "num_keys":
        return int(store.num_keys()), b""
    elif op != "wait":
        raise framing.ProtocolError(f"store op {op!r} is not one of {OPS}")
    return None, b""


async def read_op(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, request: framing.Request, timeout: float
) -> tuple[dict[str, Any], bytes]:
    """The fields and value bytes of an OP_STORE request whose frame was read (and its token
    checked): the value follows the frame (ProtocolError if malformed or oversized)."""
    if request.bytes_per_block > MAX_VALUE_BYTES:
        raise framing.ProtocolError(f"store value of {request.bytes_per_block} bytes")
    try:
        fields = json.loads(request.request_id)
    except json.JSONDecodeError as exc:
        raise framing.ProtocolError("store request is not JSON") from exc
    if not isinstance(fields, dict) or not isinstance(fields.get("pair"), str):
        raise framing.ProtocolError("store request names no pair")
    reading = framing.recv_exactly(loop, conn, request.bytes_per_block)
    return fields, await asyncio.wait_for(reading, timeout)


class RemoteStore(dist.Store):
    """The decode side's view of its pair's store on the prefill worker at ``address``: each
    operation is one blocking request on a fresh connection (called from the threads where
    torch builds and uses the group, never from the event loop)."""

    def __init__(self, address: tuple[str, int], token: str, pair_id: str, timeout: float):
        super().__init__()
        self._address = address
        self._token = token
        self._pair = pair_id
        self._timeout = timeout

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", {"key": key}, _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", {"key": key})[1]

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", {"key": key, "amount": int(amount)})[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        old, new = _as_bytes(expected), _as_bytes(desired)
        return self._call("compare_set", {"key": key, "expected_len": len(old)}, old + new)[1]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", {"keys": list(keys)})

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", {"keys": list(keys)})[0])

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", {"key": key})[0])

    def num_keys(self) -> int:
        return int(self._call("num_keys", {})[0])

    def _call(self, op: str, fields: dict[str, Any], value: bytes = b"") -> tuple[Any, bytes]:
        """(result, payload) of one operation; RuntimeError (what torch expects of a store)
        when the server refuses it or cannot be reached in time."""
        request_id = json.dumps({"pair": self._pair, "op": op, **fields})
        frame = framing.Request(framing.OP_STORE, self._token, request_id, [], len(value))
        try:
            with socket.create_connection(self._address, timeout=self._timeout) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(framing.encode_request(frame) + value)
                status, message, payload_len = _read_reply(sock)
                payload = _recv_exactly(sock, payload_len)
        except OSError as exc:
            raise RuntimeError(f"pair store {op} failed: {exc!r}") from exc
        if status != framing.STATUS_OK:
            reason = framing.STATUS_REASONS.get(status, "protocol")
            raise RuntimeError(f"pair store {op} failed: {reason}: {message}")
        return json.loads(message)["result"], payload


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionResetError("the server closed the connection")
        buf += chunk
    return bytes(buf)


def _read_reply(sock: socket.socket) -> tuple[int, str, int]:
    header = _recv_exactly(sock, framing.REPLY_HEADER.size)
    framing.parse_reply(header)  # validates magic and version before trusting msg_len
    msg_len = framing.REPLY_HEADER.unpack(header)[3]
    return framing.parse_reply(header + _recv_exactly(sock, msg_len))
