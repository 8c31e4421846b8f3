"""Every setting of every service as one Markdown reference, generated from the config
structs (`shared/config.py`): `halfmoon settings --out docs/settings.md` writes the copy
that is committed, and a test keeps it current."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from shared.config import ConductorConfig, GatewayConfig, ServiceConfig, WorkerConfig
from shared.config_loading import ENV_PREFIX, FlatField, flat_fields

SERVICES: dict[str, type[ServiceConfig]] = {
    "gateway": GatewayConfig, "conductor": ConductorConfig, "worker": WorkerConfig}

_INTRO = f"""\
# halfmoon settings

Generated from `shared/config.py` by `halfmoon settings --out docs/settings.md`: edit the
descriptions there, not here.

Each setting is a flag (`--num-blocks`), an environment variable (`{ENV_PREFIX}NUM_BLOCKS`)
and a key of the TOML file given with `--config` (`num_blocks = 64`; a worker's may also sit
in a table named for its section, `[engine]`). Flags win over the environment, which wins
over the file. `halfmoon up` passes each setting to every process whose config has it.
"""


def render_reference() -> str:
    shared = {field.name for field in flat_fields(ServiceConfig)}
    parts = [_INTRO, _table("Every service", flat_fields(ServiceConfig))]
    for service, config in SERVICES.items():
        own = [field for field in flat_fields(config) if field.name not in shared]
        sections = dict.fromkeys(field.section for field in own)
        for section in sections:
            title = f"`halfmoon {service}`" + (f": {section}" if section else "")
            parts.append(_table(title, [f for f in own if f.section == section]))
    return "\n".join(parts)


def _table(title: str, fields: list[FlatField]) -> str:
    rows = [f"## {title}\n", "| setting | environment | default | what it does |",
            "|---|---|---|---|"]
    rows += [f"| {_flags(field)} | `{field.variable}` | {_default(field)} | "
             f"{_cell(field.about + _range(field) + _choices(field.type))} |"
             for field in fields]
    return "\n".join(rows) + "\n"


def _flags(field: FlatField) -> str:
    if field.type is bool:
        return f"`{field.flag}`, `{field.negated_flag}`"
    return f"`{field.flag}`"


def _default(field: FlatField) -> str:
    if field.default is None or field.default == "":
        return ""
    return f"`{str(field.default).lower() if field.type is bool else field.default}`"


def _range(field: FlatField) -> str:
    return f" ({field.limits})" if field.limits else ""


def _choices(kind: Any) -> str:
    if get_origin(kind) is not Literal:
        return ""
    return " (one of " + ", ".join(f"`{choice}`" for choice in get_args(kind)) + ")"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
