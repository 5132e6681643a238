"""Records read from Redis are untrusted input: every one is validated as a typed model, a bad
one is skipped and logged once (never a 5xx), and a view holding the cluster token lists only
records signed with it, so the token never goes to an address someone else registered.

Against a real Redis; the last tests against a real router and real workers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtransfer
from protos import pdserve_pb2 as pb
from services.registry import (
    KV_TRANSPORTS,
    ROLES,
    Fingerprint,
    RecordError,
    RecordModel,
    RegistryConfig,
    RegistryView,
    WorkerRecord,
    WorkerRegistration,
    check_kv_address,
    parse_host_port,
    read_record,
    record_proof,
)
from services.worker.handles import HandleChecker, PeerRecords
from tests.router.cluster import MODEL, Cluster, Router, blocks_in_use, cluster, wait_until
from tests.services.test_registry import fast_config

FP = Fingerprint("m", "ab" * 8, "cd" * 8, 16, "float32", 30, 3, 64)
TOKEN = "registry-s3cret"
LOGGER = "services.registry.view"  # RegistryView's log lines


def good(worker_id: str, role: str = "prefill", port: int = 50051) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        grpc_address=f"127.0.0.1:{port}",
        kv_address=f"tcp://127.0.0.1:{port + 1}" if role != "decode" else "",
        kv_transport="tcp",
        model=FP.model_id,
        fingerprint=FP,
        kv_blocks_total=512,
    )


def good_dict(worker_id: str) -> dict[str, Any]:
    return json.loads(good(worker_id).to_json())  # type: ignore[no-any-return]


def without(key: str) -> dict[str, Any]:
    data = good_dict("x")
    if key.startswith("fingerprint."):
        del data["fingerprint"][key.split(".", 1)[1]]
    else:
        del data[key]
    return data


def with_(key: str, value: Any) -> dict[str, Any]:
    data = good_dict("x")
    if key.startswith("fingerprint."):
        data["fingerprint"][key.split(".", 1)[1]] = value
    else:
        data[key] = value
    return data


RECORD_FIELDS = [f.name for f in dataclasses.fields(WorkerRecord) if f.name != "proof"]
# quantization may be absent (a record of an older worker): "none"
FP_FIELDS = [
    f"fingerprint.{f.name}" for f in dataclasses.fields(Fingerprint) if f.name != "quantization"
]
INT_FIELDS = [
    "pid",
    "num_running",
    "num_waiting",
    "kv_blocks_used",
    "kv_blocks_cached",
    "kv_blocks_total",
    "fingerprint.block_size",
    "fingerprint.num_layers",
    "fingerprint.num_kv_heads",
    "fingerprint.head_dim",
]
STR_FIELDS = [
    "worker_id",
    "role",
    "grpc_address",
    "kv_address",
    "kv_transport",
    "model",
    "host",
    "fingerprint.model_id",
    "fingerprint.weights_hash",
    "fingerprint.tokenizer_hash",
    "fingerprint.kv_dtype",
    "fingerprint.quantization",
]
DEEP = "[" * 5000 + "]" * 5000
Case = dict[str, Any] | str | bytes


def bad_records() -> dict[str, Case]:
    """A bad record of every kind, by name: a dict gets the worker id it is stored under (unless
    its name says it is about the worker_id); text and bytes are stored as they are."""
    cases: dict[str, Case] = {}
    for key in RECORD_FIELDS + FP_FIELDS:
        cases[f"{key} missing"] = without(key)
    for key in INT_FIELDS:
        cases[f"{key} as text"] = with_(key, "16")
        cases[f"{key} as float"] = with_(key, 16.5)
        cases[f"{key} as bool"] = with_(key, True)
        cases[f"{key} -1"] = with_(key, -1)
        cases[f"{key} huge"] = with_(key, 10**30)
    for key in ("fingerprint.block_size", "fingerprint.num_layers", "fingerprint.head_dim"):
        cases[f"{key} 0"] = with_(key, 0)
    for key in STR_FIELDS:
        cases[f"{key} as int"] = with_(key, 7)
        cases[f"{key} as null"] = with_(key, None)
        cases[f"{key} as list"] = with_(key, ["a"])
        cases[f"{key} huge"] = with_(key, "x" * 5000)
    for key in ("draining", "prefix_caching"):
        cases[f"{key} as int"] = with_(key, 1)
        cases[f"{key} as text"] = with_(key, "true")
    for key in ("started_at", "updated_at"):
        cases[f"{key} as text"] = with_(key, "now")
        cases[f"{key} negative"] = with_(key, -1.0)
    cases["proof as int"] = with_("proof", 5)
    cases["proof huge"] = with_("proof", "f" * 4096)
    for value in ("", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:-1", "a b:80"):
        cases[f"grpc_address {value!r}"] = with_("grpc_address", value)
    for value in ("[::1:80", "999.1.1.1:80", "[fe80::zz]:80", "host:8o", "h:\u00b2", ":80"):
        cases[f"grpc_address {value!r}"] = with_("grpc_address", value)
    for value in ("ucx://127.0.0.1:1", "tcp://127.0.0.1", "tcp://:1", "tcp://h:1?a b", "h"):
        cases[f"kv_address {value!r}"] = with_("kv_address", value)
    cases["role admin"] = with_("role", "admin")
    cases["kv_transport rdma"] = with_("kv_transport", "rdma")
    cases["fingerprint a list"] = with_("fingerprint", [1, 2])
    cases["fingerprint nested junk"] = with_("fingerprint", {"a": {"b": {"c": []}}})
    cases["fingerprint deep lists"] = with_("fingerprint", json.loads("[" * 50 + "]" * 50))
    cases["record too large"] = with_("extra", "x" * 20_000)
    cases["worker_id of another"] = good_dict("someone-else")
    cases["deep nesting"] = json.dumps(good_dict("deep"))[:-1] + f',"junk":{DEEP}}}'
    cases["not json"] = "not json"
    cases["empty"] = ""
    cases["null"] = "null"
    cases["a list"] = "[]"
    cases["a number"] = "42"
    cases["half a record"] = json.dumps(good_dict("x"))[:40]
    cases["nan"] = json.dumps(with_("started_at", float("nan")))
    cases["not utf-8"] = b'{"worker_id": "\xff\xfe", "role": "prefill"}'
    return cases


def stored(case: Case, worker_id: str, name: str) -> str | bytes:
    if not isinstance(case, dict):
        return case
    if not name.startswith("worker_id"):
        case = {**case, "worker_id": worker_id}
    return json.dumps(case)


def write(client: redis.Redis, config: RegistryConfig, worker_id: str, text: str | bytes) -> None:
    client.set(config.worker_key(worker_id), text)
    client.sadd(config.index_key, worker_id)


def test_the_view_lists_only_good_records_and_logs_each_bad_one_once(
    redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Next to two good records, a bad one of every field and kind (missing, wrong type, out of
    range, huge, not JSON, not UTF-8, nested junk, another worker's) and two bad index members:
    three refreshes list the good ones only, and log each bad one once, with a short reason."""
    cfg = fast_config(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    cases = bad_records()
    names = {f"bad-{i}": name for i, name in enumerate(cases)}
    for worker_id, name in names.items():
        write(client, cfg, worker_id, stored(cases[name], worker_id, name))
    write(client, cfg, "good-p", good("good-p").to_json())
    write(client, cfg, "good-d", good("good-d", "decode", 50061).to_json())
    client.sadd(cfg.index_key, "bad id with blanks", "x" * 5000)

    async def main() -> dict[str, str]:
        view = RegistryView(cfg)
        try:
            with caplog.at_level(logging.WARNING, LOGGER):
                for _ in range(3):  # logged once, not at every refresh
                    assert await view.refresh()
            assert [w.worker_id for w in view.workers()] == ["good-d", "good-p"]
            return view.rejected
        finally:
            await view.close()

    rejected = asyncio.run(main())
    assert set(rejected) == {*names, "bad id with blanks", "x" * 5000}
    for worker_id, name in names.items():  # rejected for the reason the case is about
        field_name = name.split(" ")[0].split(".")[-1]
        if isinstance(cases[name], dict) and field_name in RECORD_FIELDS + FP_FIELDS + ["proof"]:
            assert field_name in rejected[worker_id], (name, rejected[worker_id])
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == len(rejected), "\n".join(lines)
    assert all(line.startswith("skipping the registry record of ") for line in lines)
    assert max(len(line) for line in lines) < 500  # no huge value echoed into the log


def test_a_record_that_turns_bad_leaves_the_view_and_is_logged_again_if_the_reason_changes(
    redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = fast_config(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    write(client, cfg, "p1", good("p1").to_json())

    async def main() -> None:
        view = RegistryView(cfg)
        try:
            assert await view.refresh() and view.get("p1") is not None
            with caplog.at_level(logging.WARNING, LOGGER):
                write(client, cfg, "p1", json.dumps({**good_dict("p1"), "pid": "1"}))
                assert await view.refresh() and await view.refresh()
                assert view.get("p1") is None and view.workers() == []
                write(client, cfg, "p1", json.dumps({**good_dict("p1"), "pid": -1}))
                assert await view.refresh() and await view.refresh()
                write(client, cfg, "p1", good("p1").to_json())
                assert await view.refresh()
                assert view.get("p1") is not None and view.rejected == {}
        finally:
            await view.close()

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2 and "pid" in lines[0] and "pid" in lines[1], lines


# -- hypothesis: arbitrary corruptions of a valid record ----------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
PATHS = st.sampled_from(RECORD_FIELDS + FP_FIELDS + ["proof", "fingerprint"])


@st.composite
def corrupted(draw: st.DrawFn) -> str:
    data = good_dict("w1")
    for _ in range(draw(st.integers(1, 3))):
        key = draw(PATHS)
        parent: Any = data
        if key.startswith("fingerprint."):
            parent, key = data.get("fingerprint"), key.split(".", 1)[1]
        if not isinstance(parent, dict):
            continue
        if draw(st.booleans()):
            parent.pop(key, None)
        else:
            parent[key] = draw(JSON)
    return json.dumps(data)


def _typed(record: WorkerRecord) -> None:
    """What readers rely on: every field of its declared type, in range, addresses parseable."""
    hints = typing.get_type_hints(WorkerRecord)
    for f in dataclasses.fields(WorkerRecord):
        value = getattr(record, f.name)
        if hints[f.name] is int:
            assert type(value) is int and value >= 0, f.name
        elif hints[f.name] is bool:
            assert type(value) is bool, f.name
        elif hints[f.name] in (str, float):
            assert type(value) is hints[f.name], f.name
    fp = record.fingerprint
    assert all(
        type(v) is int and v >= 1
        for v in (fp.block_size, fp.num_layers, fp.num_kv_heads, fp.head_dim)
    )
    assert record.role in ROLES and record.kv_transport in KV_TRANSPORTS
    parse_host_port(record.grpc_address)
    check_kv_address(record.kv_address, record.kv_transport)
    assert fp.key() and 0.0 <= record.kv_usage


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted())
def test_a_corrupted_record_is_rejected_or_fully_typed(text: str) -> None:
    """Whatever a corruption does, reading either raises RecordError or gives a record whose
    every field is of its type and in range (never another exception, never a half-typed one)."""
    for token in (None, TOKEN):
        try:
            record = read_record("w1", text, token)
        except RecordError:
            continue
        _typed(record)
        assert token is None  # unsigned: a token holder never accepts it


def test_a_proof_with_non_ascii_characters_is_refused_not_raised() -> None:
    """hmac.compare_digest raises TypeError on str holding non-ASCII: a corrupted proof such
    as "\\u0080" (found by the property test above) must be a RecordError like any other."""
    data = good_dict("w1")
    data["proof"] = "\u0080"
    with pytest.raises(RecordError, match="a proof that does not match its identity"):
        read_record("w1", json.dumps(data), TOKEN)
    assert read_record("w1", json.dumps(data), None).proof == "\u0080"  # unsigned readers


def test_the_wire_model_covers_every_field() -> None:
    assert set(RecordModel.model_fields) == {f.name for f in dataclasses.fields(WorkerRecord)}
    assert KV_TRANSPORTS == kvtransfer.TRANSPORTS
    record = good("p1")
    assert read_record("p1", record.to_json(), None) == record
    newer = json.dumps({**json.loads(record.to_json()), "added_later": {"x": [1]}})
    assert read_record("p1", newer, None) == record  # a newer writer's extra keys are ignored


# -- the proof: the token goes only to addresses a token holder registered -----------------------


def forgeries(real: WorkerRecord, trap: str) -> dict[str, WorkerRecord]:
    """Records someone with write access to Redis but without the token could write, all
    pointing at ``trap``."""
    kv_trap = f"{real.kv_transport}://{trap}" if real.kv_address else ""
    moved = dataclasses.replace(
        real, worker_id="forged-copy", grpc_address=trap, kv_address=kv_trap
    )
    return {
        "forged-none": dataclasses.replace(moved, worker_id="forged-none", proof=""),
        "forged-junk": dataclasses.replace(moved, worker_id="forged-junk", proof="0" * 64),
        "forged-copy": moved,  # the real worker's proof, for another address
        "forged-other-token": dataclasses.replace(
            moved, worker_id="forged-other-token", proof=record_proof(moved, "another-token")
        ),
        "forged-decode": dataclasses.replace(
            moved, worker_id="forged-decode", role="decode", kv_address="", proof=""
        ),
    }


def test_a_token_holding_view_lists_only_records_signed_with_the_token(
    redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = fast_config(redis_server.url, cluster_token=TOKEN)
    client = redis.Redis.from_url(redis_server.url)
    trap = "10.9.9.9:4242"

    async def main() -> None:
        async with WorkerRegistration(cfg, good("p1")) as reg:
            assert reg.record.proof == record_proof(reg.record, TOKEN)
            forged = forgeries(reg.record, trap)
            for worker_id, record in forged.items():
                write(client, cfg, worker_id, record.to_json())
            with caplog.at_level(logging.WARNING, LOGGER):
                async with RegistryView(cfg) as view:
                    assert [w.worker_id for w in view.workers()] == ["p1"]
                    assert set(view.rejected) == set(forged)
                    assert "no proof" in view.rejected["forged-none"]
                    assert "does not match" in view.rejected["forged-copy"]
                # The decode side: a KV handle naming a forged prefill worker is refused.
                peers = PeerRecords(cfg)
                checker = HandleChecker(FP.key(), peers)
                handle = pb.KVHandle(
                    prefill_worker_id="forged-copy",
                    address=reg.record.kv_address,
                    release_address=trap,
                    fingerprint=FP.key(),
                )
                assert await checker.rejection(handle) is not None
                assert trap not in checker.live_addresses(60.0)
                real = pb.KVHandle(
                    prefill_worker_id="p1",
                    address=reg.record.kv_address,
                    release_address=reg.record.grpc_address,
                    fingerprint=FP.key(),
                )
                assert await checker.rejection(real) is None
                assert checker.live_addresses(60.0) == {reg.record.grpc_address}
                await peers.close()
            # A view without the token (an --insecure router) checks no proof.
            async with RegistryView(dataclasses.replace(cfg, cluster_token=None)) as open_view:
                assert len(open_view.workers()) == 1 + len(forged)

    asyncio.run(main())
    assert sum("forged-" in r.getMessage() for r in caplog.records) == 5


def test_the_proof_binds_every_identity_field() -> None:
    real = dataclasses.replace(good("p1"), proof="")
    real = dataclasses.replace(real, proof=record_proof(real, TOKEN))
    assert read_record("p1", real.to_json(), TOKEN) == real
    changes: list[dict[str, Any]] = [
        {"role": "colocated"},
        {"grpc_address": "127.0.0.1:1"},
        {"kv_address": "tcp://127.0.0.1:1"},
        {"kv_transport": "shm", "kv_address": "shm://127.0.0.1:50052"},
        {"model": "other"},
        {"fingerprint": dataclasses.replace(FP, block_size=32)},
    ]
    for change in changes:
        changed = dataclasses.replace(real, **change)
        with pytest.raises(RecordError, match="does not match"):
            read_record("p1", changed.to_json(), TOKEN)
    # Load and draining change every heartbeat: not part of the identity.
    loaded = dataclasses.replace(real, num_running=3, draining=True, updated_at=5.0)
    assert read_record("p1", loaded.to_json(), TOKEN) == loaded


# -- a real router: bad and forged records never make a 5xx, the token never goes to a forgery --


class Trap:
    """A plain TCP listener where forged records point: counts who connects and what comes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.received = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(0.5)
                try:
                    self.received += conn.recv(65536)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture(scope="module")
def live(redis_server: Any) -> Iterator[tuple[Cluster, Router]]:
    with cluster(redis_server.url, ("prefill", "decode")) as (c, router):
        yield c, router


def _real_records(c: Cluster) -> dict[str, WorkerRecord]:
    client = redis.Redis.from_url(c.redis_url)
    cfg = RegistryConfig(prefix=c.prefix)
    ids = [str(w.info["worker_id"]) for w in c.workers]
    return {i: WorkerRecord.from_json(client.get(cfg.worker_key(i)) or b"") for i in ids}


def _serve_requests(router: Router, count: int) -> None:
    client = router.client()
    for i in range(count):
        answer = client.completions.create(
            model=MODEL, prompt=f"Request {i}: the capital of France is", max_tokens=3
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 3


def _check_workers_listing(router: Router, expected: set[str]) -> None:
    status, body = router.get("/v1/workers")
    assert status == 200, body
    assert {w["id"] for w in body["data"]} == expected
    assert body["registry"]["stale"] is False, body["registry"]  # a bad record is no outage


def test_bad_records_in_the_routers_registry_never_make_a_5xx(
    live: tuple[Cluster, Router],
) -> None:
    """Signed with the cluster's token (so that only the typed check can stop them), copies of
    the real workers' records with a zero block size or port, idle and roomy so the router would
    pick them; then huge, non-JSON, deeply nested and non-UTF-8 ones: the router lists and uses
    only the real workers, its view stays fresh, and every request is answered 200."""
    c, router = live
    token = os.environ["PDSERVE_CLUSTER_TOKEN"]
    real = _real_records(c)
    cfg = RegistryConfig(prefix=c.prefix)
    client = redis.Redis.from_url(c.redis_url)
    typed: dict[str, str | bytes] = {}
    for record in real.values():
        fp = dataclasses.replace(record.fingerprint, block_size=0)
        for name, changed in {
            f"zero-block-{record.role}": dataclasses.replace(record, fingerprint=fp),
            f"zero-port-{record.role}": dataclasses.replace(record, grpc_address="127.0.0.1:0"),
        }.items():
            changed = dataclasses.replace(
                changed, worker_id=name, num_waiting=0, kv_blocks_used=0, kv_blocks_total=1 << 20
            )
            signed = dataclasses.replace(changed, proof=record_proof(changed, token))
            typed[name] = signed.to_json()
    junk: dict[str, str | bytes] = {
        "not-json": "{not json",
        "huge": json.dumps({"worker_id": "huge", "model": "x" * 1_000_000}),
        "nested": "[" * 100_000,
        "not-utf-8": b'{"worker_id": "\xff"}',
    }
    try:
        for batch in (typed, junk):
            for worker_id, text in batch.items():
                write(client, cfg, worker_id, text)
            time.sleep(1.5)  # a few refreshes of the router's view
            _check_workers_listing(router, set(real))
            _serve_requests(router, 6)
            _check_workers_listing(router, set(real))
        assert router.get("/health")[0] == 200 and router.get("/ready")[0] == 200
        assert router.metric("pdserve_router_registry_records_rejected") >= len(typed)
    finally:
        client.delete(*[cfg.worker_key(i) for i in (*typed, *junk)])
        client.srem(cfg.index_key, *typed, *junk)
    assert all(wait_until(lambda w=w: blocks_in_use(w) == 0) for w in c.workers)


def test_a_real_router_never_calls_a_forged_record(live: tuple[Cluster, Router]) -> None:
    """Forged prefill and decode records (no proof, a junk one, a real worker's proof for the
    trap's address, one under another token) point at a plain TCP listener, and look idle and
    roomy: the router lists none of them and never connects there while it serves requests."""
    c, router = live
    real = _real_records(c)
    prefill = next(r for r in real.values() if r.role == "prefill")
    cfg = RegistryConfig(prefix=c.prefix)
    client = redis.Redis.from_url(c.redis_url)
    trap = Trap()
    forged = forgeries(dataclasses.replace(prefill, kv_blocks_total=1 << 20), trap.address)
    try:
        for worker_id, record in forged.items():
            write(client, cfg, worker_id, record.to_json())
        time.sleep(1.5)  # a few refreshes of the router's view
        _check_workers_listing(router, set(real))
        _serve_requests(router, 6)
        _check_workers_listing(router, set(real))
    finally:
        client.delete(*[cfg.worker_key(i) for i in forged])
        client.srem(cfg.index_key, *forged)
        trap.close()
    assert trap.connections == 0 and trap.received == b""
    assert all(wait_until(lambda w=w: blocks_in_use(w) == 0) for w in c.workers)
