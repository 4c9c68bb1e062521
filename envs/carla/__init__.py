"""CARLA backend: managed CARLA servers, env workers on the real ``carla`` client, and a protocol stand-in for tests.

Modules (one job each):

* :mod:`envs.carla.servers` -- launch, probe, monitor, kill and restart ``CarlaUE4.sh`` processes on disjoint ports.
* :mod:`envs.carla.standin` -- a tiny CARLA 0.9.16 protocol server for tests (not a simulator).
* :mod:`envs.carla.mapping` -- CARLA world -> the built-in simulator's map, routes and actor tensors.
* :mod:`envs.carla.worker` -- one environment on one CARLA server (a :class:`envs.sim.env.SimEnv` subclass).
* :mod:`envs.carla.vector` -- N workers in subprocesses behind :class:`envs.api.BatchedEnv`; ``make_carla_env``.
* :mod:`envs.carla.leaderboard_agent` -- a Leaderboard 2.0 agent driving an exported policy (Track MAP).

Importing this package does not import ``carla``; modules that need the client import it on use.
"""
