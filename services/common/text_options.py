"""How a sequence's token ids become text: the options a request gives the detokenizing code
(services/detokenizer/sequence_text.py), wherever it runs. Mirrors radixmesh.v2.TextOptions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

CONTEXT_IDS = 8  # prompt tail kept as decoding context (the incremental detokenizer uses the last few)


@dataclass(frozen=True)
class TextOptions:
    """How a sequence's ids become text; mirrors radixmesh.v2.TextOptions."""
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    context_ids: tuple[int, ...] = ()  # the prompt's last CONTEXT_IDS tokens
    min_tokens: int = 0  # the request's min_new_tokens
    reply_to: str = ""  # the mesh's tokenizer that holds the client (unused in process)
    traceparent: str = ""  # the request's span at the scheduler, when tracing (the mesh only)

    @classmethod
    def for_prompt(cls, prompt_ids: Sequence[int], stop: Sequence[str] = (), min_tokens: int = 0,
                   skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
                   reply_to: str = "") -> "TextOptions":
        return cls(tuple(stop), skip_special_tokens, include_stop_str_in_output,
                   tuple(prompt_ids[-CONTEXT_IDS:]), max(min_tokens, 0), reply_to)
