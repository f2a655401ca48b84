"""`reflow serve-envs`: serve the listed envs (the built-in ones by default) over HTTP (FastAPI on uvicorn).

`reflow/cli.py` registers it with `add_parser(sub)`; FastAPI and uvicorn are imported only when it runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import socket
import sys

from reflow.errors import CommandError, Parser, UsageError, report
from reflow.server.settings import BUILTIN_ENVS, TOKEN_ENV_VAR, ServerSettings, is_loopback, load_token


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), made here so the real port can be printed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:  # in use, not an address of this machine, a privileged port
        sock.close()
        raise CommandError(f"serve-envs cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _env_kwargs(text: str | None) -> dict[str, dict]:
    try:
        kwargs = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise UsageError(f"serve-envs --env-kwargs is not valid JSON ({e})") from None
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) for v in kwargs.values()):
        raise UsageError('serve-envs --env-kwargs must map env ids to kwargs: {"ID": {"name": value}}')
    return kwargs


def _client_kwargs(args: argparse.Namespace) -> dict:
    from reflow.server.client_kwargs import parse_rules  # reads env registrations: not for --help

    return parse_rules(args.allow_client_kwarg or [], list(args.env or BUILTIN_ENVS))


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The settings the command line asks for; a bad token, flag or value is a UsageError."""
    try:
        token = load_token(args.token_file)
    except OSError as e:  # no such file, not readable
        raise UsageError(f"serve-envs --token-file {args.token_file}: {e.strerror or e}") from None
    except ValueError as e:  # too short, or with spaces
        raise UsageError(f"serve-envs: {e}") from None
    if token is None and not args.no_auth:
        raise UsageError(
            f"serve-envs: no token; give --token-file F or set ${TOKEN_ENV_VAR} "
            "(or --no-auth, allowed on a loopback host only)"
        )
    if args.no_auth and not is_loopback(args.host):
        raise UsageError(f"serve-envs: --no-auth is allowed only on a loopback host, not {args.host}")
    try:
        return _settings(args, token)
    except ValueError as e:  # a limit out of range
        raise UsageError(f"serve-envs: {e}") from None


def _settings(args: argparse.Namespace, token: str | None) -> ServerSettings:
    return ServerSettings(
        token=None if args.no_auth else token,
        no_auth=args.no_auth,
        max_sessions=args.max_sessions,
        max_body_bytes=args.max_body_bytes,
        step_timeout_s=args.step_timeout,
        default_deadline_s=min(args.deadline, args.max_deadline),
        max_deadline_s=args.max_deadline,
        max_extend_s=args.max_extend,
        idle_timeout_s=args.idle_timeout,
        reaper_interval_s=min(5.0, args.idle_timeout / 4),
        shutdown_grace_s=args.shutdown_grace,
        max_connections=args.max_connections,
        head_timeout_s=args.head_timeout,
        ws_idle_timeout_s=args.ws_idle_timeout,
        max_idle_envs=args.max_idle_envs,
        env_ids=args.env or None,
        env_kwargs=_env_kwargs(args.env_kwargs),
        client_env_kwargs=_client_kwargs(args),
        allow_host_code=args.allow_host_code,
        allow_uncapped_sandbox=args.allow_uncapped_sandbox,
    )


def cmd_serve_envs(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    try:
        import uvicorn

        from reflow.server.app import create_app
        from reflow.server.connections import uvicorn_options
    except ImportError as e:
        raise CommandError(
            f"serve-envs needs the server extra (pip install 'reflow-rl[server]'): {e}"
        ) from None

    from reflow.server.app import BackendRefused, refuse_backends

    try:  # before the port opens: a server that would run clients' code on the host (or unbounded) never starts
        refuse_backends(settings)
    except BackendRefused as e:
        raise CommandError(f"serve-envs: {e}") from None
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if args.ssl_certfile else "http"
    auth = "no auth" if settings.token is None else "bearer token"
    print(f"reflow serve-envs: listening on {scheme}://{shown}:{port} ({auth})", flush=True)
    if not is_loopback(host) and scheme == "http":
        print(
            "reflow serve-envs: plain HTTP off loopback; put TLS in front or give --ssl-certfile", flush=True
        )
    config = uvicorn.Config(
        create_app(settings),
        log_level=args.log_level,
        access_log=False,
        timeout_keep_alive=75,  # a policy thinks for seconds between steps; keep its connection
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 1,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        **uvicorn_options(settings),  # connection limits, frame size, no compression
    )
    gc.freeze()  # the start-up heap (imports, the app) is never garbage: keep it out of every GC pass
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-envs",
        help="serve envs over HTTP, the built-in ones unless --env lists others (needs the server extra)",
        description=(
            "Serve envs (the built-in ones, or exactly those --env lists) with the session protocol "
            "(POST /v1/sessions, .../step, GET/DELETE /v1/sessions/ID, /v1/envs, /v1/capacity, /healthz; "
            "the same messages as frames on one WebSocket, /v1/ws, which RemoteEnv uses) and, for OpenEnv clients, OpenEnv's /ws "
            "protocol under /openenv/ENV_ID. Auth: a bearer token from --token-file or "
            f"${TOKEN_ENV_VAR}; without one it refuses to start unless --no-auth is given, and --no-auth "
            "works only on a loopback host (and answers only loopback Host and Origin headers). One token "
            "is one tenant: whoever holds it may step or delete any session whose id it knows; serve "
            "clients that must not reach each other from separate servers. An env that would run "
            "model-written code on this host (its sandbox resolved to subprocess: no Docker sandbox image, "
            "no bubblewrap) is refused unless --allow-host-code is given, and one whose sandbox is "
            "bubblewrap with no cgroup to bound it unless --allow-uncapped-sandbox is. Binds to 127.0.0.1 "
            "unless --host says otherwise."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed on start)")
    p.add_argument("--token-file", help=f"file holding the bearer token (else ${TOKEN_ENV_VAR})")
    p.add_argument("--no-auth", action="store_true", help="serve without a token (loopback host only)")
    p.add_argument("--max-sessions", type=int, default=256, help="live sessions at once (429 past it)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--step-timeout", type=float, default=60.0, help="seconds one step may take")
    p.add_argument("--deadline", type=float, default=600.0, help="default session deadline, reset included")
    p.add_argument("--max-deadline", type=float, default=3600.0, help="longest deadline a client may ask")
    p.add_argument(
        "--max-extend",
        type=float,
        default=ServerSettings.max_extend_s,
        help="seconds a session's deadline may move in all for its client's pauses (0: never)",
    )
    p.add_argument("--idle-timeout", type=float, default=300.0, help="close sessions idle this long")
    p.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds in-flight steps get on stop")
    p.add_argument(
        "--max-connections",
        type=int,
        help="open connections, WebSockets included (default: 1024 or 2x sessions)",
    )
    p.add_argument(
        "--head-timeout",
        type=float,
        default=ServerSettings.head_timeout_s,
        help="seconds a request head may take to arrive",
    )
    p.add_argument(
        "--ws-idle-timeout",
        type=float,
        default=ServerSettings.ws_idle_timeout_s,
        help="close WebSockets idle this long",
    )
    p.add_argument(
        "--env",
        action="append",
        metavar="ID",
        help=f"serve exactly these envs (repeatable; default: {', '.join(BUILTIN_ENVS)})",
    )
    p.add_argument("--env-kwargs", help='constructor kwargs per env, JSON: {"reflow/PyCode-v0": {...}}')
    p.add_argument(
        "--allow-client-kwarg",
        action="append",
        metavar="ENV_ID:NAME=TYPE",
        help="a constructor kwarg clients may set on one env, and its values; TYPE: int:LO..HI, "
        "float:LO..HI, bool, choice:A,B,... or tasks (the tasks kwarg: task objects, never a path); "
        "never sandbox (repeatable)",
    )
    p.add_argument(
        "--max-idle-envs",
        type=int,
        default=ServerSettings.max_idle_envs,
        help="idle envs kept for reuse in all, across envs and client kwargs values",
    )
    p.add_argument(
        "--allow-host-code",
        action="store_true",
        help="serve an env even when its model-written code would run on this host, unsandboxed",
    )
    p.add_argument(
        "--allow-uncapped-sandbox",
        action="store_true",
        help="serve an env even when its bubblewrap sandboxes get no cgroup (no memory or pids limit)",
    )
    p.add_argument("--ssl-certfile")
    p.add_argument("--ssl-keyfile")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(fn=cmd_serve_envs)


def main(argv: list[str] | None = None) -> int:
    """`python -m reflow.server.cli ...`: the same as `reflow serve-envs ...`."""
    parser = Parser(prog="reflow")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve-envs", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.fn(args)
    except (Exception, KeyboardInterrupt) as e:  # one line and an exit code, as `reflow` reports them
        return report(e)


if __name__ == "__main__":
    sys.exit(main())
