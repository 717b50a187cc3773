"""The gateway's flags, generated from this dataclass (services/common/config.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import CommonConfig
from services.common.server import MAX_MESSAGE_BYTES
from services.common.tool_formats.registry import DEFAULT, FORMATS

DEFAULT_LISTEN = "127.0.0.1:50050"  # gRPC health; docs/mesh.md lists every service's default port
TOOL_CALL_PARSERS = ("auto", *FORMATS)


@dataclass(frozen=True)
class GatewayConfig:
    """`common.listen` serves gRPC health (and reflection) only, like every
    service: SERVING while the gateway is ready (its /ready is 200)."""
    common: CommonConfig = field(default_factory=lambda: CommonConfig(listen=DEFAULT_LISTEN))
    host: str = field(default="127.0.0.1", metadata={"help": "address to serve HTTP on (0.0.0.0 in a container)"})
    http_port: int = field(default=8000, metadata={"help": "HTTP port; 0 picks a free one (logged as `listening`)"})
    tokenizer_addr: str = field(default="127.0.0.1:50051", metadata={
        "help": "HOST:PORT of the tokenizer service (the replica's entry point: Generate, Info)"})
    served_model_name: list[str] = field(default_factory=list, metadata={
        "help": "the model ids requests may name (as vLLM's): the first is the id /v1/models reports and "
                "responses carry; none = the id the tokenizer's Info reports (a GGUF file's stem, an HF "
                "directory's name; SmolLM2-135M-Instruct for the default model)"})
    model_name: str | None = field(default=None, metadata={
        "help": "deprecated: one name, the same as --served-model-name NAME"})
    max_request_bytes: int = field(default=8 * 1024 * 1024, metadata={
        "help": "request bodies above this size are refused with 413"})
    default_max_tokens: int | None = field(default=None, metadata={
        "help": "the most tokens a request that gives no max_tokens gets (it gets what the context leaves after "
                "the prompt, as with OpenAI); none = no cap. /generate: max_new_tokens when none is given "
                "(none = the core's default, 128)"})
    ready_interval_s: float = field(default=1.0, metadata={
        "help": "seconds between backend checks (grpc health SERVING and Info) behind /ready"})
    retry_after_s: int = field(default=1, metadata={
        "help": "Retry-After seconds sent with 503 (queue full, backend unavailable)"})
    tool_call_parser: str = field(default="auto", metadata={
        "help": "the format tool calls are constrained and parsed in with tool_choice auto; auto = the one the "
                "model's chat template writes, as the tokenizer detects it (hermes for a template without tools, "
                "which then gets the chosen format described in its system message)",
        "choices": TOOL_CALL_PARSERS})

    def tool_format(self, reported: str) -> str:
        """The tool-call format requests get: --tool-call-parser, or with auto `reported` (the
        template's, from the tokenizer's Info; one this gateway does not know counts as the default)."""
        if self.tool_call_parser != "auto":
            return self.tool_call_parser
        return reported if reported in FORMATS else DEFAULT

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names given by flag, the id first; () = the backend's own name."""
        return tuple(self.served_model_name) or ((self.model_name,) if self.model_name else ())

    def __post_init__(self) -> None:
        if self.served_model_name and self.model_name:
            raise ValueError("give --served-model-name or the deprecated --model-name, not both")
        if any(not name.strip() for name in self.served_model_name):
            raise ValueError(f"--served-model-name needs non-blank names, got {self.served_model_name!r}")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be in [0, 65535], got {self.http_port}")
        host, sep, port = self.tokenizer_addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--tokenizer-addr must be HOST:PORT, got {self.tokenizer_addr!r}")
        if not 1024 <= self.max_request_bytes <= MAX_MESSAGE_BYTES // 2:
            raise ValueError(f"--max-request-bytes must be in [1024, {MAX_MESSAGE_BYTES // 2}] (half the mesh's "
                             f"gRPC message limit), got {self.max_request_bytes}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be >= 1, got {self.default_max_tokens}")
        if self.ready_interval_s <= 0:
            raise ValueError(f"--ready-interval-s must be > 0, got {self.ready_interval_s}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.retry_after_s < 0:
            raise ValueError(f"--retry-after-s must be >= 0, got {self.retry_after_s}")
