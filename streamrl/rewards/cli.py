"""Command line: ``reward-server`` (host a reward function) and ``keys generate`` (CURVE key pairs).

``streamrl`` (streamrl/cli.py) mounts these through :func:`register_commands`;
``python -m streamrl.rewards.cli reward-server ...`` works the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial

import zmq

from streamrl import event_loop
from streamrl.rewards.function import RewardFunction
from streamrl.rewards.keys import generate_keypair, load_public_keys
from streamrl.rewards.results import RewardConfigError, RewardFunctionLoadError
from streamrl.rewards.server import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_REQUEST_SAMPLES, RewardServer

#: The line a supervisor (or a test) waits for on stdout: "READY <endpoint actually bound>".
READY_PREFIX = "READY "


def register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``reward-server`` and ``keys`` subcommands; each sets ``func(args) -> int``."""
    server = subparsers.add_parser(
        "reward-server",
        help="serve a Python reward function over ZeroMQ (docs/reward-protocol.md)",
        description="Host FUNCTION (module:function, per-sample or @batched, sync or async) as a reward "
        f"server. Prints '{READY_PREFIX}<endpoint>' on stdout once bound; SIGTERM finishes in-flight "
        "batches, then exits.",
    )
    server.add_argument(
        "function", help="the reward function as module:function (module on PYTHONPATH or in .)"
    )
    server.add_argument(
        "--bind",
        required=True,
        help="endpoint to bind: tcp://HOST:PORT (port 0 = any free port) or ipc://PATH",
    )
    server.add_argument("--workers", type=int, default=4, help="batches scored concurrently (default 4)")
    server.add_argument(
        "--max-pending",
        type=int,
        default=256,
        help="batches accepted (running + queued) before answering 'overloaded' (default 256)",
    )
    server.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to finish in-flight batches (default 30)",
    )
    server.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest incoming message; a peer sending more is disconnected (default 256 MiB)",
    )
    server.add_argument(
        "--max-request-samples",
        type=int,
        default=DEFAULT_MAX_REQUEST_SAMPLES,
        help="most samples one score request may carry; more is a bad_request (default 16384)",
    )
    server.add_argument(
        "--curve-secret-key",
        help="this server's .key_secret file: enables CURVE (encryption + authentication)",
    )
    server.add_argument(
        "--curve-allow",
        action="append",
        metavar="PATH",
        help="client public key file, or a directory of *.key files, allowed to connect (repeatable); "
        "without it any CURVE client may connect",
    )
    server.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    server.set_defaults(func=run_reward_server)

    keys = subparsers.add_parser("keys", help="CURVE key pairs for reward servers and clients")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    generate = key_commands.add_parser(
        "generate",
        help="write NAME.key (public) and NAME.key_secret (secret, 0600) for each name",
        description="Writes DIR/NAME.key and DIR/NAME.key_secret. Give servers their .key_secret and "
        "the clients' .key files (--curve-allow); give clients their .key_secret and the server's .key.",
    )
    generate.add_argument("directory", metavar="DIR")
    generate.add_argument(
        "--name",
        action="append",
        help="key pair name (repeatable; default: 'server' and 'client')",
    )
    generate.add_argument("--force", action="store_true", help="replace existing key files")
    generate.set_defaults(func=run_keys_generate)


def run_reward_server(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Like `python -m`, let module:function name a module in the current directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        allowed = load_public_keys(args.curve_allow) if args.curve_allow else None
        server = RewardServer(
            RewardFunction.from_spec(args.function),
            args.bind,
            workers=args.workers,
            max_pending=args.max_pending,
            grace_s=args.grace_s,
            curve_secret_key=args.curve_secret_key,
            curve_allowed_keys=allowed,
            max_message_bytes=args.max_message_bytes,
            max_request_samples=args.max_request_samples,
        )
        server.bind()
    except (RewardConfigError, RewardFunctionLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    event_loop.run(partial(server.serve_until_signal, ready=_announce))
    # The replies of the batches drained at shutdown are queued in ZeroMQ's I/O thread; the socket's
    # linger only holds while the context lives, and pyzmq does not terminate it at interpreter
    # exit, so without this the process could exit before they are on the wire (seen: a drained
    # batch's reply lost ~1 run in 4). Every socket is closed by now, so term() returns once the
    # queued messages are sent or the 2 s linger is over.
    zmq.Context.instance().term()
    stats = server.statistics()
    logging.getLogger(__name__).info(
        "stopped after %d batches (%d samples, %d sample errors)",
        stats.batches,
        stats.samples,
        stats.sample_errors,
    )
    return 0


def _announce(endpoint: str) -> None:
    print(f"{READY_PREFIX}{endpoint}", flush=True)


def run_keys_generate(args: argparse.Namespace) -> int:
    try:
        for name in args.name or ["server", "client"]:
            public, secret = generate_keypair(args.directory, name, overwrite=args.force)
            print(f"wrote {public} (public) and {secret} (secret)")
    except RewardConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamrl", description="streamrl reward servers and keys")
    register_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
