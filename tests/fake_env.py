"""A tiny BatchedEnv for tests: same observation keys as the simulator, a reward the policy can learn.

Each episode draws a target steering value ``target`` in [-0.8, 0.8]; it is visible in ``measurements[7]`` and as
a column of pixels in BEV channel 1. Reward per step: ``1 - |steer - target| - 0.5 * |throttle - 0.5|`` (at most 1).
Episodes truncate after ``episode_length`` steps; a steer more than 1.2 away from the target terminates the
episode as a static collision. Finished rows carry ``episode/...`` statistics like the simulator's.

Selected from the CLI with ``env.name=tests.fake_env:make_fake_env``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from envs.api import BatchedEnv, StepResult, TensorSpec


class FakeDrivingEnv(BatchedEnv):
    def __init__(
        self,
        num_envs: int,
        device: str | torch.device = "cpu",
        seed: int = 0,
        bev_size: int = 32,
        bev_channels: int = 10,
        episode_length: int = 16,
        keep_final_obs: bool = False,
        route_split: str = "train",
        built_marker: str = "",
        **_ignored: object,
    ) -> None:
        if built_marker:  # a file touched once the env is built, for tests that wait for a stage (an evaluation)
            Path(built_marker).touch()
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.bev_size, self.bev_channels = bev_size, bev_channels
        self.episode_length = episode_length
        self.keep_final_obs = keep_final_obs
        self.observation_spec = {
            "bev": TensorSpec((bev_channels, bev_size, bev_size), torch.uint8, 0, 255),
            "measurements": TensorSpec((8,), torch.float32),
            "value_measurements": TensorSpec((10,), torch.float32),
        }
        self.seed_offset = 10_000 if route_split == "eval" else 0
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed + self.seed_offset)
        self.target = torch.zeros(num_envs)
        self.t = torch.zeros(num_envs, dtype=torch.long)
        self.ret = torch.zeros(num_envs)
        self.bad = torch.zeros(num_envs)
        self.last_action = torch.zeros(num_envs, 2)

    # -- helpers ----------------------------------------------------------------------------------------------------
    def _new_targets(self, rows: torch.Tensor) -> None:
        n = int(rows.numel())
        self.target[rows] = (torch.rand(n, generator=self.gen) * 1.6 - 0.8)
        self.t[rows] = 0
        self.ret[rows] = 0
        self.bad[rows] = 0
        self.last_action[rows] = 0

    def _obs(self) -> dict[str, torch.Tensor]:
        B, S = self.num_envs, self.bev_size
        bev = torch.zeros(B, self.bev_channels, S, S, dtype=torch.uint8)
        bev[:, 0, S // 2 :, :] = 255  # "road"
        cols = ((self.target + 1) / 2 * (S - 1)).round().long()
        bev[torch.arange(B), 1, :, cols] = 255
        meas = torch.zeros(B, 8)
        meas[:, :2] = self.last_action
        meas[:, 7] = self.target
        vmeas = torch.zeros(B, 10)
        vmeas[:, 0] = 1 - self.t.float() / self.episode_length
        return {
            "bev": bev.to(self.device),
            "measurements": meas.to(self.device),
            "value_measurements": vmeas.to(self.device),
        }

    # -- API --------------------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> dict[str, torch.Tensor]:
        if seed is not None:
            self.seed = seed
            self.gen.manual_seed(seed + self.seed_offset)
        self._new_targets(torch.arange(self.num_envs))
        return self._obs()

    def step(self, action: torch.Tensor) -> StepResult:
        if torch.isnan(action).any():
            raise ValueError("NaN action")
        a = action.detach().float().cpu().clamp(-1, 1)
        err = (a[:, 0] - self.target).abs()
        reward = 1.0 - err - 0.5 * (a[:, 1] - 0.5).abs()
        self.last_action = a
        self.t += 1
        self.ret += reward
        self.bad += (err > 0.5).float()
        terminated = err > 1.2
        truncated = (self.t >= self.episode_length) & ~terminated
        done = terminated | truncated
        info: dict[str, torch.Tensor] = {}
        if self.keep_final_obs:
            for k, v in self._obs().items():
                info[f"final_obs/{k}"] = v
        if bool(done.any()):
            rc = 100.0 * self.t.float() / self.episode_length
            infr_score = 0.65 ** terminated.float()
            km = self.t.float() * 0.01
            info.update({
                "episode/return": self.ret.clone(),
                "episode/length": self.t.float(),
                "episode/route_completion": rc,
                "episode/infraction_score": infr_score,
                "episode/driving_score": rc * infr_score,
                "episode/km": km,
                "episode/infractions/collision_static": terminated.float(),
                "episode/infractions/off_road": self.bad.clone(),
                "episode/termination/collision": terminated.float(),
                "episode/termination/route_completed": truncated.float(),
            })
            info = {k: v.to(self.device) for k, v in info.items()}
            self._new_targets(done.nonzero(as_tuple=True)[0])
        return StepResult(self._obs(), reward.to(self.device), terminated.to(self.device), truncated.to(self.device), info)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "gen": self.gen.get_state(), "target": self.target.clone(), "t": self.t.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self.gen.set_state(state["gen"])
        self.target, self.t = state["target"].clone(), state["t"].clone()


def make_fake_env(num_envs: int, device: str | torch.device = "cpu", seed: int = 0, **options: object) -> FakeDrivingEnv:
    """Factory with :func:`envs.make_env`'s signature (minus the backend name)."""
    return FakeDrivingEnv(num_envs, device, seed, **options)  # type: ignore[arg-type]
