"""Whether the server answering on a port is the one this run launched.

A port is tested free before a server starts, but SGLang binds it only once its model has loaded
(20-40 s on a CPU): another process may take it in between, answer our health probe, and then be
sent our weights. So a launched server proves it is ours before anything else is sent to it, at
start and at every restart:

- the socket listening on its port belongs to its process group (Linux: /proc/net/tcp and the
  group's open files; no request is sent, so a server of another run never hears from us);
- where it was given an API key (`api_key.fleet_key`), it refuses a request without the key and
  takes one with it: only the process we gave the key to can do both.

Until then it hears no key: its health probe goes without one, and so does the first request of
the proof, which a server taking any client fails.

A port held by another process ends the start-up in one line naming that process (its command
line, with any key on it masked: another run's server may carry its own). `rollout.sglang.
ownership_proof` picks the checks: both (default), the key alone ("key": a launch_cmd through a
container, whose port another process holds), or none ("off"). Attached servers
(`rollout.urls`) are not checked: the user chose them.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import requests

from rlrecipe.core.errors import UserError
from rlrecipe.rollout.sglang.api_key import anonymous_headers, client_headers, redact

PROC_NET = ("/proc/net/tcp", "/proc/net/tcp6")
TCP_LISTEN = "0A"
# a route no server has: a key check answers before routing (401), a taken key gives 404, and
# nothing is done or forwarded (a router passes no unknown route on)
PROOF_PATH = "/rlrecipe_ownership_proof"
PROOF_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PortOwner:
    """Who listens on a port, as seen from /proc: "ours" (the launched server's group), "foreign"
    (only other processes), "none" (nobody yet), or "unknown" (no /proc to read)."""

    state: str
    holder: str = ""  # the foreign process, as far as this user can see it


def _ip(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _host_ips(host: str) -> set:
    try:
        return {ipaddress.ip_address(a[4][0].split("%")[0]) for a in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return set()


def listening_inodes(host: str, port: int) -> set[int] | None:
    """Inodes of the sockets listening on `port` that a connection to host:port could reach (the
    host's own addresses or a wildcard); None where /proc/net cannot be read (not Linux)."""
    ips, inodes, read = _host_ips(host), set(), False
    for table in PROC_NET:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != TCP_LISTEN:
                continue
            addr, _, hex_port = f[1].rpartition(":")
            if int(hex_port, 16) != port:
                continue
            ip = _ip(addr)
            if ip.is_unspecified or ip in ips or getattr(ip, "ipv4_mapped", None) in ips:
                inodes.add(int(f[9]))
    return inodes if read else None


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _group_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[2])  # fields after "(comm)": state, ppid, pgrp


def _sockets_of(pid: int) -> set[int]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    out = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    cmd = redact(" ".join(cmd.split()))  # one line; another run's server may hold its key on its command line
    return f"PID {pid}" + (f": {cmd[:160]}" if cmd else "")


def port_owner(host: str, port: int, group: int) -> PortOwner:
    """Who listens on host:port, against the process group `group` (a launched server's)."""
    inodes = listening_inodes(host, port)
    if inodes is None:
        return PortOwner("unknown")
    if not inodes:
        return PortOwner("none")
    pids = _pids()
    if any(inodes & _sockets_of(pid) for pid in pids if _group_of(pid) == group):
        return PortOwner("ours")
    holders = [pid for pid in pids if inodes & _sockets_of(pid)]
    return PortOwner("foreign", _describe(holders[0]) if holders else "a process this user cannot see")


def url_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def taken_error(label: str, url: str, pid: int, holder: str) -> UserError:
    host, port = url_port(url)
    return UserError(f"{label} ({url}): port {port} on {host} is held by another process ({holder}), not by the "
                     f"server this run launched (PID {pid}); nothing was sent to it. Another run on this machine "
                     "probably took the port first: set rollout.sglang.base_port (or router_port) to a free one; "
                     "or, where the launch_cmd's server listens through another process (a container's port "
                     "forwarding), set rollout.sglang.ownership_proof: key")


def foreign_holder(url: str, pid: int) -> str | None:
    """The process holding a launched server's port when it is not the server's (None: ours, free,
    or not known)."""
    host, port = url_port(url)
    owner = port_owner(host, port, pid)
    return owner.holder if owner.state == "foreign" else None


def key_proof(url: str, owned: bool, key: str | None) -> str | None:
    """None when the server at `url` is ours by its `key`, or (`owned`: its socket is ours) takes no
    key at all; else why it is not. A server holding the key refuses a request without it."""
    if key is None:
        return None if owned else "no API key to prove it by and no /proc to see its socket"
    try:
        bare = requests.get(url + PROOF_PATH, headers=anonymous_headers(), timeout=PROOF_TIMEOUT_S).status_code
        if bare != 401 and not owned:  # a stranger that takes any client: refused before it hears the key
            return "it answers without the API key this run gave its server"
        keyed = requests.get(url + PROOF_PATH, headers=client_headers(key), timeout=PROOF_TIMEOUT_S).status_code
    except requests.RequestException as err:
        return f"{PROOF_PATH} failed: {type(err).__name__}"
    if keyed == 401:
        return "it refuses this run's API key (another server, started with a key of its own)"
    return None


def prove_ours(label: str, url: str, pid: int, key: str | None, by_socket: bool = True) -> None:
    """Raise unless the server answering at `url` is the one launched as process group `pid` (with
    `key`, where it was given one); without `by_socket` (ownership_proof: key), by its key alone."""
    owned = False
    if by_socket:
        host, port = url_port(url)
        owner = port_owner(host, port, pid)
        if owner.state == "foreign":
            raise taken_error(label, url, pid, owner.holder)
        owned = owner.state == "ours"
    elif key is None:
        raise UserError(f"{label} ({url}): rollout.sglang.ownership_proof is key, but there is no API key to prove "
                        "it by (rlrecipe rollout-servers draws none): set SGLANG_API_KEY")
    why = key_proof(url, owned=owned, key=key)
    if why is not None:
        raise UserError(f"{label} ({url}) answers, but not as the server this run launched (PID {pid}): {why}; "
                        "nothing more is sent to it. Set rollout.sglang.base_port (or router_port) to a free port")
