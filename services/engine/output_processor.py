"""Per-request detokenization and stop strings, one token at a time.

Token-level stops (EOS, stop token ids, max_tokens, with min_tokens) are decided on the device by
the post-step update (kernels/post_step_ref.py, run from services/engine/verify_update.py), which
already cut a step's tokens after the one that ends the request; its verdict is taken as given
here. Stop strings are text, so they are looked for here, token by token even when a step yields
several (speculative decoding), and one inside accepted drafts ends the request at that token.
The engine runs this for a step while the device computes the next one, so a request a stop
string ends has run one step more, whose tokens are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.sequence import FinishReason, Sequence
from shared.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class TextState:
    decoder: IncrementalDecoder
    text: str = ""
    num_emitted_chars: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, TextState] = {}

    def start(self, seq: Sequence) -> None:
        decoder = self.tokenizer.decode_stream(seq.prompt_token_ids, seq.params.skip_special_tokens)
        self.states[seq.request_id] = TextState(decoder)

    def prime(self, seq: Sequence, token_ids: list[int]) -> None:
        """Counts tokens already delivered (a resumed request's earlier output) into the text,
        so stop strings spanning them are found, without emitting them again."""
        state = self.states[seq.request_id]
        state.text += state.decoder.step(token_ids) if token_ids else ""
        state.num_emitted_chars = len(state.text)

    def release(self, request_id: str) -> TextState | None:
        return self.states.pop(request_id, None)

    def text(self, request_id: str) -> str:
        return self.states[request_id].text

    def observe(
        self,
        seq: Sequence,
        num_new: int,
        finish_reason: FinishReason | None = None,
        stop_token_id: int | None = None,
    ) -> int:
        """Detokenizes the last `num_new` tokens of `seq` (the step's, already appended) until one
        ends it; returns how many were kept and drops the rest from `seq`. They end where the
        post-step update ended the request, with `finish_reason` (STOP for an EOS or the stop id
        `stop_token_id`, LENGTH) on the last one; a stop string may end it earlier."""
        state = self.states[seq.request_id]
        first = seq.num_tokens - num_new
        num_output = seq.num_output_tokens - num_new
        for n, token_id in enumerate(seq.token_ids[first:], start=1):
            last = n == num_new
            reason: FinishReason | None = None
            if last and finish_reason is FinishReason.STOP:  # an EOS or stop id: its text is left out
                seq.stop_reason = stop_token_id
                reason = finish_reason
            else:
                checked = len(state.text)
                state.text += state.decoder.step([token_id])
                reason = self._string_stop(seq, state, checked, num_output + n)
                if reason is None and last:
                    reason = finish_reason
            if reason is not None:
                seq.finish_reason = reason
                del seq.token_ids[first + n :]
                return n
        return num_new

    def take_delta(self, seq: Sequence) -> str:
        """New text since the last call, holding back a tail that could still begin a stop string."""
        state = self.states[seq.request_id]
        end = len(state.text)
        if seq.finish_reason is None and seq.params.stop:
            end = max(state.num_emitted_chars, end - (max(len(s) for s in seq.params.stop) - 1))
        delta = state.text[state.num_emitted_chars : end]
        state.num_emitted_chars = end
        return delta

    @staticmethod
    def _string_stop(seq: Sequence, state: TextState, checked: int, num_output: int) -> FinishReason | None:
        """Finds the earliest stop string that ends in the new text (`text[checked:]`) and cuts it
        off; none counts before `num_output` (the request's output tokens so far) reaches min_tokens."""
        if not seq.params.stop or num_output < seq.params.min_tokens:
            return None
        longest = max(len(s) for s in seq.params.stop)
        window_start = max(0, checked - longest + 1)
        best: tuple[int, str] | None = None
        for stop in seq.params.stop:
            at = state.text.find(stop, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        state.text = state.text[: best[0]]
        seq.stop_reason = best[1]
        return FinishReason.STOP
