"""Deployment adapters: a trained policy driving inside an outside system's evaluator.

This layer sits above both carl's trainer and envs' backends and may import both: an adapter joins
:func:`carl.load_policy` to a backend's internals (the CARLA conversion code, the nuPlan map and observation code),
which the rest of ``carl/`` never touches (it goes through ``envs.make_env`` / ``envs.api`` only), while ``envs/``
never imports ``carl``. ``tests/test_layers.py`` checks these rules.

* :mod:`carl.deploy.leaderboard_agent` -- ``CarlAgent``, a CARLA Leaderboard 2.0 agent (Track MAP); docs/carla.md.
* :mod:`carl.deploy.nuplan_planner` -- ``CarlPlanner``, a nuplan-devkit planner; docs/nuplan.md.

Importing this package imports neither adapter (each pulls in torch and its backend). The Leaderboard evaluator loads
its agent by file path with this folder first on ``sys.path``, so modules here must not share a name with a top-level
package (``leaderboard``, ``carla``, ``nuplan``, ...).
"""
