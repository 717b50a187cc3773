"""One sequence's outputs → text: the one place token ids become what a client reads.

The detokenizer service (services/detokenizer/service.py) runs one per sequence of every
request in the mesh, and the in-process Engine runs the same per sequence, so the two
cannot differ in what text a request gets:

- a stop token (EOS or a stop_token_id) that ended the sequence has no text; the other
  tokens of its step do (a speculative or jump-forward step can end in EOS after several);
- a stop string found in the text ends the sequence as FINISH STOP with the string as
  `matched_stop`, even while the scheduler still runs it (`apply` says so: the caller tells
  the scheduler, without waiting for it);
- text held back (a partial UTF-8 character, a possible stop-string prefix) is released when
  the sequence ends;
- logprobs (and prompt logprobs) get their tokens' text and bytes.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from services.common.outputs import FinishReason, RequestOutput, TokenLogprob
from services.common.text_options import TextOptions
from services.detokenizer.incremental import IncrementalDetokenizer


class SequenceText:
    """Text for one sequence's RequestOutputs, in order. Not thread-safe."""

    def __init__(self, tokenizer, options: TextOptions,
                 token_text: Callable[[int], tuple[str, bytes]] | None = None) -> None:
        """tokenizer: anything with decode(ids, skip_special_tokens); token_text: id → (text, bytes)
        for logprobs (TextTokenizer.token_text; None leaves them unnamed)."""
        self.options = options
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_ids=list(options.context_ids), stop=list(options.stop),
            skip_special_tokens=options.skip_special_tokens,
            include_stop_str_in_output=options.include_stop_str_in_output, min_tokens=options.min_tokens)
        self._token_text = token_text
        self.ended = False

    def apply(self, out: RequestOutput) -> tuple[RequestOutput, bool]:
        """(`out` with its text and final finish, whether a stop string ended a sequence the
        scheduler still runs). After the sequence ended, later outputs return as finished with
        no text (the scheduler may have produced tokens before it heard of the stop)."""
        if self.ended:
            return replace(out, token_ids=[], logprobs=[], text=""), False
        finished, reason, matched = out.finished, out.finish_reason, out.matched_stop
        text, stopped_here = "", False
        if out.token_ids:
            delta = self._detok.push(_visible(out))
            text = delta.text
            if delta.stopped:
                stopped_here = not finished
                finished, reason, matched = True, FinishReason.STOP, delta.matched_stop
        if finished and not isinstance(matched, str) and reason is not FinishReason.ERROR:
            text += self._detok.flush()  # may itself complete a stop string
            if self._detok.stopped:
                reason, matched = FinishReason.STOP, self._detok.matched_stop
        self.ended = finished
        logprobs = [self._named(lp) for lp in out.logprobs] if self._token_text else out.logprobs
        prompt = [self._named(lp) for lp in out.prompt_logprobs] if self._token_text else out.prompt_logprobs
        return replace(out, text=text, logprobs=logprobs, prompt_logprobs=prompt, finished=finished,
                       finish_reason=reason, matched_stop=matched), stopped_here

    def _named(self, lp: TokenLogprob) -> TokenLogprob:
        name = self._token_text
        top = [replace(t, token=text, bytes=raw) for t in lp.top for text, raw in (name(t.token_id),)]
        text, raw = name(lp.token_id)
        return replace(lp, top=top, token=text, bytes=raw)


def _visible(out: RequestOutput) -> list[int]:
    """The output's ids that have text: all but a matched stop token, which is the step's last."""
    ids = out.token_ids
    stop_token = (out.finished and out.finish_reason is FinishReason.STOP and isinstance(out.matched_stop, int)
                  and ids[-1:] == [out.matched_stop])
    return ids[:-1] if stop_token else ids
