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

A worker that fails before it has produced anything for this request (refused: full or
draining; unreachable; crashed) is replaced by another worker of its pool, up to
``max_attempts`` per pool. A decode worker that fails after its first chunk ends the request
with an error. When no decode worker ever got the request, the router releases the prefill
worker's pinned blocks itself (the lease is the backstop). A colocated worker does both phases
(no KV handle) and is used when no prefill/decode pair is routable.

Each attempt on a worker is a client span (``router.prefill``, ``router.decode``,
``router.colocated``) under the request's root span, failed ones marked as errors; its trace
context goes to the worker in the call's metadata, next to the cluster token.

No tensors here: token ids and text only.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from common import tracing
from common.sampling_params import sequence_seed
from common.wire import params_to_proto
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.disaggregation import Decision, RequestFacts, make_disaggregation_policy
from router.errors import APIError
from router.metrics import RouterMetrics
from router.policies import PolicyContext, PrefixIndex, RouteRequest, RoutingPolicy, make_policy
from router.relay import Relay
from router.worker_calls import (
    Chunk,
    SubRequest,
    WorkerCalls,
    attempt_id,
    attempt_span,
    entries,
)
from services.registry import RegistryView, Role, WorkerRecord

WorkerFilter = Callable[[WorkerRecord], str | None]  # None: the router may use it, else why not


@dataclass
class _Decoding:
    """A decode call running on a streaming handle: its request (the first token goes in once
    known, for the attempts after it) and its chunks."""

    request: pb.GenerateRequest
    relay: Relay[Chunk]
    first_token_known: asyncio.Event

    def know(self, answer: pb.PrefillResponse) -> None:
        """The prefill's answer came: attempts from now on carry its first token (a decode
        worker can then recompute the prompt if its pull fails)."""
        self.request.first_token = answer.first_token
        self.request.first_logprobs.CopyFrom(answer.logprobs)
        self.first_token_known.set()


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
        return [w for w in self.view.workers(role) if self.accepts(w) is None]

    def prefill_candidates(self, decode: WorkerRecord | None = None) -> list[WorkerRecord]:
        """Prefill workers some decode worker (``decode``, when given) can pull from."""
        if decode is None:
            keys = {d.fingerprint for d in self.routable("decode")}
            return [p for p in self.routable("prefill") if p.fingerprint in keys]
        return [p for p in self.routable("prefill") if p.fingerprint == decode.fingerprint]

    def decode_candidates(self, prefill: WorkerRecord | None = None) -> list[WorkerRecord]:
        """Decode workers that can pull from ``prefill`` (any prefill worker, when None)."""
        if prefill is None:
            keys = {p.fingerprint for p in self.routable("prefill")}
            return [d for d in self.routable("decode") if d.fingerprint in keys]
        return [d for d in self.routable("decode") if d.fingerprint == prefill.fingerprint]

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
        """Chunks of ``sub``; APIError before the first chunk, MidStreamError after it."""
        route = RouteRequest(sub.prompt_token_ids)
        if self.prefill_candidates():
            decode = await self.calls.choose("decode", self.decode_candidates(), route)
            if not (await self._decide(sub, route, decode)).remote:
                stream = self._local(sub, route, decode)
            elif self.config.stream_kv:
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
        request = pb.GenerateRequest(
            prompt_token_ids=sub.prompt_token_ids, sampling=params_to_proto(sub.params)
        )
        stream = self.calls.stream(
            "decode", sub, route, request, self.decode_candidates, first_choice=decode
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
        prefill, answer = await self._prefill(sub, route, decode)
        yield self._first_chunk(sub, answer)
        if answer.finish_reason:  # the first token ended sequence 0; nothing is pinned
            async for chunk in self._after_first_token_ended(sub, route, prefill):
                yield chunk
            return
        request = pb.GenerateRequest(
            prompt_token_ids=sub.prompt_token_ids,
            sampling=params_to_proto(sub.params),
            first_token=answer.first_token,
            first_logprobs=answer.logprobs,
            kv=answer.kv,
        )
        handed_over = False
        stream = self.calls.stream(
            "decode",
            sub,
            route,
            request,
            lambda: self.decode_candidates(prefill),
            first_choice=decode,
        )
        try:
            async with aclosing(stream):
                async for chunk in stream:
                    handed_over = True
                    yield chunk
        finally:
            if not handed_over:  # no decode worker took it: nobody will pull or release
                # The address the router called, not one the answer names.
                self.calls.spawn(self.calls.prefill_client.release(answer.kv, prefill.grpc_address))

    async def _streamed(
        self, sub: SubRequest, route: RouteRequest, decode: WorkerRecord
    ) -> AsyncGenerator[Chunk, None]:
        """Disaggregated with the KV streamed: the decode worker is called as soon as the
        prefill worker has reserved the prompt's blocks and pulls them as they are computed;
        its chunks follow the first token the prefill worker answers with. A prefill worker
        that fails first is replaced (its decode call cancelled), as in ``_prefill``."""
        failed: set[str] = set()
        last = "no prefill worker is alive"
        for attempt in range(self.config.max_attempts):
            candidates = [p for p in self.prefill_candidates(decode) if p.worker_id not in failed]
            if not candidates:
                break
            prefill = await self.calls.choose("prefill", candidates, route)
            try:
                answer, kv, decoding = await self._prefill_streamed(
                    sub, route, prefill, decode, attempt
                )
            except grpc.aio.AioRpcError as exc:
                last = self.calls.failed("prefill", prefill, exc)
                failed.add(prefill.worker_id)
                continue
            try:
                yield self._first_chunk(sub, answer)
                if answer.finish_reason:  # the decode worker has nothing to do for sequence 0
                    await decoding.relay.close()
                    async for chunk in self._after_first_token_ended(sub, route, prefill):
                        yield chunk
                    return
                decoding.know(answer)
                async for chunk in decoding.relay.items():
                    yield chunk
            finally:
                await decoding.relay.close()
                if not decoding.relay.started:  # no decode worker took it: release it here
                    self.calls.spawn(self.calls.prefill_client.release(kv, prefill.grpc_address))
            return
        raise APIError(503, f"prefill failed: {last}", retry_after=self.config.retry_after_seconds)

    async def _prefill_streamed(
        self,
        sub: SubRequest,
        route: RouteRequest,
        prefill: WorkerRecord,
        decode: WorkerRecord,
        attempt: int,
    ) -> tuple[pb.PrefillResponse, pb.KVHandle, _Decoding]:
        """One PrefillStream call: the decode call starts on its streaming handle; returns the
        answer, the handle and the running decode call (closed if this raises)."""
        request = pb.PrefillRequest(
            request_id=attempt_id(sub.request_id, "p", attempt),
            token_ids=sub.prompt_token_ids,
            sampling=params_to_proto(sub.params),
        )
        span = attempt_span("prefill", prefill, attempt, request.request_id)
        decoding: _Decoding | None = None
        kv: pb.KVHandle | None = None
        with tracing.ending(span):
            try:
                with self.calls.tracked(prefill) as channel, self.calls.queued(prefill, sub):
                    call = pb_grpc.PrefillServiceStub(channel).PrefillStream(
                        request,
                        timeout=self.config.prefill_timeout_seconds,
                        metadata=self.calls.metadata + tracing.grpc_metadata(span),
                    )
                    try:
                        async for event in call:
                            if event.HasField("kv") and decoding is None:
                                kv = event.kv
                                decoding = self._start_decoding(
                                    sub, route, prefill, decode, kv, request.request_id
                                )
                            elif event.HasField("done") and decoding is not None:
                                assert kv is not None
                                sub.worker_ids.append(prefill.worker_id)
                                span.set_attribute(
                                    "pdserve.cached_tokens", event.done.num_cached_tokens
                                )
                                return event.done, kv, decoding
                    finally:
                        call.cancel()  # a no-op once finished
                raise APIError(502, f"{prefill.worker_id} ended PrefillStream without an answer")
            except BaseException as exc:
                if decoding is not None:
                    await decoding.relay.close()
                if isinstance(exc, grpc.aio.AioRpcError):
                    tracing.set_error(span, f"{exc.code().name}: {exc.details()}")
                raise

    def _start_decoding(
        self,
        sub: SubRequest,
        route: RouteRequest,
        prefill: WorkerRecord,
        decode: WorkerRecord,
        kv: pb.KVHandle,
        prefill_request_id: str,
    ) -> _Decoding:
        """The decode call on a streaming handle, read in the background from now on."""
        request = pb.GenerateRequest(
            prompt_token_ids=sub.prompt_token_ids, sampling=params_to_proto(sub.params), kv=kv
        )
        first_token_known = asyncio.Event()
        stream = self.calls.stream(
            "decode",
            sub,
            route,
            request,
            lambda: self.decode_candidates(prefill),
            first_choice=decode,
            id_base=prefill_request_id,  # unique per prefill attempt: an aborted one may linger
            first_token_known=first_token_known,
        )
        return _Decoding(request, Relay(stream), first_token_known)

    def _first_chunk(self, sub: SubRequest, answer: pb.PrefillResponse) -> Chunk:
        """The prefill worker's first token, as the request's first chunk."""
        sub.num_cached_tokens = answer.num_cached_tokens
        sub.timings["prefill_queue"] = answer.timings.queue_s
        sub.timings["prefill_compute"] = answer.timings.compute_s
        return Chunk(
            index=0,
            text=answer.first_text,
            token_ids=[answer.first_token],
            logprobs=[entries(answer.logprobs)] if sub.params.logprobs is not None else [],
            finish_reason=answer.finish_reason or None,
        )

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
        request = pb.GenerateRequest(
            prompt_token_ids=sub.prompt_token_ids, sampling=params_to_proto(rest)
        )
        stream = self.calls.stream(
            "decode", sub, route, request, lambda: self.decode_candidates(prefill)
        )
        async with aclosing(stream):
            async for chunk in stream:
                chunk.index += 1
                yield chunk

    async def _colocated(self, sub: SubRequest, route: RouteRequest) -> AsyncGenerator[Chunk, None]:
        request = pb.GenerateRequest(
            prompt_token_ids=sub.prompt_token_ids, sampling=params_to_proto(sub.params)
        )
        stream = self.calls.stream(
            "colocated", sub, route, request, lambda: self.routable("colocated")
        )
        async with aclosing(stream):
            async for chunk in stream:
                yield chunk

    async def _prefill(
        self, sub: SubRequest, route: RouteRequest, decode: WorkerRecord
    ) -> tuple[WorkerRecord, pb.PrefillResponse]:
        failed: set[str] = set()
        last = "no prefill worker is alive"
        for attempt in range(self.config.max_attempts):
            candidates = [p for p in self.prefill_candidates(decode) if p.worker_id not in failed]
            if not candidates:
                break
            worker = await self.calls.choose("prefill", candidates, route)
            request = pb.PrefillRequest(
                request_id=attempt_id(sub.request_id, "p", attempt),
                token_ids=sub.prompt_token_ids,
                sampling=params_to_proto(sub.params),
            )
            span = attempt_span("prefill", worker, attempt, request.request_id)
            with tracing.ending(span):
                try:
                    with self.calls.tracked(worker) as channel, self.calls.queued(worker, sub):
                        answer = await pb_grpc.PrefillServiceStub(channel).Prefill(
                            request,
                            timeout=self.config.prefill_timeout_seconds,
                            metadata=self.calls.metadata + tracing.grpc_metadata(span),
                        )
                    sub.worker_ids.append(worker.worker_id)
                    span.set_attribute("pdserve.cached_tokens", answer.num_cached_tokens)
                    return worker, answer
                except grpc.aio.AioRpcError as exc:
                    tracing.set_error(span, f"{exc.code().name}: {exc.details()}")
                    last = self.calls.failed("prefill", worker, exc)
                    failed.add(worker.worker_id)
        raise APIError(503, f"prefill failed: {last}", retry_after=self.config.retry_after_seconds)

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
