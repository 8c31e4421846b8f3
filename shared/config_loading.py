"""Settings read once per process, lowest precedence first: the config struct's defaults
(`shared/config.py`), an optional TOML file (`--config`), environment variables
`HALFMOON_<FIELD>` (e.g. `HALFMOON_NATS_URL`), command-line flags (`--nats-url`), each flag
derived from its field. Modules never read the environment themselves.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

import msgspec

from shared.config import ServiceConfig
from shared.errors import ConfigError

ENV_PREFIX = "HALFMOON_"

C = TypeVar("C", bound=ServiceConfig)


@dataclass(frozen=True)
class FlatField:
    """One setting as flags, environment and TOML spell it: `name` is the flat key, `section`
    the nested struct it lives in (None: the config itself), `type` its value's type (without
    the description `about` and the range `limits` carry, in words)."""

    name: str
    section: str | None
    type: Any
    default: Any
    about: str
    limits: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def negated_flag(self) -> str:
        """A boolean's "off" spelling, as `argparse.BooleanOptionalAction` makes it."""
        return "--no-" + self.flag[2:]

    def command_line(self, value: object) -> list[str]:
        """The flags that set this setting to `value`."""
        if isinstance(value, bool):
            return [self.flag if value else self.negated_flag]
        return [self.flag, str(value)]

    @property
    def variable(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def help(self) -> str:
        """Its `--help` line: what it does, its range and its default."""
        notes = [self.limits] if self.limits else []
        if self.default not in (None, ""):
            notes.append(f"default: {self.default}")
        return self.about + (f" ({'; '.join(notes)})" if notes else "")


def flat_fields(cls: type[ServiceConfig]) -> list[FlatField]:
    """Every setting of `cls`, nested sections flattened (their fields' encoded names)."""
    found = []
    for field in msgspec.structs.fields(cls):
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            found += [_flat(inner, field.encode_name)
                      for inner in msgspec.structs.fields(field.type)]
        else:
            found.append(_flat(field, None))
    return found


def _flat(field: msgspec.structs.FieldInfo, section: str | None) -> FlatField:
    kind, metas = field.type, []
    if get_origin(kind) is Annotated:
        kind, metas = get_args(kind)[0], list(kind.__metadata__)
    for member in get_args(kind):  # `Positive | None`: the range is the number's
        if get_origin(member) is Annotated:
            metas += member.__metadata__
    metas = [meta for meta in metas if isinstance(meta, msgspec.Meta)]
    about = next((meta.description for meta in metas if meta.description), "")
    return FlatField(field.encode_name, section, kind, _default(field), about,
                     _limits(metas))


def _limits(metas: list[msgspec.Meta]) -> str:
    """A range in words: "at least 1", "above 0", "0 to 1", "above 0, at most 1"."""
    low = next((m for m in metas if m.ge is not None or m.gt is not None), None)
    high = next((m.le for m in metas if m.le is not None), None)
    if low is not None and low.ge is not None and high is not None:
        return f"{low.ge} to {high}"
    words = [] if low is None else [f"at least {low.ge}" if low.ge is not None
                                    else f"above {low.gt}"]
    words += [] if high is None else [f"at most {high}"]
    return ", ".join(words)


def _default(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    return None if field.default_factory is msgspec.NODEFAULT else field.default_factory()


def add_field_flag(parser: argparse.ArgumentParser, field: FlatField) -> None:
    """`--field-name`, with the field's choices when its type is a `Literal` and its
    description and default as help; unset, it overrides nothing."""
    help_ = field.help.replace("%", "%%")  # argparse formats help with %
    if field.type is bool:
        parser.add_argument(field.flag, dest=field.name, default=None, help=help_,
                            action=argparse.BooleanOptionalAction)
        return
    choices = get_args(field.type) if get_origin(field.type) is Literal else None
    # `--nats` is the short spelling the docs use for `--nats-url`.
    aliases = ["--nats"] if field.name == "nats_url" else []
    parser.add_argument(field.flag, *aliases, dest=field.name, default=None, choices=choices,
                        help=help_)


def add_config_flags(parser: argparse.ArgumentParser, cls: type[ServiceConfig]) -> None:
    """One flag per setting of `cls` (`--config` for a TOML file)."""
    parser.add_argument("--config", dest="config_path", default=None, help="TOML config file")
    for field in flat_fields(cls):
        add_field_flag(parser, field)


def load_config(
    cls: type[C],
    *,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    toml_path: str | Path | None = None,
) -> C:
    """Merge file, environment and flags (all flat keys) over the defaults, nest them and
    validate the result."""
    fields = {field.name: field for field in flat_fields(cls)}
    merged: dict[str, Any] = {}
    if toml_path is not None:
        merged.update(_read_toml(Path(toml_path), cls, set(fields)))
    for key, value in (env or {}).items():
        name = key.removeprefix(ENV_PREFIX).lower()
        if key.startswith(ENV_PREFIX) and name in fields:
            merged[name] = value
    merged.update({k: v for k, v in (flags or {}).items() if k in fields and v is not None})
    nested: dict[str, Any] = {}
    for name, value in merged.items():
        section = fields[name].section
        (nested.setdefault(section, {}) if section else nested)[name] = value
    try:
        return msgspec.convert(nested, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_named(str(exc), fields, cls)) from exc


def _named(problem: str, fields: Mapping[str, FlatField], cls: type[ServiceConfig]) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.engine.max_batch_tokens`" as the setting is
    spelled where it was set: "--max-batch-tokens (HALFMOON_MAX_BATCH_TOKENS): expected..."."""
    found = re.fullmatch(r"(.*) - at `\$\.(?:\w+\.)?(\w+)`", problem)
    if found is None or found.group(2) not in fields:
        return f"invalid {cls.__name__}: {problem}"
    field = fields[found.group(2)]
    return f"invalid {field.flag} ({field.variable}): {found.group(1)}"


def _read_toml(path: Path, cls: type[ServiceConfig], names: set[str]) -> dict[str, Any]:
    """Flat keys, or the same keys under a table named for their section (`[transfer]`)."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    sections = {field.section for field in flat_fields(cls) if field.section}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(value if key in sections and isinstance(value, dict) else {key: value})
    unknown = set(flat) - names
    if unknown:
        raise ConfigError(f"unknown keys in {path}: {sorted(unknown)}")
    return flat
