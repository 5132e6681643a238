"""The one admission step every API request passes, in this order:

1. at the edge (`router.edge`), before the body is parsed: the client (its API key, else its
   address; a 401 for a wrong key), the body's size (413) and nesting depth (400);
2. in the handler, before any tokenization: the request's shape (model, fan-out, stop strings,
   messages: `router.limits`) and a cheap bound on its text (`check_text`): a text longer than
   the context could hold even at the tokenizer's longest token is a 400 at once;
3. tokenization and chat templating, off the event loop, in a pool of their own
   (``--tokenizer-threads``), shared fairly among clients (one prompt per turn);
4. the token limits (`router.limits.check_tokens`, the context length);
5. the predicted wait (`LoadEstimator`): a request that would wait longer than
   ``--max-queue-wait`` for its first token is refused at once with a 503 and Retry-After;
6. the concurrency slots, shared fairly among clients (`FairSlots`), waiting at most what is
   left of ``--max-queue-wait``.

What a request can cost before it is admitted is bounded: its body (``--max-body-bytes``), two
JSON parses of it, and the tokenization of at most ``--max-model-len`` x (the longest token's
characters) characters per prompt, each prompt taking its turn in the tokenizer pool. Every
refusal is counted in ``pdserve_router_rejected_total`` by reason (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

from router import limits
from router.clients import Client
from router.config import RouterConfig
from router.errors import APIError
from router.fair_slots import FairSlots, Refused
from router.metrics import RouterMetrics

T = TypeVar("T")
RATE_WINDOW_SECONDS = 30.0  # of busy time: how far back the start rate is measured
MIN_RATE_SAMPLE_SECONDS = 1.0
TOKENIZER_NICENESS = 0  # of busy time: less, and the rate is not known yet


class LoadEstimator:
    """How long a new sub-request would wait for its first token: the sub-requests ahead of it
    (waiting for a slot, or admitted and not yet started) over the rate at which sub-requests
    started while some were waiting (over the last `RATE_WINDOW_SECONDS` of such busy time)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.not_started = 0
        self._busy = 0.0  # seconds with some sub-request not started
        self._changed = clock()
        self._num_started = 0
        self._samples: deque[tuple[float, int]] = deque()  # (busy, started) at each start

    def admitted(self, slots: int) -> None:
        self._advance()
        self.not_started += slots

    def left(self, slots: int, started: bool) -> None:
        """``slots`` sub-requests got their first token (``started``) or ended without one."""
        self._advance()
        self.not_started -= slots
        if started:
            self._num_started += slots
            self._samples.append((self._busy, self._num_started))
            while self._samples and self._samples[0][0] < self._busy - RATE_WINDOW_SECONDS:
                self._samples.popleft()

    def rate(self) -> float | None:
        """Sub-requests started per busy second; None until measured."""
        self._advance()
        if len(self._samples) < 2:
            return None
        (busy0, started0), (busy1, started1) = self._samples[0], self._samples[-1]
        if busy1 - busy0 < MIN_RATE_SAMPLE_SECONDS:
            return None
        return (started1 - started0) / (busy1 - busy0)

    def predicted_wait(self, ahead: int) -> float:
        """Seconds until ``ahead`` more sub-requests start (0 while the rate is unknown)."""
        rate = self.rate()
        return 0.0 if rate is None or rate <= 0 else (self.not_started + ahead) / rate

    def _advance(self) -> None:
        now = self.clock()
        if self.not_started > 0:
            self._busy += now - self._changed
        self._changed = now


class Admission:
    """The router's admission state (one per process): its tokenizer pool, its slots and its
    load estimate. Handlers call the steps in order; each either passes or raises an APIError
    (counted by reason)."""

    def __init__(self, config: RouterConfig, longest_token_chars: int, metrics: RouterMetrics):
        self.config = config
        self.metrics = metrics
        self.chars_per_token = max(1, longest_token_chars)
        self.tokenizer_turns = FairSlots(config.tokenizer_threads, config.max_queued_requests)
        self.slots = FairSlots(
            config.max_concurrency, config.max_queued_requests, config.max_client_share
        )
        self.load = LoadEstimator()
        # Threads suffice: the tokenizer lets go of the GIL while it works (Tokenizer.encode).
        self._executor = ThreadPoolExecutor(config.tokenizer_threads, "pdserve-tokenize")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- step 2: the text's size, before tokenizing ----------------------------------------------

    def check_text(self, lengths: list[int], max_model_len: int, param: str) -> None:
        """A 400 when a text could not fit whatever it tokenizes to: each prompt within the
        context (one token left to generate), all together within the request's token limit."""
        for chars in lengths:
            self._check_chars(chars, max_model_len - 1, "the model's context length", param)
        self._check_chars(
            sum(lengths),
            self.config.max_request_prompt_tokens,
            "--max-request-prompt-tokens",
            param,
        )

    def _check_chars(self, chars: int, tokens: int, limit_name: str, param: str) -> None:
        most = tokens * self.chars_per_token
        if chars > most:
            self._count("text_too_long")
            raise APIError(
                400,
                f"the prompt text has {chars} characters; no text over {most} characters fits "
                f"{tokens} tokens ({limit_name}) at {self.chars_per_token} characters for this "
                "model's longest token",
                param=param,
                code="context_length_exceeded",
            )

    def check_shape(
        self,
        client: Client,
        num_prompts: int,
        n: int,
        stop: str | list[str] | None,
        num_messages: int = 0,
    ) -> None:
        with self._counted("over_limit"):
            limits.check_fan_out(self.config, num_prompts, n)
            limits.check_stops(self.config, stop)
            limits.check_messages(self.config, num_messages)
            cap = self.slots.cap(client)
            if num_prompts * n > cap:  # it could never run, however long it waited
                raise limits.refuse(
                    "the number of sub-requests (prompts x n)",
                    num_prompts * n,
                    cap,
                    "a client's share: --max-client-share x its key's weight x --max-concurrency",
                    "n" if n > 1 else "prompt",
                )

    # -- step 3: tokenization, off the event loop ------------------------------------------------

    async def run_tokenizer(
        self, client: Client, deadline: float, work: Callable[..., T], *args: Any
    ) -> T:
        """``work(*args)`` in the tokenizer pool once it is ``client``'s turn."""
        try:
            await self.tokenizer_turns.acquire(client, 1, deadline - time.monotonic())
        except Refused as refused:
            raise self._refusal(refused, "tokenizer", client, 1) from None
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, work, *args)
        finally:
            self.tokenizer_turns.release(client, 1)

    # -- step 4: the token limits -----------------------------------------------------------------

    def check_tokens(
        self, prompt_lens: list[int], max_tokens: list[int], n: int, param: str
    ) -> None:
        with self._counted("over_limit"):
            limits.check_tokens(self.config, prompt_lens, max_tokens, n, param)

    # -- steps 5 and 6: the predicted wait, then the slots ---------------------------------------

    @asynccontextmanager
    async def admitted(self, client: Client, slots: int, deadline: float) -> AsyncIterator[Ticket]:
        """Holds ``slots`` concurrency slots for ``client`` while the request runs."""
        await self._take_slots(client, slots, deadline)
        ticket = Ticket(self.load, slots)
        try:
            yield ticket
        finally:
            self.slots.release(client, slots)
            self.metrics.in_flight.dec(slots)
            ticket.end()

    async def _take_slots(self, client: Client, slots: int, deadline: float) -> None:
        predicted = self.load.predicted_wait(self.slots.waiting_slots + slots)
        self.metrics.predicted_wait.set(predicted)
        limit = self.config.max_queue_wait_seconds
        if limit > 0 and predicted > limit:
            self._count("predicted_wait")
            raise APIError(
                503,
                f"the router predicts a wait of {predicted:.0f} s before this request starts, "
                f"over its limit of {limit:g} s (--max-queue-wait): retry later",
                retry_after=self._retry_after(predicted - limit),
            )
        waited = time.monotonic()
        timeout = deadline - waited if limit > 0 else 0.0
        try:
            await self.slots.acquire(client, slots, timeout)
        except Refused as refused:
            raise self._refusal(refused, "slots", client, slots) from None
        self.metrics.queue_wait_seconds.observe(time.monotonic() - waited)
        self.metrics.in_flight.inc(slots)
        self.load.admitted(slots)

    # -- refusals ---------------------------------------------------------------------------------

    def _refusal(self, refused: Refused, pool: str, client: Client, slots: int) -> APIError:
        self._count(f"{pool}_{refused.reason}")
        retry = self.config.retry_after_seconds
        if pool == "slots" and refused.reason == "full":
            return APIError(
                429,
                f"the router has {self.slots.in_use} sub-requests in flight and this request "
                f"needs {slots} more; its limit is {self.config.max_concurrency}: retry later",
                retry_after=retry,
            )
        if refused.reason == "client_share":
            return APIError(
                429,
                f"this client has {self.slots.held(client)} sub-requests in flight and this "
                f"request needs {slots} more; a client's share is {self.slots.cap(client)} "
                "(--max-client-share): retry later",
                retry_after=retry,
            )
        if refused.reason == "queue_full":
            return APIError(
                429,
                f"the router's queue for {pool} is full ({self.config.max_queued_requests} "
                "requests, --max-queued-requests) and this client waits with more requests "
                "than any other: retry later",
                retry_after=retry,
            )
        return APIError(
            503,
            f"no {pool} came free within {self.config.max_queue_wait_seconds:g} s "
            "(--max-queue-wait): retry later",
            retry_after=retry,
        )

    @contextmanager
    def _counted(self, reason: str) -> Iterator[None]:
        try:
            yield
        except APIError:
            self._count(reason)
            raise

    def _retry_after(self, seconds: float) -> int:
        return max(self.config.retry_after_seconds, math.ceil(seconds))

    def _count(self, reason: str) -> None:
        self.metrics.rejected.labels(reason=reason).inc()


class Ticket:
    """An admitted request's place in the load estimate: waiting until its first token."""

    def __init__(self, load: LoadEstimator, slots: int):
        self.load = load
        self.slots = slots
        self.started = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.load.left(self.slots, started=True)

    def end(self) -> None:
        if not self.started:  # ended (finished, failed, cancelled) before its first token
            self.started = True
            self.load.left(self.slots, started=False)
