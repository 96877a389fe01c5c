"""Whether a server is down, and what a request or a push that failed on one does with
retry_on_other_servers: a server that is down is left out (`ServerFleet.leave_out`) and the work
goes on with the others; one that answered with a failure stops the run, naming it.

A server is down when the fleet launched it and its process exited, or when it does not answer
/health. A rollout node lost mid-run is found so: behind the router by the /generate the router
failed, otherwise by the next push to it (a broadcast push is then made again without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import requests

from rlrecipe.core.errors import UserError

if TYPE_CHECKING:
    from rlrecipe.rollout.sglang.fleet import ServerFleet

DOWN_PROBE_S = 5.0  # a server not answering /health within this is taken as down
EXITED = "its process exited"


def why_down(fleet: ServerFleet, i: int) -> str | None:
    """Why server i counts as down, None when it answers /health."""
    server = fleet.server(i)
    if server is not None and server.proc is not None and not server.alive():
        return EXITED
    try:
        r = fleet.session().get(fleet.urls[i] + "/health", timeout=(DOWN_PROBE_S, DOWN_PROBE_S))
    except requests.RequestException as err:
        return type(err).__name__
    return None if r.status_code == 200 else f"HTTP {r.status_code}"


def leave_out_down(fleet: ServerFleet, what: str = "failed a /generate sent through the router") -> bool:
    """Every live server that is down is left out (`what` failed, without saying on which server: a
    /generate through the router, a broadcast push). True when one was."""
    down = _down(fleet, what)
    for i, error in down:
        fleet.leave_out(i, error)
    return bool(down)


def require_up(fleet: ServerFleet, what: str) -> None:
    """Before a rendezvous of every live server (making a broadcast group, which would wait for a
    missing member until its timeout): one that is down is left out with retry_on_other_servers,
    and stops the run without."""
    for i, error in _down(fleet, what):
        if not fleet.cfg.retry_on_other_servers:
            raise error
        fleet.leave_out(i, error)


def _down(fleet: ServerFleet, what: str) -> list[tuple[int, UserError]]:
    """The live servers that are down, each with the error that names it."""
    down: list[tuple[int, UserError]] = []
    for i in list(fleet.live):
        why = why_down(fleet, i)
        server = fleet.server(i)
        if why == EXITED and server is not None:
            down.append((i, server.crash_error()))
        elif why is not None:
            down.append((i, fleet.down_error(i, why, what, False)))
    return down


def failed_push(fleet: ServerFleet, i: int, error: UserError) -> None:
    """Server i failed a weight push: with retry_on_other_servers, left out if it is down (the push
    goes on without it, and a later push takes it back once it answers); otherwise `error`."""
    if not fleet.cfg.retry_on_other_servers or i not in fleet.live or why_down(fleet, i) is None:
        raise error
    fleet.leave_out(i, error)
