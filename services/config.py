"""Daemon configuration: command-line flag > ``SHARDLINE_*`` environment variable > YAML file > default.

The YAML file is a mapping whose keys are the daemon's long option names with ``_`` for ``-``
(``heartbeat_timeout: 5``). Unknown keys and values of the wrong type are errors that name the key
and quote the value; nothing is silently ignored.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Sequence

import yaml

from services.errors import ShardlineConfigError

def require_positive_number(value, what: str) -> float:
    """Return ``value`` as a float if it is a finite real number > 0 (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ShardlineConfigError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


# Options that make no sense in a shared config file.
_NOT_FROM_FILE = {"config", "help"}


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    given = set()
    for action in parser._actions:  # argparse has no public API for "was this flag given"
        for opt in action.option_strings:
            if any(tok == opt or tok.startswith(opt + "=") for tok in argv):
                given.add(action.dest)
    return given


_EXPECTED = {int: "an integer", float: "a number", str: "a string"}


def _coerce(action: argparse.Action, key: str, value, source: str):
    """Check a value from the file or the environment; argparse never saw it."""
    what = f"{key} in {source}"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return _as_bool(what, value)
    kind = action.type or str
    if isinstance(value, str) and source == "environment" and kind is not str:
        try:
            return kind(value)
        except ValueError:
            raise ShardlineConfigError(f"{what} must be {_EXPECTED.get(kind, kind.__name__)}, got {value!r}") from None
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, str)
    else:
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ShardlineConfigError(f"{what} has an invalid value {value!r}") from None
    if not ok:
        raise ShardlineConfigError(f"{what} must be {_EXPECTED[kind]}, got {value!r}")
    if action.choices is not None and value not in action.choices:
        raise ShardlineConfigError(f"{what} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def _as_bool(what: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ShardlineConfigError(f"{what} must be true or false, got {value!r}")


def parse_daemon_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None, *, env_prefix: str = "SHARDLINE_") -> argparse.Namespace:
    """Parse ``argv`` and fill options not given on the command line from env, then ``--config``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    given = _given_on_command_line(parser, argv)
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in _NOT_FROM_FILE}

    file_values = {}
    if getattr(args, "config", None):
        try:
            with open(args.config, encoding="utf-8") as fh:
                loaded = yaml.safe_load(fh)
        except OSError as exc:
            raise ShardlineConfigError(f"cannot read --config {args.config!r}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ShardlineConfigError(f"--config {args.config!r} is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ShardlineConfigError(f"--config {args.config!r} must hold a mapping of option names, got {type(loaded).__name__}")
        for key, value in loaded.items():
            dest = str(key).replace("-", "_")
            if dest not in actions:
                known = ", ".join(sorted(actions))
                raise ShardlineConfigError(f"unknown key {key!r} in --config {args.config!r}; known keys: {known}")
            file_values[dest] = _coerce(actions[dest], str(key), value, f"--config {args.config!r}")

    for dest, action in actions.items():
        if dest in given:
            continue
        env_name = env_prefix + dest.upper()
        if env_name in os.environ:
            setattr(args, dest, _coerce(action, env_name, os.environ[env_name], "environment"))
        elif dest in file_values:
            setattr(args, dest, file_values[dest])
    return args
