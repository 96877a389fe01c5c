"""Notices from libraries that repeat at every start without telling the user anything to do.

DeepSpeed warns that it falls back to its CPU accelerator whenever no GPU is visible: on a machine
without one that is the intended path (env.json records the devices). Only that one message is
dropped; every other DeepSpeed warning still prints.
"""

from __future__ import annotations

import logging


class _DropCpuFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Setting accelerator to CPU")


def quiet_known_notices() -> None:
    logger = logging.getLogger("DeepSpeed")  # the logger DeepSpeed creates later is this one
    if not any(isinstance(f, _DropCpuFallback) for f in logger.filters):
        logger.addFilter(_DropCpuFallback())
