"""The workflow configuration schema (one place for every key and default) and helpers around it."""

from __future__ import annotations

import contextlib
from functools import cache
from pathlib import Path
from typing import Any

import yaml

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")


@cache
def schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def section_defaults(section: str) -> dict[str, Any]:
    """Defaults of one config section, e.g. section_defaults("train")["lr"]."""
    props = schema()["properties"][section]["properties"]
    return {key: spec.get("default") for key, spec in props.items()}


def config_errors(config: dict[str, Any]) -> list[str]:
    """Every schema violation as one line naming the key path, e.g. "train.lr: 'big' is not of type 'number'"."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema())
    lines = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        lines.append(f"{where}: {err.message}")
    return lines


def coerce_strings(config: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse strings where the schema wants another type, in place.

    `snakemake --config train="{lr: 0.001}"` delivers nested values as strings ('0.001'); reading them
    as YAML scalars gives what the user meant. Values that still do not fit are left for validation.
    """
    spec = spec or schema()
    for key, value in config.items():
        sub = spec.get("properties", {}).get(key)
        if sub is None:
            continue
        types = sub.get("type", [])
        types = [types] if isinstance(types, str) else types
        if isinstance(value, dict) and "object" in types:
            coerce_strings(value, sub)
        elif isinstance(value, str) and "string" not in types:
            with contextlib.suppress(yaml.YAMLError):
                config[key] = yaml.safe_load(value)
    return config
