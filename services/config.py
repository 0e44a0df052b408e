"""Daemon configuration: command-line flag > ``SHARDLINE_*`` environment variable > YAML file > default.

The YAML file is a mapping whose keys are the daemon's long option names with ``_`` for ``-``
(``heartbeat_timeout: 5``). Unknown keys and values of the wrong type are errors that name the key
and quote the value; nothing is silently ignored.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import yaml

from services.errors import ShardlineConfigError

# Options that make no sense in a shared config file.
_NOT_FROM_FILE = {"config", "help"}


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    given = set()
    for action in parser._actions:  # argparse has no public API for "was this flag given"
        for opt in action.option_strings:
            if any(tok == opt or tok.startswith(opt + "=") for tok in argv):
                given.add(action.dest)
    return given


def _coerce(action: argparse.Action, key: str, value, source: str):
    if action.type is None or isinstance(value, (list, dict)):
        if isinstance(value, (list, dict)):
            raise ShardlineConfigError(f"{source}: {key} must be a scalar, got {value!r}")
        if action.const is not None and isinstance(action.default, bool):
            return _as_bool(key, value, source)
        return str(value) if value is not None else None
    try:
        return action.type(value)
    except (TypeError, ValueError):
        raise ShardlineConfigError(f"{source}: {key} has an invalid value {value!r}") from None


def _as_bool(key: str, value, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ShardlineConfigError(f"{source}: {key} must be true or false, got {value!r}")


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
            raise ShardlineConfigError(f"--config {args.config!r} must be a mapping of option: value, got {type(loaded).__name__}")
        for key, value in loaded.items():
            dest = str(key).replace("-", "_")
            if dest not in actions:
                known = ", ".join(sorted(actions))
                raise ShardlineConfigError(f"--config {args.config!r}: unknown key {key!r} (known keys: {known})")
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
