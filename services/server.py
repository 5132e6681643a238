"""One worker process: engine + gRPC services + KV transport + registry + metrics.

Lifecycle: load the model (``--simulate``: only its tokenizer and config, see
``services/worker/simulation.py``) -> listen (gRPC, KV transport, /metrics) -> register in Redis
and heartbeat -> serve -> SIGTERM/SIGINT: mark draining (health NOT_SERVING, registry record
``draining``: routers stop picking it), refuse new requests, wait for in-flight requests and the
KV pins handed out (up to ``drain_seconds``), deregister, stop. Deregistering last matters: a
decode worker accepts a KV handle only from a registered (draining included) prefill worker, so a
handle given out just before the drain must still name one when its Generate call arrives.
The ready line printed on stdout (``PDSERVE_READY {json}``) tells a launcher or a test the
bound addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import Counter, disable_created_metrics

import kvtransfer
from common.heap import freeze_startup_heap
from common.ready import announce_ready
from common.wire import TOKEN_HEADER, check_cluster_token
from kernels.openmp import serial_thread
from kvtransfer.base import KVLayout
from kvtransfer.source import TensorBlockSource
from protos import pdserve_pb2_grpc as pb_grpc
from services.decode.service import DecodeService
from services.engine.llm_engine import LLMEngine
from services.engine.model.source import model_name
from services.engine.tokenizer import Tokenizer
from services.prefill.service import PrefillIdentity, PrefillService
from services.registry import (
    Fingerprint,
    LoadSnapshot,
    RegistryConfig,
    WorkerRecord,
    WorkerRegistration,
    file_digest,
    new_worker_id,
    tokenizer_hash,
)
from services.worker.async_engine import AsyncEngine
from services.worker.config import WorkerConfig
from services.worker.handles import HandleChecker, PeerRecords
from services.worker.metrics import WorkerMetrics
from services.worker.simulation import load_profile, simulated_link_client
from services.worker.step_log import StepLog

log = logging.getLogger(__name__)


class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not present the cluster token (health checks excepted)."""

    def __init__(self, token: str, refused: Counter | None = None):
        self._token = token.encode()
        self._refused = refused

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(str(presented).encode(), self._token):
            return await continuation(details)
        if self._refused is not None:
            self._refused.inc()  # no method label: a prober chooses the method names
        log.warning("refused %.100s: missing or wrong cluster token", details.method)
        return self._deny


class MalformedMessageInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT (and counts it) when a request's bytes do not parse.

    Left alone, grpc.aio answers such a call UNKNOWN and logs a traceback per call, which lets
    any peer fill the logs. The handler is rewrapped to receive raw bytes and parse them itself.
    """

    def __init__(self, malformed: Counter | None = None):
        self._malformed = malformed

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, details.method

        async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return parse(raw)
            except DecodeError as exc:
                if self._malformed is not None:
                    self._malformed.inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method}: {exc}")

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await unary(await parsed(raw, context), context)

            return handler._replace(request_deserializer=None, unary_unary=unary_unary)
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                async for item in stream(await parsed(raw, context), context):
                    yield item

            return handler._replace(request_deserializer=None, unary_stream=unary_stream)
        return handler


def fingerprint_of(engine: LLMEngine, model: str | None, block_size: int) -> Fingerprint:
    """What must be equal for a prefill and a decode worker to exchange KV."""
    cfg = engine.model_config
    model_dir = engine.model_dir
    source = model_dir / "pdserve_source.json"
    if source.exists():
        weights_hash = json.loads(source.read_text())["sha256"]
    else:
        weights_hash = file_digest(sorted(model_dir.glob("*.safetensors")))
    return Fingerprint(
        model_id=model_name(model),
        weights_hash=weights_hash[:16],
        tokenizer_hash=tokenizer_hash(engine.tokenizer.path.parent),
        block_size=block_size,
        kv_dtype=engine.config.dtype,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        quantization=engine.config.quantization,
    )


class Worker:
    """Builds and runs everything a worker process serves."""

    def __init__(
        self, config: WorkerConfig, standalone: bool = True, tokenizer: Tokenizer | None = None
    ):
        """``standalone``: this worker is the process (it takes SIGTERM/SIGINT and prints the
        ready line); a process hosting several (simulated) workers passes False and does both
        for all of them, and shares one ``tokenizer`` among them."""
        self.config = config
        self.standalone = standalone
        self.worker_id = config.worker_id or new_worker_id(config.role)  # type: ignore[arg-type]
        self.shm_path: str | None = None
        engine_config = config.role_engine
        if config.kv_transport == "shm" and config.role != "decode":
            self.shm_path = f"/dev/shm/pdserve-kv-{self.worker_id}"
            cache = dataclasses.replace(engine_config.cache, shared_memory_path=self.shm_path)
            engine_config = dataclasses.replace(engine_config, cache=cache)
        self.simulation = load_profile(config.simulate) if config.simulate else None
        simulation = self.simulation
        self.async_engine = AsyncEngine.build(
            lambda: LLMEngine(engine_config, simulation, tokenizer)
        )
        self.engine = self.async_engine.engine
        self.step_log: StepLog | None = None
        if config.step_log:
            self.step_log = StepLog(config.step_log, self.worker_id, config.role, self.async_engine)
            self.async_engine.on_step(self.step_log.record)
        table = self.engine.gemm_table
        self.metrics = WorkerMetrics(
            config.role, self.async_engine.stats, gemm_paths=table.entries() if table else ()
        )
        self.async_engine.on_step(self._time_step)
        self.transfer_metrics = kvtransfer.TransferMetrics(self.metrics.registry)
        cfg = self.engine.model_config
        self.layout = KVLayout(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            config.engine.cache.block_size,
            config.engine.dtype,
        )
        self.fingerprint = fingerprint_of(self.engine, config.engine.model, self.layout.block_size)
        self.prefill: PrefillService | None = None
        self.decode: DecodeService | None = None
        self.registration: WorkerRegistration | None = None
        self.peers: PeerRecords | None = None  # decode: the records KV handles name
        self.registry_config: RegistryConfig | None = None
        if config.redis_url:
            self.registry_config = RegistryConfig(
                redis_url=config.redis_url,
                password=config.redis_password,
                prefix=config.redis_prefix,
                ttl_seconds=config.ttl_seconds,
                heartbeat_seconds=config.heartbeat_seconds,
                cluster_token=config.cluster_token,  # signs our record, checks handles' peers
            )
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[bool]] = set()
        self._stop = asyncio.Event()
        self.ready_info: dict[str, Any] | None = None  # the ready line's, once serving
        self._public_host = config.host  # what peers dial; set by run()

    async def run(self) -> None:
        cfg = self.config
        self.async_engine.start()
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if cfg.cluster_token:  # first: an unauthenticated peer learns nothing about parsing
            interceptors.append(
                ClusterTokenInterceptor(cfg.cluster_token, self.metrics.grpc_refused)
            )
        interceptors.append(MalformedMessageInterceptor(self.metrics.grpc_malformed))
        server = grpc.aio.server(interceptors=interceptors)
        port = server.add_insecure_port(f"{_bracketed(cfg.host)}:{cfg.grpc_port}")
        self._public_host = cfg.public_host  # 0.0.0.0 -> this container's address, once
        grpc_address = f"{_bracketed(self._public_host)}:{port}"
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        transfer_server = await self._add_services(server, grpc_address)
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        metrics_port = -1
        if cfg.metrics_port >= 0:
            metrics_port = self.metrics.serve(cfg.host, cfg.metrics_port)
        kv_address = self._kv_address
        await self._register(grpc_address, kv_address)
        self.ready_info = {
            "role": cfg.role,
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "grpc_address": grpc_address,
            "kv_address": kv_address,
            "metrics_port": metrics_port,
            "num_blocks": self.engine.num_blocks,
        }
        if self.simulation is not None:
            self.ready_info["simulate"] = self.simulation.name
        if self.standalone:
            self._install_signal_handlers()
            freeze_startup_heap()
            announce_ready(self.ready_info)
        await self._stop.wait()
        await self._drain(health)
        await server.stop(grace=1.0)
        if transfer_server is not None:
            await transfer_server.stop()
        await self._shutdown()

    async def _add_services(self, server: grpc.aio.Server, grpc_address: str):  # type: ignore[no-untyped-def]
        cfg = self.config
        self._kv_address = ""
        transfer_server = None
        token = cfg.cluster_token
        if cfg.role in ("prefill", "colocated"):
            loop = asyncio.get_running_loop()

            # The pins' one owner: it calls this once per pin, when the pin ended and no
            # transfer reads its blocks any more (from any thread: a transfer's or ours).
            def on_unpin(request_id: str) -> None:
                loop.call_soon_threadsafe(self._free_pinned, request_id)

            leases = TensorBlockSource(self.engine.kv_cache, cfg.lease_seconds, on_unpin=on_unpin)
            self.async_engine.on_step(leases.progressed)  # streamed pulls wait for steps
            self.metrics.watch_pins(lambda: leases.num_pins, lambda: leases.num_readers)
            options: dict[str, Any] = {
                "metrics": self.transfer_metrics,
                "faults": kvtransfer.KVFaults.parse(cfg.kv_faults),  # None: off (the default)
            }
            if self.shm_path is not None:
                options["path"] = self.shm_path
            transfer_server = kvtransfer.make_server(
                cfg.kv_transport, leases, self.layout, token, **options
            )
            self._kv_address = await transfer_server.start(cfg.host, self._public_host)
            identity = PrefillIdentity(
                self.worker_id,
                grpc_address,
                cfg.kv_transport,
                self._kv_address,
                self.layout,
                self.fingerprint.key(),
            )
            self.prefill = PrefillService(
                self.async_engine, leases, identity, self.metrics, cfg.max_pending_requests
            )
            pb_grpc.add_PrefillServiceServicer_to_server(self.prefill, server)
            self._tasks.append(asyncio.create_task(self.prefill.reap_expired_leases()))
        if cfg.role in ("decode", "colocated"):
            if self.simulation is not None:  # tcp, each pull as slow as the profile's link
                block_size = self.layout.block_size
                client = simulated_link_client(
                    self.simulation, block_size, token, self.transfer_metrics
                )
            else:
                client = kvtransfer.make_client(
                    cfg.kv_transport, token, metrics=self.transfer_metrics
                )
            if self.registry_config is not None:  # KV handles must name registered workers
                self.peers = PeerRecords(self.registry_config)
            handles = HandleChecker(self.fingerprint.key(), self.peers)
            self.decode = DecodeService(
                self.async_engine, client, self.layout, cfg, self.metrics, handles
            )
            pb_grpc.add_DecodeServiceServicer_to_server(self.decode, server)
            self._tasks.append(asyncio.create_task(self.decode.prune_channels()))
        return transfer_server

    def _free_pinned(self, request_id: str) -> None:
        """A pin ended (released or expired) and no transfer reads its blocks: free them."""
        task = asyncio.get_running_loop().create_task(self.async_engine.release_pinned(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _register(self, grpc_address: str, kv_address: str) -> None:
        cfg, registry = self.config, self.registry_config
        if registry is None:
            return
        record = WorkerRecord(
            worker_id=self.worker_id,
            role=cfg.role,  # type: ignore[arg-type]
            grpc_address=grpc_address,
            kv_address=kv_address,
            kv_transport=cfg.kv_transport,
            model=self.fingerprint.model_id,
            fingerprint=self.fingerprint,
            kv_blocks_total=self.engine.num_blocks,
            prefix_caching=cfg.engine.cache.enable_prefix_caching,
        )
        self.registration = WorkerRegistration(registry, record, self._load)
        await self.registration.register()
        self._tasks.append(asyncio.create_task(self._publish_prefixes(cfg.heartbeat_seconds)))

    def _load(self) -> LoadSnapshot:
        stats = self.async_engine.stats()
        return LoadSnapshot(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_cached=stats.num_prefix_blocks,  # what prefix-aware routing looks for
            kv_blocks_total=stats.kv_blocks_total,
        )

    def _num_active(self) -> int:
        return sum(s.num_active for s in (self.prefill, self.decode) if s is not None)

    def _num_pins(self) -> int:
        """KV handles given out and not yet pulled, released or expired."""
        return self.prefill.leases.num_pins if self.prefill is not None else 0

    async def _publish_prefixes(self, interval: float) -> None:
        assert self.registration is not None
        while True:
            await asyncio.sleep(interval)
            await self.registration.publish_prefix_hashes(self.engine.cached_block_hashes())

    def _time_step(self) -> None:
        step = self.async_engine.last_step
        if step is not None:  # None: the step failed
            self.metrics.step_seconds.labels(kind=step.kind).observe(step.ended - step.started)

    def stop(self) -> None:
        """Begin the drain (what SIGTERM does to a standalone worker)."""
        self._stop.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)

    async def _drain(self, health: HealthServicer) -> None:
        log.info("draining: refusing new requests")
        for service in (self.prefill, self.decode):
            if service is not None:
                service.draining = True
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.registration is not None:
            with contextlib.suppress(Exception):
                await self.registration.set_draining(True)
        deadline = time.monotonic() + self.config.drain_seconds
        while (self._num_active() or self._num_pins()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.prefill is not None:  # nobody will pull what is still pinned
            self.prefill.leases.release_all()  # each freed once its transfers are done
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.registration is not None:  # last: see the module docstring
            with contextlib.suppress(Exception):
                await self.registration.deregister()

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.decode is not None:
            await self.decode.close()
        if self.registration is not None:
            await self.registration.close()
        if self.peers is not None:
            await self.peers.close()
        await self.async_engine.stop()
        if self.step_log is not None:
            self.step_log.close()
        if self.shm_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)


def _bracketed(host: str) -> str:
    """``host`` as the host part of ``host:port`` (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host else host


async def _with_serial_blocking_threads(serving: Coroutine[Any, Any, None]) -> None:
    """``serving``, with ``asyncio.to_thread``'s threads (block checksums, grammar compiles)
    computing on themselves: see ``kernels.openmp``."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(
        ThreadPoolExecutor(thread_name_prefix="worker-blocking", initializer=serial_thread)
    )
    await serving


def run_worker(
    config: WorkerConfig, host: Callable[[WorkerConfig], Coroutine[Any, Any, None]] | None = None
) -> None:
    """Entry point of ``pdserve prefill|decode|colocated``: one ``Worker``, or what ``host``
    runs (several simulated workers: ``services.worker_pool``)."""
    check_cluster_token(config.cluster_token, config.insecure)
    serial_thread()  # the event loop's thread: only the engine's step thread computes in parallel
    disable_created_metrics()  # counters' *_created series only double what scrapes show
    log_format = f"%(asctime)s {config.role} %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    if config.insecure:
        log.warning("--insecure: gRPC and KV transfer accept any peer that can reach them")
    from common.tracing import setup_tracing  # here: the entry point is the one place to set up

    tracer_provider = setup_tracing(
        f"pdserve-{config.role}", config.trace_file, config.otlp_endpoint
    )
    try:
        serving = host(config) if host is not None else Worker(config).run()
        asyncio.run(_with_serial_blocking_threads(serving))
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # exports the spans still queued
