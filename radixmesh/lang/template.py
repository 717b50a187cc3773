"""A chat template as text around each role's turn, learnt from the server's own template.

The server renders [system S], [system S, user U] and [system S, user U, assistant A] with
sentinel contents; the text between the sentinels is each role's prefix and suffix. Rendering
a program's roles client-side keeps its whole prompt one growing text, whose prefixes the
radix cache can share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

ROLES = ("system", "user", "assistant")
_SENTINEL = {"system": "RMSYSTEMXQ", "user": "RMUSERXQ", "assistant": "RMASSISTANTXQ"}


@dataclass(frozen=True)
class RoleFormat:
    prefixes: dict[str, str]
    suffixes: dict[str, str]

    def begin(self, role: str) -> str:
        return self.prefixes[role]

    def end(self, role: str) -> str:
        return self.suffixes[role]


# ChatML (SmolLM2, Qwen, ...): what a backend that cannot render templates uses.
CHATML = RoleFormat({r: f"<|im_start|>{r}\n" for r in ROLES}, {r: "<|im_end|>\n" for r in ROLES})
PLAIN = RoleFormat({"system": "", "user": "User: ", "assistant": "Assistant:"}, {r: "\n" for r in ROLES})


def learn(render: Callable[[list[dict]], str]) -> RoleFormat:
    """`render(messages)` is the server's template applied without a generation prompt."""
    convo = [{"role": r, "content": _SENTINEL[r]} for r in ROLES]
    texts = [render(convo[:k]) for k in (1, 2, 3)]
    prefixes, suffixes, done = {}, {}, ""
    for role, text in zip(ROLES, texts):
        if not text.startswith(done):
            raise ValueError(f"the chat template does not render {role}'s turn after the earlier ones unchanged")
        rest = text[len(done):]
        at = rest.find(_SENTINEL[role])
        if at < 0:
            raise ValueError(f"the chat template drops the {role} message's content")
        prefixes[role], suffixes[role] = rest[:at], rest[at + len(_SENTINEL[role]):]
        done = text
    return RoleFormat(prefixes, suffixes)
