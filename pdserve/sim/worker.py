"""One simulated worker: a continuous-batching scheduler over a block pool, timed by a profile.

The state of a request on a worker is a few counters (as in the real engine's ``Sequence``):
its prompt length, how many prompt tokens are computed, how many tokens it has produced, and how
many KV blocks it holds. Lifecycle on a worker::

    waiting -> (blocks for its prompt) admitted -> [pulling ->] computing its prompt in chunks
            -> decoding, one token per step -> finished (blocks freed)

A prefill worker stops after the prompt: its first token is sampled there and its blocks stay
pinned until the decode worker has pulled them (or the lease expires). A pulled request on a
decode worker holds its blocks from admission, pulls (the cluster times the link), then decodes.

One rule schedules a step (vLLM v1's and nano-vllm's): running decodes take one token each, then
prompts take chunks from what is left of ``max_num_batched_tokens``. With ``prefill_first``
(vLLM v0's rule) a step with prompts to compute carries only them, and decodes wait. A decode
that needs a new block when none is free preempts the newest running request (its blocks freed,
its prompt recomputed later), as the real scheduler does. The step lasts what the profile says
for what is in it; its tokens appear at its end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.sim.timing import WorkerTiming


@dataclass(eq=False)  # identity: a request is in one queue once
class SimRequest:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    num_computed: int = 0  # context tokens whose KV this worker holds
    num_to_compute: int = 0  # context to compute before decoding (the prompt; after a
    # preemption, the prompt and the tokens produced so far)
    num_blocks: int = 0  # blocks held on the current worker
    token_times: list[float] = field(default_factory=list)
    route: str = ""  # "colocated", "local" (on its decode worker) or "remote"
    decision: str = ""  # the disaggregation policy's "label:reason" ("local:short", ...)
    kv_source: str = ""  # how the decode side got the KV: computed, pulled, recomputed
    needs_pull: bool = False  # on its decode worker, its KV to come from the prefill worker
    pulling: bool = False  # admitted on its decode worker, its KV on the link
    handle_taken: bool = False  # the decode worker began pulling within the lease
    answered: bool = False  # its first token is out (the router's local-prompt count)
    prefill_worker: int = -1
    decode_worker: int = -1

    def __post_init__(self) -> None:
        self.num_to_compute = self.num_to_compute or self.prompt_tokens

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= self.num_to_compute

    @property
    def is_finished(self) -> bool:
        return len(self.token_times) >= self.output_tokens

    @property
    def context(self) -> int:
        return self.prompt_tokens + len(self.token_times)


@dataclass
class StepPlan:
    """What one step computes: prompt chunks and decoding requests."""

    chunks: list[tuple[SimRequest, int, int]]  # (request, start, tokens)
    decodes: list[SimRequest]

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.decodes


class SimWorker:
    """A worker of one role (``prefill``, ``decode`` or ``colocated``); see the module doc."""

    def __init__(
        self, worker_id: int, role: str, timing: WorkerTiming, prompt_cap: int | None = None
    ):
        """``prompt_cap``: the prompt tokens of a step beside decodes, at most (the engine's
        ``max_prompt_tokens_beside_decodes``; None: what the budget leaves)."""
        self.worker_id = worker_id
        self.role = role
        self.timing = timing
        self.prompt_cap = prompt_cap
        self.num_free_blocks = timing.num_blocks
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy_until = -1.0  # the end of the step in progress (< now: idle)
        self.in_flight = 0  # requests routed here and not done here (the router's load)
        self.local_prompt_tokens = 0  # prompts it computes for the router, not yet answered
        self.num_preempted = 0

    # -- the pool (the scheduler asks, the pool answers) ----------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, request: SimRequest, num_blocks: int) -> None:
        assert self.can_allocate(num_blocks)
        self.num_free_blocks -= num_blocks
        request.num_blocks += num_blocks

    def free(self, request: SimRequest) -> None:
        self.num_free_blocks += request.num_blocks
        request.num_blocks = 0
        assert self.num_free_blocks <= self.timing.num_blocks

    # -- scheduling -----------------------------------------------------------------------------

    def admit(self) -> list[SimRequest]:
        """Waiting requests that now get their prompt's blocks (FIFO: the head blocks the rest,
        as a full pool makes the real scheduler wait). Returns those that must pull their KV."""
        to_pull = []
        while self.waiting and len(self.running) < self.timing.max_num_seqs:
            request = self.waiting[0]
            needed = self.timing.blocks_for(request.prompt_tokens + 1)
            if not self.can_allocate(needed):
                break
            self.waiting.popleft()
            self.allocate(request, needed)
            self.running.append(request)
            if request.needs_pull:
                request.pulling = True
                to_pull.append(request)
        return to_pull

    def plan_step(self) -> StepPlan:
        """Decodes first (one token each, a block when one fills), then prompt chunks. With
        ``timing.prefill_first`` (vLLM v0's scheduler) a step with prompts has no decodes."""
        budget = self.timing.max_num_batched_tokens
        if self.timing.prefill_first:
            chunks = self.plan_chunks(budget)
            if chunks:
                return StepPlan(chunks, [])
        decodes: list[SimRequest] = []
        block_size = self.timing.block_size
        prefill_role = self.role == "prefill"
        for request in list(self.running):
            if prefill_role or request.pulling or not request.token_times:
                continue
            if request.num_computed < request.num_to_compute:
                continue  # recomputing its context after a preemption
            if request.num_blocks * block_size <= request.context and not self.make_room(request):
                continue  # no room yet, or it was itself preempted
            decodes.append(request)
        room = budget - len(decodes)
        if decodes and self.prompt_cap is not None:
            room = min(room, self.prompt_cap)
        return StepPlan(self.plan_chunks(room), decodes)

    def plan_chunks(self, budget: int) -> list[tuple[SimRequest, int, int]]:
        """Prompt chunks (request, start, tokens) from ``budget`` tokens, oldest first."""
        chunks = []
        for request in self.running:
            if budget <= 0:
                break
            if request.pulling or request.num_computed >= request.num_to_compute:
                continue
            n = min(request.num_to_compute - request.num_computed, budget)
            chunks.append((request, request.num_computed, n))
            budget -= n
        return chunks

    def make_room(self, request: SimRequest) -> bool:
        """A block for ``request``'s next token, preempting the newest running request while
        none is free. False when ``request`` itself was the one preempted."""
        needed = self.timing.blocks_for(request.context + 1) - request.num_blocks
        while needed > 0 and not self.can_allocate(needed):
            victims = [r for r in self.running if not r.pulling]  # a pull in flight stays
            if not victims:
                return False  # it waits for a pull to end
            victim = victims[-1]
            self.preempt(victim)
            if victim is request:
                return False
        if needed > 0:
            self.allocate(request, needed)
        return True

    def preempt(self, request: SimRequest) -> None:
        """Back to the head of the queue without its KV: its context is recomputed."""
        self.running.remove(request)
        self.free(request)
        request.num_computed = 0
        request.num_to_compute = request.context  # the prompt and what it has produced
        if request.needs_pull or request.kv_source == "pulled":
            request.kv_source = "recomputed"
        request.needs_pull = False
        self.waiting.appendleft(request)
        self.num_preempted += 1

    def step_seconds(self, plan: StepPlan) -> float:
        return self.timing.step.seconds(
            [(start, n) for _, start, n in plan.chunks], [r.context for r in plan.decodes]
        )

    def finish_step(self, plan: StepPlan, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """The step's tokens at ``now``. Returns (prompts done on a prefill worker: hand-off,
        requests that are finished here)."""
        handed_off, finished = [], []
        for request, _, n in plan.chunks:
            request.num_computed += n
            if not request.prompt_done:
                continue
            if self.role == "prefill":
                request.token_times.append(now)  # the prefill worker samples the first token
                self.running.remove(request)  # its blocks stay pinned for the pull
                handed_off.append(request)
            elif not request.token_times:
                request.token_times.append(now)
            # a preempted request recomputed its context: it goes on decoding
        for request in plan.decodes:
            request.token_times.append(now)
        ended = [r for r in plan.decodes if r.is_finished]
        if self.role != "prefill":
            ended += [r for r, _, _ in plan.chunks if r.is_finished]
        if ended:
            gone = set(map(id, ended))
            self.running = [r for r in self.running if id(r) not in gone]
            for request in ended:
                self.free(request)
                finished.append(request)
        return handed_off, finished

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_sequences(self) -> int:
        return len(self.running) + len(self.waiting)
