"""The router's side of a request's life: pick D, decide where the prompt is computed, relay
the stream (section 1 of the architecture page).

    choose D (policy) -> the disaggregation policy decides:
      local:  Generate(prompt) on D, which computes the prompt itself
      remote, streamed (the default): PrefillStream on P (fingerprint equal to D's) -> its
              streaming KVHandle as soon as the prompt's blocks are reserved -> Generate(prompt,
              KVHandle) on D at once (D pulls while P computes) -> P's first token to the client
              -> D's chunks after it
      remote, whole (--no-stream-kv): Prefill on P -> first token to the client -> Generate(
              prompt, first token, KVHandle) on D -> D's chunks

A colocated worker does both phases (no KV handle) and is used when no prefill/decode pair is
routable. Each arrow is a call of ``WorkerCalls`` (``router/worker_calls.py``), which builds its
request, gives it its deadline, retries it on another worker while it has produced nothing, and
releases a prefill handle no decode worker took; this module only composes the flows.

No tensors here: token ids and text only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from opentelemetry import trace

from common.sampling_params import sequence_seed
from router.chunks import Chunk, SubRequest, first_chunk
from router.config import RouterConfig
from router.disaggregation import Decision, RequestFacts, make_disaggregation_policy
from router.errors import APIError
from router.metrics import RouterMetrics
from router.policies import PolicyContext, PrefixIndex, RouteRequest, RoutingPolicy, make_policy
from router.relay import Relay
from router.worker_calls import Handoff, WorkerCalls
from services.registry import ROLES, Fingerprint, RegistryView, Role, WorkerRecord

WorkerFilter = Callable[[WorkerRecord], str | None]  # None: the router may use it, else why not


@dataclass(frozen=True)
class Pools:
    """One registry refresh's routable workers (sorted by id), grouped the ways routing asks."""

    routable: dict[Role, tuple[WorkerRecord, ...]]
    # prefill workers that have a decode worker of their fingerprint, and the other way round
    pairable: dict[Role, tuple[WorkerRecord, ...]]
    by_fingerprint: dict[tuple[Role, Fingerprint], tuple[WorkerRecord, ...]]

    @classmethod
    def of(cls, view: RegistryView, accepts: WorkerFilter) -> Pools:
        routable = {r: tuple(w for w in view.workers(r) if accepts(w) is None) for r in ROLES}
        groups: dict[tuple[Role, Fingerprint], list[WorkerRecord]] = {}
        partners: list[tuple[Role, Role]] = [("prefill", "decode"), ("decode", "prefill")]
        for role, _ in partners:
            for w in routable[role]:
                groups.setdefault((role, w.fingerprint), []).append(w)
        by_fingerprint = {key: tuple(workers) for key, workers in groups.items()}
        pairable = {
            role: tuple(w for w in routable[role] if (other, w.fingerprint) in by_fingerprint)
            for role, other in partners
        }
        return cls(routable, pairable, by_fingerprint)


class Orchestrator:
    """Routes sub-requests over the live registry view and streams their chunks."""

    def __init__(
        self,
        config: RouterConfig,
        view: RegistryView,
        metrics: RouterMetrics,
        accepts: WorkerFilter,
    ):
        self.config = config
        self.view = view
        self.metrics = metrics
        self.accepts = accepts
        policies: dict[Role, RoutingPolicy] = {}  # filled below, once their context exists
        self.calls = WorkerCalls(config, metrics, policies)
        context = PolicyContext(view, self.calls.in_flight, config.prefix_load_weight)
        assert context.prefixes is not None
        self.prefixes: PrefixIndex = context.prefixes
        self.disaggregation = make_disaggregation_policy(
            config.disaggregation,
            config.local_prefill_tokens,
            config.prefill_busy_tokens,
            config.decode_busy_sequences,
        )
        policies["prefill"] = make_policy(config.prefill_policy, context)
        policies["decode"] = make_policy(config.decode_policy, context)
        policies["colocated"] = make_policy(config.colocated_policy, context)
        self._grouped = Pools.of(view, accepts)
        self._pools_of = view.generation  # the view's generation _grouped was built from

    @property
    def in_flight(self) -> dict[str, int]:
        """Calls open on each worker (by id)."""
        return self.calls.in_flight

    @property
    def num_pool_requests(self) -> dict[Role, int]:
        """Calls open on each pool's workers."""
        return self.calls.num_pool_requests

    # -- who can serve -------------------------------------------------------------------------

    def routable(self, role: Role) -> list[WorkerRecord]:
        """Live, not draining, serving this router's model with this router's tokenizer."""
        return list(self._pools().routable[role])

    def prefill_candidates(self, decode: WorkerRecord | None = None) -> list[WorkerRecord]:
        """Prefill workers some decode worker (``decode``, when given) can pull from."""
        pools = self._pools()
        if decode is None:
            return list(pools.pairable["prefill"])
        return list(pools.by_fingerprint.get(("prefill", decode.fingerprint), ()))

    def decode_candidates(self, prefill: WorkerRecord | None = None) -> list[WorkerRecord]:
        """Decode workers that can pull from ``prefill`` (any prefill worker, when None)."""
        pools = self._pools()
        if prefill is None:
            return list(pools.pairable["decode"])
        return list(pools.by_fingerprint.get(("decode", prefill.fingerprint), ()))

    def _pools(self) -> Pools:
        """The view's routable workers grouped, once per registry refresh: a request asks for
        candidates several times, and filtering hundreds of records each time grew the
        router's cost per request with the number of workers."""
        if self._pools_of != self.view.generation:
            self._grouped = Pools.of(self.view, self.accepts)
            self._pools_of = self.view.generation
        return self._grouped

    def kv_usage(self, role: Role) -> float:
        """KV blocks in use over blocks in all, summed over the routable workers of ``role`` as
        they last published them (0 with none): the pool's fill, whichever worker holds it."""
        workers = self.routable(role)
        total = sum(w.kv_blocks_total for w in workers)
        return sum(w.kv_blocks_used for w in workers) / total if total else 0.0

    def is_ready(self) -> tuple[bool, str]:
        """Whether a request could be served now, and if not, why."""
        if self.prefill_candidates() or self.routable("colocated"):
            return True, "ok"
        have = {role: len(self.routable(role)) for role in ("prefill", "decode", "colocated")}
        if have["prefill"] and have["decode"]:
            return False, "no prefill/decode pair has equal fingerprints (see /v1/workers)"
        missing = [role for role in ("prefill", "decode") if not have[role]]
        return False, f"no {' or '.join(missing)} worker is alive"

    # -- the flow ------------------------------------------------------------------------------

    async def generate(self, sub: SubRequest) -> AsyncGenerator[Chunk, None]:
        """Chunks of ``sub``; APIError before the first chunk, MidStreamError after it.

        A request for one token takes the whole hand-off: its first token (the prefill
        worker's) is all of it, so a decode worker called early would pull for nothing."""
        route = RouteRequest(sub.prompt_token_ids, sub.cache_salt)
        if self.prefill_candidates():
            decode = await self.calls.choose("decode", self.decode_candidates(), route)
            if not (await self._decide(sub, route, decode)).remote:
                stream = self._local(sub, route, decode)
            elif self.config.stream_kv and sub.params.max_tokens != 1:
                stream = self._streamed(sub, route, decode)
            else:
                stream = self._disaggregated(sub, route, decode)
        elif self.routable("colocated"):
            stream = self._colocated(sub, route)
        else:
            _, why = self.is_ready()
            raise APIError(
                503, f"cannot serve now: {why}", retry_after=self.config.retry_after_seconds
            )
        async with aclosing(stream):  # closed now, not when collected: the worker aborts at once
            async for chunk in stream:
                yield chunk
        self._record(sub)

    async def _decide(self, sub: SubRequest, route: RouteRequest, decode: WorkerRecord) -> Decision:
        """Where ``sub``'s prompt is computed, by the disaggregation policy (counted, traced)."""
        hashes = route.block_hashes(decode.fingerprint.block_size)
        cached = (await self.prefixes.cached_blocks([decode], hashes))[decode.worker_id]
        waiting = self.calls.prefill_tokens
        queued = min((waiting[p.worker_id] for p in self.prefill_candidates(decode)), default=0)
        # The registry's count is a heartbeat old; the router's own in-flight count is now.
        sequences = max(
            decode.num_running + decode.num_waiting, self.in_flight.get(decode.worker_id, 0)
        )
        facts = RequestFacts(
            len(sub.prompt_token_ids),
            cached * decode.fingerprint.block_size,
            queued,
            sequences,
            local_queue_tokens=waiting[decode.worker_id],
        )
        decision = self.disaggregation.decide(facts)
        self.metrics.disaggregation.labels(decision=decision.label, reason=decision.reason).inc()
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("pdserve.disaggregation", f"{decision.label}:{decision.reason}")
        self.prefixes.remember(decode, hashes)  # it will cache them either way
        return decision

    async def _local(
        self, sub: SubRequest, route: RouteRequest, decode: WorkerRecord
    ) -> AsyncGenerator[Chunk, None]:
        """The decode worker computes the prompt itself (no KV transfer)."""
        stream = self.calls.generate(
            "decode", sub, route, self.decode_candidates, first_choice=decode
        )
        # The prompt is in the decode worker's local prefill queue until its first token.
        queued = len(sub.prompt_token_ids)
        self.calls.add_prefill_tokens(decode, queued)
        try:
            async with aclosing(stream):
                async for chunk in stream:
                    if queued:
                        self.calls.add_prefill_tokens(decode, -queued)
                        queued = 0
                    yield chunk
        finally:
            self.calls.add_prefill_tokens(decode, -queued)

    async def _disaggregated(
        self, sub: SubRequest, route: RouteRequest, decode: WorkerRecord
    ) -> AsyncGenerator[Chunk, None]:
        """Prefill on P, its first token to the client, then D pulls and decodes."""
        handoff = await self.calls.prefill(sub, route, lambda: self.prefill_candidates(decode))
        prefill = handoff.prefill
        try:
            assert handoff.answer is not None
            yield first_chunk(sub, handoff.answer)
            if handoff.answer.finish_reason:  # the first token ended sequence 0
                async for chunk in self._after_first_token_ended(sub, route, prefill):
                    yield chunk
                return
            stream = self.calls.generate(
                "decode",
                sub,
                route,
                lambda: self.decode_candidates(prefill),
                first_choice=decode,
                handoff=handoff,
            )
            async with aclosing(stream):
                async for chunk in stream:
                    yield chunk
        finally:
            self.calls.release_untaken(handoff)

    async def _streamed(
        self, sub: SubRequest, route: RouteRequest, decode: WorkerRecord
    ) -> AsyncGenerator[Chunk, None]:
        """Disaggregated with the KV streamed: the decode worker is called as soon as the
        prefill worker has reserved the prompt's blocks and pulls them as they are computed;
        its chunks follow the first token the prefill worker answers with."""

        def start_decoding(handoff: Handoff, prefill_request_id: str) -> Relay[Chunk]:
            stream = self.calls.generate(
                "decode",
                sub,
                route,
                lambda: self.decode_candidates(handoff.prefill),
                first_choice=decode,
                handoff=handoff,
                id_base=prefill_request_id,  # unique per prefill attempt: an aborted one lingers
            )
            return Relay(stream)  # read in the background from now on

        answer, handoff, relay = await self.calls.prefill_streamed(
            sub, route, lambda: self.prefill_candidates(decode), start_decoding
        )
        try:
            if not answer.finish_reason:  # else the decode worker has nothing to do
                handoff.know(answer)
            yield first_chunk(sub, answer)
            if answer.finish_reason:
                await relay.close()
                async for chunk in self._after_first_token_ended(sub, route, handoff.prefill):
                    yield chunk
                return
            async for chunk in relay.items():
                yield chunk
        finally:
            await relay.close()
            self.calls.release_untaken(handoff)

    async def _after_first_token_ended(
        self, sub: SubRequest, route: RouteRequest, prefill: WorkerRecord
    ) -> AsyncGenerator[Chunk, None]:
        """Sequence 0 ended at its first token: the prompt's KV went nowhere; the other
        sequences (n > 1) come from a decode worker that computes the prompt itself."""
        sub.kv_source = "pulled"
        if sub.params.n > 1:
            async for chunk in self._other_sequences(sub, route, prefill):
                yield chunk

    async def _other_sequences(
        self, sub: SubRequest, route: RouteRequest, prefill: WorkerRecord
    ) -> AsyncGenerator[Chunk, None]:
        """n > 1 and sequence 0 ended at its first token: a decode worker computes the prompt
        itself for sequences 1..n-1 (their seeds shifted as if they had been forked)."""
        seed = None if sub.params.seed is None else sequence_seed(sub.params.seed, 1)
        rest = dataclasses.replace(sub.params, n=sub.params.n - 1, seed=seed)
        stream = self.calls.generate(
            "decode", sub, route, lambda: self.decode_candidates(prefill), params=rest
        )
        async with aclosing(stream):
            async for chunk in stream:
                chunk.index += 1
                yield chunk

    async def _colocated(self, sub: SubRequest, route: RouteRequest) -> AsyncGenerator[Chunk, None]:
        stream = self.calls.generate("colocated", sub, route, lambda: self.routable("colocated"))
        async with aclosing(stream):
            async for chunk in stream:
                yield chunk

    def _record(self, sub: SubRequest) -> None:
        """Count how ``sub`` got its KV and observe its phases."""
        if sub.kv_source:
            self.metrics.kv_sources.labels(source=sub.kv_source).inc()
        for phase, seconds in sub.timings.items():
            self.metrics.phase_seconds.labels(phase=phase).observe(seconds)

    async def forget_channels(self) -> None:
        """Close channels to addresses no worker in the view has any more and no call uses (a
        draining worker leaves the registry before its last streams end)."""
        addresses = [w.grpc_address for w in self.view.workers(include_draining=True)]
        await self.calls.forget_channels(addresses)

    async def close(self) -> None:
        await self.calls.close()
