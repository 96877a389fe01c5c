"""rlrecipe: reproducible recipes for RL from verifiable rewards on reasoning LLMs."""

from rlrecipe.core.library_notices import quiet_known_notices
from rlrecipe.core.threads import default_wait_policy

default_wait_policy()  # before anything imports torch: see rlrecipe/core/threads.py
quiet_known_notices()
