"""One process at a time in a run directory.

The lock is an OS file lock (`filelock`, flock on Unix): the kernel drops it when its process
dies, even by SIGKILL, so a killed run never blocks the next one. Beside it an owner file
names the holder; it is removed on a clean release, so finding it while taking the lock means
the previous holder died holding it, and we say so.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout

from rlrecipe.core.errors import UserError

LOCK_NAME = ".lock"
OWNER_NAME = ".lock.owner"


class RunDirBusy(UserError):
    """Another live process holds this run directory."""


def _describe(owner: dict | None) -> str:
    if not owner:
        return "an unknown process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"pid {owner.get('pid')} on {owner.get('host')} (started {started})"


class RunLock:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._owner = self.directory / OWNER_NAME
        # timeout 0: a second launch is refused at once rather than queued behind a multi-day run
        self._lock = FileLock(str(self.directory / LOCK_NAME), timeout=0)

    def _read_owner(self) -> dict | None:
        try:
            owner = json.loads(self._owner.read_text())
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a dead holder's lock was taken over."""
        try:
            self._lock.acquire()
        except Timeout:
            raise RunDirBusy(f"{self.directory}: in use by {_describe(self._read_owner())}; wait for it to end "
                             "or choose another run.name") from None
        previous = self._read_owner()
        note = None
        if previous is not None:  # the kernel gave us the lock, so that process is gone
            note = (f"{self.directory}: taking over the stale lock of {_describe(previous)}, "
                    "which ended without releasing it")
        self._owner.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                           "started": time.time()}))
        return note

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def release(self) -> None:
        if self._lock.is_locked:
            self._owner.unlink(missing_ok=True)
            self._lock.release(force=True)
