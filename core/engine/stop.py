"""Stop rules: whether a choice ends with the token just sampled, and why."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from lockgate.engine.handle import Delta
from lockgate.engine.params import SamplingParams
from lockgate.engine.sampling import TokenLogprob
from lockgate.engine.state import Choice

#: finish reasons, as plain data (the protocol layer words them)
STOP = "stop"
LENGTH = "length"


class StopChecker:
    """Takes each sampled token into its choice and turns it into a `Delta`.

    A choice stops on an end-of-sequence token (unless `ignore_eos`), on one
    of the request's stop token ids, on a stop string (the detokenizer finds
    those across token boundaries, in the text from the `min_tokens`-th token
    on), when its grammar is complete, and at `max_tokens`. (The sampler
    holds end-of-sequence and stop token ids back before `min_tokens`.)
    """

    def __init__(self, eos_token_ids: Iterable[int]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def held_back(self, allowed: np.ndarray | None, params: SamplingParams, width: int) -> np.ndarray | None:
        """`allowed` (None: every token of `width`) less the tokens that would
        end the output (end-of-generation and the request's stop token ids),
        for a choice short of its `min_tokens`; where a grammar allows
        nothing else, it has ended the output, and `allowed` stays as it is."""
        stops = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if 0 <= t < width]
        mask = np.ones(width, dtype=bool) if allowed is None else allowed.copy()
        mask[stops] = False
        return mask if mask.any() else allowed

    def accept(self, choice: Choice, token: int, logprob: TokenLogprob | None) -> Delta:
        params = choice.request.params
        choice.output_ids.append(token)
        logprobs = None if logprob is None else [logprob]
        matcher = choice.matcher
        detokenizer = choice.detokenizer
        if matcher is not None:
            matcher.accept(token)
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            return Delta(choice.index, detokenizer.finish(), [token], STOP, logprobs)
        # stop strings count from the min_tokens-th token on
        step = detokenizer.add(token, stops=len(choice.output_ids) >= params.min_tokens)
        text, reason = step.text, None
        if step.stopped:
            return Delta(choice.index, text, [token], STOP, logprobs, stop_string=step.stop_string)
        if matcher is not None and matcher.is_finished:
            text, reason = text + detokenizer.finish(), STOP
        elif len(choice.output_ids) >= choice.request.max_tokens:
            text, reason = text + detokenizer.finish(), LENGTH
        return Delta(choice.index, text, [token], reason, logprobs)
