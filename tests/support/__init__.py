"""Test support that is not a test: the CARLA protocol stand-in (:mod:`tests.support.carla_standin`) and process
helpers (:mod:`tests.support.processes`). Kept out of ``envs/`` and ``carl/`` so the runtime packages ship no test
doubles; import it as ``tests.support`` from the repository root, as the tests import ``tests.fake_env``."""
