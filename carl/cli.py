"""What the three commands (``carl-train``, ``carl-eval``, ``carl-export``) share: ``--help``, ``--cfg`` and the
one-line error with its exit code."""
from __future__ import annotations

import sys
from typing import Any, Callable, NoReturn


def command_line(argv: list[str] | None, doc: str | None) -> tuple[list[str], bool]:
    """``-h``/``--help`` prints ``doc`` and exits 0; returns the overrides and whether ``--cfg`` asks for the config."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(doc)
        sys.exit(0)
    return [a for a in argv if a != "--cfg"], "--cfg" in argv


def print_config(data: dict[str, Any]) -> NoReturn:
    """``--cfg``: the composed, checked config as YAML; exit 0."""
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(OmegaConf.create(data)))
    sys.exit(0)


def fail(what: str, exc: BaseException | str, code: int = 2) -> NoReturn:
    """``<what>: <message>`` on stderr and exit ``code`` (2: bad input, named in the message)."""
    print(f"{what}: {exc}", file=sys.stderr)
    sys.exit(code)


def run_command(argv: list[str] | None, doc: str | None, load: Callable[[list[str]], Any],
                run: Callable[[Any], Any], errors: dict[type[BaseException], tuple[str, int, str]]) -> NoReturn:
    """A whole command: compose with ``load``, print it for ``--cfg``, else ``run`` it and exit with the code it
    returns (0 unless an int). An exception of a type in ``errors`` (type -> (what, exit code, text appended)) is one
    line on stderr."""
    overrides, print_cfg = command_line(argv, doc)
    try:
        cfg = load(overrides)
        if print_cfg:
            print_config(cfg if isinstance(cfg, dict) else cfg.to_dict())
        result = run(cfg)
        code = result if isinstance(result, int) else 0
    except tuple(errors) as exc:  # type: ignore[misc]
        what, code, more = next(v for t, v in errors.items() if isinstance(exc, t))
        fail(what, f"{exc}{more}", code)
    sys.exit(code)
