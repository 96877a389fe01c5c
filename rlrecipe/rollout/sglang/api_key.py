"""The SGLang API key: servers started with `--api-key K` answer 401 to any request but health
checks unless it carries `Authorization: Bearer K`.

The key comes from the environment (SGLANG_API_KEY), never from a recipe: a secret must not sit
in a recipe file, its sha256 or a run's records. When it is set, the client sends it with every
request, servers it launches get `--api-key`, and `rlrecipe serve` requires it.
"""

from __future__ import annotations

import hmac
import os

ENV = "SGLANG_API_KEY"


def api_key() -> str | None:
    return os.environ.get(ENV) or None


def auth_headers() -> dict[str, str]:
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def is_authorized(path: str, authorization: str | None, key: str | None) -> bool:
    """As SGLang's middleware: no key, or a /health... path, or the right bearer token."""
    if key is None or path.startswith("/health"):
        return True
    if authorization is None:
        return False
    # constant time: how long the comparison takes says nothing about how much of the key was right
    return hmac.compare_digest(authorization.encode("utf-8", "surrogateescape"),
                               f"Bearer {key}".encode("utf-8", "surrogateescape"))
