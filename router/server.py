"""`pdserve router`: the gateway process (uvicorn serving the FastAPI app).

It binds its socket itself (port 0 picks a free one), then prints ``PDSERVE_READY {json}`` with
the URL once uvicorn serves, like the workers do, so launchers and tests know where it is.
SIGINT/SIGTERM stop it gracefully (uvicorn finishes open responses for a few seconds).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import uvicorn
from prometheus_client import disable_created_metrics

from common.ready import announce_ready
from common.tracing import setup_tracing
from common.wire import check_cluster_token
from router.app import create_app
from router.config import RouterConfig
from router.gateway import Gateway, ModelInfo

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; ValueError (a one-line message from the CLI) when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without
    # it Nagle + delayed ACK hold each response body back ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(config: RouterConfig) -> None:
    sock = bind(config.host, config.port)  # first: a taken port fails before the model loads
    port = sock.getsockname()[1]
    model = ModelInfo.load(config)
    app = create_app(Gateway(config, model))
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            loop="asyncio",  # grpc.aio runs on the standard loop
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        url = f"http://{config.host}:{port}"
        info = {"role": "router", "url": url, "port": port, "pid": os.getpid(), "model": model.name}
        announce_ready(info)
        log.info("serving %s at %s", model.name, url)
    await task


def run_router(config: RouterConfig) -> None:
    """Entry point of ``pdserve router``."""
    check_cluster_token(config.cluster_token, config.insecure)
    disable_created_metrics()  # counters' *_created series only double what scrapes show
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    if config.insecure:
        log.warning("--insecure: the workers are called without a cluster token")
    tracer_provider = setup_tracing("pdserve-router", config.trace_file, config.otlp_endpoint)
    try:
        asyncio.run(serve(config))
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # exports the spans still queued
