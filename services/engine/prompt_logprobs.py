"""A prompt's log-probabilities (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with
``logprobs``): each prompt token's log-probability given the tokens before it, with the most
likely alternatives, from the hidden states the model runner kept for those positions
(``ModelRunner.prompt_hidden``). Raw log-softmax of the model's logits, like generated tokens'
logprobs: no temperature, penalty or bias.

Cost: one more row of logits per prompt token (the model's head over the vocabulary), computed
``SLICE`` rows at a time so that a long chunk never holds tokens x vocabulary floats at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.model_runner import PromptHidden

SLICE = 256  # rows of logits at a time: 256 x a 128k vocabulary is 128 MiB of float32


@torch.inference_mode()
def record_prompt_logprobs(
    runs: list[PromptHidden], compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Append each run's entries to its sequence's ``prompt_logprobs``: the prompt token's
    logprob first, then the ``params.prompt_logprobs`` most likely tokens it is not among."""
    for run in runs:
        for first in range(0, len(run.hidden), SLICE):
            _record(run, first, compute_logits(run.hidden[first : first + SLICE]))


def _record(run: PromptHidden, first: int, logits: torch.Tensor) -> None:
    seq = run.seq
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    start = run.start + first  # the position of the first row
    targets = seq.token_ids[start + 1 : start + 1 + len(logprobs)]
    index = torch.tensor(targets, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index)
    # vLLM's rank: how many tokens are at least as likely (the token itself included).
    seq.prompt_logprob_ranks += (logprobs >= chosen).sum(dim=1).tolist()
    top_values, top_ids = logprobs.topk(seq.params.prompt_logprobs or 0)
    for token, value, values, ids in zip(
        targets, chosen.squeeze(1).tolist(), top_values.tolist(), top_ids.tolist()
    ):
        entry = {token: value}
        for v, t in zip(values, ids):
            entry.setdefault(t, v)
        seq.prompt_logprobs.append(entry)
