"""Loading a run config: YAML files (`base:` inheritance), `key=value` overrides, and the
conversion of plain values into the typed sections of gspo_mcore.config.schema, each mismatch a
one-line ConfigError naming the key; fields that moved or were replaced say where they went."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml

from gspo_mcore.config.schema import Config
from gspo_mcore.config.validate import ConfigError


def _convert(tp, value, where: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if origin is Literal:
        if isinstance(value, bool) and str(value).lower() in args:  # YAML's true/false for "true"/"false"
            value = str(value).lower()
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if tp is Any:
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}: expected a mapping with string keys, got {value!r}")
        return {k: _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp in (int, float, str):
        if isinstance(value, bool) or (tp is int and isinstance(value, float)):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
        try:
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    raise ConfigError(f"{where}: unsupported field type {tp}")


# Fields that moved to the section that reads them: a config written for the old place gets told.
# loss.level's values as loss.function's (what a run directory's config.yaml of an older version
# holds: gspo_mcore.run.saved_config reads it with them).
LEVEL_FUNCTIONS = {"sequence": "gspo", "sequence_token": "gspo_token", "token": "grpo"}
# Fields another replaced: a one-line error naming the new field.
REPLACED = {
    "loss.level": "loss.function (" + ", ".join(f"{old}: {new}" for old, new in LEVEL_FUNCTIONS.items()) + ")",
}
MOVED = {
    "loss.temperature": "rollout.temperature",
    "train.reward_norm": "reward.norm",
    "train.advantage_std_norm": "reward.advantage_std_norm",
    "train.advantage_clip": "reward.advantage_clip",
    "train.group_filter": "rollout.group_filter",
    "train.oversample": "rollout.oversample",
    "train.max_sampling_rounds": "rollout.max_sampling_rounds",
}


def from_dict(cls, data: dict, where: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        key = f"{where + '.' if where else ''}{unknown[0]}"
        if key in MOVED:
            raise ConfigError(f"{key}: moved to {MOVED[key]}")
        if key in REPLACED:
            raise ConfigError(f"{key}: replaced by {REPLACED[key]}")
        close = difflib.get_close_matches(unknown[0], sorted(names), n=1)
        hint = f" (did you mean {where + '.' if where else ''}{close[0]}?)" if close else ""
        raise ConfigError(f"{key}: unknown config {'field' if where else 'section'}{hint}")
    kwargs = {
        key: _convert(hints[key], value, f"{where + '.' if where else ''}{key}") for key, value in data.items()
    }
    return cls(**kwargs)


def _set_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep:
        raise ConfigError(f"override {override!r}: expected key=value")
    *parents, leaf = key.split(".")
    node = data
    for depth, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parents[:depth + 1])} is not a section")
    try:
        node[leaf] = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {override!r}: not a valid value ({str(err).splitlines()[0]})") from None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    """A config file; `base: OTHER.yaml` (relative to this file) is read first and this
    file's sections are merged over it, key by key."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: `base` chain loops back to itself")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected a file name")
    return _merge(_read_yaml(path.parent / base, (*seen, path.resolve())), data)


def config_yaml(config: Config) -> str:
    """The resolved config (base files merged, overrides applied, every default filled in) as
    YAML that load_config reads back to the same config."""
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)


def translate_old_keys(data: dict) -> dict:
    """Keys the docs or a config ever showed, at their place now (MOVED: the same value; loss.level:
    its loss.function, LEVEL_FUNCTIONS), each with a dated warning (common.deprecation's release);
    an old key beside the new one with another value is a one-line error. Works until REMOVED_AFTER."""
    from gspo_mcore.common.deprecation import REMOVED_AFTER, MovedWarning

    renames = {**{old: (new, None) for old, new in MOVED.items()}, "loss.level": ("loss.function", LEVEL_FUNCTIONS)}
    for old, (new, values) in renames.items():
        section, field_name = old.split(".")
        if not isinstance(data.get(section), dict) or field_name not in data[section]:
            continue
        value = data[section].pop(field_name)
        if values is not None:
            if value not in values:
                raise ConfigError(f"{old}: {value!r} is not one of {sorted(values)} (it is {REPLACED[old]} now)")
            value = values[value]
        new_section, new_field = new.split(".")
        target = data.setdefault(new_section, {})
        if new_field in target and target[new_field] != value:
            raise ConfigError(f"{old}: {value!r} beside {new}: {target[new_field]!r}; write {new} alone")
        target[new_field] = value
        warnings.warn(f"config key {old} is {new} now: write {new}: {value} (the old key works until "
                      f"{REMOVED_AFTER})", MovedWarning, stacklevel=3)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None) -> Config:
    """The config of `path` (or of `data`, a config's sections as read from YAML) with `overrides`;
    old keys translated (translate_old_keys)."""
    data = {} if path is None and data is None else (data if data is not None else _read_yaml(Path(path)))
    for override in overrides:
        _set_override(data, override)
    return from_dict(Config, translate_old_keys(data)).validate()
