"""The router groups the routable workers once per registry refresh (``Pools``,
router/orchestrator.py), not on every request: a request asks for its candidates several times,
and filtering and comparing every record each time grew the router's cost per request with the
number of workers (docs/simulation.md, "Control-plane scale"). The groups still follow every
refresh. Against a real Redis registry."""

from __future__ import annotations

import dataclasses

from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from services.registry import RegistryView, WorkerRecord, WorkerRegistration
from tests.services.test_registry import FP, fast_config, make_record, run

OTHER = dataclasses.replace(FP, block_size=32)  # a decode worker no prefill worker pairs with


def ids(workers: list[WorkerRecord]) -> list[str]:
    return [w.worker_id for w in workers]


def test_candidates_are_grouped_once_per_refresh_and_follow_the_registry(redis_server):  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        cfg = fast_config(redis_server.url)
        records = [make_record(f"p{i}") for i in range(3)]
        records += [make_record(f"d{i}", "decode") for i in range(4)]
        records.append(make_record("d-other", "decode", OTHER))
        refused = make_record("d-refused", "decode")
        registrations = [WorkerRegistration(cfg, r) for r in [*records, refused]]
        for reg in registrations:
            await reg.register()
        async with RegistryView(cfg) as view:
            reads = 0
            workers = view.workers

            def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
                nonlocal reads
                reads += 1
                return workers(*args, **kwargs)

            view.workers = counted  # type: ignore[method-assign]
            accepts = lambda w: "refused" if w.worker_id == "d-refused" else None  # noqa: E731
            orchestrator = Orchestrator(RouterConfig(), view, RouterMetrics(), accepts)
            reads = 0
            for _ in range(100):  # what a hundred requests ask
                assert ids(orchestrator.prefill_candidates()) == ["p0", "p1", "p2"]
                assert ids(orchestrator.decode_candidates()) == ["d0", "d1", "d2", "d3"]
                decode = orchestrator.decode_candidates()[0]
                assert ids(orchestrator.prefill_candidates(decode)) == ["p0", "p1", "p2"]
                assert ids(orchestrator.routable("decode"))[-1] == "d3"
            assert reads == 0  # nothing was filtered again: no refresh came between
            assert orchestrator.prefill_candidates(make_record("x", "decode", OTHER)) == []

            # A worker leaves, the next refresh regroups (once) and the candidates follow.
            await registrations[1].deregister()
            await view.refresh()
            assert ids(orchestrator.prefill_candidates()) == ["p0", "p2"]
            assert ids(orchestrator.routable("decode")) == ["d-other", "d0", "d1", "d2", "d3"]
            assert 0 < reads <= 3  # one read per role, for the whole refresh
            await registrations[0].set_draining(True)  # written at once
            await view.refresh()
            assert ids(orchestrator.prefill_candidates()) == ["p2"]
        for reg in registrations:
            await reg.deregister()

    run(scenario())
