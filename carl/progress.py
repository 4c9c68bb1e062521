"""How far a training run is: its updates, or with ``ppo.train_for_seconds`` its wall time, whichever is further along.

The schedules (learning rate, the teacher's weight) read :meth:`RunProgress.fraction`, and the loop ends at the last
update or once the budget is spent, so that a recipe sized for one machine finishes its schedule inside the same
wall time on a slower one (on fewer samples). With several ranks the clock is rank 0's, broadcast once per update:
every rank sets the same learning rate and stops after the same update.
"""
from __future__ import annotations

from typing import Callable

from carl.parallel import DistContext


class RunProgress:
    """The run's progress from its update count and, with a budget, its wall clock (``clock``: the run's seconds so
    far, resumes included)."""

    def __init__(self, num_updates: int, train_for_seconds: float, clock: Callable[[], float],
                 ctx: DistContext) -> None:
        self.num_updates, self.budget, self.clock, self.ctx = num_updates, train_for_seconds, clock, ctx
        self.seconds = 0.0
        self.tick()

    def tick(self) -> None:
        """Read the clock (rank 0's); every rank calls this once per update, after it."""
        if self.budget:
            self.seconds = float(self.ctx.broadcast_object(self.clock(), "run clock"))

    def fraction(self, update: int) -> float:
        """The share of the run done before ``update`` (counted from 1), in [0, 1]."""
        done = (update - 1) / self.num_updates
        return min(1.0, max(done, self.seconds / self.budget)) if self.budget else done

    def spent(self) -> bool:
        """Whether the time budget is used up (never without one)."""
        return bool(self.budget) and self.seconds >= self.budget

    def describe(self) -> str:
        """The budget's state for the progress bar and the log ("" without one)."""
        if not self.budget:
            return ""
        return f"budget {self.seconds:,.0f}/{self.budget:,.0f} s"
