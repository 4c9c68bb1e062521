"""nuPlan backend: read nuPlan logs and maps directly, cache scenarios, and replay them in the built-in simulator.

Modules: :mod:`gpkg` (GeoPackage binary), :mod:`reader` (SQLite logs, scenario extraction), :mod:`nuplan_map`
(map layers), :mod:`mapgraph` (map patch -> ``LaneGraph``), :mod:`cache` (per-scenario cache files),
:mod:`env` (the batched log-replay environment), :mod:`synthetic` (a nuPlan-format test dataset). The nuplan-devkit
planner adapter, which loads a trained policy, is ``carl.deploy.nuplan_planner`` (``envs`` never imports ``carl``).
"""
