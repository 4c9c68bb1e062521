"""Config composition and validation: every error names the full key, the value and a fix."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from carl.config import ConfigError, TrainConfig, backend_of, compose, from_dict, schema, use_bf16
from carl import cli


def load_config(overrides: list[str]) -> TrainConfig:
    return cli.load_config("train", overrides)


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
    data = load_config([]).to_dict()
    data["logging"]["eval_evry"] = 3
    with pytest.raises(ConfigError, match=r"unknown key logging\.eval_evry=3; did you mean logging\.eval_every"):
        from_dict(data)


@pytest.mark.parametrize("amx, bf16, vendor, on", [
    (True, True, "GenuineIntel", True),  # AMX tiles: measured faster (docs/training.md)
    (False, True, "AuthenticAMD", True),  # Zen 4 / Zen 5's AVX-512 BF16: measured faster
    (False, True, "GenuineIntel", False),  # an Intel AVX-512 BF16 without AMX: measured 20-25 % slower
    (False, False, "AuthenticAMD", False),  # no native bf16 (Zen 3): emulated, slower
])
def test_bf16_auto_is_on_only_where_it_was_measured_to_pay(monkeypatch: pytest.MonkeyPatch, amx: bool, bf16: bool,
                                                           vendor: str, on: bool) -> None:
    import carl.config as config

    monkeypatch.setattr(config, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(config, "cpu_info", lambda: {"vendor_id": vendor})
    assert use_bf16(load_config(["parallel.device=cpu", "parallel.bf16=auto"]), on_cuda=False) is on
    assert use_bf16(load_config(["parallel.device=cpu", "parallel.bf16=true"]), on_cuda=False) is True  # as asked


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


def test_compile_auto_resolves_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``parallel.compile=auto`` compiles on CUDA and on a CPU with AMX tiles, nowhere else; true and false are kept
    as given; any other value is refused by name."""
    import torch

    from carl.config import use_compile

    auto = load_config(["parallel.compile=auto"])
    for amx in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert use_compile(auto, on_cuda=True) is True
        assert use_compile(auto, on_cuda=False) is amx
        assert use_compile(load_config(["parallel.compile=false"]), on_cuda=True) is False
        assert use_compile(load_config(["parallel.compile=true"]), on_cuda=False) is True
    with pytest.raises(ConfigError, match="parallel.compile='always' must be true, false or auto"):
        load_config(["parallel.compile=always"])


# -- one source of defaults ---------------------------------------------------------------------------------------
CONF = Path(__file__).resolve().parent.parent / "conf"


def _leaves(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _restated(path: Path, root: Path = CONF) -> list[str]:
    """Values of a conf/ file equal to what they would override: the registered schema for group files, the schema
    plus the chosen env group for experiment presets."""
    raw = OmegaConf.to_container(OmegaConf.load(path)) or {}
    choices = raw.pop("defaults", [])
    if path.parent.name == "experiment":
        env = next((v for d in choices if isinstance(d, dict) for k, v in d.items() if k == "override /env"), "sim")
        base, data = OmegaConf.to_container(compose([f"env={env}"])), raw
    else:
        group = path.parent.name
        backend = path.stem if group == "env" else "sim"
        base = OmegaConf.to_container(schema(backend_of(backend)))
        data = {group: raw}
    same = []
    for key, value in _leaves(data):
        node: object = base
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is not KeyError and node == value:
            same.append(f"{path.relative_to(root)}: {key}={value!r}")
    return same


def test_no_default_is_written_twice() -> None:
    """conf/ holds presets and the values that differ; the defaults live only in the registered dataclasses."""
    files = sorted(p for p in CONF.rglob("*.yaml") if p.parent.name in ("env", "parallel", "experiment"))
    assert len(files) >= 9
    assert [s for p in files for s in _restated(p)] == []
    assert not any((CONF / d).exists() for d in ("ppo", "model", "logging"))  # their defaults are the schema's


def test_restated_default_is_detected(tmp_path: Path) -> None:
    bad = tmp_path / "experiment" / "x.yaml"
    bad.parent.mkdir()
    bad.write_text("# @package _global_\nppo:\n  gamma: 0.99\n  ent_coef: 0.0\nenv:\n  options:\n    bev_size: 128\n")
    assert sorted(_restated(bad, tmp_path)) == ["experiment/x.yaml: env.options.bev_size=128",
                                                "experiment/x.yaml: ppo.gamma=0.99"]


def test_env_options_are_typed_per_backend() -> None:
    cfg = load_config(["+experiment=quick", "env.options.map=Town01"])  # no '+': the key is in SimConfig
    assert cfg.env.options["map"] == "Town01" and cfg.env.options["bev_size"] == 64
    carla = load_config(["env=carla", "env.options.town=Town02", "env.options.base_port=3000"])
    assert (carla.env.name, carla.env.options["town"], carla.env.options["base_port"]) == ("carla", "Town02", 3000)
    with pytest.raises(ConfigError, match=r"unknown key env\.options\.mapp='Town01'; did you mean env\.options\.map\?"):
        load_config(["env.options.mapp=Town01"])
    with pytest.raises(ConfigError, match=r"unknown key env\.options\.twn='Town02'; did you mean env\.options\.town\?"):
        load_config(["env=carla", "env.options.twn=Town02"])
    with pytest.raises(ConfigError, match=r"env\.options\.bev_size='big' must be an integer"):
        load_config(["env.options.bev_size=big"])
    with pytest.raises(ConfigError, match=r"drop the '\+'"):
        load_config(["+env.options.map=Town01"])
    # a preset that selects the backend types its options too (no env= on the command line)
    nuplan = load_config(["+experiment=carl_nuplan", "env.options.data_root=/data/nuplan", "env.options.reactive=true"])
    assert (nuplan.env.name, nuplan.env.options["data_root"], nuplan.env.options["reactive"]) == \
        ("nuplan", "/data/nuplan", True)
    with pytest.raises(ConfigError, match=r"unknown key env\.options\.data_rot=.*did you mean env\.options\.data_root"):
        load_config(["+experiment=carl_nuplan", "env.options.data_rot=/data/nuplan"])


def test_every_problem_is_reported_at_once() -> None:
    """Unknown keys, wrong types and bad ranges of one command line, all in one error."""
    with pytest.raises(ConfigError) as err:
        load_config(["env.options.mapp=Town01", "ppo.learnign_rate=1", "ppo.clip_coef=abc", "env.num_envs=1.5",
                     "ppo.minibatch_size=1000", "ppo.gamma=3", "env.options.bev_size=4", "env.options.rules=lb"])
    text = str(err.value)
    expected = ("unknown key env.options.mapp='Town01'; did you mean env.options.map?",
                "unknown key ppo.learnign_rate=1; did you mean ppo.learning_rate?",
                "ppo.clip_coef='abc' must be a number", "env.num_envs=1.5 must be an integer",
                "ppo.minibatch_size=1000 must divide", "ppo.gamma=3.0 must be in [0, 1]",
                "env.options.bev_size=4: must be in [8, 1024]", "env.options.rules='lb': use 'carl'")
    for line in expected:
        assert line in text, text
    assert text.startswith(f"{len(err.value.problems)} problems:") and len(err.value.problems) >= len(expected)


def test_the_cli_prints_the_typed_config() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "carl.train", "+experiment=quick", "env.options.map=Town01", "--cfg"],
                         capture_output=True, text=True, timeout=120, cwd=CONF.parent)
    assert out.returncode == 0, out.stderr
    printed = OmegaConf.create(out.stdout)
    assert printed.env.options.map == "Town01" and printed.env.num_envs == 32


def test_hydra_launcher_and_sweeper_choices_are_named() -> None:
    from carl.config import check_choices

    assert check_choices(["hydra/launcher=basic", "hydra/sweeper=basic", "seed=2"]) == {}
    bad = check_choices(["hydra/launcher=slurm_nod", "hydra/sweeper=grid"])
    assert bad["hydra/launcher=slurm_nod"].startswith("hydra/launcher=slurm_nod is unknown; did you mean "
                                                      "hydra/launcher=slurm_node?")
    assert "choose one of basic" in bad["hydra/sweeper=grid"] and "conf/hydra/sweeper/" in bad["hydra/sweeper=grid"]
    with pytest.raises(ConfigError) as err:  # with the other problems of the command line
        load_config(["hydra/launcher=foo", "ppo.gamma=3"])
    assert len(err.value.problems) == 2 and "hydra/launcher=foo is unknown" in str(err.value)


def test_the_cli_is_hydras_command_line() -> None:
    """--help: the command's usage, its groups and Hydra's flags; --cfg hydra: Hydra's config (no chdir)."""
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "carl.train", *args], capture_output=True, text=True,
                              timeout=120, cwd=CONF.parent)

    helped = cli("--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("``carl-train`` / ``python -m carl.train``")
    for text in ("+experiment: ", "hydra/launcher: basic, slurm_node", "--multirun,-m", "--cfg,-c"):
        assert text in helped.stdout, text
    shown = cli("--cfg", "hydra", "+experiment=quick")
    assert shown.returncode == 0, shown.stderr
    import yaml

    hydra = yaml.safe_load(shown.stdout)["hydra"]  # as written, interpolations unresolved
    assert hydra["job"]["chdir"] is False and hydra["run"]["dir"].startswith("runs/${experiment}-")
    assert hydra["sweep"]["subdir"] == "${hydra.job.num}"


# ---------------------------------------------------------------------------------------------- refused at start
def test_bootstrap_truncation_needs_the_final_observations() -> None:
    """ppo.bootstrap_truncation=true reads info['final_obs/...'], which the backends keep only when asked: refused at
    start naming both keys (the nuPlan backend nests the simulator's options), accepted with both set."""
    with pytest.raises(ConfigError) as err:
        load_config(["+experiment=quick", "ppo.bootstrap_truncation=true"])
    assert "ppo.bootstrap_truncation=true" in str(err.value) and "env.options.keep_final_obs=true" in str(err.value)
    assert load_config(["+experiment=quick", "ppo.bootstrap_truncation=true",
                        "env.options.keep_final_obs=true"]).ppo.bootstrap_truncation
    with pytest.raises(ConfigError, match=r"env.options.sim.keep_final_obs=true"):
        load_config(["env=nuplan", "ppo.bootstrap_truncation=true"])


def test_a_teacher_needs_a_backend_with_an_expert() -> None:
    """ppo.teacher=expert asks the env backend's rule-based expert: a custom env has none, refused at start with the
    fix; the simulator has one."""
    with pytest.raises(ConfigError, match=r"ppo.teacher=expert .* env.name='tests.fake_env:make_fake_env' is not a "
                                          r"backend with one .*; set ppo.teacher=none"):
        load_config(["env=custom", "env.name=tests.fake_env:make_fake_env", "ppo.teacher=expert"])
    assert load_config(["+experiment=quick", "ppo.teacher=expert"]).ppo.teacher == "expert"


def test_the_seen_only_teacher_needs_the_simulator() -> None:
    """ppo.teacher=expert_seen is the simulator's expert without the flows' unspawned cars: a backend whose expert has
    no such variant (CARLA's is the server's) is refused at start, naming the key and the fix."""
    with pytest.raises(ConfigError, match=r"ppo.teacher=expert_seen: env 'carla'.s expert has no seen-only variant "
                                          r"\(only sim\); set ppo.teacher=expert"):
        load_config(["env=carla", "ppo.teacher=expert_seen"])
    assert load_config(["+experiment=quick", "ppo.teacher=expert_seen"]).ppo.teacher == "expert_seen"


def test_ppo_term_off_needs_a_teacher_for_the_whole_run() -> None:
    """ppo.pg_coef=0 leaves the actor to the teacher's term: without a teacher nothing would train it, and with the
    teacher's weight reaching 0 at bc_until = 0.5 (the default) nothing would after half the run."""
    with pytest.raises(ConfigError, match=r"ppo.pg_coef=0.0 .* ppo.teacher=none .* nothing trains the actor at all"):
        load_config(["+experiment=quick", "ppo.pg_coef=0"])
    with pytest.raises(ConfigError, match=r"ppo.bc_until=0.5 nothing trains the actor after 50% of the run; .* "
                                          r"ppo.teacher=expert with ppo.bc_until=1.0"):
        load_config(["+experiment=quick", "ppo.pg_coef=0", "ppo.teacher=expert"])
    assert load_config(["+experiment=quick", "ppo.pg_coef=0", "ppo.teacher=expert",
                        "ppo.bc_until=1.0"]).ppo.pg_coef == 0.0


def test_a_custom_env_without_final_observations_is_named_at_the_first_truncation() -> None:
    from carl.config import PPOConfig
    from carl.policy import CarlPolicy
    from carl.ppo import PPOTrainer
    from tests.fake_env import make_fake_env

    env = make_fake_env(2, "cpu", seed=0, bev_size=24, bev_channels=3, episode_length=2)
    trainer = PPOTrainer(CarlPolicy(env.observation_spec, 2, 16, 16, 32), env,
                         PPOConfig(num_steps=4, minibatch_size=8, update_epochs=1, bootstrap_truncation=True))
    trainer.reset(seed=0)
    with pytest.raises(ValueError, match=r"no info\['final_obs/bev'\].*keep_final_obs=true"):
        trainer.collect()


def test_final_benchmark_must_read_what_the_run_trains_on() -> None:
    with pytest.raises(ConfigError, match=r"logging.final_benchmark=towns drives env 'sim' \(carla observations\), "
                                          r"but this run trains on env 'nuplan' \(nuplan observations\); use "
                                          r"logging.final_benchmark=val14 or null"):
        load_config(["env=nuplan", "logging.final_benchmark=towns"])
    assert load_config(["logging.final_benchmark=longest6"]).logging.final_benchmark == "longest6"


@pytest.mark.parametrize("override, listed", [
    ("env=simm", "did you mean env=sim? choose one of carla, custom, nuplan, sim"),
    ("+experiment=quik", "did you mean +experiment=quick?"),
    ("parallel=dd", "did you mean parallel=ddp? choose one of ddp, single"),
])
def test_unknown_group_choices_list_the_presets(override: str, listed: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([override, "seed=x"])  # every problem at once: the bad seed too
    assert listed in str(err.value) and "seed='x'" in str(err.value)


def test_unknown_benchmark_lists_the_benchmarks() -> None:
    with pytest.raises(ConfigError, match=r"benchmark=longest7 is unknown; did you mean benchmark=longest6\? choose "
                                          r"one of longest6, longest6_carla, towns, unseen_towns, val14"):
        cli.load_config("eval", ["benchmark=longest7"])


def test_resume_cannot_change_the_env_or_model(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    train_config = load_config

    OmegaConf.save(OmegaConf.create(load_config(["+experiment=quick"]).to_dict()), tmp_path / "config.yaml")
    cfg = train_config([f"resume={tmp_path}", "ppo.total_timesteps=2000000"])
    assert cfg.ppo.total_timesteps == 2_000_000 and cfg.resume == str(tmp_path)
    with pytest.raises(ConfigError, match=r"env.num_envs=3 \(the run has \d+\), model.hidden_dim=8 \(the run has 256\) "
                                          r"cannot change"):
        train_config([f"resume={tmp_path}", "env.num_envs=3", "model.hidden_dim=8"])


def test_a_resume_overrides_options_only_its_own_backend_has(tmp_path: Path) -> None:
    """A nuPlan run resumed with its data moved (``env.options.data_root``, a key the default sim env lacks): the
    command line is composed with the run's own env group, which the resume accepts; another group is refused."""
    from omegaconf import OmegaConf

    from carl.cli import prepare
    from carl.train import TrainCommand

    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(OmegaConf.create(load_config(["env=nuplan", f"run_dir={run}"]).to_dict()), run / "config.yaml")
    (run / "last.pt").touch()  # the command line is checked before anything reads it
    plan = prepare(TrainCommand(), [f"resume={run}", "env.options.data_root=/data/moved"])
    assert "env=nuplan" in plan.hydra_argv
    cfg = TrainCommand().load([f"resume={run}", "env=nuplan", "env.options.data_root=/data/moved"])
    assert cfg.env.options["data_root"] == "/data/moved" and cfg.resume == str(run)
    with pytest.raises(ConfigError, match=r"group selections \['env=sim'\] are not allowed"):
        TrainCommand().load([f"resume={run}", "env=sim"])


def test_a_town_that_is_not_there_says_how_to_add_it(tmp_path: Path) -> None:
    from envs.maps.lanegraph import MapError
    from envs.maps.opendrive import load_town

    (tmp_path / "Town01.xodr").write_text("<OpenDRIVE/>")
    with pytest.raises(MapError, match=r"unknown town 'osm_grid': no osm_grid.xodr in .* \(maps_dir\); available: "
                                       r"Town01; to add a map, put osm_grid.xodr there or set CARL_CARLA_MAPS"):
        load_town("osm_grid", maps_dir=tmp_path)


def test_declared_options_are_checked_and_listed_with_their_help() -> None:
    """One declaration per option (envs.config.option): check_fields reports each bad value by its key with the
    declared bound or choices, and describe_fields lists every key, nested ones included, with its help."""
    import dataclasses

    from envs.config import Checks, check_fields, describe_fields, option

    @dataclasses.dataclass
    class Inner:
        rate: float = option(0.5, "a share", gt=0, lt=1)

    @dataclasses.dataclass
    class Outer:
        n: int = option(2, "how many", ge=1)
        mode: str = option("a", "which", choices=("a", "b"))
        flag: bool | str = option(False, "on, off or auto", choices=(True, False, "auto"))
        inner: Inner = option(help="nested", factory=Inner)
        plain: int = 3  # documented by its comment

    checks = Checks()
    check_fields(Outer(n=0, mode="c", flag="yes", inner=Inner(rate=1.0)), "x", checks)
    assert checks.problems == ["x.n=0 must be >= 1 (default 2)", "x.mode='c' must be a or b (default a)",
                               "x.flag='yes' must be true, false or auto (default false)",
                               "x.inner.rate=1.0 must be in (0, 1) (default 0.5)"]
    checks = Checks()
    check_fields(Outer(flag=True), "x", checks)
    assert checks.problems == []
    rows = {k: (d, h) for k, d, h in describe_fields(Outer)}
    assert rows["n"] == ("2", "how many") and rows["inner.rate"] == ("0.5", "a share")
    assert rows["mode"] == ("a", "which [a | b]") and rows["plain"] == ("3", "documented by its comment")


def test_help_lists_every_training_key_with_its_help() -> None:
    from carl.cli import help_text
    from carl.train import TrainCommand
    from envs.config import describe_fields
    from envs.sim.config import SimConfig

    text = help_text(TrainCommand())
    for key, _, help_ in describe_fields(TrainConfig) + describe_fields(SimConfig, "env.options"):
        assert help_, f"{key} has no help"
        assert f"  {key} = " in text, key


def test_the_cpu_line_names_what_figures_depend_on() -> None:
    """The CPU line names the first ``model name`` of /proc/cpuinfo (where there is one), the CPUs this process may
    use, and the ISA torch dispatches to."""
    import os
    from pathlib import Path

    import torch

    from carl.config import cpu_line

    line = cpu_line()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")]
        if names:
            assert line.startswith(names[0])
    assert f", {len(os.sched_getaffinity(0))} CPUs, " in line
    assert torch.backends.cpu.get_cpu_capability() in line and ("bf16: yes" in line or "bf16: no" in line)
