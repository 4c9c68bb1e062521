"""Stopping a training run on SIGINT / SIGTERM without losing it: the loop asks :class:`StopRequest` between steps,
saves last.pt and exits 0; work that may run for minutes without a checkpoint at stake (an evaluation) stops at
once inside :meth:`StopRequest.at_once`."""
from __future__ import annotations

import contextlib
import signal
import sys
from typing import Any, Iterator


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop finishes the current env step, saves last.pt and exits 0. During a
    periodic evaluation, and once the checkpoints are saved (the final evaluations), a signal stops at once
    (:meth:`at_once`)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self.immediate = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.immediate or (self.requested and signum == signal.SIGINT):  # a second Ctrl-C aborts at once
            self.signal_name = signal.Signals(signum).name
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        print(f"\n{self.signal_name} received: finishing the current step, then saving last.pt", file=sys.stderr, flush=True)

    def __call__(self) -> bool:
        return self.requested

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Inside, a signal stops at once (KeyboardInterrupt): for work with no checkpoint write in flight (a periodic
        evaluation, the final ones)."""
        self.immediate = True
        try:
            yield
        finally:
            self.immediate = False
