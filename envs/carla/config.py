"""Options of ``env=carla``: the CARLA worker's own keys (:class:`CarlaConfig`) beside the simulator's (:class:`SimConfig`).

Users write one flat ``env.options`` mapping (:data:`CarlaOptions` is its schema for Hydra); :func:`split_options`
divides it, so a misspelt key is named together with both sets of valid keys.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from envs.config import Checks, from_dict, suggest
from envs.sim.config import SimConfig

# simulator keys that CARLA decides itself: the map is the server's town
CARLA_OWNS = ("map", "maps", "map_weights")


@dataclass
class CarlaConfig:
    """CARLA-specific options of ``env=carla`` (the remaining options configure the shared :class:`SimConfig`)."""

    town: str = "Town01"  # the CARLA town every worker loads
    host: str = "127.0.0.1"  # where the servers listen
    base_port: int = 2000  # first RPC port; server i uses the i-th free block of 4 ports (rpc, stream, primary, TM)
    port_stride: int = 4  # ports between consecutive workers' servers
    launch: bool = True  # start and restart servers ourselves; false = connect to servers already running
    executable: str | None = None  # CarlaUE4.sh; default $CARLA_ROOT/CarlaUE4.sh
    extra_args: tuple[str, ...] = ()  # more command-line arguments of CarlaUE4.sh
    gpus: tuple[int, ...] = ()  # Vulkan adapter indices, assigned round-robin; () = let CARLA choose
    no_rendering: bool = True  # -nullrhi: BEV training needs no rendering
    traffic_vehicles: int = 20  # background vehicles spawned on the Traffic Manager
    traffic_pedestrians: int = 10  # walkers spawned per episode
    walker_ai: bool = True  # walkers driven by CARLA's AI controllers (needs the server's navigation mesh)
    client_timeout: float = 10.0  # seconds a client call (tick) may take before the server counts as dead
    ready_timeout: float = 180.0  # seconds a (re)started server has to answer
    max_restarts: int = 1000  # per worker
    check_version: bool = True  # refuse a server whose version differs from the client's
    log_dir: str = "carla_logs"  # server logs (one file per server, rewritten on every restart)
    start_method: str = "spawn"  # multiprocessing start method of the worker processes
    carla_lights: bool = True  # light states from CARLA's traffic-light actors; false = the simulator's light cycle
    vehicle_lights: bool = True  # the Traffic Manager drives background vehicles' brake lights and blinkers

    def validate(self) -> "CarlaConfig":
        checks = Checks()

        def need(cond: bool, key: str, fix: str) -> None:
            checks.need(cond, f"env.options.{key}={getattr(self, key)!r}: {fix}")

        need(bool(self.town), "town", "name a CARLA town such as Town01")
        need(1024 <= self.base_port <= 65000, "base_port", "must be in [1024, 65000]")
        need(self.port_stride >= 4, "port_stride", "must be >= 4 (rpc, streaming, primary, traffic manager)")
        need(self.traffic_vehicles >= 0 and self.traffic_pedestrians >= 0, "traffic_vehicles", "counts must be >= 0")
        need(self.client_timeout > 0, "client_timeout", "must be > 0 seconds")
        need(self.ready_timeout > 0, "ready_timeout", "must be > 0 seconds")
        need(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        need(self.start_method in ("spawn", "forkserver", "fork"), "start_method", "use spawn, forkserver or fork")
        checks.done()
        return self


def _flat_schema() -> type:
    """CARLA's keys and the simulator's in one dataclass: the typed ``env.options`` of ``env=carla``."""
    fields = []
    for cls in (CarlaConfig, SimConfig):
        hints = typing.get_type_hints(cls)
        fields += [(f.name, hints[f.name], dataclasses.field(default=f.default, default_factory=f.default_factory))
                   for f in dataclasses.fields(cls) if f.name not in CARLA_OWNS]
    return dataclasses.make_dataclass("CarlaOptions", fields, namespace={"__module__": __name__})


CarlaOptions = _flat_schema()


def split_options(options: dict[str, Any]) -> tuple[CarlaConfig, SimConfig]:
    """Split ``env.options`` into CARLA options and simulator options; unknown keys name both sets of valid keys."""
    names = [f.name for f in dataclasses.fields(CarlaConfig)]
    sim_names = [f.name for f in dataclasses.fields(SimConfig)]
    checks = Checks()
    for key, value in options.items():
        if key not in names and key not in sim_names:
            checks.need(False, f"env.options.{key}={value!r}: unknown key; CARLA keys: {', '.join(sorted(names))}; "
                        f"simulator keys: {', '.join(sorted(sim_names))}; {suggest(key, names + sim_names)}")
    carla_opts = {k: v for k, v in options.items() if k in names}
    sim_opts = {k: v for k, v in options.items() if k in sim_names}
    ccfg = checks.run(lambda: from_dict(CarlaConfig, carla_opts, "env.options").validate())
    if ccfg is not None:
        sim_opts.setdefault("map", ccfg.town)
        checks.need(sim_opts["map"] == ccfg.town,
                    f"env.options.map={sim_opts['map']!r} differs from town={ccfg.town!r}; set only town")
    scfg = checks.run(lambda: from_dict(SimConfig, sim_opts, "env.options").validate())
    checks.done()
    return ccfg, scfg
