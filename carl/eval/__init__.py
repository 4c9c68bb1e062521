"""Evaluation: ``carl-eval`` (docs/evaluation.md) and the trainer's held-out evaluations.

Modules: :mod:`~carl.eval.benchmarks` (``conf/benchmark/*.yaml`` -> route groups), :mod:`~carl.eval.policies`
(``policy=`` -> expert | random | checkpoint | bundle), :mod:`~carl.eval.loop` (driving: the trainer's
``evaluate``, carl-eval's route groups), :mod:`~carl.eval.store` (the resumable results folder, aggregates),
:mod:`~carl.eval.report` (tables, plots, videos), :mod:`~carl.eval.cli` (``carl-eval`` / ``python -m carl.eval``).
The Leaderboard 2.0 record format is :mod:`envs.metrics.leaderboard`.
"""
from __future__ import annotations


class EvalError(RuntimeError):
    """A benchmark or output folder that cannot be used as asked; the message says why and how to fix it."""
