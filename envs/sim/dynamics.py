"""The built-in simulator's car model: a kinematic bicycle referenced at the centre, and its automatic gearbox.

Written once, against an array namespace ``xp`` (``torch`` for the simulator's batched tensors, ``numpy`` for the
test-only CARLA stand-in server, which runs without torch), so that both move a car with the same equations and
constants and a policy sees the same first observations in both. This module imports neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

DRAG = 0.004  # 1/m: quadratic drag, deceleration DRAG * v^2
ROLLING = 0.1  # m/s^2: rolling resistance while moving
GEAR_UP_SPEEDS = (6.0, 11.0, 16.0, 22.0)  # m/s: the automatic gearbox shifts up above each (gear 1 at standstill)


class CarParams(Protocol):
    """What the bicycle needs to know about a car (``SimConfig`` has these fields)."""

    wheelbase: float  # m
    max_steer: float  # rad, front wheel angle at |steer| = 1
    max_accel: float  # m/s^2 at full throttle
    max_brake: float  # m/s^2 at full brake


@dataclass(frozen=True)
class Car:
    """CaRL's ego car (Lincoln MKZ): the values ``SimConfig`` starts from."""

    wheelbase: float = 2.9
    max_steer: float = 0.6
    max_accel: float = 4.0
    max_brake: float = 8.0


def bicycle_step(xp: Any, car: CarParams, xy: Any, yaw: Any, speed: Any, steer: Any, throttle: Any, brake: Any,
                 dt: float) -> tuple[Any, Any, Any, Any]:
    """One step of the kinematic bicycle with its centre of gravity at mid-wheelbase; no reverse.

    ``steer`` in [-1, 1] (positive: the yaw increases), ``throttle`` and ``brake`` in [0, 1]; ``xy`` [..., 2], the
    rest [...]. Returns (xy, yaw, speed, side slip): the yaw is not wrapped (each caller keeps its angle convention),
    the velocity points along yaw + side slip."""
    acc = throttle * car.max_accel - brake * car.max_brake - DRAG * speed * speed - ROLLING * (speed > 0)
    new_speed = xp.clip(speed + acc * dt, min=0.0)
    slip = xp.atan(0.5 * xp.tan(steer * car.max_steer))
    v_mid = 0.5 * (speed + new_speed)
    heading = yaw + slip
    xy = xy + xp.stack((xp.cos(heading), xp.sin(heading)), -1) * (v_mid * dt)[..., None]
    yaw = yaw + v_mid / (car.wheelbase / 2) * xp.sin(slip) * dt
    return xy, yaw, new_speed, slip
