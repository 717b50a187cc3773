"""CLI flags generated from frozen dataclass configs, and the options every service shares.

A flag and its default live in one place, the dataclass field:

    @dataclass(frozen=True)
    class SchedulerServiceConfig:
        common: CommonConfig = field(default_factory=lambda: CommonConfig(listen="0.0.0.0:50052"))
        scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
        worker: str = field(default="127.0.0.1:50053", metadata={"help": "worker address"})

    parser = argparse.ArgumentParser()
    flags_from_dataclass(SchedulerServiceConfig, parser)
    config = config_from_args(SchedulerServiceConfig, parser.parse_args())

Composition by flattening: a field whose type is itself a dataclass is a
*group*; its fields become top-level flags (`--listen`, not `--common-listen`)
shown under their own help heading, and `config_from_args` rebuilds the nested
instance. This keeps each core config (SchedulerConfig, WorkerConfig) free of
transport options (listen address, drain timeout), lets a service pick its own
defaults for the common options through the group's default instance, and
needs no inheritance. Two fields that would map onto the same flag raise
ValueError when the flags are generated.

Field → flag rules (field name `max_new_tokens` → `--max-new-tokens`):
  bool            `--x` / `--no-x`
  int, float, str one value; `metadata={"choices": [...]}` restricts it
  X | None        as X; the value `none` (any case) gives None
  list[X], tuple[X, ...]   zero or more values: `--stop a b`
A field without a default is a required flag. Help comes from
`field(metadata={"help": ...})`; the default is appended to it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

T = TypeVar("T")

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class CommonConfig:
    """Options every service has. Compose it as a field of a service's config."""

    listen: str = field(default="127.0.0.1:0", metadata={
        "help": "HOST:PORT to serve gRPC on; port 0 picks a free port (logged as `listening`)"})
    drain_timeout_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM/SIGINT: seconds in-flight RPCs get to finish before they are cancelled"})
    log_level: str = field(default="info", metadata={"help": "log level", "choices": LOG_LEVELS})
    metrics_port: int | None = field(default=None, metadata={
        "help": "serve Prometheus metrics at http://HOST:PORT/metrics (HOST from --listen; 0 picks a free port, "
                "logged as `metrics_port`); none = no metrics endpoint. The gateway serves /metrics on its HTTP "
                "port and ignores this"})
    # TLS (services/common/tls.py): server side, then this process's outbound channels. Off by default.
    tls_cert: str | None = field(default=None, metadata={
        "help": "serve gRPC over TLS with this PEM certificate (chain); needs --tls-key"})
    tls_key: str | None = field(default=None, metadata={"help": "the PEM private key of --tls-cert"})
    tls_client_ca: str | None = field(default=None, metadata={
        "help": "mTLS: require client certificates signed by this PEM CA (needs --tls-cert)"})
    tls_ca: str | None = field(default=None, metadata={
        "help": "dial other services over TLS, verifying them against this PEM CA"})
    tls_client_cert: str | None = field(default=None, metadata={
        "help": "the PEM certificate this service presents to servers that require one (needs --tls-ca, "
                "--tls-client-key)"})
    tls_client_key: str | None = field(default=None, metadata={"help": "the PEM private key of --tls-client-cert"})

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"--listen must be HOST:PORT with PORT in [0, 65535], got {self.listen!r}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout-s must be >= 0, got {self.drain_timeout_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        self._check_tls()

    def _check_tls(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key: client certificates are "
                             "checked in a TLS handshake")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if self.tls_client_cert is not None and self.tls_ca is None:
            raise ValueError("--tls-client-cert needs --tls-ca: a certificate is presented over TLS only")
        for flag in ("tls_cert", "tls_key", "tls_client_ca", "tls_ca", "tls_client_cert", "tls_client_key"):
            path = getattr(self, flag)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{_flag(flag)}: no such file: {path}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """`X | None` / Optional[X] → (X, True); anything else → (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union {tp!r}: only `X | None` maps onto a flag")
    return tp, False


def _scalar_parser(tp: Any, optional: bool) -> Callable[[str], Any]:
    if tp not in (int, float, str):
        raise TypeError(f"unsupported flag type {tp!r}")
    if not optional:
        return tp

    def parse(text: str) -> Any:
        return None if text.lower() == "none" else tp(text)

    parse.__name__ = tp.__name__  # argparse names the type in its error messages
    return parse


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _walk(cls: type, defaults: Any) -> list[tuple[str, dataclasses.Field, Any, Any]]:
    """Leaf fields of cls, groups flattened: (group path, field, type, default).

    `defaults` is an instance whose values override the class defaults (the
    group's default instance), or MISSING.
    """
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = _default_of(f) if defaults is dataclasses.MISSING else getattr(defaults, f.name)
        if dataclasses.is_dataclass(tp):
            out.append((f.name, f, tp, default))  # the group marker itself
            for path, sub, sub_tp, sub_default in _walk(tp, default):
                out.append((f"{f.name}.{path}", sub, sub_tp, sub_default))
        else:
            out.append((f.name, f, tp, default))
    return out


def flags_from_dataclass(cls: type, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per leaf field of the dataclass `cls` to `parser` (returned).

    Raises TypeError for an annotation with no flag mapping, ValueError when
    two fields (e.g. in different groups) map onto the same flag.
    """
    seen: dict[str, str] = {}
    groups: dict[str, Any] = {"": parser}
    for path, f, tp, default in _walk(cls, dataclasses.MISSING):
        parent = path.rpartition(".")[0]
        if dataclasses.is_dataclass(tp):
            groups[path] = parser.add_argument_group(f"{path} options", f.metadata.get("help"))
            continue
        if f.name in seen:
            raise ValueError(f"fields {seen[f.name]!r} and {path!r} both map onto {_flag(f.name)}")
        seen[f.name] = path
        target = groups[parent]
        help_text = f.metadata.get("help", "")
        kwargs: dict[str, Any] = {"dest": path.replace(".", "__"), "help": help_text}
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
            kwargs["help"] = f"{help_text} (default: {default!r})".strip()
        kwargs["help"] = kwargs["help"].replace("%", "%%")  # argparse %-formats help: a literal "3%" would crash --help
        inner, optional = _unwrap_optional(tp)
        origin = typing.get_origin(inner)
        if inner is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin in (list, tuple):
            args = typing.get_args(inner)
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                raise TypeError(f"{path}: only tuple[X, ...] maps onto a flag, got {inner!r}")
            kwargs["type"] = _scalar_parser(args[0], optional=False)
            kwargs["nargs"] = "*"
        else:
            kwargs["type"] = _scalar_parser(inner, optional)
        if "choices" in f.metadata:
            kwargs["choices"] = tuple(f.metadata["choices"])
        target.add_argument(_flag(f.name), **kwargs)
    return parser


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build `cls` from a namespace parsed with the flags of `flags_from_dataclass(cls, ...)`.

    The dataclass's own validation (`__post_init__`) runs and its ValueError
    propagates; `parse_config` turns it into a usage error.
    """
    values = vars(args)

    def build(klass: type, prefix: str) -> Any:
        hints = typing.get_type_hints(klass)
        kwargs = {}
        for f in dataclasses.fields(klass):
            path = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(hints[f.name]):
                kwargs[f.name] = build(hints[f.name], f"{path}__")
                continue
            value = values[path]
            origin = typing.get_origin(_unwrap_optional(hints[f.name])[0])
            if origin is tuple and value is not None:
                value = tuple(value)  # nargs="*" parses into a list
            elif origin is list and value is not None:
                value = list(value)  # never share the mutable default
            kwargs[f.name] = value
        return klass(**kwargs)

    return build(cls, "")


def parse_config(cls: type[T], argv: list[str] | None = None,
                 parser: argparse.ArgumentParser | None = None) -> T:
    """Parse argv into `cls`; a validation error exits with a usage message (status 2)."""
    parser = parser or argparse.ArgumentParser()
    flags_from_dataclass(cls, parser)
    args = parser.parse_args(argv)
    try:
        return config_from_args(cls, args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
