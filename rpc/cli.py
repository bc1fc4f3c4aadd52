"""``hgrt rpc-server --tracker HOST:PORT --key KEY [--host H --port P --allow ADDR|CIDR]``: a TVM
RPC server whose sessions also serve hgrt, refusing clients not in ``--allow`` before the
handshake. hgrt/cli.py adds it through ``register(subparsers)``;
``hgrt run DIR --rpc-tracker HOST:PORT --rpc-key KEY`` is in hgrt/cli.py itself.

``python -m hgrt.rpc.cli rpc-server ...`` runs the server without hgrt/cli.py.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys


def add_rpc_server_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``rpc-server`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "rpc-server", help="start a TVM RPC server that runs hgrt graphs",
        description="Start a TVM RPC server whose sessions serve hgrt's remote executor. With "
                    "--tracker it registers under --key; without, clients connect directly.")
    p.add_argument("--tracker", metavar="HOST:PORT", help="RPC tracker to register with")
    p.add_argument("--key", default="", help="device key clients request (e.g. jetson)")
    p.add_argument("--host", default=None,
                   help="address to listen on (default 127.0.0.1; a board reached over the "
                        "network needs its address or 0.0.0.0, see README 'Security')")
    p.add_argument("--port", type=int, default=9090, help="first port to try (default 9090)")
    p.add_argument("--port-end", type=int, default=None,
                   help="last port to try (default: port + 100)")
    p.add_argument("--custom-addr", default=None,
                   help="address to report to the tracker (default: as the tracker sees it)")
    p.add_argument("--allow", action="append", default=[], metavar="ADDR|CIDR",
                   help="serve only clients from this address or block (repeatable; e.g. "
                        "10.0.0.5 or 10.0.0.0/24); others are disconnected before the "
                        "handshake. Default: any client that reaches the port")
    p.add_argument("--max-session", type=float, default=0.0, metavar="SECONDS",
                   help="end any session after this long, whatever its client asked (default: "
                        "no cap; sessions are served one at a time)")
    p.add_argument("--session-start", choices=["auto", "fork", "spawn"], default="auto",
                   help="how each session's process starts (default auto: fork, or a fresh "
                        "interpreter where a CUDA driver is present, since a process forked "
                        "after TVM's import cannot use the GPU)")
    p.add_argument("--silent", action="store_true",
                   help="no per-session log lines (refused clients are still logged)")
    p.set_defaults(func=run_rpc_server)
    return p


def run_rpc_server(args: argparse.Namespace) -> int:
    """Serve until killed; prints one line with the bound port once it listens."""
    from hgrt.errors import HgrtError
    from hgrt.rpc.server import serve

    if args.tracker and not args.key:
        print("hgrt rpc-server: --tracker needs --key", file=sys.stderr)
        return 2
    try:
        host = listen_address(args.host, args.tracker)
        # --port-end is the last port tried; serve() takes the end of the range
        port_end = args.port_end + 1 if args.port_end is not None else min(args.port + 100, 65536)
        server = serve(host, args.port, port_end, tracker=args.tracker, key=args.key,
                       custom_addr=args.custom_addr, silent=args.silent, allow=args.allow,
                       max_session=args.max_session, session_start=args.session_start)
    except HgrtError as e:
        print(f"hgrt rpc-server: error: {e}", file=sys.stderr)
        return 2
    if not _is_loopback(host):
        who = "anyone who reaches this port" + (" from an --allow address" if args.allow else "")
        print(f"hgrt rpc-server: warning: listening on {host}: {who} runs the code they upload "
              f"(TVM RPC has no authentication; see README 'Security')", file=sys.stderr)

    def stop(signum, frame):  # kill the server and its session processes, then leave
        server.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    where = f"tracker {args.tracker}, key {args.key!r}" if args.tracker else \
        f"standalone, key {args.key!r}"
    if args.allow:
        where += f", clients from {' '.join(args.allow)} only"
    print(f"hgrt rpc-server listening on {host}:{server.port} ({where})", flush=True)
    server.join()
    print("hgrt rpc-server: the server process ended (see the lines above)", file=sys.stderr)
    return 1


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def listen_address(host: str | None, tracker: str | None) -> str:
    """Where the server listens: ``host`` if given; else loopback, which a tracker elsewhere
    could not hand out to its clients, so then the address must be named."""
    if host:
        return host
    if tracker and not _is_loopback(tracker.rpartition(":")[0]):
        from hgrt.errors import InputError

        raise InputError(f"the tracker {tracker} is not on this machine, so its clients reach "
                         f"this server over the network: name the address to listen on with "
                         f"--host (this board's address, or 0.0.0.0)")
    return "127.0.0.1"


def register(subparsers) -> None:
    """Hook hgrt/cli.py calls for optional sub-commands."""
    add_rpc_server_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hgrt.rpc.cli")
    add_rpc_server_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
