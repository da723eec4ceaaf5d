"""The workflow configuration schema (one place for every key and default) and checks around it: the
config files (read, merged, each line located), single values and the schema's checks, the target's
config.json read. The checks of the whole configuration against its inputs and its target at start are
core/workflow/startup.py's (they read prompt files, which core/data/ owns)."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from draftsmith.core.io.hub import hub_target_dir, is_hub_id

SCHEMA_PATH = Path(__file__).parents[2] / "config.schema.yaml"
# The embedded default target: the `target` rule materialises it from `target.gguf_wheel`, and only it.
EMBEDDED_TARGET = "resources/SmolLM2-135M-Instruct"
# Its config.json fields the checks need, for a dry run before it is materialised.
EMBEDDED_TARGET_CONFIG = {"num_hidden_layers": 30, "vocab_size": 49152}
EMBEDDED_TARGET_HEADS = (9, 3)  # (attention heads, key-value heads) of SmolLM2-135M


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
    """Defaults of one config section, e.g. section_defaults("train")["lr"], section_defaults("resources.train");
    an object-valued key's default holds its own keys' defaults (as validate() fills them in a workflow)."""
    return {key: spec_default(spec) for key, spec in section_schema(section).items()}


def spec_default(spec: dict[str, Any]) -> Any:
    """A schema property's default; for an object with properties, its properties' defaults filled in."""
    default = copy.deepcopy(spec.get("default"))
    if isinstance(default, dict) and "properties" in spec:
        filled = {k: spec_default(sub) for k, sub in spec["properties"].items() if "default" in sub}
        return {**filled, **default}
    return default


def deep_merge(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """base with given's keys on top; where both hold an object, merged key by key."""
    out = dict(base)
    for key, value in given.items():
        out[key] = (
            deep_merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


STREAM_MODES = ("stream", "hybrid")  # train.hidden_states where the train job runs the extraction engine

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
        "gpus",
        "tensor_parallel",
        "gpu_memory_utilization",
    ),
    "train": (
        "threads",
        "checkpoint_every",
        "loader_threads",
        "report_to",
        "micro_batch_tokens",
        "checkpoint_ttt",
        "keep_hidden_cache",
        "engine_gpus",
    ),
    "evaluate": ("threads", "gpus", "gpu_memory_utilization", "vllm_timeout_s"),
}


def section_from_file(
    section: str, config_path: str | Path | None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A stage's settings as the workflow merges them for a run of `config_path` (benchmarks replay
    runs): the schema's defaults and the stage's operational knobs < the file's `section` < overrides.
    A missing or absent file leaves the defaults."""
    values = settings_defaults(section)
    if config_path is not None and Path(config_path).is_file():
        loaded = yaml.safe_load(Path(config_path).read_text(encoding="utf-8")) or {}
        values.update(loaded.get(section) or {})
    values.update(overrides or {})
    values.pop("gpus", None)  # a job's GPUs, not a setting of the library call
    return values


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


def requirement_error(value: str) -> str | None:
    """Why `value` is not one package requirement (`name==version`, PEP 508) to hand to pip, or None.

    A leading '-' would make pip read it as an option (`-r file`, `--index-url ...`).
    """
    from packaging.requirements import InvalidRequirement, Requirement

    if value.startswith("-"):
        return f"{value!r} begins with '-': pip would take it for an option, not a package"
    try:
        Requirement(value)
    except InvalidRequirement as err:
        return f"{value!r} is not a package requirement such as name==1.0 ({str(err).splitlines()[0]})"
    return None


def url_error(value: str) -> str | None:
    """Why `value` is not the http(s) URL of a server, or None."""
    from urllib.parse import urlsplit

    problem = f"{value!r} is not an http(s) URL such as http://127.0.0.1:8000/v1"
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (parsing it is the check: 'http://h:x/' raises)
    except ValueError:
        return problem
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in value):
        return problem
    return None


# vllm-server flags the workflow sets itself: what it serves, under what name, where it listens and who
# may call it; --config, a YAML file whose keys vLLM reads as more flags (any of the above); and
# --middleware, through which the workflow requires the key on every route (backends/server_auth.py).
RESERVED_SERVER_ARGS = (
    "--model", "--host", "--port", "--uds", "--api-key", "--served-model-name", "--config", "--middleware",
)  # fmt: skip
# What generate.server_args may set: the performance and model-loading flags generation needs, by the
# exact name vLLM's parser knows (after `_` -> `-`; with `--no-` where vLLM has one). An allow-list, not
# a deny-list: each vLLM release adds flags, and some open a door the run would leave open
# (--kv-events-config publishes on tcp://*:5557, --data-parallel-address, --kv-transfer-config,
# --otlp-traces-endpoint send or listen elsewhere; --middleware, --tool-parser-plugin load code).
# Abbreviations are refused too: an exact name is what argparse takes without guessing.
SERVER_FLAGS = frozenset((
    # loading the model and its chat template
    "--dtype", "--seed", "--max-model-len", "--quantization", "-q", "--trust-remote-code",
    "--no-trust-remote-code", "--tokenizer-mode", "--hf-overrides", "--model-impl", "--disable-sliding-window",
    "--limit-mm-per-prompt", "--language-model-only", "--no-language-model-only", "--chat-template",
    "--chat-template-content-format", "--default-chat-template-kwargs", "--reasoning-parser",
    "--tool-call-parser", "--enable-auto-tool-choice", "--no-enable-auto-tool-choice",
    # speed and memory
    "--enforce-eager", "--no-enforce-eager", "--compilation-config", "-cc", "--optimization-level", "-O",
    "--max-cudagraph-capture-size", "--cudagraph-capture-sizes", "--attention-backend", "--max-num-seqs",
    "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-dtype", "--kv-cache-memory-bytes",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
    "--no-enable-chunked-prefill", "--async-scheduling", "--no-async-scheduling", "--block-size",
    "--swap-space", "--cpu-offload-gb", "--disable-log-stats",
    # the job's GPUs (one node)
    "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp", "--pipeline-parallel-size", "-pp",
    "--enable-expert-parallel", "--no-enable-expert-parallel", "-ep", "--enable-eplb", "--no-enable-eplb",
    "--disable-custom-all-reduce",
))  # fmt: skip
# A value that starts with '-' but that argparse reads as a value, not an option (`--seed -1`).
NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")


def server_flag(arg: str) -> str | None:
    """The long option vLLM's parser (FlexibleArgumentParser) reads in `arg`, or None for a value or a
    short option: the name before `=` and before the first `.` (`--api-key.x v` is the JSON form of
    --api-key), with `_` read as `-` (`--api_key`)."""
    if not arg.startswith("--") or arg == "--":
        return None
    return arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def server_option(arg: str) -> str | None:
    """The option vLLM's parser reads in `arg` (long as server_flag names it; short as `-tp` in `-tp=2`;
    `-O3`, `-O=3` as `-O`), or None for a value (a word, a negative number). `--` (the end of the
    options) and `-` are options here: they are refused like any name not allowed."""
    if arg.startswith("--") and arg != "--":
        return server_flag(arg)
    if not arg.startswith("-") or NEGATIVE_NUMBER.fullmatch(arg):
        return None
    if arg.startswith("-O"):  # vLLM reads -O3, -O=3, -Odecode as --optimization-level
        return "-O"
    return arg.split("=", 1)[0].split(".", 1)[0]


def server_args_error(args: list[Any]) -> str | None:
    """Why `generate.server_args` may not be given to the vllm-server, or None. Read as vLLM reads
    them (server_option): a flag the workflow sets, in any form (argparse takes any unambiguous
    abbreviation, `--hos`, so a prefix of a reserved flag is refused as one), or a flag not among
    SERVER_FLAGS."""
    taken, other = [], []
    for arg in map(str, args):
        name = server_option(arg)
        if name is None:
            continue
        if len(name) > 2 and name.startswith("--") and any(r.startswith(name) for r in RESERVED_SERVER_ARGS):
            taken.append(arg)
        elif name not in SERVER_FLAGS:
            other.append(arg)
    reasons = []
    if taken:
        reasons.append(
            f"{', '.join(taken)}: set by the workflow (the server listens on generate.server_host, a free "
            "port, with a new API key per run that its middleware requires on every route, and serves the "
            "target under its own name; no --config file)"
        )
    if other:
        reasons.append(
            f"{', '.join(other)}: not a flag generation may set (performance and model loading only, by "
            "their full names: see generate.server_args in draftsmith/config.schema.yaml)"
        )
    return "; ".join(reasons) or None


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (a name other than localhost: only the resolver
    knows, so no)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_host_error(host: str) -> str | None:
    """Why the workflow's own server may not listen on `host`, or None: loopback only."""
    if is_loopback(host):
        return None
    return (
        f"{host!r} is not a loopback address: the server the workflow starts listens on this machine only "
        "(127.0.0.1, ::1 or localhost); to serve the target to a network, run your own server and use "
        "generate.backend: openai"
    )


# Variables that hold the Hugging Face token: a generation endpoint never gets it.
HUB_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def api_key_env_error(name: str) -> str | None:
    """Why `generate.api_key_env` may not name this variable, or None."""
    if name.upper() in HUB_TOKEN_VARIABLES:
        return (
            f"{name} holds the Hugging Face token, which no generation server gets: put the server's own "
            "key in another variable and name that one"
        )
    return None


def api_key_url_error(base_url: str | None, api_key_env: str | None) -> str | None:
    """Why the key in `api_key_env` may not be sent to `base_url`, or None: only to this machine
    (loopback) or over https, so that it never crosses a network in the clear."""
    from urllib.parse import urlsplit

    if not api_key_env or not base_url or url_error(base_url):  # url_error names a bad one
        return None
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    if parts.scheme == "https" or is_loopback(host):
        return None
    return (
        f"the key in {api_key_env} would cross the network in the clear to {host} ({base_url}): use an "
        "https:// base_url, or a loopback address (127.0.0.1) for a server on this machine"
    )


# Checks of single values beyond what the schema can say, by key path: (the type checked, the check,
# which gives the reason or None).
def requirements_error(values: list[Any]) -> str | None:
    """requirement_error of the first bad requirement of a list (prompts.code_wheels)."""
    return next((reason for v in values if isinstance(v, str) and (reason := requirement_error(v))), None)


VALUE_CHECKS = {
    ("target", "gguf_wheel"): (str, requirement_error),
    ("prompts", "sharegpt_wheel"): (str, requirement_error),
    ("prompts", "code_wheels"): (list, requirements_error),
    # each benchmark's wheel (evaluate.humaneval_wheel, evaluate.mtbench_wheel: core/data/benchmarks.py's
    # wheel_setting, tests/unit/config/test_config.py checks they are these)
    **{
        ("evaluate", key): (str, requirement_error)
        for key in section_schema("evaluate")
        if key.endswith("_wheel")
    },  # fmt: skip
    ("generate", "base_url"): (str, url_error),
    ("generate", "server_args"): (list, server_args_error),
    ("generate", "api_key_env"): (str, api_key_env_error),
}


def nonfinite_errors(values: Any, prefix: str = "") -> list[str]:
    """A line per NaN or infinity in `values` (YAML `.nan`, `.inf`): JSON Schema's bounds let them
    through (nan > 0 is false, so is nan <= 0), and torch refuses them only in the job."""
    if isinstance(values, dict):
        return [e for k, v in values.items() for e in nonfinite_errors(v, f"{prefix}{k}.")]
    if isinstance(values, list):
        return [e for i, v in enumerate(values) for e in nonfinite_errors(v, f"{prefix.rstrip('.')}[{i}].")]
    if isinstance(values, float) and not math.isfinite(values):
        return [f"{prefix.rstrip('.')}: {values} is not a finite number"]
    return []


def value_errors(config: dict[str, Any], section: str | None = None) -> list[str]:
    """VALUE_CHECKS on the values present in config (the whole config, or one section's values), and
    no NaN or infinity anywhere."""
    lines = nonfinite_errors(config, f"{section}." if section else "")
    for (where, key), (kind, check) in VALUE_CHECKS.items():
        if section is None:
            values = config.get(where)
        elif section == where:
            values = config
        else:
            continue
        value = values.get(key) if isinstance(values, dict) else None
        if isinstance(value, kind) and (reason := check(value)):
            lines.append(f"{where}.{key}: {reason}")
    return lines


# keys that were renamed: (section, old) -> new, named in the error a config with the old key gets
RENAMED_KEYS = {
    ("generate", "engine"): "backend",
    ("extract", "engine"): "backend",
    ("evaluate.gate", "beats_ngram"): "beats_free",  # the free methods are n-gram lookup and suffix decoding
}


def renamed_hint(where: str, instance: Any) -> str:
    """ " (section.old is now section.new)" for each renamed key an object still uses, else ""."""
    if not isinstance(instance, dict):
        return ""
    renamed = [
        f"{where}.{k} is now {where}.{RENAMED_KEYS[where, k]}" for k in instance if (where, k) in RENAMED_KEYS
    ]
    return " (" + "; ".join(renamed) + ")" if renamed else ""


def config_errors(config: dict[str, Any], sources: list[ConfigSource] | None = None) -> list[str]:
    """Every schema violation as one line naming the key path, e.g. "train.lr: 'big' is not of type
    'number'", and with `sources` where the key was set ("configs/x.yaml:12: train.lr: ...")."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema())
    lines = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        path = tuple(str(p) for p in err.absolute_path)
        where = ".".join(path) or "(top level)"
        line = f"{where}: {err.message}"
        line += renamed_hint(where, err.instance)
        if sources and err.validator == "additionalProperties" and isinstance(err.instance, dict):
            # the unexpected key is the one whose file matters
            known = err.schema.get("properties", {})
            extra = next((k for k in err.instance if k not in known), None)
            place = origin((*path, str(extra)), sources) if extra is not None else ""
            line = f"{place}: {line}" if place else line
        elif sources:
            line = locate(line, sources)
        lines.append(line)
    values = value_errors(config)
    return lines + ([locate(v, sources) for v in values] if sources else values)


def section_errors(section: str, values: dict[str, Any]) -> list[str]:
    """Schema violations of the keys of `section` present in values, one line each naming section.key
    (how a stage command checks its --settings JSON)."""
    import jsonschema

    props = section_schema(section)
    spec = {"type": "object", "properties": {k: props[k] for k in values if k in props}}
    validator = jsonschema.Draft202012Validator(spec)
    errors = sorted(validator.iter_errors(values), key=lambda e: list(map(str, e.absolute_path)))
    lines = []
    for e in errors:
        where = ".".join([section, *map(str, e.absolute_path)])
        lines.append(f"{where}: {e.message}{renamed_hint(where, e.instance)}")
    return lines + value_errors(values, section)


def _types(spec: dict[str, Any]) -> list[str]:
    types = spec.get("type", [])
    return [types] if isinstance(types, str) else types


# How YAML writes null; `--config` hands a nested one over as this string.
YAML_NULLS = ("null", "Null", "NULL", "~")


def coerce_strings(
    config: dict[str, Any], spec: dict[str, Any] | None = None, only: Any = None
) -> dict[str, Any]:
    """Parse strings where the schema wants another type, in place; `only` limits it to the keys present
    in that mapping (what `--config` set).

    `snakemake --config train="{lr: 0.001}"` delivers nested values as strings ('0.001'); reading them
    as YAML scalars gives what the user meant. Values that still do not fit are left for validation. A
    config file's own strings are what its author wrote (`epochs: "3"`), so they are never parsed.
    """
    spec = spec or schema()

    def parse(value: Any, types: list[str]) -> Any:
        if isinstance(value, str) and types and "string" not in types:
            with contextlib.suppress(yaml.YAMLError):
                return yaml.safe_load(value)
        if isinstance(value, str) and "null" in types and value in YAML_NULLS:
            return None  # `target={gguf_wheel: null}` means no wheel, not a package named "null"
        return value

    for key, value in config.items():
        sub = spec.get("properties", {}).get(key)
        if sub is None or (only is not None and (not isinstance(only, dict) or key not in only)):
            continue
        types = _types(sub)
        if isinstance(value, dict) and "object" in types:
            coerce_strings(value, sub, None if only is None else only[key])
        elif isinstance(value, list) and "array" in types:
            config[key] = [parse(item, _types(sub.get("items", {}))) for item in value]
        else:
            config[key] = parse(value, types)
    return config


# A number as YAML 1.2 reads it (what every EAGLE-3 recipe writes: `lr: 1e-4`); PyYAML reads YAML 1.1,
# where a float needs a dot and a signed exponent, and hands `1e-4` over as a string.
YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def read_numbers(config: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Floats for the strings YAML 1.2 reads as numbers but YAML 1.1 does not (`1e-4`, `3e3`), where
    the schema wants a number; in place. A quoted number that YAML 1.1 reads too ("0.001") was meant
    as a string and is left for validation to refuse."""
    spec = spec or schema()
    for key, value in config.items():
        sub = spec.get("properties", {}).get(key)
        if sub is None:
            continue
        if isinstance(value, dict) and "object" in _types(sub):
            read_numbers(value, sub)
        elif (
            isinstance(value, str)
            and "number" in _types(sub)
            and YAML12_FLOAT.fullmatch(value)
            and isinstance(yaml.safe_load(value), str)
        ):
            config[key] = float(value)
    return config


# ------------------------------------------------------------------------ where each setting came from


class ConfigFileError(ValueError):
    """A config file that cannot be read; the message names the file and line."""


@dataclass
class ConfigSource:
    """One layer of the configuration as Snakemake merges them: a config file or `--config`."""

    name: str  # the file as given, or "--config"
    values: dict[str, Any]
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)  # key path -> line in the file


def _key_lines(node: yaml.Node, prefix: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = (*prefix, str(key.value))
            lines[path] = key.start_mark.line + 1
            _key_lines(value, path, lines)


def read_config_file(path: str | Path) -> ConfigSource:
    """A YAML (or JSON) config file with the line of every key; a syntax error names file and line."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        values = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        reason = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigFileError(f"{where}: not valid YAML: {reason}") from None
    if values is not None and not isinstance(values, dict):
        raise ConfigFileError(
            f"{path}: a config file must be a mapping of sections, not {type(values).__name__}"
        )
    lines: dict[tuple[str, ...], int] = {}
    if node is not None:
        _key_lines(node, (), lines)
    return ConfigSource(str(path), values or {}, lines)


def _lookup(values: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
    for part in path:
        if not isinstance(values, dict) or part not in values:
            return False, None
        values = values[part]
    return True, values


def origin(path: tuple[str, ...], sources: list[ConfigSource]) -> str:
    """Where the value at `path` (or the nearest mapping above it) was set: "FILE:LINE", "--config", or
    "" (the schema's default). `sources` in Snakemake's order (later ones override)."""
    for n in range(len(path), 0, -1):
        for source in reversed(sources):
            if _lookup(source.values, path[:n])[0]:
                line = source.lines.get(path[:n])
                return f"{source.name}:{line}" if line else source.name
    return ""


def replaced_mappings(
    spec: dict[str, Any] | None = None, prefix: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    """Key paths of the mappings whose keys are entries, not settings (the schema does not close them
    with additionalProperties: false): prompts.columns, evaluate.heldout_sets and set_num_prompts,
    train.drafter.rope."""
    spec = spec or schema()
    paths = []
    for key, sub in spec.get("properties", {}).items():
        if "object" not in _types(sub):
            continue
        if sub.get("additionalProperties", True) is not False:
            paths.append((*prefix, key))
        else:
            paths += replaced_mappings(sub, (*prefix, key))
    return paths


def merge_sources(config: dict[str, Any], sources: list[ConfigSource]) -> dict[str, Any]:
    """Snakemake's merged `config`, made what the sources mean; in place.

    Snakemake merges every mapping key by key. For sections of settings that is right; for a mapping of
    entries (`evaluate.heldout_sets`, `train.drafter.rope`) it is not: a file that names one held-out set
    would get every set of the files before it too. The last source that sets such a mapping replaces it
    whole. Then `--config`'s strings are read as YAML scalars and numbers as YAML 1.2 writes them.
    """
    for path in replaced_mappings():
        for source in reversed(sources):
            found, value = _lookup(source.values, path)
            if found:
                parent = config
                for part in path[:-1]:
                    parent = parent.setdefault(part, {})
                parent[path[-1]] = copy.deepcopy(value)
                break
    for source in sources:
        if source.name == "--config":
            coerce_strings(config, only=source.values)
    return read_numbers(config)


def locate(line: str, sources: list[ConfigSource]) -> str:
    """An error line "key.path: reason" prefixed with where that key was set ("config.yaml:12: ..."); a
    line that already names its source is returned as it is."""
    if any(line.startswith(f"{source.name}:") for source in sources):
        return line
    key = line.split(": ", 1)[0]
    where = origin(tuple(key.split(".")), sources) if re.fullmatch(r"[\w.-]+", key) else ""
    return f"{where}: {line}" if where else line


class StoppedAtStart(SystemExit):
    """The workflow refused at parse time (rules/common.smk): exit status 2, bad input, as every
    draftsmith command gives it; str() is the message, one line per problem."""

    def __init__(self, head: str, lines: list[str]):
        super().__init__(2)
        self.message = f"{head}:\n  " + "\n  ".join(lines)

    def __str__(self) -> str:
        return self.message


def stop_at_start(head: str, lines: list[str]) -> None:
    """Print `lines` under `head` and stop with exit 2 (an int exit status prints nothing itself)."""
    if lines:
        error = StoppedAtStart(head, lines)
        print(error, file=sys.stderr)
        raise error


def config_file_error(path: str | Path) -> str | None:
    """Why a config file cannot be read ("config.yaml:7: not valid YAML: ..."), or None; a missing
    file is no error here."""
    if not Path(path).is_file():
        return None
    try:
        read_config_file(path)
    except ConfigFileError as err:
        return str(err)
    return None


def workdir_path(path: str | Path) -> str:
    """`path` relative to the working folder when it lies inside it, else absolute: how a packaged file
    (the hand-written held-out set) enters a rule's input and params, so that a checkout moved or copied
    with its working folder reruns nothing."""
    path = Path(path).absolute()
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


# ------------------------------------------------------------------------ checks against the target


def is_embedded_target(model: str | Path) -> bool:
    return Path(model).resolve() == Path(EMBEDDED_TARGET).resolve()


def is_hub_target(target: dict[str, Any]) -> bool:
    """Whether the `target` section names a Hugging Face Hub model (`owner/name`), which the workflow
    materialises (rules/target.smk), rather than a local folder."""
    return not is_embedded_target(target["model"]) and is_hub_id(target["model"])


def target_folder(target: dict[str, Any]) -> str:
    """The local folder every stage reads the target from: `target.model` itself, or for a Hub id the
    folder the `target` rule materialises it into."""
    if is_hub_target(target):
        return hub_target_dir(target["model"], target.get("revision"))
    return target["model"]


def text_config_json(model: str | Path) -> dict[str, Any]:
    """A HF config.json as plain JSON, with a multimodal wrapper's `text_config` (Kimi-K2.5, Llama-4,
    Qwen3-VL) merged over the top level: the language model's settings. No transformers, no remote code.
    A file that is not a JSON object is a ValueError naming it."""
    path = Path(model) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object of settings (a {type(raw).__name__})")
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


def target_heads(model: str | Path) -> tuple[int, int]:
    """(attention heads, key-value heads) of the target's language model; key-value heads 0 for latent
    attention (MLA: one latent, replicated on every GPU) and 0 heads where config.json names none."""
    config = text_config_json(model)
    heads = config.get("num_attention_heads")
    heads = heads if isinstance(heads, int) else 0
    if config.get("kv_lora_rank") is not None:
        return heads, 0
    kv = config.get("num_key_value_heads")
    return heads, kv if isinstance(kv, int) else heads


def with_defaults(values: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config with the schema's defaults filled in wherever a key is absent (what Snakemake's
    validate() does to the workflow's config), for commands that read config files themselves."""
    spec = schema() if spec is None else spec
    out = copy.deepcopy(values)
    for key, sub in spec.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if sub.get("type") == "object" and isinstance(out.get(key), dict) and "properties" in sub:
            out[key] = with_defaults(out[key], sub)
    return out


def merged_config_files(paths: Sequence[str | Path]) -> dict[str, Any]:
    """Config files merged key by key in order (later ones win), as `snakemake --configfile` does."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        for key, value in over.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                merge(base[key], value)
            else:
                base[key] = copy.deepcopy(value)
        return base

    merged: dict[str, Any] = {}
    for path in paths:
        merge(merged, yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {})
    return merged
