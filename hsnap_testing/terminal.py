"""A child process started as a terminal starts a command: Ctrl-C (SIGINT) reaches it and raises KeyboardInterrupt.

A process that starts with SIGINT ignored or blocked keeps it so (Python installs its KeyboardInterrupt handler only
over the default, as a shell's background job expects), and both dispositions are inherited from whoever started it:
a test that sends SIGINT to the command it runs starts that command with SIGINT at its default, unblocked.
"""

from __future__ import annotations

import signal

__all__ = ["sigint_as_at_a_terminal"]


def sigint_as_at_a_terminal() -> None:
    """``preexec_fn`` of ``subprocess.Popen``: SIGINT unblocked and at its default in the child."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
