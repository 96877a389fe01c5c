"""SGLang's weight-update session: from 0.5.21, `/update_weights_from_distributed` and
`/update_weights_from_tensor` are refused unless they run between `/begin_weight_update` and
`/end_weight_update` (sglang/srt/managers/scheduler_components/weight_updater.py).

A push opens one on every live server that has it (known from the server's version, or from a 404
on older ones) and closes it, also when the push fails, so the next push can open it again. A
session a killed client left open is closed and opened again, once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.rollout.sglang.versions import Dialect

SESSION_S = 300.0  # opening or closing a session waits for the server's ranks (a barrier), not a load
FAILING_CLOSE_S = 30.0
# SGLang's 400 to /begin_weight_update while a session is open (0.5.21-0.5.23, scheduler_components/
# weight_updater.py): "a weight-update session is already open; call end_weight_update() first"
SESSION_LEFT_OPEN = "session is already open"


class SessionServers(Protocol):
    urls: list[str]
    live: list[int]

    def post(self, i: int, path: str, body: dict, timeout: float | tuple | None = 30.0) -> Any: ...

    def dialect(self, i: int) -> Dialect: ...


def answer(r: Any) -> dict:
    """A control endpoint's JSON {success, message}, or its text as the message."""
    try:
        body = r.json()
    except ValueError:
        return {"message": r.text[:300]}
    return body if isinstance(body, dict) else {"message": str(body)[:300]}


def session(srv: SessionServers, action: str, servers: list[int], failing: bool = False,
            failed: Callable[[int, UserError], None] | None = None) -> list[int]:
    """/begin_weight_update or /end_weight_update on `servers`; those that have a session (a 404:
    a server before 0.5.21). While a push is failing, a close that fails is not raised. `failed(i,
    error)` takes a server that failed to begin: it raises to stop the push (the sessions begun so far
    are closed), or returns and the push goes on without that server."""
    opened = []
    for i in servers:
        try:
            if _session_call(srv, action, i, failing):
                opened.append(i)
        except UserError as err:
            if failing:
                continue
            try:
                (failed or _stop)(i, err)
            except BaseException:
                if action == "begin":
                    session(srv, "end", opened, failing=True)
                raise
    return opened


def _stop(i: int, error: UserError) -> None:
    """Without a `failed` callback, a server that fails its session call stops the push."""
    raise error


def _session_call(srv: SessionServers, action: str, i: int, failing: bool = False) -> bool:
    """/<action>_weight_update on server i: True when it has a session, a UserError naming it when
    the call failed. A close while the push is failing waits less: a server left waiting in a
    collective the push cut answers no sooner than its timeout, and a session left open is closed
    by the next push's begin."""
    if not srv.dialect(i).weight_update_session:
        return False
    wait = FAILING_CLOSE_S if failing else SESSION_S
    r = begin(srv, i) if action == "begin" else srv.post(i, "/end_weight_update", {}, timeout=(30.0, wait))
    if r.status_code == 404:
        return False
    body = answer(r)
    if r.status_code != 200 or not body.get("success", False):
        raise UserError(f"SGLang server {srv.urls[i]} /{action}_weight_update failed: "
                        f"{body.get('message', f'HTTP {r.status_code}')}")
    return True


@contextmanager
def in_session(srv: SessionServers, servers: list[int],
               failed: Callable[[int, UserError], None] | None = None) -> Iterator[None]:
    """A push's updates inside the weight-update session of `servers`, closed after, also when the
    push fails (so the next push can open it again). `failed`: as session's, for a server that fails
    to begin."""
    opened = session(srv, "begin", servers, failed=failed)
    try:
        yield
    except BaseException:
        session(srv, "end", opened, failing=True)
        raise
    session(srv, "end", [i for i in opened if i in srv.live])  # not those left out mid-push (down)


def begin(srv: SessionServers, i: int) -> Any:
    """/begin_weight_update on server i. A session left open (a client killed mid-push) makes every
    later begin a 400 that says so, and only an end closes it: it is closed and begun again, once.
    The end's own answer is not judged: the second begin's decides, and any other failure of the
    first is the caller's error as before."""
    r = srv.post(i, "/begin_weight_update", {}, timeout=(30.0, SESSION_S))
    if r.status_code == 400 and SESSION_LEFT_OPEN in str(answer(r).get("message", "")):
        console.print(f"[yellow]warning[/]: SGLang server {srv.urls[i]} had a weight-update session left "
                      "open (a push that never finished): closed, and this push opens its own", highlight=False,
                      soft_wrap=True)
        srv.post(i, "/end_weight_update", {}, timeout=(30.0, SESSION_S))
        r = srv.post(i, "/begin_weight_update", {}, timeout=(30.0, SESSION_S))
    return r
