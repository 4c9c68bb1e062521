"""Training configuration: the dataclasses below are the schema *and* the defaults.

They are registered in Hydra's ConfigStore (:func:`register_configs`); ``conf/`` holds only presets and the values
that differ (a test checks that no YAML file restates a default). ``env.options`` is typed by the chosen backend's
own dataclass (``envs.options_schema``), so ``env.options.map=Town01`` needs no ``+`` and a typo is named with a
suggestion. Every problem is collected and reported at once as one :class:`ConfigError`, each naming the full key,
the offending value and the fix, e.g.::

    config error: 2 problems:
      unknown key ppo.learnign_rate=0.001; did you mean ppo.learning_rate?
      ppo.minibatch_size=1000 must divide the batch (env.num_envs * ppo.num_steps = 4096); try ppo.minibatch_size=1024

One file, on purpose: the schema, its registration, the per-key checks and the range checks are one contract that
carl-train, carl-eval and carl-export share; split, every change to a key would touch several files.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import envs
from envs.config import Checks, ConfigError, check_fields, option, suggest

__all__ = ["ConfigError", "EnvConfig", "ModelConfig", "PPOConfig", "ParallelConfig", "LoggingConfig", "TrainConfig",
           "compose", "from_dict", "validate", "register_configs"]

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# config groups of conf/train.yaml (a selection such as env=carla is not a key)
GROUPS = ("env", "parallel", "experiment")
# parallel.sync: the gradient-sync methods, name -> what travels (carl.parallel.sync.SYNC_BUILDERS builds each;
# LAYERWISE_SYNC compress layer by layer, so they can also run hierarchically)
SYNC_METHODS = {"allreduce": "fp32 gradients (DDP)", "fp16": "float16 gradients", "bf16": "bfloat16 gradients",
                "powersgd": "rank-r factors per layer (PowerSGD)", "lgreco": "per-layer ranks planned by L-GreCo",
                "topk": "top-k values per layer", "localsgd": "parameters every local_steps steps (CO2)"}
LAYERWISE_SYNC = ("lgreco", "topk")  # and powersgd with powersgd_impl=layerwise


@dataclass
class EnvConfig:
    """Which environment backend, how many parallel environments and the backend's own options."""

    name: str = option("sim", "a backend of envs.BACKENDS, or package.module:function for a custom factory "
                              "(env=custom)")
    num_envs: int = option(8, "environments stepped together (per rank)", ge=1)
    options: Any = option(help="the backend's options (typed by envs.options_schema(name); `carl-train --help` lists "
                               "the simulator's), passed to its factory", factory=dict)
    eval_options: dict[str, Any] = option(help="merged over env.options for the held-out evaluation envs",
                                          factory=lambda: {"route_split": "eval"})


MODEL_NAMES = ("carl", "set")  # model.name values this code builds (and rebuilds from files)


@dataclass
class ModelConfig:
    """The network: CaRL's BEV CNN (carl/policy.py; the widths default to CaRL's) or the set encoder for the vector
    observation (carl/set_policy.py). Declared here only."""

    name: str = option("carl", "the network: carl (CaRL's BEV CNN, env.options.observation=bev) | set (set encoder, "
                               "env.options.observation=vector)", choices=MODEL_NAMES)
    features_dim: int = option(256, "width of the shared feature (fusion output)", ge=1)
    hidden_dim: int = option(256, "width of the measurement MLP and the heads", ge=1)
    fusion_dim: int = option(512, "width of the fusion layer", ge=1)
    min_final_size: int = option(1, "the stride rule keeps the conv output at least this many pixels wide", ge=1)
    embed_dim: int = option(32, "model.name=set: width of the per-entity MLP and of each pooled set", ge=1)


@dataclass
class PPOConfig:
    """CleanRL-style PPO with CaRL's settings (reference §5.1). With the default 8 envs this is CaRL's 10M "tiny" run
    (batch 4096, minibatch 1024); +experiment=carl_carla sets the 300M sizes."""

    total_timesteps: int = option(10_000_000, "samples to train on (all ranks together)", ge=1)
    train_for_seconds: float = option(0.0, "a wall-clock budget for the run (resumes included; the final evaluation "
                                           "not): it ends at whichever of total_timesteps and this comes first, and "
                                           "the schedules (lr, bc) follow whichever is further along, so that a "
                                           "slower machine completes the schedule on fewer samples; 0: samples "
                                           "only", ge=0)
    num_steps: int = option(512, "rollout length per env; batch = env.num_envs * num_steps", ge=1)
    minibatch_size: int = option(1024, "global minibatch (all ranks); must divide the batch", ge=1)
    update_epochs: int = option(3, "passes over the batch per update", ge=1)
    learning_rate: float = option(2.5e-4, "Adam's learning rate", gt=0)
    anneal_lr: bool = option(True, "linear decay: lr = lr0 * (1 - progress), progress the share of the run done "
                                   "before the update ((update - 1) / num_updates, or the share of "
                                   "ppo.train_for_seconds spent where that is larger)")
    adam_eps: float = option(1e-5, "Adam's epsilon", gt=0)
    gamma: float = option(0.99, "discount", ge=0, le=1)
    gae_lambda: float = option(0.95, "GAE's lambda", ge=0, le=1)
    clip_coef: float = option(0.1, "PPO's ratio clip", gt=0)
    clip_vloss: bool = option(True, "value clipping, +-clip_coef around the old value (absolute units)")
    pg_coef: float = option(1.0, "weight of PPO's clipped surrogate; 0 with a teacher: the actor learns from the "
                                 "teacher's term alone (DAgger on the policy's own rollouts; the critic still learns; needs "
                                 "ppo.bc_until=1.0)",
                            ge=0)
    vf_coef: float = option(0.5, "value loss weight", ge=0)
    ent_coef: float = option(0.01, "entropy bonus weight", ge=0)
    max_grad_norm: float = option(0.5, "gradient norm clip", gt=0)
    norm_adv: bool = option(True, "per-minibatch advantage normalisation")
    accumulation_steps: int = option(1, "split each minibatch into this many micro-batches (gradient accumulation)",
                                     ge=1)
    bootstrap_truncation: bool = option(False, "bootstrap truncated episodes from their final observation (CaRL: "
                                               "done = terminated OR truncated, no bootstrap)")
    teacher: str = option("none", "a teacher the policy is also fitted to, beside PPO (behaviour cloning on the "
                                  "policy's own rollouts): none, expert (the env backend's rule-based expert, which "
                                  "reads privileged state), or expert_seen (env sim: the expert without its knowledge "
                                  "of the junction flows' next cars before they spawn, which no observation shows)",
                          choices=("none", "expert", "expert_seen"))
    bc_coef: float = option(1.0, "with a teacher: weight of its term (squared error of the policy's mean action to the "
                                 "teacher's) at the first update", ge=0)
    bc_until: float = option(0.5, "with a teacher: share of the run over which bc_coef decays linearly to "
                                  "bc_coef x bc_final (PPO alone after it when bc_final is 0)", gt=0, le=1)
    bc_final: float = option(0.0, "with a teacher: its weight from bc_until on, as a share of bc_coef (a floor that "
                                  "keeps the policy near the teacher to the end of the run)", ge=0, le=1)
    teacher_every: int = option(1, "with a teacher: label every n-th rollout step only (its time / n; the cloning term "
                                   "averages over the labelled samples of each minibatch)", ge=1)


@dataclass
class ParallelConfig:
    """Device and process layout; with torchrun, how gradients are synchronised (``carl/parallel``)."""

    name: str = option("single", "process layout (parallel=single | parallel=ddp)", choices=("single", "ddp"))
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    bf16: bool | str = option(False, "bfloat16 autocast for the network; auto: on where it was measured to pay "
                                     "(CUDA, a CPU with AMX, an AMD CPU with AVX-512 BF16: 1.3-1.6x faster PPO "
                                     "updates; an Intel CPU with AVX-512 BF16 but no AMX ran 20-25 % slower with it, "
                                     "docs/training.md)", choices=(True, False, "auto"))
    compile: bool | str = option(False, "torch.compile the network (inductor; on CPU it needs a C++ compiler); "
                                        "30-60 s of compiling at the start; auto: on CUDA and on CPUs with AMX, "
                                        "where the set policy's update ran 1.4-1.7x faster (on a Zen 4 the gain was "
                                        "within a VM's noise, on a Zen 3 it was slower; docs/training.md)",
                                 choices=(True, False, "auto"))
    torch_threads: int = option(0, "CPU threads of PyTorch; 0 = its default", ge=0)
    # -- multi-process (torchrun); ignored with one process. See docs/distributed.md --
    sync: str = option("allreduce", "gradient-sync method: " + "; ".join(f"{k}: {v}" for k, v in SYNC_METHODS.items()),
                       choices=tuple(SYNC_METHODS))
    backend: str = option("auto", "collective backend; auto: nccl on CUDA, gloo on CPU", choices=("auto", "gloo", "nccl"))
    timeout_s: float = option(1800.0, "a collective waiting longer than this fails with the rank and the reason", gt=0)
    bucket_cap_mb: float = option(0.0, "DDP bucket size; 0 = DDP's default (powersgd on gloo: one bucket)", ge=0)
    powersgd_rank: int = option(4, "powersgd rank; lgreco's uniform reference rank r0", ge=1)
    powersgd_start_iter: int = option(2, "plain all-reduce before this step (>= 2: DDP rebuilds buckets after step 1)")
    powersgd_impl: str = option("layerwise", "layerwise: per-parameter matrices (near-square views of conv/LayerNorm "
                                             "tensors); torch: torch's powerSGD_hook on flat buckets ([shape[0], -1] "
                                             "views leave CaRL's LayerNorms uncompressed: ~6x)",
                                choices=("layerwise", "torch"))
    lgreco_every: int = option(100, "re-plan the per-layer ranks every K optimiser steps", ge=1)
    lgreco_acc_steps: int = option(10, "steps averaged before each re-plan", ge=1)
    lgreco_alpha: float = option(1.0, "error budget = alpha * error of the uniform rank", gt=0)
    topk_ratio: float = option(0.01, "fraction of each layer's entries sent", gt=0, lt=1)
    hierarchical: bool = option(False, "exact fp32 all-reduce inside a node, the compression method only between "
                                       "nodes (powersgd/lgreco/topk)")
    node_size: int = option(0, "ranks per node for `hierarchical`; 0 = torchrun's LOCAL_WORLD_SIZE", ge=0)
    local_steps: int = option(8, "localsgd: optimiser steps between outer steps", ge=1)
    outer_lr: float = option(1.0, "localsgd: outer learning rate", gt=0)
    outer_momentum: float = option(0.0, "localsgd: outer momentum", ge=0, lt=1)
    staleness_penalty: float = option(1.0, "the one-round-stale average is divided by this", gt=0)
    outer_clip: float = option(0.0, "clip the outer momentum to this norm; 0 = off", ge=0)

    @property
    def per_layer_compression(self) -> bool:
        """A method run by our per-layer reducers (the only ones ``hierarchical`` can wrap)."""
        return self.sync in LAYERWISE_SYNC or (self.sync == "powersgd" and self.powersgd_impl == "layerwise")


@dataclass
class LoggingConfig:
    """What is written where and how often (in updates)."""

    tensorboard: bool = option(True, "TensorBoard event files in the run folder")
    progress_bar: bool = option(True, "a progress bar on the terminal")
    summary_every: int = option(1, "one summary line every N updates", ge=1)
    checkpoint_last_every: int = option(1, "last.pt every N updates", ge=1)
    checkpoint_every: int = option(0, "update_<n>.pt every N updates; 0 = never", ge=0)
    eval_every: int = option(0, "evaluation (and best.pt) every N updates; 0 = only at the end", ge=0)
    eval_episodes: int = option(8, "held-out episodes per evaluation; 0 = no evaluation", ge=0)
    final_eval_episodes: int = option(0, "held-out episodes of the final evaluation, on which last.pt, best.pt and the "
                                         "baselines are compared (the recipes: 128, a standard error of ~3 DS); "
                                         "0 = eval_episodes", ge=0)
    eval_max_steps: int = option(3000, "cap per evaluation episode (control steps)", ge=1)
    eval_seed: int = option(1_000_004, "seed of the held-out evaluation (its routes and traffic), the same whatever the "
                                        "training seed, so that runs of different seeds are scored on the same routes")
    final_baselines: bool = option(True, "evaluate random + expert policies on the same routes at the end")
    final_benchmark: str | None = option(None, "a carl-eval benchmark (conf/benchmark/<name>.yaml, e.g. towns or "
                                               "longest6) run on best.pt at the end: the benchmark's own conditions "
                                               "beside the training distribution's; null = none")
    video_every: int = option(0, "BEV video of env 0 every N updates; 0 = off", ge=0)
    video_max_frames: int = option(400, "frames per video", ge=1)


@dataclass
class TrainConfig:
    """The whole run. ``run_dir`` defaults to ``runs/<experiment>-<timestamp>``."""

    experiment: str = option("default", "the preset's name (+experiment=...): names the run folder")
    seed: int = option(1, "seed of the run (each rank and env row derives its own)")
    run_dir: str | None = option(None, "the run folder; default runs/<experiment>-<timestamp>")
    resume: str | None = option(None, "a run folder to continue (its config.yaml and last.pt)")
    init_from: str | None = option(None, "weights that start a new run (fine-tuning): a checkpoint .pt or a bundle "
                                         "(zoo:<name>) of the same model and observation; the optimiser, counters "
                                         "and learning-rate schedule start fresh")
    lock_wait_s: float = option(0.0, "seconds to wait while another process holds the run folder before refusing "
                                     "(carl/runlock.py); e.g. 120 for a SLURM job requeued while its predecessor "
                                     "still saves its last checkpoint; 0 = refuse at once", ge=0)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # -- derived sizes --------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.env.num_envs * self.ppo.num_steps

    @property
    def num_updates(self) -> int:
        return max(1, self.ppo.total_timesteps // self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------------
# Schema: the dataclasses above, env.options typed per backend, registered with Hydra
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def env_schema(backend: str | None) -> type:
    """:class:`EnvConfig` with ``options`` typed by the backend's dataclass; ``None`` (a custom factory) keeps a free
    mapping."""
    if backend is None:
        return EnvConfig
    options = envs.options_schema(backend)
    return dataclasses.make_dataclass(
        f"{backend.capitalize()}EnvConfig",
        [("name", str, field(default=backend)), ("options", options, field(default_factory=options))],
        bases=(EnvConfig,), namespace={"__module__": __name__})


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore: ``train_schema`` and one ``env/<backend>_schema`` per backend, which
    the YAML files of ``conf/`` extend (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "train_schema.yaml" not in cs.repo:  # storing converts every dataclass again (~0.3 s): once per process
        cs.store(name="train_schema", node=TrainConfig)
        for backend in envs.BACKENDS:
            cs.store(group="env", name=f"{backend}_schema", node=env_schema(backend))
        cs.store(group="env", name="custom_schema", node=EnvConfig)
    try:  # the commands' --help text (conf/*.yaml select hydra/help: carl); carl.cli stores the command's own
        cs.load("hydra/help/carl.yaml")
    except Exception:  # noqa: BLE001 - not stored yet
        register_help("$FLAGS_HELP")


def register_help(template: str) -> None:
    """The ``--help`` text of a command as Hydra's ``hydra/help`` config ``carl`` (a ``string.Template``: Hydra
    substitutes ``$FLAGS_HELP``, ``$APP_CONFIG_GROUPS``, ``$HYDRA_CONFIG_GROUPS`` and ``$CONFIG``)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="hydra/help", name="carl", provider="carl",
                                 node={"app_name": "carl", "header": "", "footer": "", "template": template})


def schema(backend: str | None):  # -> DictConfig
    """The whole typed schema with defaults, its ``env`` typed for ``backend``."""
    from omegaconf import OmegaConf

    base = OmegaConf.structured(TrainConfig)
    base.env = OmegaConf.structured(env_schema(backend))
    return base


def backend_of(name: str) -> str | None:
    return name if name in envs.BACKENDS else None


# ----------------------------------------------------------------------------------------------------------------
# Checking values against the schema: every problem at once, in our words
# ----------------------------------------------------------------------------------------------------------------
def _expected(node: Any, key: str) -> str:
    from omegaconf import ListConfig
    from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

    if isinstance(node, BooleanNode):
        return "true or false"
    if isinstance(node, IntegerNode):
        return f"an integer, e.g. {key}=8"
    if isinstance(node, FloatNode):
        return f"a number, e.g. {key}=0.5"
    if isinstance(node, StringNode):
        return "a string"
    if isinstance(node, ListConfig):
        return f"a list, e.g. {key}=[1,2]"
    return "of another type"


def _typed(node: Any) -> bool:
    """A section of the schema (a dataclass), as opposed to a free mapping."""
    from omegaconf import DictConfig, OmegaConf

    return isinstance(node, DictConfig) and OmegaConf.get_type(node) not in (dict, None)


def check_value(base: Any, key: str, value: Any, add: bool = False) -> bool:
    """Set ``key=value`` on ``base`` (a typed config, changed in place) or raise a :class:`ConfigError` naming an
    unknown key (with the closest valid one) or a value of the wrong type (with what it must be). Returns whether
    the key lies in a free mapping (``env.eval_options``, nuPlan's ``sim`` overrides), where any key may be set."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import ConfigKeyError, ValidationError
    from omegaconf.nodes import BooleanNode

    parts = key.split(".")
    node, depth = base, 0
    for part in parts[:-1]:  # walk down the typed sections; below a free mapping any key goes
        if not _typed(node) or part not in node or not isinstance(node[part], DictConfig):
            break
        node, depth = node[part], depth + 1
    at = ".".join(parts[:depth])
    if _typed(node) and (depth < len(parts) - 1 or parts[-1] not in node.keys()):  # keys(): MISSING too
        raise ConfigError(f"unknown key {key}={value!r}; {suggest(parts[depth], list(node.keys()), at + '.' if at else '')}")
    parent, leaf = node, parts[-1]
    if add and depth == len(parts) - 1 and leaf in parent.keys():
        raise ConfigError(f"+{key}={value!r}: the key exists, so drop the '+' ({key}=...); '+' adds a key, '++' sets "
                          "either way")
    node = parent._get_node(leaf) if depth == len(parts) - 1 and leaf in parent.keys() else None
    if isinstance(node, BooleanNode) and not isinstance(value, bool) and not (value is None and node._is_optional()):
        raise ConfigError(f"{key}={value!r} must be true or false")  # None: an optional flag's "not set" (saved so)
    try:
        OmegaConf.update(base, key, value, merge=True, force_add=add or not _typed(parent))
    except (ValidationError, ConfigKeyError) as exc:
        if node is None:
            raise ConfigError(f"{key}={value!r}: {str(exc).splitlines()[0]}") from None
        raise ConfigError(f"{key}={value!r} must be {_expected(node, key)}") from None
    return not _typed(parent)


def _leaves(data: dict[str, Any], base: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted (key, value) pairs of ``data`` down to the schema's leaves (free mappings are one value)."""
    from omegaconf import DictConfig, OmegaConf

    out = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        node = base.get(k) if isinstance(base, DictConfig) and k in base else None
        if isinstance(v, dict) and isinstance(node, DictConfig) and OmegaConf.get_type(node) not in (dict, None):
            out += _leaves(v, node, key + ".")
        else:
            out.append((key, v))
    return out


def from_dict(data: dict[str, Any], overrides: list[str] = (), world_size: int = 1) -> TrainConfig:
    """Build and validate a :class:`TrainConfig` from a plain dictionary (a saved ``config.yaml``) and ``key=value``
    overrides: unknown keys, wrong types and bad values all reported at once."""
    data = {k: v for k, v in data.items() if k != "hydra"}
    env = data.get("env") if isinstance(data.get("env"), dict) else {}
    base = schema(backend_of(str(env.get("name", EnvConfig.name))))
    checks = Checks()
    for key, value in _leaves(data, base):
        checks.run(check_value, base, key, value)
    checks.problems += check_overrides(list(overrides), base)[1]
    checks.done()
    return to_train_config(base, world_size)


def to_train_config(cfg: Any, world_size: int = 1) -> TrainConfig:
    """A composed, typed config -> a validated :class:`TrainConfig` of plain values; ``env.options`` becomes a plain
    mapping (the backend builds its own config object from it)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    parts = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    sections = {"env": EnvConfig, "model": ModelConfig, "ppo": PPOConfig, "parallel": ParallelConfig,
                "logging": LoggingConfig}
    values = {k: sections[k](**v) if k in sections else v for k, v in data.items() if k in parts}
    return validate(TrainConfig(**values), world_size)


# ----------------------------------------------------------------------------------------------------------------
# Composition of conf/train.yaml with command-line overrides
# ----------------------------------------------------------------------------------------------------------------
def check_overrides(overrides: list[str], base: Any, groups: tuple[str, ...] = GROUPS) -> tuple[list[str], list[str]]:
    """Check (and apply) every ``key=value`` override on the typed ``base``, before Hydra applies them one by one, so
    all unknown keys and wrong types are found together (``groups``: selections, not keys). Returns the overrides
    that passed and the problems of the others."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as exc:
        raise ConfigError(f"{str(exc).splitlines()[0]} (overrides: {' '.join(overrides)})") from None
    checks, good = Checks(), []
    for text, ov in zip(overrides, parsed):
        key = ov.key_or_group
        if not (key in groups or key.startswith("hydra") or ov.is_delete() or ov.package):
            before = len(checks.problems)
            free = checks.run(check_value, base, key, ov.value(), ov.is_add())
            if len(checks.problems) > before:
                continue
            if free and not (ov.is_add() or ov.is_force_add()):
                text = "++" + text  # a free mapping takes new keys without a '+'
        good.append(text)
    return good, checks.problems


def _compose(overrides: list[str], config_name: str, schemas: dict[str, type] | None,
             groups: tuple[str, ...], with_hydra: bool = False) -> tuple[Any, Checks]:
    """Hydra's composition of the overrides that pass :func:`check_overrides`; the problems of the others are
    returned beside it, so that range checks can add theirs and everything is reported at once."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    base = _base(overrides, config_name, schemas, groups)
    checks = Checks()
    good, problems = check_overrides(overrides, base, groups)  # the bad ones are left out of the composition
    checks.problems += problems
    bad_choices = check_choices(overrides, groups)
    checks.problems += bad_choices.values()
    good = [o for o in good if o not in bad_choices]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name=config_name, overrides=good, return_hydra_config=with_hydra), checks
    except Exception as exc:  # noqa: BLE001 - Hydra/OmegaConf raise many types; all are user errors here
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = f"; `carl-{config_name} --cfg` prints every key" if "override" in msg.lower() else ""
        raise ConfigError([*checks.problems, f"{msg} (overrides: {' '.join(overrides) or 'none'}){hint}"]) from None


def _base(overrides: list[str], config_name: str, schemas: dict[str, type] | None, groups: tuple[str, ...]) -> Any:
    """The typed schema the overrides are checked on (registered with Hydra on the way)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    register_configs()
    if schemas:
        for name, node in schemas.items():
            ConfigStore.instance().store(name=name, node=node)
        return OmegaConf.structured(schemas[f"{config_name}_schema"])
    return schema(backend_of(_env_choice(overrides, config_name, groups)))


def free_keys(overrides: list[str], config_name: str = "train", schemas: dict[str, type] | None = None,
              groups: tuple[str, ...] = GROUPS) -> set[str]:
    """The keys of ``overrides`` that lie in a free mapping (``env.eval_options.x``, a custom env's options), which
    Hydra takes only with ``++``: :func:`compose` adds it, and so must a caller that hands overrides to Hydra."""
    good, _ = check_overrides(overrides, _base(overrides, config_name, schemas, groups), groups)
    return {g[2:].split("=", 1)[0] for g in good if g.startswith("++")} - {
        o[2:].split("=", 1)[0] for o in overrides if o.startswith("++")}


# plugin groups of Hydra: the preset names of conf/hydra/<group>/ and the packages that provide the others
HYDRA_PLUGINS = {"hydra/launcher": {"submitit_local": "hydra-submitit-launcher",
                                    "submitit_slurm": "hydra-submitit-launcher"},
                 "hydra/sweeper": {"optuna": "hydra-optuna-sweeper"}}


def hydra_options(group: str) -> list[str]:
    """The choices of a Hydra config group (``hydra/launcher``): Hydra's own, the installed plugins' and ours."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        options = GlobalHydra.instance().config_loader().get_group_options(group)
    GlobalHydra.instance().clear()
    return sorted(options)


def group_options(group: str) -> list[str]:
    """The presets of one of our config groups (``conf/<group>/*.yaml``)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _unknown_choice(key: str, name: str, options: list[str], where: str) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return (f"{key}={name} is unknown; " + (f"did you mean {key}={close[0]}? " if close else "")
            + f"choose one of {', '.join(options)} ({where})")


def check_choices(overrides: list[str], groups: tuple[str, ...] = ()) -> dict[str, str]:
    """Selections of a config group that cannot be composed -> the problem naming the choices there are (override ->
    problem): our groups (``benchmark=``, ``env=``, ``+experiment=``...; presets in ``conf/<group>/``), and
    ``hydra/launcher=`` / ``hydra/sweeper=``, where a known name may also need its plugin package."""
    problems = {}
    for o in overrides:
        key, _, name = o.lstrip("+~").partition("=")
        if not name or name == "null":
            continue
        if key in groups:
            options = group_options(key)
            if name not in options:
                problems[o] = _unknown_choice(o.partition("=")[0], name, options, f"presets: conf/{key}/")
            continue
        if key not in HYDRA_PLUGINS:
            continue
        options = hydra_options(key)
        preset = CONF_DIR / key / f"{name}.yaml"
        base = next((b for b in HYDRA_PLUGINS[key] if preset.is_file() and f"- {b}" in preset.read_text()), name)
        if base in HYDRA_PLUGINS[key] and base not in options:  # a plugin's preset (or one extending it), absent
            problems[o] = (f"{key}={name} needs the {HYDRA_PLUGINS[key][base]} package (not installed): "
                           "pip install -e '.[sweep]' (make dev installs it)")
        elif name not in options:
            problems[o] = _unknown_choice(key, name, options, f"presets: conf/{key}/")
    return problems


def _env_choice(overrides: list[str], config_name: str, groups: tuple[str, ...]) -> str:
    """The environment a composition selects, directly (``env=...``) or through a preset that overrides ``/env``
    (``+experiment=carl_nuplan``): the selections alone are composed to find it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    selections = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in groups]
    if not any(o.lstrip("+~").startswith("experiment=") for o in selections):
        return next((o.split("=", 1)[1] for o in selections if o.lstrip("+").split("=", 1)[0] == "env"), "sim")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return str(hydra_compose(config_name=config_name, overrides=selections).env.name)
    except Exception:  # noqa: BLE001 - a bad selection is reported by the full composition
        return "sim"


def compose(overrides: list[str], config_name: str = "train", schemas: dict[str, type] | None = None,
            groups: tuple[str, ...] = GROUPS) -> Any:
    """``conf/<config_name>.yaml`` + ``overrides`` composed by Hydra over its registered schema (no working-directory
    change, no ``outputs/``). ``schemas`` (name -> dataclass) are stored for configs other than ``train``, whose YAML
    extends ``<config_name>_schema``; every bad override is reported at once."""
    cfg, checks = _compose(overrides, config_name, schemas, groups)
    checks.done()
    return cfg


def load(overrides: list[str], world_size: int = 1) -> TrainConfig:
    """Compose and validate the training config (for a launch of ``world_size`` ranks): bad overrides and bad values
    are reported together."""
    cfg, checks = _compose(overrides, "train", None, GROUPS)
    result = checks.run(to_train_config, cfg, world_size)
    checks.done()
    return result


# ----------------------------------------------------------------------------------------------------------------
# Range checks
# ----------------------------------------------------------------------------------------------------------------
def sim_options(options: Any) -> dict[str, Any]:
    """The simulator options inside a backend's ``env.options`` (nuPlan nests them under ``sim``)."""
    opts = dict(options or {})
    opts.update(opts.get("sim", {}) if isinstance(opts.get("sim"), dict) else {})
    return opts


def validate(cfg: TrainConfig, world_size: int = 1) -> TrainConfig:
    """Check ranges, cross-field constraints and the backend's options; raise one :class:`ConfigError` listing every
    problem. ``ppo.minibatch_size`` is global: it must divide the batch of all ``world_size`` ranks."""
    e, p, par, lg = cfg.env, cfg.ppo, cfg.parallel, cfg.logging
    checks = Checks()
    _require = checks.need
    check_fields(cfg, "", checks)  # every declared choice and range (carl.config's dataclasses)
    _require(bool(e.name), "env.name is empty; use env=sim (or env.name=package.module:function)")
    batch = cfg.batch_size * world_size
    ranks = f" * {world_size} ranks" if world_size > 1 else ""
    _require(
        p.total_timesteps >= batch,
        f"ppo.total_timesteps={p.total_timesteps} is smaller than one batch (env.num_envs * ppo.num_steps{ranks} = "
        f"{batch}); "
        f"try ppo.total_timesteps={batch}",
    )
    if p.minibatch_size >= 1 and batch >= 1 and batch % p.minibatch_size:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        best = min(divisors, key=lambda d: abs(d - p.minibatch_size))
        _require(False, f"ppo.minibatch_size={p.minibatch_size} must divide the batch (env.num_envs * ppo.num_steps"
                        f"{ranks} = {batch}); try ppo.minibatch_size={best}")
    _require(
        p.accumulation_steps < 1 or p.minibatch_size % p.accumulation_steps == 0,
        f"ppo.accumulation_steps={p.accumulation_steps} must divide ppo.minibatch_size={p.minibatch_size}",
    )
    opts = sim_options(e.options)
    observation = opts.get("observation", "bev")
    key = "env.options.sim.observation" if isinstance((e.options or {}).get("sim"), dict) else "env.options.observation"
    wants = {"carl": "bev", "set": "vector"}[cfg.model.name] if cfg.model.name in MODEL_NAMES else observation
    _require(observation == wants, f"model.name={cfg.model.name} reads the {wants} observation but "
             f"{key}={observation}; set {key}={wants}, or model.name={'set' if observation == 'vector' else 'carl'}")
    dev = par.device
    _require(
        dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
        f"parallel.device={dev!r} must be auto, cpu, cuda or cuda:N",
    )
    _require(not par.hierarchical or par.per_layer_compression,
             "parallel.hierarchical=true compresses between nodes with parallel.sync=lgreco, topk or powersgd "
             f"(powersgd_impl=layerwise); it cannot wrap parallel.sync={par.sync!r}"
             + (f" with powersgd_impl={par.powersgd_impl}" if par.sync == "powersgd" else ""))
    if lg.final_benchmark is not None:
        benches = group_options("benchmark")
        _require(lg.final_benchmark in benches, f"logging.final_benchmark={lg.final_benchmark!r} is not a benchmark; "
                 f"use one of {', '.join(benches)} (conf/benchmark), or null")
        if lg.final_benchmark in benches and backend_of(e.name) is not None:
            bench_envs = {b: _benchmark_env(b) for b in benches}
            layouts = {b: envs.BACKENDS[env].layout if env in envs.BACKENDS else "custom"
                       for b, env in bench_envs.items()}
            mine = envs.BACKENDS[e.name].layout
            fits = [b for b in benches if layouts[b] == mine]
            _require(layouts[lg.final_benchmark] == mine, f"logging.final_benchmark={lg.final_benchmark} drives env "
                     f"{bench_envs[lg.final_benchmark]!r} ({layouts[lg.final_benchmark]} observations), but this run "
                     f"trains on env {e.name!r} ({mine} observations); use logging.final_benchmark="
                     f"{' or '.join(fits) or 'null'}" + (" or null" if fits else ""))
    if p.bootstrap_truncation and backend_of(e.name) is not None:
        from omegaconf import OmegaConf

        key = envs.final_obs_option(e.name)
        keeps = OmegaConf.select(OmegaConf.create(dict(e.options)), key, default=False)
        _require(keeps is True, f"ppo.bootstrap_truncation=true bootstraps truncated episodes from their final observation, "
                        f"which env {e.name!r} keeps only with env.options.{key}=true; set both, or "
                        "ppo.bootstrap_truncation=false (CaRL's recipe)")
    _require(p.pg_coef > 0 or (p.teacher != "none" and (p.bc_until == 1.0 or p.bc_final > 0)),
             f"ppo.pg_coef={p.pg_coef} turns PPO's policy term off, and with ppo.teacher={p.teacher} "
             f"ppo.bc_until={p.bc_until} nothing trains the actor "
             + ("at all" if p.teacher == "none" else f"after {p.bc_until:.0%} of the run")
             + "; set ppo.pg_coef > 0, or ppo.teacher=expert with ppo.bc_until=1.0 or ppo.bc_final > 0")
    _require(p.teacher != "expert_seen" or backend_of(e.name) in (None, *envs.SEEN_ONLY_EXPERTS),
             f"ppo.teacher=expert_seen: env {e.name!r}'s expert has no seen-only variant (only "
             f"{', '.join(envs.SEEN_ONLY_EXPERTS)}); set ppo.teacher=expert")
    _require(p.teacher == "none" or backend_of(e.name) is not None,
             f"ppo.teacher={p.teacher} fits the policy to the env backend's rule-based expert, and env.name={e.name!r} "
             f"is not a backend with one ({', '.join(envs.BACKENDS)}); set ppo.teacher=none")
    if backend_of(e.name) is not None:  # the backend's own checks, on the training and on the evaluation options
        checks.run(envs.check_options, e.name, e.options)
        if e.eval_options:
            checks.run(envs.check_options, e.name, envs.merge_options(e.name, dict(e.options), dict(e.eval_options)))
    checks.done()
    return cfg


def _benchmark_env(name: str) -> str:
    """The env backend of benchmark ``conf/benchmark/<name>.yaml`` (its ``env`` key; sim where unset)."""
    from omegaconf import OmegaConf

    return str(OmegaConf.load(CONF_DIR / "benchmark" / f"{name}.yaml").get("env", "sim"))


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later), where the compiled network pays most."""
    import torch

    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX); elsewhere bf16 autocast is emulated."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or cpu_has_amx())


def cpu_bf16_pays() -> bool:
    """Whether bf16 autocast was measured faster than float32 on this kind of CPU (``parallel.bf16=auto``): with AMX
    tiles, and on AMD's AVX-512 BF16 (Zen 4, Zen 5). On an Intel Xeon with AVX-512 BF16 and no AMX both presets ran
    20-25 % slower with it (docs/training.md, "bf16 without AMX")."""
    return cpu_has_amx() or (cpu_has_bf16() and cpu_info().get("vendor_id") == "AuthenticAMD")


def cpu_info() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` entries (empty where there is none: not Linux)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_line() -> str:
    """The CPU a figure was measured on, as every figure must name it (the same code runs up to 4x slower on one
    2-core machine than on another): model, family and model numbers (VMs often hide the full name), the CPUs this
    process may use, the vector ISA torch dispatches to, native bf16 and AMX tiles; e.g. ``AMD EPYC (family 25
    model 1), 2 CPUs, AVX2, bf16: no``, ``Intel(R) Xeon(R) Processor (family 6 model 207), 2 CPUs, AVX512, bf16: yes,
    AMX``."""
    import os
    import platform

    import torch

    info = cpu_info()
    name = info.get("model name") or platform.processor() or platform.machine()
    family = f" (family {info['cpu family']} model {info['model']})" if "cpu family" in info and "model" in info else ""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{name}{family}, {cpus} CPUs, {torch.backends.cpu.get_cpu_capability()}, "
            f"bf16: {'yes' if cpu_has_bf16() else 'no'}{', AMX' if cpu_has_amx() else ''}")


def use_bf16(cfg: TrainConfig, on_cuda: bool) -> bool:
    """``parallel.bf16`` resolved for the device: true/false as given, ``auto`` = where it pays (CUDA's bf16,
    :func:`cpu_bf16_pays`)."""
    if cfg.parallel.bf16 == "auto":
        import torch

        return torch.cuda.is_bf16_supported() if on_cuda else cpu_bf16_pays()
    return bool(cfg.parallel.bf16)


def use_compile(cfg: TrainConfig, on_cuda: bool) -> bool:
    """``parallel.compile`` resolved for the device: true/false as given, ``auto`` = on CUDA and on CPUs with AMX."""
    if cfg.parallel.compile == "auto":
        return on_cuda or cpu_has_amx()
    return bool(cfg.parallel.compile)


def check_device(cfg: TrainConfig, cuda_available: bool, cpu_bf16: bool | None = None) -> None:
    """Refuse options the device cannot run (called once the device is resolved)."""
    dev = cfg.parallel.device
    on_cuda = dev.startswith("cuda") or (dev == "auto" and cuda_available)
    if dev.startswith("cuda") and not cuda_available:
        raise ConfigError(f"parallel.device={dev!r} but CUDA is not available; use parallel.device=cpu (or auto)")
    if not on_cuda:
        if cfg.parallel.bf16 is True and not (cpu_has_bf16() if cpu_bf16 is None else cpu_bf16):
            raise ConfigError("parallel.bf16=true: this CPU has no native bfloat16 (AVX-512 BF16 or AMX), where bf16 "
                              "autocast is slower than fp32; set parallel.bf16=false (or auto: on where supported)")
