"""From sampled tokens to what callers see: text (incremental detokenization), stop strings and
stop tokens, and one delta per request per step.

Per sequence it keeps a detokenizer, the text held back because it could be the start of a stop
string, and how many tokens were handed out; nothing that grows with the output, so the work
per token is constant (the detokenizer decodes a short window; a stop string is searched for
only in the held-back text plus the new piece, the one place one can start: held-back text is
by construction the longest tail that could begin one).

A request's life here: ``RequestState`` created by ``add_request`` -> its sequences registered
(forks included) -> ``process_token`` per sampled token -> ``output`` after each step -> the
engine drops the state once the output says finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling_params import SamplingParams
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sequence import FinishReason, Sequence
from services.engine.stop_checker import check_stop_token, find_stop_string, num_held_back
from services.engine.tokenizer import Tokenizer


@dataclass
class _SeqText:
    """Text bookkeeping of one sequence."""

    detokenizer: IncrementalDetokenizer
    held: str = ""  # decoded but not shown yet: it could be the start of a stop string
    new_text: list[str] = field(default_factory=list)  # shown since the last output
    num_emitted_tokens: int = 0  # output tokens (and their logprobs) already handed out
    finish_emitted: bool = False  # its finish reason was in an output: never again


@dataclass
class RequestState:
    """One request as the engine tracks it between steps."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # its prefix-cache tenant (services.engine.hashing)
    seqs: list[Sequence] = field(default_factory=list)
    texts: dict[int, _SeqText] = field(default_factory=dict)  # by seq_id
    prompt_logprobs_sent: bool = False  # handed out in an output already

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class OutputProcessor:
    """Detokenizes, applies stop conditions and builds each step's deltas."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def register(self, request: RequestState, seq: Sequence) -> None:
        """Track ``seq`` (a fork inherits its parent's tokens so far, already handed out)."""
        request.seqs.append(seq)
        detok = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
        )
        for token in seq.output_token_ids:
            detok.add(token)
        request.texts[seq.seq_id] = _SeqText(detok, num_emitted_tokens=seq.num_output_tokens)

    def process_token(
        self, request: RequestState, seq: Sequence
    ) -> tuple[FinishReason, str | int | None] | None:
        """Account for ``seq``'s newest token; (finish reason, stop reason) if it ends ``seq``."""
        state = request.texts[seq.seq_id]
        stopped = check_stop_token(seq, self.tokenizer.eos_token_ids, self.max_model_len)
        if stopped is not None and stopped[0] is FinishReason.STOP:
            if not request.params.include_stop_str_in_output:
                return stopped  # vLLM's rule: the EOS or stop token that ends it is not text
        text = state.held + state.detokenizer.add(seq.token_ids[-1])
        stops = request.params.stop
        # vLLM's min_tokens: a stop string must end after the first min_tokens tokens (it may
        # start in them: their text is held back as usual, it just is not matched yet).
        may_stop = seq.num_output_tokens > request.params.min_tokens
        if stops and may_stop and len(text) > len(state.held):
            match = find_stop_string(text, len(text) - len(state.held), stops)
            if match is not None:
                index, stop = match
                if request.params.include_stop_str_in_output:
                    index += len(stop)
                state.new_text.append(text[:index])
                state.held = ""
                return FinishReason.STOP, stop
        held = 0 if stopped is not None else num_held_back(text, stops)
        state.new_text.append(text[: len(text) - held])
        state.held = text[len(text) - held :]
        return stopped

    def mark_emitted(self, request: RequestState, seq: Sequence) -> None:
        """What ``seq`` has so far was streamed by someone else (the prefill worker's first
        token): only the held-back text is still to come."""
        state = request.texts[seq.seq_id]
        state.new_text.clear()
        state.num_emitted_tokens = seq.num_output_tokens

    def output(self, request: RequestState, kv_block_ids: list[int] | None = None) -> RequestOutput:
        """The request's delta since its previous output."""
        outputs = [self._delta(request, seq) for seq in request.seqs]
        outputs.sort(key=lambda o: o.index)
        prompt_logprobs, ranks = self._prompt_logprobs(request)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished or kv_block_ids is not None,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            kv_block_ids=kv_block_ids,
            prompt_logprobs=prompt_logprobs,
            prompt_logprob_ranks=ranks,
        )

    def _prompt_logprobs(
        self, request: RequestState
    ) -> tuple[list[dict[int, float] | None] | None, list[int | None] | None]:
        """The prompt's logprobs and ranks once all are computed (None before, and after one
        output had them; also when they came from elsewhere: a pulled prompt's are the prefill
        worker's)."""
        seq = request.seqs[0]
        wanted = request.params.prompt_logprobs is not None and not request.prompt_logprobs_sent
        if not wanted or len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
            return None, None
        request.prompt_logprobs_sent = True
        return [None, *seq.prompt_logprobs], [None, *seq.prompt_logprob_ranks]

    def _delta(self, request: RequestState, seq: Sequence) -> CompletionOutput:
        state = request.texts[seq.seq_id]
        if seq.finish_reason is not None and state.held:  # ended: show the rest
            state.new_text.append(state.held)
            state.held = ""
        first = state.num_emitted_tokens
        tokens = seq.token_ids[seq.num_prompt_tokens + first :]
        logprobs = seq.logprobs[first:] if request.params.logprobs is not None else None
        state.num_emitted_tokens = seq.num_output_tokens
        text = "".join(state.new_text)
        state.new_text.clear()
        # A delta: the finish once, in the output where it happens (with n > 1 a sequence that
        # ended early was otherwise finished again in each of its siblings' outputs)
        finish = seq.finish_reason if not state.finish_emitted else None
        state.finish_emitted = seq.finish_reason is not None
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=tokens,
            finish_reason=finish.value if finish else None,
            stop_reason=seq.stop_reason if finish else None,
            logprobs=logprobs,
        )
