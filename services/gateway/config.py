"""The gateway's flags, generated from this dataclass (services/common/config.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import CommonConfig
from services.common.request_limits import MAX_N, MAX_STOP
from services.common.sampling_params import SamplingParams
from services.common.server import MAX_MESSAGE_BYTES
from services.common.tool_formats.registry import DEFAULT, FORMATS
from services.gateway.keys import ADMIN_KEY_ENV, API_KEY_ENV, keys_from

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
    # Who may call (services/gateway/auth.py). repr=False: a config printed in a log never shows a key.
    api_key: str | None = field(default=None, repr=False, metadata={
        "help": "an API key clients must send as `Authorization: Bearer KEY` (shown by `ps`: prefer "
                f"--api-key-file or ${API_KEY_ENV}, read when neither flag is given: one key or several, "
                "comma-separated); no key from any source = anyone who can connect may call"})
    api_key_file: str | None = field(default=None, metadata={
        "help": "a file of API keys, one per line (# comments and blank lines skipped); with --api-key, "
                "both are accepted"})
    admin_api_key: str | None = field(default=None, repr=False, metadata={
        "help": "the key /admin/* needs (a user key there gets 403); also accepted where a user key is "
                f"(else --admin-api-key-file or ${ADMIN_KEY_ENV}); none while user keys are set = /admin is "
                "refused to everyone; no key at all = /admin is open, as everything else"})
    admin_api_key_file: str | None = field(default=None, metadata={"help": "a file of admin keys, as --api-key-file"})
    probes_need_key: bool = field(default=False, metadata={
        "help": "/health, /ready and /metrics need a key too (default: open to probes and scrapers)"})
    # Limits (services/gateway/limits.py, connections.py).
    rate_limit_rpm: int | None = field(default=None, metadata={
        "help": "requests per minute per API key (per client address without keys), as a token bucket "
                "holding a minute's worth; beyond it 429 + Retry-After; none = no limit"})
    rate_limit_tpm: int | None = field(default=None, metadata={
        "help": "prompt + completion tokens per minute per API key (per client address without keys): a request "
                "is admitted unless the key's bucket is overdrawn and charged its usage when it ends, so one "
                "large request may overdraw it (the key then waits; 429 + Retry-After); none = no limit"})
    max_n: int = field(default=MAX_N, metadata={"help": f"the largest n a request may ask for (at most {MAX_N})"})
    max_stop: int = field(default=MAX_STOP, metadata={
        "help": f"the most stop strings a request may give (at most {MAX_STOP})"})
    max_tokens_limit: int | None = field(default=None, metadata={
        "help": "the largest max_tokens (max_completion_tokens, /generate max_new_tokens) a request may ask for; "
                "a request that gives none gets at most this many; none = what the context allows"})
    header_timeout_s: float = field(default=10.0, metadata={
        "help": "a connection that has not sent a whole request head this long after it opened (or after the "
                "first byte of its next request) is closed"})
    body_timeout_s: float = field(default=60.0, metadata={
        "help": "a request body not received in full this long after its head gets 408 and the connection closes"})
    idle_timeout_s: float = field(default=75.0, metadata={
        "help": "a keep-alive connection idle this long between requests is closed"})
    max_connections_per_client: int | None = field(default=256, metadata={
        "help": "open connections one client address may hold; the next one is answered 429 and closed; "
                "none = no cap"})
    # The Responses API's store (services/gateway/responses_store.py).
    responses_store_size: int = field(default=1024, metadata={
        "help": "stored responses (POST /v1/responses with store, the default) kept for GET and "
                "previous_response_id; beyond it the oldest goes"})
    responses_store_ttl_s: float = field(default=3600.0, metadata={
        "help": "seconds a stored response is kept; then GET and previous_response_id answer it not found"})

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

    def keys(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(user keys, admin keys), from the flags, else the environment; () where none is configured.
        Raises ValueError naming the flag, file line or variable at fault, never a key."""
        return (keys_from(self.api_key, self.api_key_file, API_KEY_ENV, "--api-key"),
                keys_from(self.admin_api_key, self.admin_api_key_file, ADMIN_KEY_ENV, "--admin-api-key"))

    def max_tokens_default(self, native: bool) -> int | None:
        """The default_max_tokens the parsers get: --default-max-tokens within --max-tokens-limit.
        The OpenAI routes fill the context up to it (None: no cap); /generate (`native`) gives it as
        max_new_tokens when a request names none (None: the core's default)."""
        cap = self.max_tokens_limit
        if cap is None:
            return self.default_max_tokens
        default = self.default_max_tokens or (SamplingParams().max_new_tokens if native else cap)
        return min(default, cap)

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
        self._check_limits()
        if self.responses_store_size < 1:
            raise ValueError(f"--responses-store-size must be >= 1, got {self.responses_store_size}")
        if not self.responses_store_ttl_s > 0:
            raise ValueError(f"--responses-store-ttl-s must be > 0, got {self.responses_store_ttl_s}")
        self.keys()  # an unreadable file or a malformed key: a usage error at start

    def _check_limits(self) -> None:
        for flag, value in (("--rate-limit-rpm", self.rate_limit_rpm), ("--rate-limit-tpm", self.rate_limit_tpm),
                            ("--max-tokens-limit", self.max_tokens_limit),
                            ("--max-connections-per-client", self.max_connections_per_client)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1 or none, got {value}")
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"--max-n must be in [1, {MAX_N}], got {self.max_n}")
        if not 0 <= self.max_stop <= MAX_STOP:
            raise ValueError(f"--max-stop must be in [0, {MAX_STOP}], got {self.max_stop}")
        for flag, value in (("--header-timeout-s", self.header_timeout_s), ("--body-timeout-s", self.body_timeout_s),
                            ("--idle-timeout-s", self.idle_timeout_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
