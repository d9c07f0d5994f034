"""``staleness-metrics serve``: the sidecar service (one sink per run behind an HTTP API)."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .options import add_command, failed

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9487
DEFAULT_DATA_DIR = "staleness-data"
TOKEN_ENV = "STALENESS_METRICS_TOKEN"  # also in server.security, which needs fastapi to import
OTLP_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
OTLP_PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")

EPILOG = f"""\
examples:
  staleness-metrics serve                                   # http://127.0.0.1:9487, no token needed
  {TOKEN_ENV}=$(openssl rand -hex 32) staleness-metrics serve --host 0.0.0.0
  curl -X PUT localhost:9487/v1/runs/exp-42 -H 'content-type: application/json' -d '{{"max_staleness": 4}}'

Off loopback a token is required. See docs/service.md.
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    what = "send rollouts over HTTP, it keeps the sinks and publishes the metrics"
    parser = add_command(subparsers, run, "serve", f"sidecar service: {what}", EPILOG)
    add = parser.add_argument
    add("--host", default=DEFAULT_HOST, help=f"address to listen on (default: {DEFAULT_HOST})")
    port_help = f"port (default: {DEFAULT_PORT}; 0 picks a free one)"
    add("--port", type=int, default=DEFAULT_PORT, help=port_help)
    add("--token", help=f"bearer token required on writes (default: ${TOKEN_ENV}, if set)")
    add("--token-file", type=Path, metavar="FILE", help="read the token from FILE")
    reads_help = "require the token on reads too (/healthz stays open)"
    add("--protect-reads", action="store_true", help=reads_help)
    body_help = "largest request body accepted, 413 beyond (default: 64 MiB)"
    add("--max-body-bytes", type=int, default=64 << 20, metavar="N", help=body_help)
    rows_help = "body bytes per span row a rollouts body may cut (default: 128; 0: no cap)"
    add("--body-bytes-per-span-row", type=int, default=128, metavar="N", help=rows_help)
    header_help = "largest request line and headers accepted, 431 beyond (default: 64 KiB)"
    add("--max-header-bytes", type=int, default=64 << 10, metavar="N", help=header_help)
    timeout_help = "seconds a request's headers, or the next piece of its body, may take to arrive (default: 10)"
    add("--header-timeout", type=float, default=10.0, metavar="SECONDS", help=timeout_help)
    store = parser.add_mutually_exclusive_group()
    data_help = f"persist the runs here, restored at start (default: ./{DEFAULT_DATA_DIR})"
    data_dir = Path(DEFAULT_DATA_DIR)
    store.add_argument("--data-dir", type=Path, default=data_dir, metavar="DIR", help=data_help)
    memory_help = "keep runs in memory only: a restart or crash loses them"
    store.add_argument("--in-memory", action="store_true", help=memory_help)
    otlp = parser.add_argument_group("OTLP (every run, besides /metrics)")
    otlp_help = "send OTLP metrics there (default: if OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT is set)"
    otlp.add_argument("--otlp-endpoint", metavar="URL", help=otlp_help)
    otlp.add_argument("--otlp-protocol", choices=("http/protobuf", "grpc"), help="default: http/protobuf")
    wandb = parser.add_argument_group("Weights & Biases (one W&B run per service run)")
    wandb.add_argument("--wandb-project", metavar="NAME", help="log every run to this W&B project")
    wandb.add_argument("--wandb-entity", metavar="NAME")
    wandb.add_argument("--wandb-mode", choices=("online", "offline"), help="default: $WANDB_MODE, else online")
    wandb.add_argument("--wandb-dir", metavar="DIR", help="where W&B writes its run files")
    levels = ("critical", "error", "warning", "info", "debug")
    add("--log-level", default="info", choices=levels, help="uvicorn log level (default: info)")


SHUTDOWN_GRACE = 10  # seconds SIGTERM waits for requests in progress; then they end unanswered


def _token(args: argparse.Namespace) -> str | None:
    if args.token is not None and args.token_file is not None:  # (one would be silently ignored)
        raise ValueError("--token and --token-file: give one of them")
    if args.token_file is not None:
        try:
            token: str = args.token_file.read_text(encoding="utf-8").strip()
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the token file: {exc}") from None
        if not token:  # asked for a token: serving without one would be a silent downgrade
            raise ValueError(f"cannot read the token file: {args.token_file} is empty")
        return token
    given: str | None = args.token
    where = "--token"
    if given is None:  # an empty variable is how shells unset it: no token either
        given, where = os.environ.get(TOKEN_ENV) or None, TOKEN_ENV
    # a blank token is no secret: refuse rather than serve with it or without one
    if given is not None and not given.strip():
        raise ValueError(f"refusing a blank token from {where}: give a real secret (e.g. $(openssl rand -hex 32))")
    return given


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, bound here so that port 0 can report the port it got."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP (else a response
    # sent in two writes waits ~40 ms for a delayed ACK)
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    family, kind, proto, _, address = found[0]
    sock = socket.socket(family, kind, proto)
    try:
        if os.name != "nt":  # a restarted service takes its port back while old connections linger
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ...exporters.otlp import PROTOCOLS
        from ...server import ExportSettings, ServerSettings, create_app
        from ...server.limits import return_large_frees_to_the_os, uvicorn_header_options
        from ...server.security import BindRefused, check_bind
    except ImportError as exc:
        install = "pip install 'staleness-metrics[server]'"
        return failed("serve", f"{exc}; install the server extra: {install}")

    otlp = args.otlp_endpoint is not None or any(map(os.environ.get, OTLP_ENDPOINT_ENVS))
    names = ("otlp_endpoint", "otlp_protocol", "wandb_project", "wandb_entity", "wandb_mode", "wandb_dir")
    exporters = ExportSettings(otlp=otlp, **{name: getattr(args, name) for name in names})
    data_dir = None if args.in_memory else args.data_dir
    try:
        token = _token(args)  # a token file unreadable, empty or not UTF-8, or a blank token
        if not 0 <= args.port <= 65535:  # the socket layer would silently wrap a larger port
            raise ValueError(f"--port must be 0..65535, got {args.port}")
        check_bind(args.host, token)
        # checked as the flag is: else every run would lack OTLP, said only in a log line
        env = next(filter(os.environ.get, OTLP_PROTOCOL_ENVS), None)  # (the one the exporter reads)
        if otlp and args.otlp_protocol is None and env and os.environ[env].strip() not in PROTOCOLS:
            raise ValueError(f"${env}: expected {' or '.join(PROTOCOLS)}, got {os.environ[env]!r}")
        if args.max_header_bytes < 1024:
            raise ValueError("--max-header-bytes must be >= 1024")
        if not args.header_timeout > 0:
            raise ValueError("--header-timeout must be > 0")
        copied = ("protect_reads", "max_body_bytes", "body_bytes_per_span_row")
        from_args = {name: getattr(args, name) for name in copied}
        settings = ServerSettings(token=token, exporters=exporters, data_dir=data_dir, **from_args)
    except ConfigError as exc:  # a setting named as its flag is
        return failed("serve", f"--{str(exc.field).replace('_', '-')}: {exc.reason}")
    except (ValueError, BindRefused) as exc:
        return failed("serve", exc)
    return_large_frees_to_the_os()  # a large body's memory goes back to the OS once applied
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        return failed("serve", f"cannot listen on {args.host}:{args.port}: {exc}", 1)
    try:
        app = create_app(settings)  # restores the stored runs, before the URL is announced
    except Exception as exc:  # an unreadable or foreign data directory: say so, do not start empty
        sock.close()
        return failed("serve", f"cannot load the data directory {data_dir}: {exc}", 1)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"staleness-metrics service on http://{shown}:{port} (API: /docs; metrics: /metrics; "
        f"token: {'required on writes' if token else 'none (loopback only)'}; "
        f"data: {data_dir if data_dir is not None else 'in memory only'})",
        flush=True,
    )
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE,
        **uvicorn_header_options(args.max_header_bytes, args.header_timeout),
    )
    with sock:
        uvicorn.Server(config).run(sockets=[sock])
    return 0
