"""Ports for what a test starts (servers, routers, rendezvous), drawn below the system's ephemeral
range. A port the system hands out (a bind to port 0) is one that any outgoing connection may be
given between the check and the server's own bind; a port below that range is taken only by a
process that asks for it by number."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above the ports services commonly listen on


def _first_ephemeral() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default (macOS's range starts higher still)


POOL = range(LOWEST, max(LOWEST + 1000, _first_ephemeral()))
_draw = random.Random()  # its own: a test that seeds the global generator does not repeat the draws
_given: set[int] = set()  # never handed out twice in one test session


def port_free(port: int) -> bool:
    """Nothing listens on `port` on the loopback address (one left in TIME_WAIT is free, as a server binds)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> int:
    """A base port with n free ports from it on, none handed out before."""
    while True:
        base = _draw.randrange(POOL.start, POOL.stop - n)
        span = range(base, base + n)
        if not _given.intersection(span) and all(port_free(p) for p in span):
            _given.update(span)
            return base


def free_port() -> int:
    return free_ports(1)
