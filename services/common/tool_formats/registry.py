"""The tool-call formats by name (adding one: a file beside this one and a line here), and which
one a chat template writes."""
from __future__ import annotations

from services.common.tool_formats.base import ToolFormat
from services.common.tool_formats.hermes import Hermes
from services.common.tool_formats.llama3_json import Llama3Json
from services.common.tool_formats.mistral import Mistral

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    Hermes(),
    Llama3Json(),
    Mistral(),
)}
DEFAULT = "hermes"  # what a template that writes no known format, or no tools at all, gets


def tool_format(name: str) -> ToolFormat:
    """The format called `name`; "" is the default. Raises ValueError naming the known ones."""
    found = FORMATS.get(name or DEFAULT)
    if found is None:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}")
    return found


def detect(template: str | None) -> str:
    """The format a chat template's source writes tool calls in: the first whose markers it holds."""
    return next((f.name for f in FORMATS.values() if any(m in (template or "") for m in f.template_markers)),
                DEFAULT)
