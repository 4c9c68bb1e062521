"""Configuration plumbing shared by every backend and by the trainer: one error type that reports every problem at
once, and plain-dictionary -> dataclass conversion with the key, the value and the fix named.

No torch here: the CARLA stand-in server and the map compiler use it without loading torch.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any


class ConfigError(ValueError):
    """Configuration values that cannot work. Each problem names the key, the value and the fix; all are reported
    together (``problems``), so one run of the command shows everything to change."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems:\n  " + "\n  ".join(self.problems)
        super().__init__(message)


class Checks:
    """Collects failed checks; :meth:`done` raises one :class:`ConfigError` listing all of them."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def need(self, ok: bool, message: str) -> None:
        if not ok and message not in self.problems:
            self.problems.append(message)

    def run(self, check: Any, *args: Any) -> Any:
        """Call ``check(*args)``, keeping the problems of a :class:`ConfigError` it raises instead of stopping."""
        try:
            return check(*args)
        except ConfigError as exc:
            for message in exc.problems:
                self.need(False, message)
            return None

    def done(self) -> None:
        if self.problems:
            raise ConfigError(self.problems)


def suggest(key: str, valid: list[str], prefix: str = "") -> str:
    """``did you mean <prefix><closest>?`` or the list of valid keys."""
    close = difflib.get_close_matches(key, valid, n=1)
    return f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(sorted(valid))}"


def from_dict(cls: type, values: dict[str, Any], prefix: str = "env") -> Any:
    """Build a (nested) config dataclass from plain values, naming every unknown key and bad type at once."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    checks = Checks()
    for key, value in values.items():
        if key not in known:
            checks.need(False, f"{prefix}.{key}={value!r}: unknown key; {suggest(str(key), list(known), prefix + '.')}")
            continue
        default = known[key].default if known[key].default is not dataclasses.MISSING else known[key].default_factory()
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                checks.need(False, f"{prefix}.{key}: expected a mapping of {type(default).__name__} fields")
                continue
            value = checks.run(from_dict, type(default), value, f"{prefix}.{key}")
            if value is None:
                continue
        elif isinstance(default, tuple) and isinstance(value, (list, tuple)):
            value = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                checks.need(False, f"{prefix}.{key}={value!r}: expected true or false")
                continue
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                checks.need(False, f"{prefix}.{key}={value!r}: expected a number")
                continue
            value = type(default)(value) if isinstance(default, float) else value
        kwargs[key] = value
    checks.done()
    return cls(**kwargs)
