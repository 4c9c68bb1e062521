"""CARLA backend: managed CARLA servers and env workers on the real ``carla`` client.

Modules (one job each):

* :mod:`envs.carla.servers` -- launch, probe, monitor, kill and restart ``CarlaUE4.sh`` processes on disjoint ports.
* :mod:`envs.carla.mapping` -- CARLA world -> the built-in simulator's map, routes and actor tensors.
* :mod:`envs.carla.worker` -- one environment on one CARLA server (the simulator core with CARLA's parts).
* :mod:`envs.carla.vector` -- N workers in subprocesses behind :class:`envs.api.BatchedEnv`; ``make_carla_env``.

The Leaderboard 2.0 agent, which loads a trained policy, is ``carl.deploy.leaderboard_agent`` (``envs`` never imports
``carl``). Importing this package does not import ``carla``; modules that need the client import it on use.
"""
