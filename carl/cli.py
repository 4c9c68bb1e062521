"""What the three commands (``carl-train``, ``carl-eval``, ``carl-export``) share: Hydra's command line, checked
first, and the one-line error with its exit code.

:func:`run_command` checks the overrides the way :mod:`carl.config` does (every unknown key, wrong type and bad
value at once, exit code 2), and for a sweep (``-m``) the config of every job and that no two jobs share a run
folder, before anything runs; then it hands the command line to Hydra's own app runner (``hydra.main``), so
``--help``, ``--hydra-help``, ``--cfg job|hydra|all`` (a bare ``--cfg`` means ``job``), ``--resolve``,
``--package``, ``--info``, ``-m``, ``hydra.run.dir``, ``hydra.sweep.dir``, ``hydra/launcher=...`` and
``hydra/sweeper=...`` behave as Hydra documents them. The working directory never changes (``hydra.job.chdir``
is false).

Run folder (where a job writes, also Hydra's output folder with its ``.hydra/`` record):

* one run: the command's own key if given (``run_dir=``, ``out_dir=``), else ``hydra.run.dir`` if given on the
  command line, else the command's default (carl-train: ``hydra.run.dir`` = ``runs/<experiment>-<timestamp>``;
  carl-eval: ``runs/eval/<benchmark>-<policy>``; carl-export: ``<checkpoint folder>/bundle-<name>``);
* a sweep: ``hydra.sweep.dir/hydra.sweep.subdir`` (``<sweep dir>/<job number>``); the command's own key is refused
  there, as is a sweep folder that already holds runs: nothing saved is overwritten. When the sweep ends its
  summary (:mod:`carl.sweep`) is printed and written to the sweep folder.

Errors the command's ``errors`` table knows (type -> (what, exit code, text appended)) print as one line
``<what>: <message>`` on stderr; a single run exits with that code, a sweep goes on with its other jobs and exits
with the first failing job's code.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import envs
from carl import config, runlock, sweep
from carl.config import CONF_DIR, ConfigError

# exit codes of the jobs run in this process (one run, or the basic launcher's jobs), in order
OUTCOMES: list[int] = []
UNSUPPORTED_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun")


def fail(what: str, exc: BaseException | str, code: int = 2) -> NoReturn:
    """``<what>: <message>`` on stderr and exit ``code`` (2: bad input, named in the message)."""
    print(f"{what}: {exc}", file=sys.stderr)
    sys.exit(code)


def print_config(data: dict[str, Any]) -> NoReturn:
    """The composed, checked config as YAML; exit 0."""
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(OmegaConf.create(data)))
    sys.exit(0)


class Command:
    """One command: its config (``conf/<name>.yaml``), how it is checked and run, and where a run writes. The three
    commands subclass it (:mod:`carl.train`, :mod:`carl.eval.cli`, :mod:`carl.export`); an instance is pickled into
    cluster jobs, so subclasses live at module level and hold no state."""

    name = ""  # conf/<name>.yaml; the command is carl-<name>
    folder_key = "out_dir"  # the key naming the run folder
    groups: tuple[str, ...] = ()  # config groups of conf/<name>.yaml (selections, not keys)
    schemas: dict[str, type] | None = None  # ConfigStore entries for conf/<name>.yaml (None: carl.config's)
    errors: dict[type[BaseException], tuple[str, int, str]] = {}  # noqa: RUF012 - read-only table
    result_source = ""  # where a run folder keeps the final evaluation (sweep summary); "" = no summary
    locks_folder = False  # the run holds its folder (carl.runlock): a folder another process holds is refused

    @property
    def doc(self) -> str:
        """The ``--help`` text: the docstring of the module that defines the command."""
        return sys.modules[type(self).__module__].__doc__ or ""

    def load(self, overrides: list[str]) -> Any:
        """Overrides -> the checked config (a :class:`ConfigError` names every problem): ``conf/<name>.yaml`` over
        the command's schemas, as plain values (:meth:`build`)."""
        return self.build(config.compose(overrides, self.name, self.schemas, self.groups), overrides)

    def build(self, cfg: Any, overrides: list[str]) -> Any:
        """Hydra's composed config (the job part) -> the config :meth:`run` takes."""
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)

    def run(self, cfg: Any) -> Any:
        """Run it; an int result is the exit code."""
        raise NotImplementedError

    def execute(self, cfg: Any, job: Any) -> Any:
        """:meth:`run` inside Hydra's job (``job``: Hydra's config of the job: launcher, runtime)."""
        return self.run(cfg)

    def rewrite(self, overrides: list[str]) -> list[str]:
        """Command-line shortcuts -> the keys they stand for."""
        return overrides

    def folder(self, cfg: Any) -> str | None:
        """The run folder ``cfg`` names itself (its :attr:`folder_key`)."""
        return cfg.get(self.folder_key)

    def default_folder(self, cfg: Any) -> str | None:
        """The run folder when neither :attr:`folder_key` nor ``hydra.run.dir`` is given (None: ``hydra.run.dir``)."""
        return None

    def with_folder(self, cfg: Any, folder: str) -> Any:
        cfg[self.folder_key] = folder
        return cfg

    def check(self, cfg: Any) -> list[str]:
        """Problems of a job's config to report before Hydra creates any folder (e.g. a missing input file)."""
        return []

    def holds_run(self, folder: Path) -> bool:
        """Whether ``folder`` already holds a run's results (a sweep refuses such a folder)."""
        return any(folder.iterdir()) if folder.is_dir() else False

    def refuses(self, cfg: Any) -> bool:
        """Whether one run refuses a folder that :meth:`holds_run` (carl-train: unless resuming; carl-eval resumes
        its routes; carl-export checks ``overwrite`` itself)."""
        return False

    def check_sweep(self, cfg: Any) -> list[str]:
        """Problems of a job's config that only a sweep (``-m``) has."""
        return []

    def show(self, cfg: Any, overrides: list[str]) -> dict[str, Any] | None:
        """``--cfg job`` printed by the command itself instead of Hydra (None: Hydra prints it)."""
        return None

    def result(self, folder: Path) -> dict[str, Any] | None:
        """The final evaluation a finished run left in ``folder`` (DS/RC/IS; the sweeper's objective)."""
        return None


# ----------------------------------------------------------------------------------------------------------------
# Before Hydra: the command line, every job's config and run folder checked
# ----------------------------------------------------------------------------------------------------------------
COMMANDS = {"train": "carl.train:TrainCommand", "eval": "carl.eval.cli:EvalCommand",
            "export": "carl.export:ExportCommand"}


def load_config(name: str, overrides: list[str]) -> Any:
    """The one loader of every command's config: ``carl-<name>``'s shortcuts expanded, ``conf/<name>.yaml`` and
    ``overrides`` composed over its schema and checked (every problem in one :class:`ConfigError`): a
    :class:`~carl.config.TrainConfig` for ``train`` (``resume=`` reloads the run's), plain values for the others."""
    import importlib

    if name not in COMMANDS:
        raise ConfigError(f"no command {name!r}; the commands are {', '.join(COMMANDS)}")
    module, cls = COMMANDS[name].split(":")
    command: Command = getattr(importlib.import_module(module), cls)()
    return command.load(command.rewrite(list(overrides)))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Hydra's own argument parser over ``argv``; a bare ``--cfg``/``-c`` means ``--cfg job``. Returns the parsed
    flags and the argv to hand to Hydra."""
    from hydra._internal.utils import get_args_parser

    fixed: list[str] = []
    for i, a in enumerate(argv):
        fixed.append(a)
        if a in ("--cfg", "-c") and (i + 1 == len(argv) or argv[i + 1] not in ("job", "hydra", "all")):
            fixed.append("job")
    for flag in UNSUPPORTED_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in fixed):
            raise ConfigError(f"{flag} is not supported: the config is conf/*.yaml of this repository; put your own "
                              "presets in conf/experiment/ (+experiment=<name>) or conf/benchmark/")
    return get_args_parser().parse_args(fixed), fixed


class Plan:
    """What the checks decided: the argv for Hydra, the run or sweep folder, the config to print."""

    def __init__(self) -> None:
        self.hydra_argv: list[str] = []
        self.multirun = False
        self.folder: Path | None = None  # one run's folder
        self.sweep_dir: Path | None = None
        self.show: dict[str, Any] | None = None  # --cfg job printed by us (a resumed run's saved config)
        self.fresh = False  # the run folder did not exist before
        self.help = False  # --help / --hydra-help


def quote(path: Path | str) -> str:
    """A path as a quoted Hydra override value."""
    text = str(path).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def _given(overrides: list[str], key: str) -> str | None:
    """The value of ``key=`` among the overrides (the last one), unquoted."""
    value = None
    for o in overrides:
        k, eq, v = o.lstrip("+").partition("=")
        if eq and k == key:
            value = v.strip("'\"")
    return value


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def prepare(command: Command, argv: list[str]) -> Plan:
    """Check the command line; raise a :class:`ConfigError` naming every problem, or return the :class:`Plan`."""
    args, fixed = parse_args(argv)
    plan = Plan()
    if args.help or args.hydra_help:  # Hydra's help of the plain config
        plan.hydra_argv = [a for a in fixed if a in ("-h", "--help", "--hydra-help")]
        plan.help = True
        return plan
    if args.info or args.shell_completion:
        plan.hydra_argv = fixed
        return plan
    flags = [a for a in fixed if a not in args.overrides]
    overrides = command.rewrite(list(args.overrides))
    schemas, groups, name = command.schemas, command.groups, command.name

    problems: list[str] = []
    swept = sweep.sweep_values(overrides)
    first = sweep.first_values(overrides) if swept else overrides
    # the hydra part (mode, sweeper, launcher, folders) of the first job; its other problems are every job's too
    hyd, checks = config._compose(first, name, schemas, groups, with_hydra=True)
    problems += checks.problems
    h = hyd.hydra
    plan.multirun = bool(args.multirun) or str(h.mode) == "RunMode.MULTIRUN"
    exact = "BasicSweeper" in str(h.sweeper.get("_target_", ""))
    if not plan.multirun and swept:
        problems.append(f"{' '.join(swept)}: a sweep runs with -m (--multirun), one job per value; "
                        f"for a list value use brackets, e.g. {swept[0].split('=', 1)[0]}=[...]")
    if args.cfg and plan.multirun:
        problems.append("--cfg prints one config: drop -m, or give one value per key")
    if h.job.chdir:
        problems.append("hydra.job.chdir=true is not supported: carl keeps the working directory, so relative paths "
                        "mean what they say; drop it (the run folder is run_dir / hydra.run.dir)")
    params = h.sweeper.get("params") if plan.multirun else None
    jobs = sweep.expand(overrides, params, exact) if plan.multirun else [first]
    if plan.multirun:
        from omegaconf import OmegaConf

        problems += sweep.check_launcher(OmegaConf.to_container(h.launcher, resolve=False))

    configs = []
    for job in jobs:  # every job's config, every problem once
        try:
            configs.append(command.load(job))
        except ConfigError as exc:
            problems += [p for p in exc.problems if p not in problems]
    if problems:
        raise ConfigError(problems)

    free = config.free_keys(first, name, schemas, groups)
    hydra_overrides = [("++" + o if o.lstrip("+~").split("=", 1)[0] in free and not o.startswith("++") else o)
                       for o in overrides]
    if args.cfg:
        plan.show = command.show(configs[0], overrides)
        plan.hydra_argv = flags + hydra_overrides
        return plan

    if plan.multirun:
        plan.sweep_dir, pinned = _sweep_folders(command, configs, jobs, h, first, problems)
    else:
        plan.folder, pinned = _run_folder(command, configs[0], overrides, h, problems)
    if problems:
        raise ConfigError(problems)
    plan.hydra_argv = flags + hydra_overrides + pinned
    return plan


def _run_folder(command: Command, cfg: Any, overrides: list[str], h: Any,
                problems: list[str]) -> tuple[Path, list[str]]:
    """One run's folder: the command's key, else ``hydra.run.dir`` given, else the command's default, else
    ``hydra.run.dir``; checked, and pinned for Hydra (its timestamp resolved once)."""
    explicit = _given(overrides, "hydra.run.dir")
    key = command.folder_key if command.folder(cfg) else "hydra.run.dir"
    folder = Path(command.folder(cfg) or explicit or command.default_folder(cfg) or str(h.run.dir))
    pinned = [f"hydra.run.dir={quote(folder)}"]
    if _rank() > 0:  # a torchrun rank other than 0: rank 0 owns the folder and Hydra's record
        return folder, [*pinned, "hydra.output_subdir=null"]
    problems += command.check(cfg)
    if command.locks_folder and (busy := runlock.holder(folder)) is not None and not getattr(cfg, "lock_wait_s", 0):
        problems.append(str(runlock.busy(folder, busy, "resume" if getattr(cfg, "resume", None) else key)))
    elif command.refuses(cfg) and command.holds_run(folder):
        problems.append(f"{key}={folder} already holds a run; continue it with resume={folder} or pick another "
                        f"{command.folder_key}=")
    if h.output_subdir is not None and (folder / str(h.output_subdir)).exists():  # keep the earlier record
        pinned.append(f"hydra.output_subdir={quote(Path(str(h.output_subdir)) / time.strftime('%Y%m%d-%H%M%S'))}")
    return folder, pinned


def _sweep_folders(command: Command, configs: list[Any], jobs: list[list[str]], h: Any, first: list[str],
                   problems: list[str]) -> tuple[Path, list[str]]:
    """A sweep's folder and its jobs' run folders: none shared, none already holding a run."""
    from omegaconf import OmegaConf

    key = command.folder_key
    for c in configs:
        problems += [p for p in command.check_sweep(c) if p not in problems]
    named = sorted({str(command.folder(c)) for c in configs if command.folder(c)})
    if problems:
        return Path(str(h.sweep.dir)), []
    if named:
        share = f"would be the run folder of all {len(jobs)} runs of this sweep" if len(named) == 1 else \
            "cannot be swept"
        problems.append(f"{key}={','.join(named)} {share}: in a sweep (-m) each run's folder is "
                        f"hydra.sweep.dir/hydra.sweep.subdir ({h.sweep.dir}/<job number>); drop {key}= "
                        f"(hydra.sweep.dir=<folder> puts the sweep's runs under <folder>)")
        return Path(str(h.sweep.dir)), []
    sweep_dir = Path(str(h.sweep.dir))
    exact = "BasicSweeper" in str(h.sweeper.get("_target_", ""))
    numbered = list(enumerate(jobs)) if exact else [(0, first), (1, first)]  # a sampler's jobs: numbers differ
    folders = []
    for num, job in numbered:
        cfg, _ = config._compose([*job, f"hydra.job.num={num}"], command.name, command.schemas, command.groups,
                                 with_hydra=True)
        folders.append(sweep_dir / str(cfg.hydra.sweep.subdir))
    subdir = OmegaConf.to_container(h.sweep, resolve=False)["subdir"]
    for folder, nums in sweep.shared_folders(folders).items():
        problems.append(f"hydra.sweep.subdir={subdir} gives jobs {', '.join(map(str, nums))} the same run "
                        f"folder {folder}; use hydra.sweep.subdir='${{hydra.job.num}}' (one folder per job)")
    for c in configs:
        problems += [p for p in command.check(c) if p not in problems]
    held = [f for f in folders if command.holds_run(f)]
    if (sweep_dir / f"{sweep.SUMMARY}.json").exists() or held:
        problems.append(f"hydra.sweep.dir={sweep_dir} already holds a sweep ({(held or [sweep_dir])[0]}); pick "
                        "another hydra.sweep.dir= (its default has a timestamp); nothing there is overwritten")
    return sweep_dir, [f"hydra.sweep.dir={quote(sweep_dir)}"]


# ----------------------------------------------------------------------------------------------------------------
# Hydra's app runner and the task function it calls for each job
# ----------------------------------------------------------------------------------------------------------------
class HydraTask:
    """Hydra's task function: builds the command's config from the composed one, runs it in the job's run folder
    (``hydra.runtime.output_dir``) and returns the final held-out driving score (NaN without one) for a sweeper
    such as Optuna. Errors of the command's table are one line on stderr (and ``error.txt`` in a sweep's run
    folder), never an exception: a sweep goes on with its other jobs."""

    def __init__(self, command: Command, multirun: bool) -> None:
        self.command, self.multirun = command, multirun

    def __call__(self, cfg: Any) -> float:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        # one run: the folder as given (pinned hydra.run.dir); a sweep's job: Hydra's absolute output folder
        folder = Path(hc.runtime.output_dir if self.multirun else hc.run.dir)
        command = self.command
        code = 0
        try:
            built = command.with_folder(command.build(cfg, list(hc.overrides.task)), str(folder))
            result = command.execute(built, hc)
            code = result if isinstance(result, int) else 0
        except tuple(command.errors) as exc:  # type: ignore[misc]
            what, code, more = next(v for t, v in command.errors.items() if isinstance(exc, t))
            line = f"{what}: {exc}{more}"
            print(line, file=sys.stderr, flush=True)
            if self.multirun:
                (folder / sweep.ERROR_FILE).write_text(line + "\n")
        OUTCOMES.append(code)
        metrics = command.result(folder) if code == 0 else None
        if code and self.multirun and not (folder / sweep.ERROR_FILE).exists():
            (folder / sweep.ERROR_FILE).write_text(f"exit code {code}\n")
        value = metrics.get("driving_score") if metrics else None
        return float(value) if isinstance(value, (int, float)) else float("nan")


def help_text(command: Command) -> str:
    """``--help``: the command's docstring, every option with its default and help, its config groups and Hydra's
    flags."""
    from envs.config import describe_fields

    lines = [(command.doc or "").strip(), "", "Options (key = default: help):"]
    schemas = list((command.schemas or {"train": config.TrainConfig}).values())
    rows = [row for schema in schemas for row in describe_fields(schema)]
    if command.name == "train":  # env.options: the default backend's (the simulator's); other backends: env=<name>
        rows += describe_fields(envs.options_schema("sim"), "env.options")
    for key, default, help_ in rows:
        lines.append(f"  {key} = {default}" + (f": {help_}" if help_ else ""))
    lines += ["", "Config groups (conf/):"]
    for group in command.groups:
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        lines.append(f"  {'+' if group == 'experiment' else ''}{group}: {', '.join(options)}")
    for group in ("hydra/launcher", "hydra/sweeper"):
        lines.append(f"  {group}: {', '.join(config.hydra_options(group))}")
    lines += ["", "Hydra's flags (--hydra-help: Hydra's own config groups):", "$FLAGS_HELP"]
    return "\n".join(lines).replace("$", "$$").replace("$$FLAGS_HELP", "$FLAGS_HELP")


def run_command(command: Command, argv: list[str] | None = None) -> NoReturn:
    """A whole command: check the command line (exit 2 with every problem), print the config for ``--cfg``, else
    let Hydra run the job(s); a sweep's summary is printed and written at the end. Exits with the job's code (a
    sweep: the first failing job's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plan = prepare(command, argv)
    except ConfigError as exc:
        what, code, more = command.errors.get(ConfigError, ("config error", 2, ""))
        fail(what, f"{exc}{more}", code)
    if plan.show is not None:
        print_config(plan.show)
    if plan.folder is not None:
        plan.fresh = not plan.folder.exists()
    code = launch(command, plan)
    if plan.folder is not None and plan.fresh and plan.folder.is_dir():
        _tidy(plan.folder, code)
    if plan.sweep_dir is not None and command.result_source and plan.sweep_dir.is_dir():
        text, summary = sweep.write_summary(plan.sweep_dir, command.result, command.result_source)
        print(text + f"sweep summary: {plan.sweep_dir / (sweep.SUMMARY + '.md')} (and .json)", flush=True)
        if code == 0 and any(r["status"] != "ok" for r in summary["runs"]):
            code = 1  # a job that failed in another process (a cluster job)
    sys.exit(code)


def launch(command: Command, plan: Plan) -> int:
    """``hydra.main`` over ``plan.hydra_argv``; returns the exit code (the jobs' first non-zero one)."""
    import hydra

    config.register_configs()
    if plan.help:
        config.register_help(help_text(command))
        config._base([], command.name, command.schemas, command.groups)  # the command's own schema, for Hydra's help
    OUTCOMES.clear()
    task = HydraTask(command, plan.multirun)
    app = hydra.main(config_path=str(CONF_DIR), config_name=command.name, version_base=None)(task)
    saved, sys.argv = sys.argv, [f"carl-{command.name}", *plan.hydra_argv]
    hydra_code: Any = 0
    try:
        app()
    except SystemExit as exc:  # Hydra's own exits: --help (0), its errors (1)
        hydra_code = exc.code
    finally:
        sys.argv = saved
    failed = [c for c in OUTCOMES if c]
    if failed:
        return failed[0]
    return hydra_code if isinstance(hydra_code, int) else (0 if hydra_code is None else 1)


def _tidy(folder: Path, code: int) -> None:
    """A run that failed before writing anything leaves no folder behind (Hydra creates it, with ``.hydra/``);
    neither does a torchrun rank whose folder name (a timestamp) differs from rank 0's."""
    left = {p.name for p in folder.iterdir()}
    if not left or (code and left <= {".hydra"}):
        shutil.rmtree(folder / ".hydra", ignore_errors=True)
        folder.rmdir()
