"""Child processes out of a terminal's reach.

A terminal's Ctrl-C (SIGINT) and hang-up (SIGHUP) go to every process of its foreground
process group, children included; they are the `asyncllm` process's to act on. A child
started by `start_child` has them blocked from its first instruction on (the mask
survives exec, and so covers the imports before its main()), calls
`ignore_terminal_signals` in its main(), and follows its parent through its stdin's EOF.
What it starts inherits the mask. Both sides use it: the host for the engine core and the
tokenizer process, the core for its workers.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGHUP})


def start_child(cmd: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd, ...)` with TERMINAL_SIGNALS blocked in the child. Only the
    calling thread's signal mask changes, and only during the call: thread-safe, with no
    `preexec_fn` (unsafe where threads run)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        return subprocess.Popen(cmd, **popen_kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_terminal_signals() -> None:
    """In a child's main(): TERMINAL_SIGNALS ignored for good (one that arrived while
    blocked is discarded), even if a library later unblocks them."""
    for sig in TERMINAL_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
