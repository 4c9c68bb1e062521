"""Options of ``env=nuplan`` (:class:`NuplanOptions`): which cached scenarios, how they replay, simulator overrides."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envs.config import Checks


@dataclass
class NuplanOptions:
    """``env.options`` of ``env=nuplan`` (validated once; unknown keys are errors)."""

    cache_dir: str = "data/nuplan_cache"  # the scenario cache (built from data_root when given)
    data_root: str | None = None  # build missing cache files from these logs (maps under <data_root>/maps)
    maps_root: str | None = None  # nuPlan maps; default <data_root>/maps
    split: str | None = None  # e.g. "mini", "val" (nuplan-v1.1/splits/<split>)
    split_yaml: str | None = None  # scenario filter yaml (e.g. val14_split.yaml): its tokens and types
    tokens: tuple[str, ...] | None = None  # only these scenario tokens
    log_names: tuple[str, ...] | None = None  # only scenarios of these logs
    scenario_types: tuple[str, ...] | None = None  # only scenarios of these types
    max_scenarios: int = 64  # scenarios held by one env object (the training pool / evaluation set)
    reactive: bool = False  # IDM vehicles instead of log replay
    red_light: bool = False  # red-light termination (CaRL nuPlan: off)
    route_split: str = "train"  # "train": random scenarios; "eval": each scenario once, in order
    workers: int = 1  # cache build processes
    score: bool = True  # record the per-step trace and report nuPlan's closed-loop score per episode
    run_to_end: bool | None = None  # episodes run to the scenario's last frame, no event ends them (the devkit's
    # closed loop); false: CaRL's training episodes (hard infractions end them, 2 frames before the end). None: eval
    action_order: tuple[str, ...] = ("accel", "steer")  # CaRL nuPlan (§16.1); ("steer", "accel"): the CARLA order
    sim: dict = field(default_factory=dict)  # SimConfig overrides (bev_size, reward, ...)

    def validate(self) -> "NuplanOptions":
        checks = Checks()
        checks.need(self.route_split in ("train", "eval"),
                    f"env.options.route_split={self.route_split!r}: use 'train' or 'eval'")
        checks.need(self.max_scenarios >= 1, f"env.options.max_scenarios={self.max_scenarios}: must be >= 1")
        checks.need(bool(self.cache_dir), "env.options.cache_dir: set the scenario cache folder")
        checks.need(sorted(self.action_order) == ["accel", "steer"],
                    f"env.options.action_order={list(self.action_order)}: use [accel, steer] or [steer, accel]")
        checks.done()
        return self


def check_options(options: dict[str, Any]) -> None:
    """Validate nuPlan's ``env.options`` without building anything: its own keys and ranges, and the keys and types of
    the simulator options under ``sim`` (their values are checked with the scenarios' defaults when the env is
    built)."""
    from envs.config import from_dict
    from envs.sim.config import SimConfig

    opts = from_dict(NuplanOptions, options, "env.options").validate()
    from_dict(SimConfig, opts.sim, "env.options.sim")
