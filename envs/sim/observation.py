"""CaRL's observation from the batched state: the 10-channel BEV, the measurement and the value-measurement vectors."""
from __future__ import annotations

import torch
from torch import Tensor

from envs.api import (BEV_CHANNELS, LAYOUT_CARLA, MEASUREMENTS, OBS_BEV, OBS_MEASUREMENTS, OBS_VALUE_MEASUREMENTS,
                      VALUE_MEASUREMENTS, TensorSpec)
from envs.maps.lanegraph import CONTROL_STOP
from envs.maps.rasterize import LAYER_MARKINGS, LAYER_ROAD, LAYER_SHOULDER, LAYER_SPEED_SIGNS, speed_encoding
from envs.reward import RewardConfig
from envs.sim.agents import LIGHT_BRAKE, LIGHT_EMERGENCY, LIGHT_LEFT_BLINKER, LIGHT_RIGHT_BLINKER
from envs.sim.config import SimConfig
from envs.sim.infractions import lane_measures
from envs.sim.parts import Observer
from envs.sim.bev_draw import BevConfig, crop_static, draw_boxes, draw_discs, draw_segments
from envs.sim.world import ForecastFn, LightFn, World

STATIC_LAYERS = {0: LAYER_ROAD, 2: LAYER_MARKINGS, 7: LAYER_SPEED_SIGNS, 9: LAYER_SHOULDER}
MIN_HALF_EXTENT = 0.8  # CaRL draws actor boxes with at least 0.8 m half extent
LIGHT_GREEN, LIGHT_RED = 80, 255  # int(0.315 * 255), 255
YELLOW_FACTOR, YELLOW_RAMP_S = 0.67, 3.0  # yellow is 0.67 * 255 = 170, ramping to 255 over its last 3 s
# CaRL's light boxes: (light bit, value, centre in the vehicle frame (forward, left) m); each 0.5 m half extent,
# drawn over the vehicle's own box.
LIGHT_BOXES = ((LIGHT_EMERGENCY, 22, (0.0, 0.0)), (LIGHT_LEFT_BLINKER, 44, (0.5, 0.5)),
               (LIGHT_RIGHT_BLINKER, 77, (0.5, -0.5)), (LIGHT_BRAKE, 111, (-1.5, 0.0)))
LIGHT_BOX_HALF = 0.5
EVENT_WINDOW = (-20, 150)  # route points around the ego whose stop lines are drawn
STOP_SIGN_RANGE = 20.0  # m ahead at which a stop sign becomes the target


def bev_config(cfg: SimConfig) -> BevConfig:
    return BevConfig(size=cfg.bev_size, ppm=cfg.bev_ppm, ego_from_bottom=cfg.bev_ego_from_bottom)


def upcoming_stop_lines(world: World, route_id: Tensor, route_idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Stop lines on the ego's route near the ego: (stop index [B,E] clamped, route point index [B,E], in-window)."""
    ev_idx = world.route_ev_idx[route_id]
    ev_stop = world.route_ev_stop[route_id]
    rel = ev_idx - route_idx.unsqueeze(1)
    near = (ev_stop >= 0) & (rel >= EVENT_WINDOW[0]) & (rel <= EVENT_WINDOW[1])
    return ev_stop.clamp(min=0), ev_idx, near


def stop_lines_ahead(world: World, route_id: Tensor, route_idx: Tensor, ev_idx: Tensor) -> Tensor:
    """Route metres from the ego's route point to each stop line event ``ev_idx`` [B, E] (negative: passed)."""
    at = world.route_cum[route_id.unsqueeze(1).expand_as(ev_idx), ev_idx.clamp(max=world.route_pts.shape[1] - 1)]
    return at - world.route_cum[route_id, route_idx].unsqueeze(1)


def render_bev(world: World, s, cfg: SimConfig, lights: LightFn) -> Tensor:
    """Draw the 10 CaRL channels for every environment of the state ``s`` (an :class:`envs.sim.env.SimState`)."""
    bc = bev_config(cfg)
    B = s.ego_xy.shape[0]
    out = torch.zeros(B, len(BEV_CHANNELS), bc.size, bc.size, dtype=torch.uint8, device=s.ego_xy.device)
    crop_static(world.raster, list(STATIC_LAYERS.values()), s.ego_xy, s.ego_yaw, bc, out=out,
                out_channels=list(STATIC_LAYERS))
    pose = (s.ego_xy, s.ego_yaw, bc)
    # route: discs at upcoming route points inside junctions
    n = world.route_n[s.route_id].unsqueeze(1)
    k = s.route_idx.unsqueeze(1) + torch.arange(cfg.route_points_drawn, device=s.ego_xy.device)
    in_route = k < n
    k = k.clamp(max=n - 1)
    rid = s.route_id.unsqueeze(1).expand_as(k)
    radius = max(1, round(3 * cfg.bev_ppm / 2.0))
    draw_discs(out[:, 1], world.route_pts[rid, k], radius, 255, in_route & world.route_junction[rid, k], *pose)
    # actors (CaRL: boxes at least MIN_HALF_EXTENT, speed-encoded, a 1 s speed line from the front centre)
    v = s.veh
    v_half = v.half.clamp(min=MIN_HALF_EXTENT)
    v_value = speed_encoding(v.speed)
    draw_boxes(out[:, 3], v.xy, v.yaw, v_half, v_value, v.valid, *pose, max_extent_m=3.5)
    _draw_speed_lines(out[:, 3], v.xy, v.yaw, v_half, v.speed, v_value, v.valid, cfg, pose)
    _draw_vehicle_lights(out[:, 3], v.xy, v.yaw, v.lights, v.valid, pose)
    p = s.ped
    moving_speed = torch.where(p.moving, p.speed, torch.zeros_like(p.speed))
    p_half = torch.full_like(p.xy, MIN_HALF_EXTENT)
    p_value = speed_encoding(moving_speed)
    draw_boxes(out[:, 4], p.xy, p.yaw, p_half, p_value, p.valid, *pose, max_extent_m=1.0)
    _draw_speed_lines(out[:, 4], p.xy, p.yaw, p_half, moving_speed, p_value, p.valid, cfg, pose)
    st = s.statics
    draw_boxes(out[:, 8], st.xy, st.yaw, st.half.clamp(min=MIN_HALF_EXTENT), 255, st.valid, *pose, max_extent_m=3.5)
    # traffic lights and the targeted stop sign, from the stop lines on the route
    stop, ev_idx, near = upcoming_stop_lines(world, s.route_id, s.route_idx)
    is_sign = world.stop_control[stop] == CONTROL_STOP
    group = torch.where(is_sign, torch.full_like(stop, -1), world.stop_group[stop])
    state, yellow_left = lights(group)
    value = torch.where(state == 0, LIGHT_GREEN, torch.where(state == 1, yellow_value(yellow_left), LIGHT_RED)
                        ).to(torch.uint8)
    centre, yaw, width = world.stop_xy[stop], world.stop_yaw[stop], world.stop_width[stop]
    across = torch.stack((-torch.sin(yaw), torch.cos(yaw)), -1) * (width / 2).unsqueeze(-1)
    draw_segments(out[:, 5], centre - across, centre + across, 3.0 / cfg.bev_ppm, value, near & ~is_sign, *pose,
                  max_length_m=8.0)
    ahead_m = stop_lines_ahead(world, s.route_id, s.route_idx, ev_idx)
    targeted = near & is_sign & (ahead_m > -2.0) & (ahead_m < STOP_SIGN_RANGE) & ~s.stop_done.unsqueeze(1)
    box_c = centre - torch.stack((torch.cos(yaw), torch.sin(yaw)), -1) * 2.0
    box_half = torch.stack((torch.full_like(width, 2.0), width / 2), -1)
    draw_boxes(out[:, 6], box_c, yaw, box_half, 255, targeted, *pose, max_extent_m=4.0)
    return out


def yellow_value(yellow_left: Tensor) -> Tensor:
    """CaRL's yellow stop-line value: 170 until 3 s of yellow remain, then a linear ramp to 255 at red."""
    fraction = (yellow_left / YELLOW_RAMP_S).clamp(max=1.0)
    return ((1.0 - fraction * (1.0 - YELLOW_FACTOR)) * 255).long()  # int() truncation as in CaRL


def _draw_speed_lines(canvas: Tensor, xy: Tensor, yaw: Tensor, half: Tensor, speed: Tensor, value: Tensor,
                      valid: Tensor, cfg: SimConfig, pose: tuple) -> None:
    """1-px line from the box's front centre forward by max(1 px, speed x 1 s): where the actor will be in 1 s."""
    heading = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1)
    front = xy + heading * half[..., :1]
    tip = front + heading * speed.clamp(min=1.0 / cfg.bev_ppm).unsqueeze(-1)
    draw_segments(canvas, front, tip, 1.0 / cfg.bev_ppm, value, valid, *pose, max_length_m=36.0)


def _draw_vehicle_lights(canvas: Tensor, xy: Tensor, yaw: Tensor, lights: Tensor, valid: Tensor, pose: tuple
                         ) -> None:
    """CaRL's light boxes (emergency 22, blinkers 44 / 77, brake 111) drawn over the vehicle boxes (they replace
    the speed value there, so they are drawn apart and written where they are set)."""
    c, s_ = torch.cos(yaw).unsqueeze(-1), torch.sin(yaw).unsqueeze(-1)
    offsets = torch.tensor([off for _, _, off in LIGHT_BOXES], device=xy.device)  # [4, 2] (forward, left)
    centres = xy.unsqueeze(2) + torch.stack((c * offsets[:, 0] - s_ * offsets[:, 1],
                                             s_ * offsets[:, 0] + c * offsets[:, 1]), -1)  # [B, A, 4, 2]
    bits = torch.tensor([bit for bit, _, _ in LIGHT_BOXES], dtype=lights.dtype, device=xy.device)
    on = ((lights.unsqueeze(-1) & bits) != 0) & valid.unsqueeze(-1)  # [B, A, 4]
    values = torch.tensor([val for _, val, _ in LIGHT_BOXES], dtype=torch.uint8, device=xy.device).expand_as(on)
    B = xy.shape[0]
    scratch = torch.zeros_like(canvas)
    draw_boxes(scratch, centres.reshape(B, -1, 2), yaw.unsqueeze(-1).expand_as(on).reshape(B, -1),
               torch.full((B, on[0].numel(), 2), LIGHT_BOX_HALF, device=xy.device), values.reshape(B, -1),
               on.reshape(B, -1), *pose, max_extent_m=LIGHT_BOX_HALF)
    canvas.copy_(torch.where(scratch > 0, scratch, canvas))


def measurements(s, speed_limit: Tensor) -> Tensor:
    """CaRL's 8 policy measurements (``envs.api.MEASUREMENTS``): last steer/throttle/brake, gear, ego-frame velocity
    (forward, lateral), forward speed, speed limit. Lateral quantities are positive to the left, like carl's steer
    (CaRL's CARLA frame: right)."""
    vx, v_left = s.ego_vel_local.unbind(-1)
    return torch.stack((s.last_action[:, 0], s.last_action[:, 1], s.last_action[:, 2], s.gear, vx, v_left,
                        vx, speed_limit), -1)


def value_measurements(world: World, s, cfg: SimConfig, reward_cfg: RewardConfig) -> Tensor:
    """CaRL's 10 critic-only values (``envs.api.VALUE_MEASUREMENTS``): time left, time until blocked, route left,
    penalty windows left."""
    remaining = (world.route_n[s.route_id] - 1 - s.route_idx).float() / 100.0
    ttc = s.reward_state.ttc_ticks.float() / max(reward_cfg.ttc_penalty_ticks, 1)
    comfort = s.reward_state.comfort_ticks.float() / max(reward_cfg.comfort_penalty_ticks, 1)
    return torch.cat((
        ((cfg.max_time - s.t) / cfg.max_time).unsqueeze(-1),
        (1.0 - s.still_time / cfg.blocked_time).clamp(0.0, 1.0).unsqueeze(-1),
        remaining.unsqueeze(-1), ttc.unsqueeze(-1), comfort), -1)


class CarlaObserver(Observer):
    """CaRL's CARLA observation (``carl-reference.md`` §2): the 10-channel BEV, 8 measurements and 10 critic values.
    Every backend's default."""

    layout = LAYOUT_CARLA

    def spec(self) -> dict[str, TensorSpec]:
        cfg = self.setup.cfg
        bev = (len(BEV_CHANNELS), cfg.bev_size, cfg.bev_size)
        return {OBS_BEV: TensorSpec(bev, torch.uint8, 0, 255, BEV_CHANNELS),
                OBS_MEASUREMENTS: TensorSpec((len(MEASUREMENTS),), torch.float32, names=MEASUREMENTS),
                OBS_VALUE_MEASUREMENTS: TensorSpec((len(VALUE_MEASUREMENTS),), torch.float32,
                                                   names=VALUE_MEASUREMENTS)}

    def observe(self, s, lights: LightFn, speed_limit: Tensor | None = None,  # noqa: ANN001
                forecast: ForecastFn | None = None) -> dict[str, Tensor]:
        w, cfg = self.setup.world, self.setup.cfg
        if speed_limit is None:
            speed_limit = lane_measures(w, s.ego_xy, s.ego_yaw)["speed_limit"]
        obs = {OBS_MEASUREMENTS: measurements(s, speed_limit),
               OBS_VALUE_MEASUREMENTS: value_measurements(w, s, cfg, cfg.reward)}
        obs[OBS_BEV] = render_bev(w, s, cfg, lights) if cfg.bev else self.blank_bev()
        return obs
