"""Servers that come back after a failure, so a multi-day run does not shrink server by server.

With `rollout.sglang.retry_on_other_servers`, a server that dies or stops answering is left out and
its requests go to the others (`sglang/engine.py`). Two things bring it back:

- a server the run launched itself is started again at once, in the background, at most
  `rollout.sglang.max_restarts` times (`rlrecipe rollout-servers` does the same for its own);
- any server left out, launched or attached (`rollout.urls`), that answers /health_generate again
  is taken back at the next weight update, which is what gives it the current policy: it never
  samples with the weights it started with.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.rollout.sglang.health import probe_health
from rlrecipe.rollout.sglang.server import ServerProcess

STOP_S = 5.0  # a server given up on needs no long goodbye: SIGKILL follows SIGTERM after this
PROBE_S = 2.0  # one health probe of a server left out, at a weight update (side by side)


class ServerRecovery:
    def __init__(self, servers: Sequence[ServerProcess], max_restarts: int):
        self.servers = list(servers)  # those this engine launched (index = server index)
        self.restarts_left = {i: max_restarts for i in range(len(self.servers))}
        self._lock = threading.Lock()  # start vs close: nothing is started once the engine closes
        self._threads: list[threading.Thread] = []
        self._closed = False

    def restart(self, i: int) -> bool:
        """Start launched server i again in the background; False when it is not ours or has no
        restarts left."""
        if self.restarts_left.get(i, 0) <= 0:
            return False
        self.restarts_left[i] -= 1
        server = self.servers[i]
        console.print(f"starting {server.label} again ({self.restarts_left[i]} restarts left); it is taken back "
                      "at the first weight update after it answers", highlight=False, soft_wrap=True)
        thread = threading.Thread(target=self._restart, args=(server,), name=f"restart-server-{i}", daemon=True)
        self._threads.append(thread)
        thread.start()
        return True

    def _restart(self, server: ServerProcess) -> None:
        server.stop(timeout=STOP_S)  # a hung one is killed; a dead one's group is cleared
        with self._lock:
            if not self._closed:
                server.start()

    def answering(self, candidates: Sequence[int], urls: Sequence[str]) -> list[int]:
        """Those of `candidates` (servers left out) that answer /health_generate now."""
        if not candidates:
            return []

        def answers(i: int) -> bool:
            server = self.servers[i] if i < len(self.servers) else None
            if server is None:
                return probe_health(urls[i], PROBE_S) is None
            if not server.alive():
                return False  # dead, or its restart has not begun
            try:  # a restarted server proves it is ours before it is taken back (sglang/ownership.py)
                server.check_port()
                if probe_health(urls[i], PROBE_S) is not None:
                    return False
                server.prove_ours()
            except UserError as err:
                console.print(f"[yellow]warning[/]: {err}; it stays left out", highlight=False, soft_wrap=True)
                server.stop(timeout=STOP_S)
                return False
            return True

        with ThreadPoolExecutor(max_workers=min(32, len(candidates))) as pool:
            up = list(pool.map(answers, candidates))
        return [i for i, ok in zip(candidates, up, strict=True) if ok]

    def close(self) -> None:
        """No more starts; restarts under way finish their stop (the engine stops the servers)."""
        with self._lock:
            self._closed = True
        for thread in self._threads:
            thread.join(timeout=STOP_S + 15.0)
