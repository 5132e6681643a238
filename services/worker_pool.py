"""Many simulated workers in one process (``--simulate P --simulated-workers N``).

Each is a whole ``Worker`` (its own gRPC server, KV listener, /metrics port, worker id, registry
record, heartbeat, leases and engine step thread) on one asyncio loop: what a router and Redis
see is N workers. Simulated steps sleep, so a few cores host a hundred of them (docs/simulation.md
gives the costs).

Lifecycle: build the N workers (their engines, one after another) -> run them all -> once every
one is registered and serving, one ready line (the first worker's fields, plus ``workers``: each
one's) -> SIGTERM/SIGINT: every worker drains at once, as a standalone one would -> exit. A
worker that fails stops the others and fails the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal

from common.heap import freeze_startup_heap
from common.ready import announce_ready
from services.server import Worker, run_worker
from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)


def pool_configs(config: WorkerConfig) -> list[WorkerConfig]:
    """One config per hosted worker: an explicit ``--worker-id`` gets a ``-i`` suffix; the
    first keeps the fixed ports (a container's probes and scrapes find it), the others take
    free ones (``-1``, no /metrics, stays)."""
    return [
        dataclasses.replace(
            config,
            simulated_workers=1,
            worker_id=f"{config.worker_id}-{i}" if config.worker_id else None,
            grpc_port=config.grpc_port if i == 0 else 0,
            metrics_port=config.metrics_port if i == 0 else min(config.metrics_port, 0),
        )
        for i in range(config.simulated_workers)
    ]


async def host_workers(config: WorkerConfig) -> None:
    """Run ``config.simulated_workers`` workers on this loop until a signal drains them."""
    first, *rest = pool_configs(config)
    workers = [Worker(first, standalone=False)]
    shared = workers[0].engine.tokenizer  # one per process, not per worker
    workers += [Worker(c, standalone=False, tokenizer=shared) for c in rest]
    tasks = [asyncio.create_task(w.run(), name=w.worker_id) for w in workers]

    def stop_all() -> None:
        for worker in workers:
            worker.stop()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all)
    try:
        while not all(w.ready_info for w in workers):
            failed = [t for t in tasks if t.done()]
            if failed:
                await failed[0]  # raises its error (a worker that ended is an error here)
                raise RuntimeError(f"worker {failed[0].get_name()} stopped while starting")
            await asyncio.sleep(0.05)
        infos = [w.ready_info for w in workers if w.ready_info is not None]
        freeze_startup_heap()
        announce_ready({**infos[0], "workers": infos})
        log.info("%d simulated %s workers serving", len(workers), config.role)
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # a worker's error, if one failed
    finally:
        stop_all()
        await asyncio.gather(*tasks, return_exceptions=True)


def run_workers(config: WorkerConfig) -> None:
    """Entry point of ``pdserve prefill|decode|colocated``: one worker, or a pool of them."""
    run_worker(config, host_workers if config.simulated_workers > 1 else None)
