"""CARLA's traffic lights as the simulator's light source: its light actors matched to the map's light groups, and
their colours each tick. Used by the CARLA worker and by the Leaderboard agent's mirror."""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from envs.maps.opendrive import carla_to_world
from envs.sim.parts import LightCycle
from envs.sim.state import SimState

log = logging.getLogger(__name__)

LIGHT_MATCH_M = 15.0  # a stop line takes the CARLA light whose trigger volume centre is nearest, within this distance
CARLA_LIGHT_STATE = {0: 2, 1: 1, 2: 0}  # carla.TrafficLightState Red/Yellow/Green -> ours; Off/Unknown -> green


class CarlaLights:
    """CARLA's traffic-light actors -> the map's light groups, and their colours each tick.

    Each signalised stop line of ``world`` takes the light whose trigger-volume centre is nearest (within
    :data:`LIGHT_MATCH_M`); a group takes the light most of its stop lines chose. Lights are static, so the matching
    runs once per connection. Colours are read from the client's latest snapshot (no RPC). ``__call__(group)`` returns
    ``(state 0/1/2, yellow seconds left)`` for light groups [B, N], or None when no CARLA light is in use (the caller
    then falls back to the simulator's cycle); a group no light matched counts as green."""

    def __init__(self, world: Any, cworld: Any, device: torch.device, enabled: bool = True, where: str = "CARLA"):
        self.device = device
        num_groups = int(world.group_junction.shape[0])
        group_light = np.full(max(num_groups, 1), -1, np.int64)
        lights = list(cworld.get_actors().filter("traffic.traffic_light*")) if enabled else []
        if lights and num_groups:
            centres = []
            for tl in lights:
                loc = tl.get_transform().transform(tl.trigger_volume.location)
                centres.append(carla_to_world(loc.x, loc.y))
            centres = np.asarray(centres, np.float64).reshape(-1, 2)
            stop_xy, groups = world.stop_xy.cpu().numpy(), world.stop_group.cpu().numpy()
            d = np.linalg.norm(stop_xy[:, None] - centres[None], axis=-1)
            near, close = d.argmin(1), d.min(1) < LIGHT_MATCH_M
            for g in range(num_groups):
                votes = near[(groups == g) & close]
                if len(votes):
                    group_light[g] = np.bincount(votes).argmax()
        self.actors = lights
        self.group_light = torch.as_tensor(group_light, device=device)
        self.used = sorted(set(group_light[group_light >= 0].tolist()))
        self.state = torch.zeros(max(len(lights), 1), dtype=torch.long, device=device)
        self.yellow = torch.zeros(max(len(lights), 1), device=device)
        if enabled:
            log.info("%s: %d traffic lights, %d of %d light groups matched", where, len(lights),
                     int((group_light >= 0).sum()), num_groups)

    @property
    def matched(self) -> int:
        return int((self.group_light >= 0).sum()) if self.actors else 0

    def read(self) -> None:
        if not self.used:
            return
        state, yellow = self.state.clone(), self.yellow.clone()
        for i in self.used:
            tl = self.actors[i]
            code = int(tl.get_state())
            state[i] = CARLA_LIGHT_STATE.get(code, 0)
            yellow[i] = max(tl.get_yellow_time() - tl.get_elapsed_time(), 0.0) if code == 1 else 0.0
        self.state, self.yellow = state, yellow

    def __call__(self, group: Tensor) -> tuple[Tensor, Tensor] | None:
        if not self.actors:
            return None
        light = self.group_light[group.clamp(min=0)]
        have = (group >= 0) & (light >= 0)
        idx = light.clamp(min=0)
        state = torch.where(have, self.state[idx], torch.zeros_like(idx))
        yellow = torch.where(have, self.yellow[idx], torch.zeros_like(self.yellow[idx]))
        return state, yellow


class CarlaLightSource(LightCycle):
    """CARLA's traffic lights as the light source: the colours of the last read of the :class:`CarlaLights` that
    ``current()`` returns (kept and read by whoever reads the CARLA world); the simulator's cycle model while there
    is none, with ``carla_lights`` off, or on a server without light actors."""

    def __init__(self, current: Callable[[], CarlaLights | None]):
        self.current = current

    def state(self, s: SimState, group: Tensor) -> tuple[Tensor, Tensor]:
        lights = self.current()
        out = lights(group) if lights is not None else None
        return out if out is not None else super().state(s, group)
