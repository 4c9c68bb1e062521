"""Gymnasium front-ends of the built-in simulator, for everyone who is not the trainer (numpy in, numpy out).

``gymnasium.make("carl/Sim-v0", **options)`` gives one environment; ``gymnasium.make_vec("carl/Sim-v0", num_envs=N,
vectorization_mode="vector_entry_point", **options)`` gives the batched simulator behind gymnasium's ``VectorEnv``
API (same-step auto-reset, the terminal observation in ``info["final_obs"]``). ``options`` are
:class:`envs.sim.config.SimConfig` fields.
"""
from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from envs.api import FINAL_OBS, BatchedEnv, final_obs
from envs.config import from_dict
from envs.sim.config import SimConfig
from envs.sim.env import SimEnv

ENV_ID = "carl/Sim-v0"


def observation_space(env: BatchedEnv) -> spaces.Dict:
    def box(spec) -> spaces.Box:
        dtype = np.uint8 if spec.dtype == torch.uint8 else np.float32
        return spaces.Box(spec.low, spec.high, spec.shape, dtype)

    return spaces.Dict({k: box(v) for k, v in env.observation_spec.items()})


ACTION_SPACE = spaces.Box(-1.0, 1.0, (2,), np.float32)


def _numpy(obs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.cpu().numpy() for k, v in obs.items()}


def _info(info: dict[str, torch.Tensor], row: int | slice) -> dict[str, Any]:
    return {k: v[row].cpu().numpy() for k, v in info.items() if not k.startswith(FINAL_OBS)}


class SimGymEnv(gymnasium.Env):
    """One simulator environment. Episodes end on ``terminated``/``truncated``; call ``reset`` to start the next."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, render_mode: str | None = None, device: str = "cpu", **options: Any):
        cfg = from_dict(SimConfig, {**options, "keep_final_obs": True}).validate()
        self.sim = SimEnv(cfg, 1, device)
        self.observation_space = observation_space(self.sim)
        self.action_space = ACTION_SPACE
        self.render_mode = render_mode
        self._last_bev: np.ndarray | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is None:
            seed = int(self.np_random.integers(2**31 - 1))
        obs = _numpy(self.sim.reset(seed=seed))
        self._last_bev = obs.get("bev")  # None for the vector observation (nothing to render)
        return {k: v[0] for k, v in obs.items()}, {}

    def step(self, action):
        r = self.sim.step(torch.as_tensor(np.asarray(action, np.float32)).reshape(1, 2))
        done = bool(r.terminated[0] | r.truncated[0])
        obs = final_obs(r.info) if done else r.obs
        obs = {k: v[0] for k, v in _numpy(obs).items()}
        self._last_bev = obs["bev"][None] if "bev" in obs else None
        info = _info(r.info, 0) if done else {}
        return obs, float(r.reward[0]), bool(r.terminated[0]), bool(r.truncated[0]), info

    def render(self):
        if self.render_mode == "rgb_array" and self._last_bev is not None:
            from envs.sim.render import bev_to_rgb

            return bev_to_rgb(self._last_bev[0])
        return None


class SimVectorEnv(VectorEnv):
    """The batched simulator as a gymnasium ``VectorEnv`` (numpy in and out, same-step auto-reset)."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int, device: str = "cpu", **options: Any):
        cfg = from_dict(SimConfig, {**options, "keep_final_obs": True}).validate()
        self.sim = SimEnv(cfg, num_envs, device)
        self.num_envs = num_envs
        self.single_observation_space = observation_space(self.sim)
        self.single_action_space = ACTION_SPACE
        self.observation_space = gymnasium.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gymnasium.vector.utils.batch_space(self.single_action_space, num_envs)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return _numpy(self.sim.reset(seed=seed)), {}

    def step(self, actions):
        r = self.sim.step(torch.as_tensor(np.asarray(actions, np.float32)))
        info = _info(r.info, slice(None))
        info["final_obs"] = _numpy(final_obs(r.info))
        return (_numpy(r.obs), r.reward.cpu().numpy(), r.terminated.cpu().numpy(), r.truncated.cpu().numpy(), info)


def register() -> None:
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(ENV_ID, entry_point=SimGymEnv, vector_entry_point=SimVectorEnv)


register()
