"""Configuration plumbing shared by every backend and by the trainer: one error type that reports every problem at
once, plain-dictionary -> dataclass conversion with the key, the value and the fix named, and options declared once
(:func:`option`: default, help, choices, range) with one checker (:func:`check_fields`) and one help listing
(:func:`describe_fields`).

No torch here: the CARLA stand-in server and the map compiler use it without loading torch.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import re
from typing import Any, Callable


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


# ---------------------------------------------------------------------------------------------- declared options
def option(default: Any = dataclasses.MISSING, help: str = "", *, choices: tuple | None = None,  # noqa: A002
           ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           factory: Callable[[], Any] | None = None) -> Any:
    """A config field declared once: its default, its help (``--help`` prints it) and its allowed values (choices, or
    a range), which :func:`check_fields` checks for every config that uses it."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _num(x: float) -> str:
    return f"{x:g}"


def _word(x: Any) -> str:
    return str(x).lower() if isinstance(x, bool) else str(x)


def field_problem(key: str, value: Any, meta: dict[str, Any], default: Any) -> str | None:
    """What is wrong with ``key=value`` under the field's declared choices or range (None: nothing)."""
    hint = f" (default {_word(default)})" if default is not dataclasses.MISSING else ""
    choices = meta.get("choices")
    if choices is not None:
        if any(type(c) is type(value) and c == value for c in choices):  # 1 is not True, "1" is not 1
            return None
        words = [_word(c) for c in choices]
        listed = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
        return f"{key}={value!r} must be {listed}{hint}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    ge, gt, le, lt = (meta.get(k) for k in ("ge", "gt", "le", "lt"))
    lo = (ge, "[") if ge is not None else (gt, "(") if gt is not None else None
    hi = (le, "]") if le is not None else (lt, ")") if lt is not None else None
    ok = ((lo is None or (value >= lo[0] if lo[1] == "[" else value > lo[0]))
          and (hi is None or (value <= hi[0] if hi[1] == "]" else value < hi[0])))
    if ok:
        return None
    if lo and hi:
        return f"{key}={value!r} must be in {lo[1]}{_num(lo[0])}, {_num(hi[0])}{hi[1]}{hint}"
    if lo:
        return f"{key}={value!r} must be {'>=' if lo[1] == '[' else '>'} {_num(lo[0])}{hint}"
    return f"{key}={value!r} must be {'<=' if hi[1] == ']' else '<'} {_num(hi[0])}{hint}"


def check_fields(obj: Any, prefix: str, checks: Checks) -> None:
    """Check every declared field of the dataclass ``obj`` (and of the dataclasses it holds) against its choices and
    range; each problem goes to ``checks`` named by its dotted key (``prefix.name``)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_fields(value, key, checks)
            continue
        problem = field_problem(key, value, dict(f.metadata), f.default)
        if problem:
            checks.need(False, problem)


@functools.lru_cache(maxsize=None)
def _comments(cls: type) -> dict[str, str]:
    """The trailing and preceding ``#`` comments of each field in ``cls``'s source (the help of fields declared
    without :func:`option`)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out, above = {}, []
    for line in lines:
        s = line.strip()
        if s.startswith("#"):
            above.append(s.lstrip("# ").strip())
            continue
        m = re.match(r"(\w+)\s*:[^=]+(=.*)?$", s)
        if m and not s.startswith(("def ", "return", "@")):
            tail = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            out[m.group(1)] = " ".join([*above, tail]).strip()
        above = []
    return out


def describe_fields(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) of every field of the dataclass ``cls``, nested ones expanded: what ``--help``
    lists."""
    rows = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
            if dataclasses.is_dataclass(value):
                rows += describe_fields(type(value), key)
                continue
            default = repr(value)
        else:
            default = _word(f.default) if f.default is not dataclasses.MISSING else "(required)"
        meta = dict(f.metadata)
        help_ = meta.get("help") or _comments(cls).get(f.name, "")
        if meta.get("choices"):
            help_ = f"{help_} [{' | '.join(_word(c) for c in meta['choices'])}]".strip()
        rows.append((key, default, help_))
    return rows
