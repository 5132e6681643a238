"""Fault injection on served KV pulls, for chaos tests: off unless a worker asks for it.

A prefill worker started with ``--kv-faults "drop=0.1,corrupt=0.05"`` (env
``PDSERVE_KV_FAULTS``) makes its transfer server draw, for every pull it would otherwise serve,
one of:

- ``drop``: the transfer is aborted (the connection closes without the payload), so the decode
  side fails at once with ``connection_lost`` instead of waiting for its pull timeout;
- ``corrupt``: one byte of a *copy* of the payload is flipped after the checksums were computed
  (at pin time), so the decode side's checksum verification must catch it;
- nothing, with the remaining probability.

``pause=SECONDS`` (not drawn: every pull) makes the server stop that long in the middle of each
transfer while it holds the blocks: tests use it to let a lease run out mid-transfer.

Either way the decode worker recomputes the prompt (or fails the request, by its flag): the
point is to show that it does, and that no block leaks on either side. Where each transport
injects (what it can, and what it cannot):

==========  ====================================================  ============================
transport   drop                                                  corrupt
==========  ====================================================  ============================
tcp         OK reply, then close before the payload               flipped byte in the payload
ucx         OK reply, then close the endpoint before the payload  flipped byte in the payload
torch       close the control connection before the reply (after  flipped byte in the payload
            an OK the client would wait in gloo's recv until its
            timeout)
shm         close the control connection before the reply         not possible: the client
                                                                  copies straight from the
                                                                  prefill worker's KV cache
==========  ====================================================  ============================

Injected faults are counted per kind in the server's ``stats.injected`` and in
``pdserve_kv_transfer_faults_injected_total{transport, kind}``. The draws come from a
``random.Random`` seeded by ``seed=`` when given (a restarted worker repeats its sequence).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import torch

FAULT_KINDS = ("drop", "corrupt")


@dataclass
class KVFaults:
    """Probabilities of each fault per served pull, and the RNG that draws them."""

    drop: float = 0.0
    corrupt: float = 0.0
    pause: float = 0.0  # seconds every served pull stops mid-transfer, holding its blocks
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for kind in FAULT_KINDS:
            value = getattr(self, kind)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"kv fault {kind}={value} is not a probability in [0, 1]")
        if self.drop + self.corrupt > 1.0:
            raise ValueError(f"kv faults drop + corrupt = {self.drop + self.corrupt} > 1")
        self._rng = random.Random(self.seed)

    @classmethod
    def parse(cls, spec: str | None) -> KVFaults | None:
        """``"drop=0.1,corrupt=0.05,seed=7"`` -> KVFaults; None for an empty or all-zero spec
        (faults off). Raises ValueError naming what is wrong."""
        values: dict[str, float] = {}
        seed: int | None = None
        for item in (spec or "").replace(" ", "").split(","):
            if not item:
                continue
            name, sep, text = item.partition("=")
            if not sep or name not in (*FAULT_KINDS, "pause", "seed"):
                raise ValueError(
                    f"kv faults: cannot read {item!r}; expected e.g. 'drop=0.1,corrupt=0.05,seed=1'"
                )
            try:
                if name == "seed":
                    seed = int(text)
                else:
                    values[name] = float(text)
            except ValueError as exc:
                raise ValueError(f"kv faults: {name}={text!r} is not a number") from exc
        if not any(values.values()):
            return None
        return cls(seed=seed, **values)

    async def pause_mid_transfer(self) -> None:
        if self.pause > 0:
            await asyncio.sleep(self.pause)

    def draw(self) -> str | None:
        """The fault to inject into the pull being served: "drop", "corrupt" or None."""
        x = self._rng.random()
        if x < self.drop:
            return "drop"
        if x < self.drop + self.corrupt:
            return "corrupt"
        return None

    def corrupted(self, payload: torch.Tensor) -> torch.Tensor:
        """A copy of ``payload`` with one byte (chosen by the RNG) inverted; the original,
        which may be a view of the KV cache itself, is left alone."""
        copy = payload.detach().clone(memory_format=torch.contiguous_format)
        flat = copy.reshape(-1).view(torch.uint8)
        if flat.numel():
            index = self._rng.randrange(flat.numel())
            flat[index] = flat[index] ^ 0xFF
        return copy
