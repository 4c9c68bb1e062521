"""``carl-train resume=<run dir>``: the run's saved config with the command line's overrides, checked against what
its ``last.pt`` fixes (the env's rows and the network)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from carl import config
from carl.config import ConfigError, TrainConfig


def resume_of(overrides: list[str]) -> str | None:
    """The run folder of a ``resume=<dir>`` override, if any."""
    return next((o.split("=", 1)[1] for o in overrides if o.startswith("resume=")), None)


def resumed_config(resume: str, overrides: list[str], world_size: int = 1) -> TrainConfig:
    """``<resume>/config.yaml`` with ``overrides`` (no ``resume=``) applied and validated; group selections other
    than the run's own env group, and changes to what ``last.pt`` fixes, are refused with the fix."""
    data = saved_config(resume)
    own = f"env={env_group(data)}"  # the run's own env group: what carl-train adds to compose a resume
    groups = [o for o in overrides if o.lstrip("+").split("=", 1)[0] in config.GROUPS and o != own]
    if groups:
        raise ConfigError(f"resume={resume} reuses the run's config; group selections {groups} are not allowed")
    changed = resume_changes(data, overrides)
    if changed:
        raise ConfigError(f"resume={resume} continues the run's env and model as saved in last.pt, so "
                          f"{', '.join(changed)} cannot change; start a new run (run_dir=) to change them")
    return config.from_dict({**data, "resume": resume, "run_dir": resume}, overrides, world_size)


def saved_config(resume: str) -> dict[str, Any]:
    """The ``config.yaml`` of the run folder ``resume``, as plain values."""
    from omegaconf import OmegaConf

    saved = Path(resume) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"resume={resume}: {saved} does not exist; pass the run folder of an earlier run")
    data = OmegaConf.to_container(OmegaConf.load(saved), resolve=True)
    assert isinstance(data, dict)
    return data


def env_group(data: dict[str, Any]) -> str:
    """The ``env=`` group a saved config was composed with: its backend, or ``custom`` for an env factory."""
    name = str((data.get("env") or {}).get("name", "sim"))
    return name if config.backend_of(name) else "custom"


def resume_changes(saved: dict[str, Any], overrides: list[str]) -> list[str]:
    """The overrides of a resume that change what ``last.pt`` fixes: the env's rows and the network."""
    from omegaconf import OmegaConf

    run, changed = OmegaConf.create(saved), []
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key in ("env.name", "env.num_envs") or key.startswith("model."):
            now, was = OmegaConf.from_dotlist([f"v={value}"]).v, OmegaConf.select(run, key)  # typed as Hydra does
            if now != was:
                changed.append(f"{key}={now} (the run has {was})")
    return changed
