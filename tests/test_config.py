"""Config composition and validation: every error names the full key, the value and a fix."""
from __future__ import annotations

import pytest

from carl.config import ConfigError, TrainConfig, from_dict
from carl.train import compose_config, load_config


def test_presets_compose_and_validate() -> None:
    quick = load_config(["+experiment=quick"])
    assert quick.experiment == "quick" and quick.env.name == "sim"
    carla = load_config(["+experiment=carl_carla"])
    assert carla.env.name == "carla" and carla.env.num_envs == 128 and carla.ppo.num_steps == 512
    assert carla.batch_size == 65536 and carla.ppo.minibatch_size == 16384 and carla.ppo.update_epochs == 3
    assert carla.ppo.learning_rate == 2.5e-4 and carla.ppo.clip_coef == 0.1 and carla.ppo.ent_coef == 0.01
    nuplan = load_config(["+experiment=carl_nuplan"])
    assert "nuplan" in nuplan.env.name and nuplan.batch_size == 4096 and nuplan.ppo.minibatch_size == 1024
    assert nuplan.ppo.update_epochs == 2 and nuplan.ppo.ent_coef == 0.0
    assert isinstance(load_config([]), TrainConfig)


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown key ppo\.learnign_rate.*did you mean ppo\.learning_rate"):
        load_config(["ppo.learnign_rate=1e-3"])
    with pytest.raises(ConfigError, match=r"unknown key ppo\.foo"):
        load_config(["+ppo.foo=1"])


def test_bad_type_is_named() -> None:
    with pytest.raises(ConfigError, match=r"ppo\.clip_coef='abc' must be a number"):
        load_config(["ppo.clip_coef=abc"])
    with pytest.raises(ConfigError, match=r"env\.num_envs=1\.5 must be an integer"):
        load_config(["env.num_envs=1.5"])
    with pytest.raises(ConfigError, match=r"ppo\.norm_adv=.* must be true or false"):
        load_config(["ppo.norm_adv=3"])


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("ppo.minibatch_size=1000", r"ppo\.minibatch_size=1000 must divide the batch .* try ppo\.minibatch_size="),
        ("ppo.learning_rate=-1", r"ppo\.learning_rate=-1\.0 must be > 0"),
        ("ppo.clip_coef=0", r"ppo\.clip_coef=0\.0 must be > 0"),
        ("ppo.gamma=1.5", r"ppo\.gamma=1\.5 must be in \[0, 1\]"),
        ("parallel.device=tpu", r"parallel\.device='tpu'"),
        ("parallel.hierarchical=true", r"parallel\.hierarchical=true .* cannot wrap parallel\.sync='allreduce'"),
        ("parallel.node_size=-2", r"parallel\.node_size=-2 must be >= 0"),
    ],
)
def test_bad_range_is_named(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(["+experiment=quick", override])


def test_from_dict_nested_unknown_key() -> None:
    data = compose_config([])
    data["logging"]["eval_evry"] = 3
    with pytest.raises(ConfigError, match=r"unknown key logging\.eval_evry=3; did you mean logging\.eval_every"):
        from_dict(data)


def test_bf16_refused_on_cpu_without_it() -> None:
    from carl.config import check_device

    cfg = load_config(["parallel.device=cpu", "parallel.bf16=true"])
    with pytest.raises(ConfigError, match=r"parallel.bf16=true: this CPU has no native bfloat16.*parallel.bf16=false"):
        check_device(cfg, cuda_available=False, cpu_bf16=False)
    check_device(cfg, cuda_available=False, cpu_bf16=True)  # a CPU with AVX-512 BF16 / AMX runs it
    auto = load_config(["parallel.device=cpu", "parallel.bf16=auto"])
    check_device(auto, cuda_available=False, cpu_bf16=False)  # auto never fails: it falls back to fp32
    with pytest.raises(ConfigError, match="parallel.bf16='yes' must be true, false or auto"):
        load_config(["parallel.bf16=yes"])
