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
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from common import tracing
from common.channels import ChannelPool
from common.prefill_client import PrefillClient
from common.sampling_params import SamplingParams, sequence_seed
from common.wire import params_to_proto, token_metadata
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.disaggregation import Decision, RequestFacts, make_disaggregation_policy
from router.errors import APIError
from router.metrics import RouterMetrics
from router.policies import PolicyContext, PrefixIndex, RouteRequest, RoutingPolicy, make_policy
from router.relay import Relay
from services.registry import ROLES, RegistryView, Role, WorkerRecord

log = logging.getLogger(__name__)

WorkerFilter = Callable[[WorkerRecord], str | None]  # None: the router may use it, else why not
# Codes after which another worker may well succeed; anything else is the request's own fault.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}


@dataclass
class Chunk:
    """New output of one of a request's ``n`` sequences."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list[tuple[int, float]]]  # per token: (token, logprob), sampled token first
    finish_reason: str | None = None


@dataclass
class SubRequest:
    """One prompt of an API request, as the workers see it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_cached_tokens: int = 0  # filled in: prompt tokens a worker's prefix cache already held
    worker_ids: list[str] = field(default_factory=list)  # filled in: who served it
    kv_source: str = ""  # filled in: pulled | recomputed | local | colocated
    timings: dict[str, float] = field(default_factory=dict)  # filled in: phase -> seconds


class MidStreamError(APIError):
    """A worker failed after the client already got part of the answer."""


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
        self.in_flight: Counter[str] = Counter()
        self.prefill_tokens: Counter[str] = Counter()  # worker id -> prompt tokens in flight
        # Calls open on each pool's workers: the requests this router has in that pool's hands.
        self.num_pool_requests: dict[Role, int] = dict.fromkeys(ROLES, 0)
        context = PolicyContext(view, self.in_flight, config.prefix_load_weight)
        assert context.prefixes is not None
        self.prefixes: PrefixIndex = context.prefixes
        self.disaggregation = make_disaggregation_policy(
            config.disaggregation, config.local_prefill_tokens, config.prefill_busy_tokens
        )
        self.policies: dict[Role, RoutingPolicy] = {
            "prefill": make_policy(config.prefill_policy, context),
            "decode": make_policy(config.decode_policy, context),
            "colocated": make_policy(config.colocated_policy, context),
        }
        self.channels = ChannelPool()
        self.prefill_client = PrefillClient(self.channels, config.cluster_token)
        self._background: set[asyncio.Task[None]] = set()
        self._metadata = token_metadata(config.cluster_token)

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
            decode = await self._choose("decode", self.decode_candidates(), route)
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
        queued = min(
            (self.prefill_tokens[p.worker_id] for p in self.prefill_candidates(decode)), default=0
        )
        facts = RequestFacts(
            len(sub.prompt_token_ids), cached * decode.fingerprint.block_size, queued
        )
        decision = self.disaggregation.decide(facts)
        self.metrics.disaggregation.labels(decision=decision.label, reason=decision.reason).inc()
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("pdserve.disaggregation", f"{decision.label}:{decision.reason}")
        self.prefixes.remember(decode.worker_id, hashes)  # it will cache them either way
        return decision

    async def _local(
        self, sub: SubRequest, route: RouteRequest, decode: WorkerRecord
    ) -> AsyncGenerator[Chunk, None]:
        """The decode worker computes the prompt itself (no KV transfer)."""
        request = pb.GenerateRequest(
            prompt_token_ids=sub.prompt_token_ids, sampling=params_to_proto(sub.params)
        )
        stream = self._stream_with_retries(
            "decode", sub, route, request, self.decode_candidates, first_choice=decode
        )
        async with aclosing(stream):
            async for chunk in stream:
                yield chunk

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
        stream = self._stream_with_retries(
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
                self._spawn(self.prefill_client.release(answer.kv, prefill.grpc_address))

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
            prefill = await self._choose("prefill", candidates, route)
            try:
                answer, kv, decoding = await self._prefill_streamed(
                    sub, route, prefill, decode, attempt
                )
            except grpc.aio.AioRpcError as exc:
                last = self._failed("prefill", prefill, exc)
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
                    self._spawn(self.prefill_client.release(kv, prefill.grpc_address))
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
            request_id=_attempt_id(sub.request_id, "p", attempt),
            token_ids=sub.prompt_token_ids,
            sampling=params_to_proto(sub.params),
        )
        span = _attempt_span("prefill", prefill, attempt, request.request_id)
        decoding: _Decoding | None = None
        kv: pb.KVHandle | None = None
        with tracing.ending(span):
            try:
                with self._tracked(prefill) as channel, self._queued(prefill, sub):
                    call = pb_grpc.PrefillServiceStub(channel).PrefillStream(
                        request,
                        timeout=self.config.prefill_timeout_seconds,
                        metadata=self._metadata + tracing.grpc_metadata(span),
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
        stream = self._stream_with_retries(
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
            logprobs=[_entries(answer.logprobs)] if sub.params.logprobs is not None else [],
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
        stream = self._stream_with_retries(
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
        stream = self._stream_with_retries(
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
            worker = await self._choose("prefill", candidates, route)
            request = pb.PrefillRequest(
                request_id=_attempt_id(sub.request_id, "p", attempt),
                token_ids=sub.prompt_token_ids,
                sampling=params_to_proto(sub.params),
            )
            span = _attempt_span("prefill", worker, attempt, request.request_id)
            with tracing.ending(span):
                try:
                    with self._tracked(worker) as channel, self._queued(worker, sub):
                        answer = await pb_grpc.PrefillServiceStub(channel).Prefill(
                            request,
                            timeout=self.config.prefill_timeout_seconds,
                            metadata=self._metadata + tracing.grpc_metadata(span),
                        )
                    sub.worker_ids.append(worker.worker_id)
                    span.set_attribute("pdserve.cached_tokens", answer.num_cached_tokens)
                    return worker, answer
                except grpc.aio.AioRpcError as exc:
                    tracing.set_error(span, f"{exc.code().name}: {exc.details()}")
                    last = self._failed("prefill", worker, exc)
                    failed.add(worker.worker_id)
        raise APIError(503, f"prefill failed: {last}", retry_after=self.config.retry_after_seconds)

    async def _stream_with_retries(
        self,
        pool: Role,
        sub: SubRequest,
        route: RouteRequest,
        request: pb.GenerateRequest,
        candidates_fn,  # type: ignore[no-untyped-def]
        first_choice: WorkerRecord | None = None,
        id_base: str = "",
        first_token_known: asyncio.Event | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """Generate on a worker of ``pool`` (``first_choice`` first, when it is still a
        candidate), moving to another one until the first chunk. Attempts are numbered after
        ``id_base`` (the request's id by default). A worker that answers ABORTED (its streamed
        pull failed before the first token came) is asked again once ``first_token_known``."""
        failed: set[str] = set()
        last = f"no {pool} worker is alive"
        deadline = time.monotonic() + self.config.request_timeout_seconds
        for attempt in range(self.config.max_attempts):
            if attempt and first_token_known is not None:
                await first_token_known.wait()  # the request carries it from then on
            candidates = [w for w in candidates_fn() if w.worker_id not in failed]
            if not candidates:
                break
            if first_choice is not None and first_choice in candidates:
                worker, first_choice = first_choice, None
            else:
                worker = await self._choose(pool, candidates, route)
            request.request_id = _attempt_id(id_base or sub.request_id, pool[0], attempt)
            span = _attempt_span(pool, worker, attempt, request.request_id)
            started, num_tokens = False, 0
            call = None
            with tracing.ending(span):
                try:
                    with self._tracked(worker) as channel:
                        call = pb_grpc.DecodeServiceStub(channel).Generate(
                            request,
                            timeout=max(1.0, deadline - time.monotonic()),
                            metadata=self._metadata + tracing.grpc_metadata(span),
                        )
                        async for message in call:
                            if not started:
                                started = True
                                sub.worker_ids.append(worker.worker_id)
                                _first_message(sub, pool, message)
                            num_tokens += len(message.token_ids)
                            yield _chunk(message, sub.params.logprobs is not None)
                    span.set_attribute("pdserve.output_tokens", num_tokens)
                    return
                except grpc.aio.AioRpcError as exc:
                    tracing.set_error(span, f"{exc.code().name}: {exc.details()}")
                    reason = self._failed(pool, worker, exc)
                    if started:
                        raise MidStreamError(
                            502, f"{pool} worker failed mid-stream: {reason}"
                        ) from exc
                    last = reason
                    if exc.code() != grpc.StatusCode.ABORTED:  # else the worker is fine
                        failed.add(worker.worker_id)
                        first_choice = None
                    else:
                        first_choice = worker
                finally:
                    if call is not None:
                        call.cancel()  # a no-op once finished; on client disconnect: abort there
        raise APIError(503, f"{pool} failed: {last}", retry_after=self.config.retry_after_seconds)

    # -- helpers -------------------------------------------------------------------------------

    async def _choose(
        self, pool: Role, candidates: list[WorkerRecord], route: RouteRequest
    ) -> WorkerRecord:
        policy = self.policies[pool]
        worker = await policy.choose(candidates, route)
        self.metrics.routing.labels(pool=pool, policy=policy.name).inc()
        return worker

    def _failed(self, pool: Role, worker: WorkerRecord, exc: grpc.aio.AioRpcError) -> str:
        """Classify a worker's failure: raise for the request's own errors, else describe it."""
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise APIError(400, details or "invalid request") from exc
        if code == grpc.StatusCode.UNAUTHENTICATED:
            log.error(
                "%s refused the router's cluster token: check PDSERVE_CLUSTER_TOKEN",
                worker.worker_id,
            )
        elif code not in RETRYABLE:
            raise APIError(500, f"{pool} worker error: {code.name}: {details}") from exc
        self.metrics.retries.labels(pool=pool, reason=code.name.lower()).inc()
        log.warning(
            "%s worker %s failed (%s: %s); trying another",
            pool,
            worker.worker_id,
            code.name,
            details,
        )
        return f"{worker.worker_id}: {code.name}: {details}"

    def _record(self, sub: SubRequest) -> None:
        """Count how ``sub`` got its KV and observe its phases."""
        if sub.kv_source:
            self.metrics.kv_sources.labels(source=sub.kv_source).inc()
        for phase, seconds in sub.timings.items():
            self.metrics.phase_seconds.labels(phase=phase).observe(seconds)

    @contextmanager
    def _queued(self, worker: WorkerRecord, sub: SubRequest) -> Iterator[None]:
        """``sub``'s prompt counts in the prefill worker's queue while its Prefill call runs."""
        tokens = len(sub.prompt_token_ids)
        self.prefill_tokens[worker.worker_id] += tokens
        try:
            yield
        finally:
            self.prefill_tokens[worker.worker_id] -= tokens
            if not self.prefill_tokens[worker.worker_id]:
                del self.prefill_tokens[worker.worker_id]

    @contextmanager
    def _tracked(self, worker: WorkerRecord) -> Iterator[grpc.aio.Channel]:
        """The worker's channel, kept open while the call runs; the call counts in the worker's
        in-flight load and its pool's. A request has at most one call open per pool: retries
        are sequential."""
        self.in_flight[worker.worker_id] += 1
        self.num_pool_requests[worker.role] += 1
        try:
            with self.channels.using(worker.grpc_address) as channel:
                yield channel
        finally:
            self.num_pool_requests[worker.role] -= 1
            self.in_flight[worker.worker_id] -= 1
            if not self.in_flight[worker.worker_id]:
                del self.in_flight[worker.worker_id]

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def forget_channels(self) -> None:
        """Close channels to addresses no worker in the view has any more and no call uses (a
        draining worker leaves the registry before its last streams end)."""
        await self.channels.prune(w.grpc_address for w in self.view.workers(include_draining=True))

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.channels.close()


def _attempt_span(pool: Role, worker: WorkerRecord, attempt: int, request_id: str) -> Span:
    """The client span of one call to ``worker`` (a child of the current span: the request's)."""
    return tracing.TRACER.start_span(
        f"router.{pool}",
        kind=SpanKind.CLIENT,
        attributes={
            "pdserve.request_id": request_id,
            "pdserve.worker_id": worker.worker_id,
            "pdserve.worker_address": worker.grpc_address,
            "pdserve.attempt": attempt,
        },
    )


def _attempt_id(request_id: str, pool: str, attempt: int) -> str:
    return f"{request_id}-{pool}{attempt}"


def _entries(message: pb.TokenLogprobs) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for e in message.entries]


def _first_message(sub: SubRequest, pool: Role, message: pb.GenerateChunk) -> None:
    """What the first chunk of a Generate stream says about the request's way to it."""
    t = message.timings
    if pool == "colocated":
        sub.num_cached_tokens = message.num_cached_tokens
        sub.kv_source = "colocated"
    elif not sub.kv_source:  # n > 1 after a finished sequence 0 keeps "pulled"
        sub.kv_source = message.kv_source
    if sub.kv_source in ("local", "colocated"):
        sub.num_cached_tokens = message.num_cached_tokens
        sub.timings.update(decode_queue=t.queue_s, decode_first_step=t.compute_s)
        return
    sub.timings.update(
        kv_transfer=t.transfer_s,
        kv_transfer_exposed=t.transfer_exposed_s,
        decode_queue=t.queue_s,
        decode_first_step=t.compute_s,
    )


def _chunk(message: pb.GenerateChunk, with_logprobs: bool) -> Chunk:
    return Chunk(
        index=message.index,
        text=message.text,
        token_ids=list(message.token_ids),
        logprobs=[_entries(lp) for lp in message.logprobs] if with_logprobs else [],
        finish_reason=message.finish_reason or None,
    )
