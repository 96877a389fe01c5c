"""The project's one rich console, on stderr: progress and notes for people, stdout left for data.

One shared object so that `console.quiet = True` (the non-zero ranks of a distributed run)
silences every module at once. A leaf module: it imports nothing from the project.
"""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=True)
