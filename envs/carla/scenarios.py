"""Route scenarios on a CARLA server: the core plays them (activation, scripted motion, overrides: the simulator's
:class:`~envs.sim.scenarios.RouteScenarios`), and this part makes the server show them, so that a CARLA run and a
simulator run play the same route file the same way.

Every scenario actor the state shows is a server actor: spawned when it appears (a car, an emergency vehicle, a
bicycle, a walker or the blocker prop, by its slot), with physics off, moved to the scripted pose after each tick,
destroyed when it leaves the state. The overridden junction lights are set and frozen on the server for as long as
a scenario holds them (CARLA's Traffic Manager then stops the background traffic at them), and released after.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from envs.carla.servers import CLIENT_VERSION, CarlaError
from envs.maps.opendrive import world_to_carla, world_yaw_to_carla
from envs.sim.scenario_world import NUM_GROUPS, VEHICLE_GROUPS
from envs.sim.scenarios import RouteScenarios
from envs.sim.state import SimState

BLUEPRINTS = {  # slot kind -> blueprint patterns, the first the library has (the Leaderboard's own choices first)
    "car": ("vehicle.lincoln.mkz_2020", "vehicle.*"),
    "emergency": ("vehicle.ford.ambulance", "vehicle.carlamotors.firetruck", "vehicle.dodge.charger_police_2020",
                  "vehicle.*"),
    "bicycle": ("vehicle.diamondback.century", "vehicle.*"),
    "walker": ("walker.pedestrian.*",),
    "blocker": ("static.prop.vendingmachine", "static.prop.*"),
}
LIFT = {"car": 0.3, "emergency": 0.3, "bicycle": 0.2, "walker": 1.0, "blocker": 0.1}  # m above the lane


class CarlaScenarios(RouteScenarios):
    """:class:`RouteScenarios` mirrored onto the session's server (see the module docstring)."""

    keeps_slots = False  # the actor source rewrites every slot from the server's reading: every row is played

    def __init__(self, session: Any):
        self.session = session
        self.spawned: dict[tuple[str, int], tuple[str, Any]] = {}  # (state group, slot) -> (kind, server actor)
        self.frozen: set[int] = set()  # light indices we hold
        self.server = None  # the client world our actors live in (a recovered session has a new one)

    def reset(self, s: SimState, rows: Tensor) -> None:
        super().reset(s, rows)
        self.destroy()
        self.mirror(s)

    def step(self, s: SimState) -> None:
        super().step(s)
        self.mirror(s)

    def refresh(self, s: SimState) -> None:
        """CARLA's actor source rewrites every slot from the server's reading: write the scenario actors again."""
        if self.on:
            self._write(s, self.group_scenario(s.scn))

    def mirror(self, s: SimState) -> None:
        """The state's scenario actors and light overrides onto the server (batch of one)."""
        if not self.on or self.session.crashed:
            return
        fresh = self.server is not self.session.cworld
        if fresh:  # a new server: the old actors and lights went with the old one
            self.forget()
            self.server = self.session.cworld
        try:
            if fresh:  # every blueprint the part may spawn, at the first reset: a lacking one is named up front
                for kind in BLUEPRINTS:
                    _blueprint(self.session, kind)
            self._actors(s)
            self._lights(s)
        except CarlaError:  # a blueprint the server lacks: a setup problem no restart mends
            raise
        except RuntimeError as e:  # the server is gone: the session recovers it and the episode counts as lost
            self.session.mark_crash(e)

    def _slots(self, s: SimState) -> list[tuple[str, int, str, Tensor, Tensor, bool]]:
        """(state group, slot, blueprint kind, xy, yaw, shown) of every scenario slot of row 0."""
        tab, c = self.tab, s.scn
        g = self.group_scenario(c)[0]
        out = []
        v0, p0, o0 = self.veh0, self.ped0, self.sta0
        for k, group in enumerate(self.slot_group.tolist()):
            kind = "car" if group == 0 else ("emergency" if bool(tab.emergency[g[group]]) else "bicycle")
            out.append(("veh", k, kind, s.veh.xy[0, v0 + k], s.veh.yaw[0, v0 + k], bool(s.veh.valid[0, v0 + k])))
        for k in range(NUM_GROUPS - len(VEHICLE_GROUPS)):
            out.append(("ped", k, "walker", s.ped.xy[0, p0 + k], s.ped.yaw[0, p0 + k], bool(s.ped.valid[0, p0 + k])))
            out.append(("static", k, "blocker", s.statics.xy[0, o0 + k], s.statics.yaw[0, o0 + k],
                        bool(s.statics.valid[0, o0 + k])))
        return out

    def _actors(self, s: SimState) -> None:
        sess = self.session
        carla = sess.carla
        for where, k, kind, xy, yaw, shown in self._slots(s):
            key = (where, k)
            had_kind, actor = self.spawned.get(key, (None, None))
            if actor is not None and (not shown or had_kind != kind):
                self.spawned.pop(key)
                actor.destroy()
                actor = None
            if not shown:
                continue
            x, y = world_to_carla(float(xy[0]), float(xy[1]))
            wp = sess.cmap.get_waypoint(carla.Location(x=x, y=y, z=0.0), project_to_road=True)
            z = (wp.transform.location.z if wp is not None else 0.0) + LIFT[kind]
            tf = carla.Transform(carla.Location(x=x, y=y, z=z), carla.Rotation(yaw=float(world_yaw_to_carla(float(yaw)))))
            if actor is None:
                actor = sess.cworld.try_spawn_actor(_blueprint(sess, kind), tf)
                if actor is None:
                    continue  # the place is taken this tick; tried again at the next
                actor.set_simulate_physics(False)
                self.spawned[key] = (kind, actor)
            else:
                actor.set_transform(tf)

    def _lights(self, s: SimState) -> None:
        """Set and freeze the server lights of overridden junctions to the state's colours; release the others."""
        lights = self.session.lights
        if lights is None:
            return
        carla = self.session.carla
        groups = torch.nonzero(lights.group_light >= 0).view(1, -1).to(s.t.device)  # groups matched to a server light
        if groups.numel() == 0:
            return
        base, yellow = self.setup.world.group_junction.new_zeros(groups.shape), torch.zeros(groups.shape)
        forced, _ = self.lights(s, groups, base - 1, yellow)  # -1 where no scenario overrides the group
        colour = {0: carla.TrafficLightState.Green, 1: carla.TrafficLightState.Yellow, 2: carla.TrafficLightState.Red}
        held = set()
        for group, state in zip(groups[0].tolist(), forced[0].tolist()):
            if state < 0:
                continue
            i = int(lights.group_light[group])
            held.add(i)
            actor = lights.actors[i]
            actor.set_state(colour[state])
            actor.freeze(True)
        for i in self.frozen - held:
            lights.actors[i].freeze(False)
        self.frozen = held

    def destroy(self) -> None:
        """Destroy our server actors and release our lights (best effort: a dead server cannot)."""
        for _, actor in self.spawned.values():
            try:
                actor.destroy()
            except RuntimeError:
                pass
        self.spawned = {}
        lights = self.session.lights
        for i in self.frozen:
            try:
                lights.actors[i].freeze(False)
            except (RuntimeError, AttributeError, IndexError):
                pass
        self.frozen = set()

    def close(self) -> None:
        self.destroy()

    def forget(self) -> None:
        """Drop the actors of a server that is gone."""
        self.spawned, self.frozen = {}, set()


def _blueprint(sess: Any, kind: str) -> Any:
    """The first library blueprint matching the kind's patterns (cached per session)."""
    cache = sess.__dict__.setdefault("_scenario_blueprints", {})
    if kind not in cache:
        lib = sess.cworld.get_blueprint_library()
        for pattern in BLUEPRINTS[kind]:
            found = list(lib.filter(pattern))
            if kind in ("car", "emergency") and pattern == "vehicle.*":
                found = [b for b in found if b.has_attribute("number_of_wheels")
                         and b.get_attribute("number_of_wheels").as_int() == 4] or found
            if found:
                cache[kind] = found[0]
                break
        else:
            raise CarlaError(f"the CARLA server has no blueprint for a scenario {kind} (none matches "
                             f"{', '.join(BLUEPRINTS[kind])}); route scenarios need a CARLA {CLIENT_VERSION} "
                             "whose blueprint library has them, or env.options.route_scenarios=false")
    return cache[kind]
