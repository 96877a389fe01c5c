"""The SGLang API key: servers started with `--api-key K` answer 401 to any request but health
checks unless it carries `Authorization: Bearer K`.

The user's key comes from the environment (SGLANG_API_KEY), never from a recipe: a secret must not
sit in a recipe file, its sha256 or a run's records. When it is set, the client sends it to every
server, servers it launches get it, and `rlrecipe serve` requires it. Without it, each fleet of
servers a run launches draws a key of its own (`fleet_key`): its servers then refuse every other
client, answering with that key proves a server is the fleet's own (`sglang/ownership.py`), and
it goes to that fleet's servers only, never to attached ones (`rollout.urls`) or another fleet's.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets

ENV = "SGLANG_API_KEY"
REDACTED = "***"
# a key in text that may quote another run's command line or SGLang's logged arguments: what follows
# --api-key (or --admin-api-key), as a separate argument or after "=", and SGLang's api_key='...'
_KEY_IN_TEXT = re.compile(r"""(--(?:admin-)?api-key[= ]|\b(?:admin_)?api_key=['"]?)(?!None\b)[^\s'",)]+""")


def user_key() -> str | None:
    """The user's key (SGLANG_API_KEY), which every server is sent; None when unset."""
    return os.environ.get(ENV) or None


def fleet_key() -> str:
    """The key a fleet of launched servers gets: the user's, else one drawn for that fleet alone
    (never written anywhere but its servers' command lines and environments)."""
    return user_key() or secrets.token_hex(24)  # hex: never read as a flag (a leading "-")


def key_env(key: str | None) -> dict[str, str]:
    """The environment a launched server reads the key from (`rlrecipe serve`, serve.sh)."""
    return {ENV: key} if key else {}


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def anonymous_headers() -> dict[str, str]:
    """Which process sent a request (a server's access log can tell one run's requests from
    another's), and no key: what goes to a server not yet proven the run's own."""
    return {"User-Agent": f"rlrecipe pid/{os.getpid()}"}


def client_headers(key: str | None) -> dict[str, str]:
    """What every request to a fleet's servers carries: its key, and which process sent it."""
    return {**auth_headers(key), **anonymous_headers()}


def redact(text: str, key: str | None = None) -> str:
    """`text` as the project writes it (errors, logs): `key`, and any key given by its flag, masked."""
    if key:
        text = text.replace(key, REDACTED)
    return _KEY_IN_TEXT.sub(lambda m: m.group(1) + REDACTED, text)


def is_authorized(path: str, authorization: str | None, key: str | None) -> bool:
    """As SGLang's middleware: no key, or a /health... path, or the right bearer token."""
    if key is None or path.startswith("/health"):
        return True
    if authorization is None:
        return False
    # constant time: how long the comparison takes says nothing about how much of the key was right
    return hmac.compare_digest(authorization.encode("utf-8", "surrogateescape"),
                               f"Bearer {key}".encode("utf-8", "surrogateescape"))
