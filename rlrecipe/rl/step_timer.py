"""Wall seconds of the named parts of a step."""

from __future__ import annotations

import time
from contextlib import contextmanager


class StepTimer:
    """Wall seconds of the named parts of one step: `with timer("train_s"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.time() - t0
