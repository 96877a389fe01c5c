"""The SGLang API key: servers started with `--api-key K` answer 401 to any request but health
checks unless it carries `Authorization: Bearer K`.

The key comes from the environment (SGLANG_API_KEY), never from a recipe: a secret must not sit
in a recipe file, its sha256 or a run's records. When it is set, the client sends it with every
request, servers it launches get `--api-key`, and `rlrecipe serve` requires it. A run that launches
its own servers with no key set draws one for itself (`launch_key`): its servers then refuse every
other client, and answering with that key proves a server is the run's own (`sglang/ownership.py`).
"""

from __future__ import annotations

import hmac
import os
import secrets

ENV = "SGLANG_API_KEY"
_drawn: str | None = None  # drawn by this process for the servers it launches, when ENV is unset
_holders = 0  # fleets of launched servers still using the drawn key


def api_key() -> str | None:
    return os.environ.get(ENV) or _drawn


def launch_key() -> str:
    """The key servers this process launches get: SGLANG_API_KEY, else one drawn for them (never
    written anywhere but the servers' own command lines and environments), kept until every fleet
    that took it gives it back (`give_back_key`)."""
    global _drawn, _holders
    _holders += 1
    key = api_key()
    if key is None:
        key = _drawn = secrets.token_hex(24)  # hex: never read as a flag (a leading "-")
    return key


def give_back_key() -> None:
    """A fleet's servers are stopped: once no fleet uses the drawn key, it is forgotten."""
    global _drawn, _holders
    _holders = max(0, _holders - 1)
    if _holders == 0:
        _drawn = None


def key_env() -> dict[str, str]:
    """The environment a launched server reads the key from (`rlrecipe serve`, serve.sh)."""
    key = api_key()
    return {ENV: key} if key else {}


def auth_headers() -> dict[str, str]:
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def anonymous_headers() -> dict[str, str]:
    """Which process sent a request (a server's access log can tell one run's requests from
    another's), and no key: what goes to a server not yet proven the run's own."""
    return {"User-Agent": f"rlrecipe pid/{os.getpid()}"}


def client_headers() -> dict[str, str]:
    """What every request of this client carries: the key, and which process sent it."""
    return {**auth_headers(), **anonymous_headers()}


def is_authorized(path: str, authorization: str | None, key: str | None) -> bool:
    """As SGLang's middleware: no key, or a /health... path, or the right bearer token."""
    if key is None or path.startswith("/health"):
        return True
    if authorization is None:
        return False
    # constant time: how long the comparison takes says nothing about how much of the key was right
    return hmac.compare_digest(authorization.encode("utf-8", "surrogateescape"),
                               f"Bearer {key}".encode("utf-8", "surrogateescape"))
