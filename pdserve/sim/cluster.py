"""The discrete-event loop of a whole deployment: the router, the worker pools, the KV links.

Events (a heap of ``(time, seq, kind, payload)``; ``seq`` keeps ties in order, so a run is
deterministic): a request **arrives** at the router; a worker's **step ends**; a KV **pull
ends**; a pinned KV handle's **lease ends**. Between events nothing happens, so a run costs what
its steps cost, not its simulated seconds.

What each part does, as the real one does:

- **Router**: one pool choice per request, ``least_loaded`` (its requests in flight there, ties
  in turn; the router's default decode policy, and its prefix-aware prefill/colocated policies
  without a prefix cache to follow) or ``round_robin``. With both pools, the decode worker is
  chosen first, then ``router.disaggregation``'s own policy object (``always`` or
  ``conditional`` with ``--local-prefill-tokens``, ``--prefill-busy-tokens``,
  ``--decode-busy-sequences``) decides from the same ``RequestFacts`` the router builds:
  prompt tokens (nothing cached: the simulator has no prefix cache), prompt tokens in flight on
  the least busy prefill worker, the requests it has in flight on the decode worker, and that
  worker's local prompts not yet answered.
- **Hand-off**: the prefill worker samples the first token and pins the prompt's blocks under a
  lease; the request joins its decode worker's queue; when admitted (blocks for the prompt) it
  pulls over that worker's link (one pull at a time, ``latency + bytes / bandwidth``) while the
  worker steps; the pinned blocks are freed when the pull ends; it decodes from the next step.
  With ``early_handle`` (the streamed hand-off's order) the decode worker has admitted the
  request while the prompt computed, so its pull starts when the prompt's step ends instead of
  at the decode worker's next step boundary.
  A handle not taken within the lease is freed and the decode worker recomputes the prompt
  (the real decode worker renews the lease while it waits for room: ``lease_renewed``).
- **A shared host** (``corun``, off by default): all the workers on one host, as the recorded
  sweep's 2-core machine runs them; a step started while another worker is inside a step takes
  the measured co-run factor (:mod:`pdserve.sim.corun`). With ``host_work`` (off by default) the
  router and the clients share that host too: each arrival and each finished request lengthens
  the steps in progress (:mod:`pdserve.sim.host_work`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, fields

import numpy as np

from pdserve.sim.corun import CoRun
from pdserve.sim.host_work import HostWork
from pdserve.sim.overheads import Overheads
from pdserve.sim.timing import WorkerTiming
from pdserve.sim.trace import Trace
from pdserve.sim.worker import SimRequest, SimWorker, StepPlan
from router.config import RouterConfig
from router.disaggregation import RequestFacts, make_disaggregation_policy
from services.worker.config import DECODE_PROMPT_TOKENS

ARRIVE, STEP_END, PULL_END, LEASE_END = range(4)
ROUTING_POLICIES = ("least_loaded", "round_robin")


def _router_default(name: str) -> int:
    """The router's default for one of its settings (declared there once)."""
    default = next(f.default for f in fields(RouterConfig) if f.name == name)
    assert isinstance(default, int), name
    return default


@dataclass(frozen=True)
class Layout:
    """A deployment: ``num_prefill`` P + ``num_decode`` D, or ``num_colocated`` workers, with
    the router's settings (its flags' defaults)."""

    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    disaggregation: str = "conditional"
    local_prefill_tokens: int = _router_default("local_prefill_tokens")
    prefill_busy_tokens: int = _router_default("prefill_busy_tokens")
    decode_busy_sequences: int = _router_default("decode_busy_sequences")
    policy: str = "least_loaded"
    lease_s: float = 5.0  # the prefill workers' --lease-seconds
    lease_renewed: bool = True  # the decode worker renews it while waiting for room
    # The streamed hand-off (the default): the prefill worker sends the KV handle before the
    # step that computes the prompt, so the decode worker admits the request at a step
    # boundary while the prompt computes, and its pull waits at the prefill worker for the
    # blocks. False: the handle after that step (the decode worker learns of it then).
    early_handle: bool = True
    # A decode worker's --max-prompt-tokens-beside-decodes (its default; None: uncapped, as the
    # engine was before 2026-11-28 and in the sweeps recorded then).
    decode_prompt_tokens: int | None = DECODE_PROMPT_TOKENS

    def __post_init__(self) -> None:
        if self.num_colocated < 0 or self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError("worker counts must be >= 0")
        if self.num_colocated == 0 and (self.num_prefill == 0 or self.num_decode == 0):
            raise ValueError("give colocated workers, or prefill and decode workers")
        if self.num_colocated and self.num_prefill + self.num_decode:
            raise ValueError("a layout is colocated or disaggregated, not both")
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {ROUTING_POLICIES}, got {self.policy!r}")

    @property
    def is_disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def name(self) -> str:
        if not self.is_disaggregated:
            return f"{self.num_colocated}x colocated"
        how = self.disaggregation
        if how == "conditional":
            how += f" {self.local_prefill_tokens}/{self.prefill_busy_tokens}"
        return f"{self.num_prefill}P:{self.num_decode}D {how}"


class Pool:
    """The workers of one role and the router's view of their load."""

    def __init__(self, role: str, workers: list[SimWorker], policy: str):
        self.role, self.workers, self.policy = role, workers, policy
        self.loads = np.zeros(len(workers), dtype=np.int64)  # requests in flight
        self.prompt_tokens = np.zeros(len(workers), dtype=np.int64)  # prompts in flight
        self.turn = 0

    def choose(self) -> int:
        self.turn += 1
        if self.policy == "round_robin":
            return self.turn % len(self.workers)
        ties = np.flatnonzero(self.loads == self.loads.min())
        return int(ties[self.turn % len(ties)])


@dataclass
class SimResult:
    requests: list[SimRequest]
    failed: list[SimRequest]
    num_events: int
    num_preempted: int
    num_lease_expired: int
    routes: dict[str, int] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)  # "local:short" -> requests


class Simulation:
    """One run of ``trace`` on ``layout``; ``timings`` per role (a role missing: ``timing``);
    ``overheads``: the costs outside the steps (:mod:`pdserve.sim.overheads`; none by default);
    ``corun``: the workers share one host, and its co-run factors (:mod:`pdserve.sim.corun`;
    none by default: each worker on a host of its own); ``host_work``: the router and clients
    share it too (:mod:`pdserve.sim.host_work`; none by default)."""

    def __init__(
        self,
        trace: Trace,
        layout: Layout,
        timing: WorkerTiming,
        timings: dict[str, WorkerTiming] | None = None,
        overheads: Overheads | None = None,
        corun: CoRun | None = None,
        host_work: HostWork | None = None,
    ):
        self.trace, self.layout = trace, layout
        self.overheads = overheads or Overheads()
        self.corun = corun or CoRun()
        self.host_work = host_work or HostWork()
        roles = {
            "prefill": layout.num_prefill,
            "decode": layout.num_decode,
            "colocated": layout.num_colocated,
        }
        self.pools: dict[str, Pool] = {}
        for role, count in roles.items():
            worker_timing = (timings or {}).get(role, timing)
            cap = layout.decode_prompt_tokens if role == "decode" else None
            workers = [SimWorker(i, role, worker_timing, cap) for i in range(count)]
            self.pools[role] = Pool(role, workers, layout.policy)
        self.disaggregation = make_disaggregation_policy(
            layout.disaggregation,
            layout.local_prefill_tokens,
            layout.prefill_busy_tokens,
            layout.decode_busy_sequences,
        )
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.plans: dict[tuple[str, int], StepPlan] = {}  # the step in progress per worker
        # when it ends: a STEP_END event at another time is one it was lengthened past
        self.step_due: dict[tuple[str, int], float] = {}
        self.link_free: dict[int, float] = {}  # decode worker -> when its link is free
        self.pinned: dict[int, tuple[SimWorker, int]] = {}  # request -> prefill worker, blocks
        self.done: list[SimRequest] = []
        self.failed: list[SimRequest] = []
        self.num_events = self.num_lease_expired = 0

    def push(self, time: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, kind, payload))

    def run(self) -> SimResult:
        requests = [
            SimRequest(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens)
            for r in self.trace.requests
        ]
        for request in requests:  # its arrival_s stays the send time: TTFT counts the overhead
            self.push(self.overheads.arrival(request.arrival_s), ARRIVE, request)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            self.num_events += 1
            if kind == ARRIVE:
                self.arrive(payload, now)  # type: ignore[arg-type]
            elif kind == STEP_END:
                self.end_step(payload, now)  # type: ignore[arg-type]
            elif kind == PULL_END:
                self.end_pull(payload, now)  # type: ignore[arg-type]
            else:
                self.end_lease(payload, now)  # type: ignore[arg-type]
        finished = {r.index for r in self.done} | {r.index for r in self.failed}
        self.failed += [r for r in requests if r.index not in finished]  # never admitted
        routes: dict[str, int] = {}
        decisions: dict[str, int] = {}
        for r in requests:
            routes[r.route or "none"] = routes.get(r.route or "none", 0) + 1
            if r.decision:
                decisions[r.decision] = decisions.get(r.decision, 0) + 1
        workers = [w for pool in self.pools.values() for w in pool.workers]
        return SimResult(
            sorted(self.done, key=lambda r: r.index),
            sorted(self.failed, key=lambda r: r.index),
            self.num_events,
            sum(w.num_preempted for w in workers),
            self.num_lease_expired,
            routes,
            decisions,
        )

    # -- the router -----------------------------------------------------------------------------

    def arrive(self, request: SimRequest, now: float) -> None:
        self.lengthen_steps(self.host_work.arrival_s)
        if not self.fits(request):
            self.failed.append(request)
            return
        if not self.layout.is_disaggregated:
            request.route = "colocated"
            self.send(self.pools["colocated"], request, now)
            return
        decode = self.pools["decode"]
        d = decode.choose()
        request.decode_worker = d
        worker = decode.workers[d]
        prefill = self.pools["prefill"]
        facts = RequestFacts(
            prompt_tokens=request.prompt_tokens,
            cached_tokens=0,
            prefill_queue_tokens=int(prefill.prompt_tokens.min()),
            # the router's own count of its calls open there (a heartbeat's count lags behind)
            decode_sequences=int(decode.loads[d]),
            local_queue_tokens=worker.local_prompt_tokens,
        )
        decision = self.disaggregation.decide(facts)
        request.decision = f"{decision.label}:{decision.reason}"  # as the router's metric has it
        if decision.remote:
            request.route = "remote"
            request.prefill_worker = self.send(prefill, request, now)
            decode.loads[d] += 1
        else:
            request.route, request.kv_source = "local", "computed"
            worker.local_prompt_tokens += request.prompt_tokens
            self.send(decode, request, now, d)

    def fits(self, request: SimRequest) -> bool:
        """Whether every worker's pool holds the whole context (else the worker refuses it)."""
        tokens = request.prompt_tokens + request.output_tokens
        return all(
            pool.workers[0].timing.blocks_for(tokens) <= pool.workers[0].timing.num_blocks
            for pool in self.pools.values()
            if pool.workers
        )

    def send(self, pool: Pool, request: SimRequest, now: float, index: int = -1) -> int:
        index = pool.choose() if index < 0 else index
        worker = pool.workers[index]
        pool.loads[index] += 1
        pool.prompt_tokens[index] += request.prompt_tokens
        worker.waiting.append(request)
        self.kick(worker, now)
        return index

    # -- the workers ----------------------------------------------------------------------------

    def kick(self, worker: SimWorker, now: float) -> None:
        """Start a step on ``worker`` unless one is in progress."""
        if (worker.role, worker.worker_id) not in self.plans and worker.has_work:
            self.start_step(worker, now)

    def start_step(self, worker: SimWorker, now: float) -> None:
        for request in worker.admit():
            self.start_pull(worker, request, now)
        plan = worker.plan_step()
        if plan.is_empty:
            return  # idle until a pull ends, blocks are freed or a request arrives
        key = (worker.role, worker.worker_id)
        factor = 1.0
        if self.corun.slows:  # else skip a pass over every step in progress (1,000 workers)
            factor = self.corun.factor(plan, (p for k, p in self.plans.items() if k != key))
        self.plans[key] = plan
        self.step_due[key] = now + worker.step_seconds(plan) * factor
        self.push(self.step_due[key], STEP_END, worker)

    def lengthen_steps(self, seconds: float) -> None:
        """Every step in progress ends ``seconds`` later (the host's serving work took that
        from them); the events at their old ends go stale."""
        if seconds <= 0:
            return
        for key in self.plans:
            self.step_due[key] += seconds
            self.push(self.step_due[key], STEP_END, self.pools[key[0]].workers[key[1]])

    def end_step(self, worker: SimWorker, now: float) -> None:
        key = (worker.role, worker.worker_id)
        if self.step_due.get(key) != now:
            return  # stale: the step was lengthened (or has ended already)
        del self.step_due[key]
        plan = self.plans.pop(key)
        handed_off, finished = worker.finish_step(plan, now)
        pool = self.pools[worker.role]
        for request, _, _ in plan.chunks:
            if request.route == "local" and request.token_times and not request.answered:
                request.answered = True  # no longer a local prompt in the router's count
                worker.local_prompt_tokens -= request.prompt_tokens
        for request in handed_off:
            self.hand_off(worker, request, now)
        for request in finished:
            pool.loads[worker.worker_id] -= 1
            if request.route != "remote":
                pool.prompt_tokens[worker.worker_id] -= request.prompt_tokens
            self.done.append(request)
        self.kick(worker, now)
        self.lengthen_steps(self.host_work.finish_s * len(finished))

    def hand_off(self, worker: SimWorker, request: SimRequest, now: float) -> None:
        """The prompt is done on a prefill worker: pin its blocks, queue it on its decode
        worker."""
        prefill = self.pools["prefill"]
        prefill.loads[worker.worker_id] -= 1
        prefill.prompt_tokens[worker.worker_id] -= request.prompt_tokens
        self.pinned[request.index] = (worker, request.num_blocks)
        request.num_blocks = 0
        if request.is_finished:  # one token: nothing to decode, nothing to pull
            self.release(request, now)
            self.pools["decode"].loads[request.decode_worker] -= 1
            self.done.append(request)
            return
        request.num_computed = 0
        request.needs_pull = True
        decode = self.pools["decode"].workers[request.decode_worker]
        decode.waiting.append(request)
        if not self.layout.lease_renewed:
            self.push(now + self.layout.lease_s, LEASE_END, request)
        if self.layout.early_handle:  # admitted already: the pull starts as the blocks are
            for admitted in decode.admit():  # ready, not at the decode worker's next step
                self.start_pull(decode, admitted, now)
        self.kick(decode, now)

    def start_pull(self, worker: SimWorker, request: SimRequest, now: float) -> None:
        request.handle_taken = True
        start = max(now, self.link_free.get(worker.worker_id, 0.0))
        blocks = worker.timing.blocks_for(request.prompt_tokens)
        end = start + worker.timing.transfer_seconds(blocks)
        self.link_free[worker.worker_id] = end
        self.push(end, PULL_END, request)

    def end_pull(self, request: SimRequest, now: float) -> None:
        if not request.pulling:
            return
        request.pulling = request.needs_pull = False
        request.num_computed = request.num_to_compute
        request.kv_source = "pulled"
        self.release(request, now)
        self.kick(self.pools["decode"].workers[request.decode_worker], now)

    def end_lease(self, request: SimRequest, now: float) -> None:
        if request.handle_taken or request.index not in self.pinned:
            return
        self.num_lease_expired += 1
        self.release(request, now)
        request.needs_pull = False
        request.kv_source = "recomputed"
        request.num_to_compute = request.context  # the decode worker computes it itself

    def release(self, request: SimRequest, now: float) -> None:
        """Free the prompt's pinned blocks on its prefill worker."""
        worker, blocks = self.pinned.pop(request.index)
        worker.num_free_blocks += blocks
        self.kick(worker, now)


def simulate(
    trace: Trace,
    layout: Layout,
    timing: WorkerTiming,
    timings: dict[str, WorkerTiming] | None = None,
    overheads: Overheads | None = None,
    corun: CoRun | None = None,
    host_work: HostWork | None = None,
) -> SimResult:
    """Run ``trace`` on ``layout`` (see :class:`Simulation`)."""
    if not trace.requests:
        raise ValueError("an empty trace")
    if not all(math.isfinite(r.arrival_s) for r in trace.requests):
        raise ValueError("a trace needs finite arrival times")
    return Simulation(trace, layout, timing, timings, overheads, corun, host_work).run()
