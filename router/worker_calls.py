"""The router's one owner of calls to workers: ``WorkerCalls`` builds every request a worker
gets (``generate_request``, ``prefill_request``; Release goes through ``PrefillClient``), gives
every call a deadline and runs the one retry loop (``Attempts``). ``router/orchestrator.py``
composes its flows (local, disaggregated streamed or whole, colocated) from these calls. Each
call counts in the worker's and its pool's load and is a client span (``router.prefill``,
``router.decode``, ``router.colocated``) whose context goes to the worker in the call's
metadata, next to the cluster token.

Deadlines. A sub-request has one deadline, ``request_timeout_seconds`` after its first call
(``SubRequest.deadline``). Every call gets the time left of it as its gRPC timeout, a Prefill or
PrefillStream call at most ``prefill_timeout_seconds``; the wait of a decode retry for the
prefill's first token is bounded by it too. Once it has passed, the request ends with 504.
Release / RenewLease have their own short timeout (``common/prefill_client.py``).

Retries. A call that fails before it produced output for the request is made again, up to
``max_attempts`` calls per pool and flow, on another worker of the pool (the flow's first choice
first), unless the status says otherwise (below). A decode call on a streaming handle is made
again only once the prefill's first token is known: that request carries it, so the worker can
compute the prompt itself should its pull fail again. Once a call produced output (a stream's
first chunk) it is never retried: its failure is a ``MidStreamError`` (502). No worker left or
no attempt left: 503 with Retry-After. A prefill handle no decode worker took (every decode
attempt failed first, the first token ended the sequence, the client left) is released by the
router at the address it called (``release_untaken``); the lease is the backstop.

What a worker's status means to the router (``retry_rule``; the worker's side of each status is
in ``protos/pdserve.proto``):

    status               meaning                                       the router
    UNAVAILABLE          draining or full, unreachable, crashed; a     another worker
                         decode worker's pull failed and it could not
                         recompute
    RESOURCE_EXHAUSTED   gRPC's own limits on the worker               another worker
    ABORTED              the worker is fine, the request was aborted   the same worker again,
                         and nothing of it is held: a decode worker's  not counted as failed; a
                         streamed pull failed before the first token   decode call once the first
                         was known; a prefill worker's pin ended       token is known, carrying it
                         while it computed, or its engine step failed
    DEADLINE_EXCEEDED    the call's timeout passed                     another worker (504 if the
                                                                       request's time is out)
    CANCELLED            the worker ended the call                     another worker
    INTERNAL, UNKNOWN    the worker failed on this call                another worker
    UNAUTHENTICATED      the worker refused the cluster token          logged as an error,
                                                                       another worker
    INVALID_ARGUMENT     the request itself is wrong                   400, no retry
    any other            a fault of the router or the worker           500, no retry

What a flow hands back to the gateway (``Chunk``, ``SubRequest``) is in ``router/chunks.py``.

No tensors here: token ids and text only.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from types import TracebackType

import grpc
from opentelemetry.trace import Span, SpanKind

from common import tracing
from common.channels import ChannelPool
from common.prefill_client import PrefillClient, renew_delay
from common.sampling_params import SamplingParams
from common.wire import params_to_proto, token_metadata
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.chunks import Chunk, SubRequest, chunk_of, first_message
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import RouterMetrics
from router.policies import RouteRequest, RoutingPolicy
from router.relay import Relay
from services.registry import ROLES, Role, WorkerRecord

log = logging.getLogger(__name__)

Candidates = Callable[[], list[WorkerRecord]]  # a pool's workers the call may go to, now


class Retry(enum.Enum):
    """What the router does after a call failed before producing output (the table above)."""

    ANOTHER_WORKER = "another worker"
    SAME_WORKER = "the same worker again"
    BAD_REQUEST = "400, no retry"
    WORKER_ERROR = "500, no retry"


# Codes after which another worker may well succeed; anything else is the request's own fault.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNAUTHENTICATED,  # this worker's token is not ours: another may be
    }
)


def retry_rule(code: grpc.StatusCode) -> Retry:
    """The retry policy: what a call to a worker that failed with ``code`` before producing
    output leads to."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return Retry.BAD_REQUEST
    if code == grpc.StatusCode.ABORTED:
        return Retry.SAME_WORKER
    if code in RETRYABLE:
        return Retry.ANOTHER_WORKER
    return Retry.WORKER_ERROR


@dataclass
class Handoff:
    """A prefill worker's KV handle on its way to a decode worker: who pinned it (Release goes
    to the address the router called), the prefill's answer once in, whether a decode worker
    took it (produced output: releasing it is that worker's job then)."""

    kv: pb.KVHandle
    prefill: WorkerRecord
    answer: pb.PrefillResponse | None = None
    taken: bool = False
    known: asyncio.Event = field(default_factory=asyncio.Event)  # set with ``answer``

    def know(self, answer: pb.PrefillResponse) -> None:
        """The prefill answered: decode calls from now on carry its first token."""
        self.answer = answer
        self.known.set()


class MidStreamError(APIError):
    """A worker failed after the client already got part of the answer."""


def generate_request(
    request_id: str,
    sub: SubRequest,
    params: SamplingParams | None = None,
    handoff: Handoff | None = None,
) -> pb.GenerateRequest:
    """A Generate call's request: ``sub``'s prompt (with ``params`` instead of its own when
    given), and the handle to pull with the first token once known. The prompt's logprobs
    are asked of the worker that computes the prompt only: with a handle, the prefill worker."""
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=sub.prompt_token_ids,
        sampling=params_to_proto(params or sub.params),
        cache_salt=sub.cache_salt or "",
    )
    if handoff is not None:
        request.sampling.ClearField("prompt_logprobs")
        request.kv.CopyFrom(handoff.kv)
        if handoff.answer is not None:
            request.first_token = handoff.answer.first_token
            request.first_logprobs.CopyFrom(handoff.answer.logprobs)
    return request


def prefill_request(request_id: str, sub: SubRequest) -> pb.PrefillRequest:
    """A Prefill or PrefillStream call's request."""
    return pb.PrefillRequest(
        request_id=request_id,
        token_ids=sub.prompt_token_ids,
        sampling=params_to_proto(sub.params),
        cache_salt=sub.cache_salt or "",
    )


@dataclass
class Attempt(AbstractContextManager["Attempt"]):
    """One call of a retry loop: its worker, id, client span and timeout. The call runs in
    ``with attempt:``, which ends the span; a failure another attempt may mend is swallowed
    there (the loop goes on), any other raises."""

    retries: Attempts
    worker: WorkerRecord
    number: int
    request_id: str
    span: Span
    timeout: float
    started: bool = False  # the call produced output: never retried from then on

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self.retries.calls.metadata + tracing.grpc_metadata(self.span)

    def __enter__(self) -> Attempt:
        self._ending = tracing.ending(self.span)
        self._ending.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if not isinstance(exc, grpc.aio.AioRpcError):
            return bool(self._ending.__exit__(exc_type, exc, tb))
        tracing.set_error(self.span, f"{exc.code().name}: {exc.details()}")
        try:
            self.retries.failed(self, exc)
        except BaseException as error:
            self._ending.__exit__(type(error), error, error.__traceback__)
            raise
        self._ending.__exit__(None, None, None)
        return True


class Attempts:
    """The retry loop, written once: ``async for attempt in Attempts(...): with attempt: ...``
    hands out calls until one succeeds (the body returns), then ``exhausted()`` says why none
    did. Attempts are numbered after ``id_base`` (the request's id by default)."""

    def __init__(
        self,
        calls: WorkerCalls,
        pool: Role,
        sub: SubRequest,
        route: RouteRequest,
        candidates: Candidates,
        first_choice: WorkerRecord | None = None,
        id_base: str = "",
        handoff: Handoff | None = None,
    ):
        self.calls = calls
        self.pool = pool
        self.sub = sub
        self.route = route
        self.candidates = candidates
        self.next_choice = first_choice
        self.id_base = id_base or sub.request_id
        self.handoff = handoff
        self.number = -1
        self.failed_ids: set[str] = set()
        self.last = f"no {pool} worker is alive"

    def __aiter__(self) -> Attempts:
        return self

    async def __anext__(self) -> Attempt:
        self.number += 1
        if self.number >= self.calls.config.max_attempts:
            raise StopAsyncIteration
        if self.number and self.handoff is not None:  # the next request carries the first token
            await self._first_token()
        timeout = self.calls.time_left(self.sub)
        if timeout <= 0:
            raise self.timed_out()
        candidates = [w for w in self.candidates() if w.worker_id not in self.failed_ids]
        if not candidates:
            raise StopAsyncIteration
        # The flow's choice while it is still a candidate, by id: its record may be from an
        # earlier refresh, and comparing whole records costs microseconds per worker.
        wanted = self.next_choice.worker_id if self.next_choice is not None else None
        worker = next((w for w in candidates if w.worker_id == wanted), None)
        if worker is None:
            worker = await self.calls.choose(self.pool, candidates, self.route)
        self.next_choice = None
        timeout = self.calls.time_left(self.sub)  # choosing may have taken some
        if self.pool == "prefill":
            timeout = min(timeout, self.calls.config.prefill_timeout_seconds)
        request_id = attempt_id(self.id_base, self.pool[0], self.number)
        span = attempt_span(self.pool, worker, self.number, request_id)
        return Attempt(self, worker, self.number, request_id, span, timeout)

    async def _first_token(self) -> None:
        """Wait for the prefill's answer, renewing the handle's lease meanwhile: a decode worker
        that answered ABORTED left the blocks pinned for this retry, and a prefill whose lease
        runs out while it computes is aborted."""
        handoff = self.handoff
        assert handoff is not None
        expires_ms = handoff.kv.lease_expires_unix_ms
        while not handoff.known.is_set():
            left = self.calls.time_left(self.sub)
            if left <= 0:
                raise self.timed_out()
            try:
                await asyncio.wait_for(handoff.known.wait(), min(left, renew_delay(expires_ms)))
            except TimeoutError:
                renewed = await self.calls.prefill_client.renew_lease(handoff.kv)
                expires_ms = renewed or expires_ms  # None: the stream's own end will come

    def failed(self, attempt: Attempt, exc: grpc.aio.AioRpcError) -> None:
        """``attempt``'s call failed: raise unless another attempt may follow (the rule)."""
        reason = self.calls.classify(self.pool, attempt.worker, exc)
        if attempt.started:
            raise MidStreamError(502, f"{self.pool} worker failed mid-stream: {reason}") from exc
        self.last = reason
        if retry_rule(exc.code()) is Retry.SAME_WORKER:
            self.next_choice = attempt.worker  # it is fine: ask it again (decode: with the token)
        else:
            self.failed_ids.add(attempt.worker.worker_id)

    def exhausted(self) -> APIError:
        return APIError(
            503,
            f"{self.pool} failed: {self.last}",
            retry_after=self.calls.config.retry_after_seconds,
        )

    def timed_out(self) -> APIError:
        seconds = self.calls.config.request_timeout_seconds
        return APIError(504, f"the request took over {seconds:g} s ({self.pool}: {self.last})")


class WorkerCalls:
    """The router's calls to its workers: requests, deadlines, retries, channels, load."""

    def __init__(
        self, config: RouterConfig, metrics: RouterMetrics, policies: dict[Role, RoutingPolicy]
    ):
        self.config = config
        self.metrics = metrics
        self.policies = policies
        self.channels = ChannelPool()
        self.prefill_client = PrefillClient(self.channels, config.cluster_token)
        self.metadata = token_metadata(config.cluster_token)
        self.in_flight: Counter[str] = Counter()
        # worker id -> prompt tokens it has yet to compute, from this router (prefill workers, and
        # decode workers computing prompts themselves)
        self.prefill_tokens: Counter[str] = Counter()
        # Calls open on each pool's workers: the requests this router has in that pool's hands.
        self.num_pool_requests: dict[Role, int] = dict.fromkeys(ROLES, 0)
        self._background: set[asyncio.Task[None]] = set()

    async def choose(
        self, pool: Role, candidates: list[WorkerRecord], route: RouteRequest
    ) -> WorkerRecord:
        policy = self.policies[pool]
        worker = await policy.choose(candidates, route)
        self.metrics.routing.labels(pool=pool, policy=policy.name).inc()
        return worker

    def time_left(self, sub: SubRequest) -> float:
        """Seconds left of ``sub``'s deadline (which starts with its first call)."""
        now = time.monotonic()
        if sub.deadline is None:
            sub.deadline = now + self.config.request_timeout_seconds
        return sub.deadline - now

    # -- the calls -----------------------------------------------------------------------------

    async def generate(
        self,
        pool: Role,
        sub: SubRequest,
        route: RouteRequest,
        candidates: Candidates,
        first_choice: WorkerRecord | None = None,
        params: SamplingParams | None = None,
        handoff: Handoff | None = None,
        id_base: str = "",
    ) -> AsyncGenerator[Chunk, None]:
        """Generate on a worker of ``pool`` (``first_choice`` first, when it is a candidate),
        moving to another one until the first chunk; with ``handoff``, the worker pulls the
        prompt's KV from it."""
        attempts = Attempts(self, pool, sub, route, candidates, first_choice, id_base, handoff)
        async for attempt in attempts:
            request = generate_request(attempt.request_id, sub, params, handoff)
            with attempt, self.tracked(attempt.worker) as channel:
                call = pb_grpc.DecodeServiceStub(channel).Generate(
                    request, timeout=attempt.timeout, metadata=attempt.metadata
                )
                num_tokens = 0
                try:
                    async for message in call:
                        if not attempt.started:
                            attempt.started = True
                            if handoff is not None:
                                handoff.taken = True
                            sub.worker_ids.append(attempt.worker.worker_id)
                            first_message(sub, pool, message)
                        num_tokens += len(message.token_ids)
                        yield chunk_of(message, sub.params.logprobs is not None)
                finally:
                    call.cancel()  # a no-op once finished; on client disconnect: abort there
                attempt.span.set_attribute("pdserve.output_tokens", num_tokens)
                return
        raise attempts.exhausted()

    async def prefill(
        self, sub: SubRequest, route: RouteRequest, candidates: Candidates
    ) -> Handoff:
        """Prefill on a prefill worker, moving to another one until one answers."""
        attempts = Attempts(self, "prefill", sub, route, candidates)
        async for attempt in attempts:
            worker = attempt.worker
            with attempt, self.tracked(worker) as channel, self.queued(worker, sub):
                answer = await pb_grpc.PrefillServiceStub(channel).Prefill(
                    prefill_request(attempt.request_id, sub),
                    timeout=attempt.timeout,
                    metadata=attempt.metadata,
                )
                sub.worker_ids.append(worker.worker_id)
                attempt.span.set_attribute("pdserve.cached_tokens", answer.num_cached_tokens)
                handoff = Handoff(answer.kv, worker)
                handoff.know(answer)
                return handoff
        raise attempts.exhausted()

    async def prefill_streamed(
        self,
        sub: SubRequest,
        route: RouteRequest,
        candidates: Candidates,
        start_decoding: Callable[[Handoff, str], Relay[Chunk]],
    ) -> tuple[pb.PrefillResponse, Handoff, Relay[Chunk]]:
        """PrefillStream on a prefill worker, moving to another one until one answers: the
        decode call starts (``start_decoding``, given the handle and the prefill call's id) as
        soon as the handle comes, and is closed when that prefill call fails."""
        attempts = Attempts(self, "prefill", sub, route, candidates)
        async for attempt in attempts:
            worker = attempt.worker
            with attempt, self.tracked(worker) as channel, self.queued(worker, sub):
                call = pb_grpc.PrefillServiceStub(channel).PrefillStream(
                    prefill_request(attempt.request_id, sub),
                    timeout=attempt.timeout,
                    metadata=attempt.metadata,
                )
                return await self._read_prefill_stream(sub, attempt, call, start_decoding)
        raise attempts.exhausted()

    async def _read_prefill_stream(
        self,
        sub: SubRequest,
        attempt: Attempt,
        call: grpc.aio.UnaryStreamCall,
        start_decoding: Callable[[Handoff, str], Relay[Chunk]],
    ) -> tuple[pb.PrefillResponse, Handoff, Relay[Chunk]]:
        handoff: Handoff | None = None
        relay: Relay[Chunk] | None = None
        try:
            async for event in call:
                if event.HasField("kv") and relay is None:
                    handoff = Handoff(event.kv, attempt.worker)
                    relay = start_decoding(handoff, attempt.request_id)
                elif event.HasField("done") and relay is not None:
                    assert handoff is not None
                    sub.worker_ids.append(attempt.worker.worker_id)
                    attempt.span.set_attribute(
                        "pdserve.cached_tokens", event.done.num_cached_tokens
                    )
                    return event.done, handoff, relay
            raise APIError(502, f"{attempt.worker.worker_id} ended PrefillStream without an answer")
        except BaseException:
            if relay is not None:
                await relay.close()
            raise
        finally:
            call.cancel()  # a no-op once finished

    def release_untaken(self, handoff: Handoff) -> None:
        """Release ``handoff``'s blocks unless a decode worker took them (in the background;
        the lease frees them should the call be lost)."""
        if handoff.taken or not handoff.kv.request_id:  # taken, or nothing was pinned
            return
        # The address the router called, not one the answer names.
        self.spawn(self.prefill_client.release(handoff.kv, handoff.prefill.grpc_address))

    # -- helpers -------------------------------------------------------------------------------

    def classify(self, pool: Role, worker: WorkerRecord, exc: grpc.aio.AioRpcError) -> str:
        """Classify a worker's failure by ``retry_rule``: raise for those no retry mends, else
        count and describe it."""
        code, details = exc.code(), exc.details() or ""
        rule = retry_rule(code)
        if rule is Retry.BAD_REQUEST:
            raise APIError(400, details or "invalid request") from exc
        if rule is Retry.WORKER_ERROR:
            raise APIError(500, f"{pool} worker error: {code.name}: {details}") from exc
        if code == grpc.StatusCode.UNAUTHENTICATED:
            log.error(
                "%s refused the router's cluster token: check PDSERVE_CLUSTER_TOKEN",
                worker.worker_id,
            )
        self.metrics.retries.labels(pool=pool, reason=code.name.lower()).inc()
        log.warning(
            "%s worker %s failed (%s: %s); trying %s",
            pool,
            worker.worker_id,
            code.name,
            details,
            rule.value,
        )
        return f"{worker.worker_id}: {code.name}: {details}"

    @contextmanager
    def queued(self, worker: WorkerRecord, sub: SubRequest) -> Iterator[None]:
        """``sub``'s prompt counts in the prefill worker's queue while its Prefill call runs."""
        self.add_prefill_tokens(worker, len(sub.prompt_token_ids))
        try:
            yield
        finally:
            self.add_prefill_tokens(worker, -len(sub.prompt_token_ids))

    def add_prefill_tokens(self, worker: WorkerRecord, tokens: int) -> None:
        """Count ``tokens`` more (or fewer) prompt tokens in ``worker``'s prefill queue: a
        prefill worker's Prefill calls, or the prompts a decode worker computes itself."""
        self.prefill_tokens[worker.worker_id] += tokens
        if not self.prefill_tokens[worker.worker_id]:
            del self.prefill_tokens[worker.worker_id]

    @contextmanager
    def tracked(self, worker: WorkerRecord) -> Iterator[grpc.aio.Channel]:
        """The worker's channel, kept open while the call runs; the call counts in the worker's
        in-flight load and its pool's. A request has at most one call open per pool: retries
        are sequential."""
        self.in_flight[worker.worker_id] += 1
        self.num_pool_requests[worker.role] += 1
        try:
            with self.channels.using(worker.grpc_address, worker.worker_id) as channel:
                yield channel
        finally:
            self.num_pool_requests[worker.role] -= 1
            self.in_flight[worker.worker_id] -= 1
            if not self.in_flight[worker.worker_id]:
                del self.in_flight[worker.worker_id]

    def spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def forget_channels(self, addresses: Iterable[str]) -> None:
        """Close channels to addresses not in ``addresses`` that no call uses."""
        await self.channels.prune(addresses)

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.channels.close()


def attempt_span(pool: Role, worker: WorkerRecord, attempt: int, request_id: str) -> Span:
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


def attempt_id(request_id: str, pool: str, attempt: int) -> str:
    return f"{request_id}-{pool}{attempt}"
