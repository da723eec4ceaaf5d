"""No function repeats a default the schema holds: a setting's default is written once, in
draftsmith/config.schema.yaml, and reaches a stage through its settings object (issue 34). Two walks:

- every public function and method of every stage module, and of the core modules that implement one
  section's settings: a parameter named after a key of the sections the module reads (a stage's own, its
  `resources.<stage>` knobs and `target`) may not have a default at all. (Those found drifted from the
  schema: write_shard(codec='none') vs zstd-planes, max_prompt_chars=0 vs 1500, pack_window=1 vs 256.)
- every module of core/, backends/ and stages/, its public functions, methods and dataclass fields
  (issue 46): none may default to the schema's default of a key of its name (found: ServingPoint's
  bytes_per_parameter=2.0 and lookup_us=20.0, SuffixProposer's four, speculative_decode's temperature,
  OpenAIClient's retries and timeout, the memory plan's knobs). None is no value, so it is not one.
  `NOT_THE_SETTING` lists the parameters that share a key's name without being that setting."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from typing import Any

import pytest

import draftsmith.backends
import draftsmith.core
import draftsmith.stages
from draftsmith.core.config.config import section_schema
from draftsmith.core.config.settings import schema

# the config sections each stage module reads
SECTIONS = {
    "prompts": ("prompts",),
    "generate": ("generate", "resources.generate"),
    "tokenize": ("extract",),
    "extract": ("extract", "resources.extract"),
    "estimate": ("extract",),
    "manifest": ("extract",),
    "vocab": ("vocab",),
    "train": ("train", "resources.train"),
    "evaluate": ("evaluate", "resources.evaluate"),
    "eval_summary": ("evaluate",),
    "gate": ("evaluate",),
    "export": ("evaluate",),
    "push": (),
    "target": (),  # its own section (sections_of adds it to every stage's)
}
# core modules that implement one section's settings (their `dtype`s are storage or compute dtypes, not
# target.dtype, so `target` is not theirs)
CORE_SECTIONS = {
    "draftsmith.core.data.prompt_sources": ("prompts",),
    "draftsmith.core.planning.estimate": ("extract",),
    "draftsmith.core.data.shards": ("extract",),
    "draftsmith.core.data.loader": ("train",),
    "draftsmith.core.training.objective": ("train",),
    "draftsmith.core.training.optimizers": ("train",),
}
STAGE_MODULES = sorted(
    m.name for m in pkgutil.walk_packages(draftsmith.stages.__path__, "draftsmith.stages.") if not m.ispkg
)


def stage_of(module: str) -> str:
    return module.removeprefix("draftsmith.stages.").split(".")[0]


def sections_of(module_name: str) -> tuple[str, ...]:
    if module_name in CORE_SECTIONS:
        return CORE_SECTIONS[module_name]
    return (*SECTIONS[stage_of(module_name)], "target")


def defaults_the_schema_holds(module_name: str) -> list[str]:
    """`module.function(param=default)` for every parameter with a default named after a key of the
    module's sections."""
    keys = {key for section in sections_of(module_name) for key in section_schema(section)}
    module = importlib.import_module(module_name)
    functions = [f for _, f in inspect.getmembers(module, inspect.isfunction) if f.__module__ == module_name]
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ == module_name:
            functions += [
                f for name, f in vars(cls).items() if inspect.isfunction(f) and not name.startswith("_")
            ]
    found = []
    for function in functions:
        if function.__name__.startswith("_"):
            continue
        for param in inspect.signature(function).parameters.values():
            if param.name in keys and param.default is not inspect.Parameter.empty:
                found.append(f"{module_name}.{function.__qualname__}({param.name}={param.default!r})")
    return found


def test_every_stage_module_has_its_sections() -> None:
    assert {stage_of(m) for m in STAGE_MODULES} <= set(SECTIONS)


@pytest.mark.parametrize("module_name", STAGE_MODULES + sorted(CORE_SECTIONS))
def test_no_function_repeats_a_schema_default(module_name: str) -> None:
    found = defaults_the_schema_holds(module_name)
    assert not found, "take these from the settings object (the schema's default):\n" + "\n".join(found)


# ------------------------------------------------------------------- every module: the schema's values

ALL_MODULES = sorted(
    m.name
    for package in (draftsmith.core, draftsmith.backends, draftsmith.stages)
    for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
    if not m.ispkg
)
# `module.Function(parameter)` that shares a schema key's name without being that setting -> why
NOT_THE_SETTING = {
    "draftsmith.core.evaluation.stats.bootstrap_ratio(seed)": "the bootstrap's resampling seed (stage_settings.GateSettings)",
    "draftsmith.core.evaluation.stats.bootstrap_tau(seed)": "the bootstrap's resampling seed (stage_settings.GateSettings)",
    "draftsmith.core.evaluation.stats.paired_difference(seed)": "the bootstrap's resampling seed (stage_settings.GateSettings)",
}


def schema_leaves(spec: dict[str, Any], path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(key, dotted path, default) of every schema key with a default that is not an object of keys."""
    for key, sub in (spec.get("properties") or {}).items():
        dotted = f"{path}.{key}" if path else key
        if "default" in sub and "properties" not in sub:
            yield key, dotted, sub["default"]
        yield from schema_leaves(sub, dotted)


def same_value(a: Any, b: Any) -> bool:
    """Equal as a setting's value: 2 and 2.0 are, True and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return type(a) is type(b) and a == b


def defaults_of(module_name: str) -> Iterator[tuple[str, str, Any]]:
    """(`module.Function(parameter)`, parameter, default) of every public function and method (and
    __init__) and every dataclass field with a default other than None. The settings classes are left
    out: `from_schema` gives them the schema's defaults."""
    module = importlib.import_module(module_name)
    for _, f in inspect.getmembers(module, inspect.isfunction):
        if f.__module__ == module_name and not f.__name__.startswith("_"):
            yield from _params(module_name, f)
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module_name or hasattr(cls, "schema_paths"):
            continue
        for name, member in vars(cls).items():
            f = getattr(member, "__func__", member)
            if inspect.isfunction(f) and (not name.startswith("_") or name == "__init__"):
                if name == "__init__" and dataclasses.is_dataclass(cls):
                    continue  # its fields below
                yield from _params(module_name, f)
        if dataclasses.is_dataclass(cls):
            for field in dataclasses.fields(cls):
                if field.default is not dataclasses.MISSING and field.default is not None:
                    yield f"{module_name}.{cls.__name__}({field.name})", field.name, field.default


def _params(module_name: str, f: Any) -> Iterator[tuple[str, str, Any]]:
    for p in inspect.signature(f).parameters.values():
        if p.default is not inspect.Parameter.empty and p.default is not None:
            yield f"{module_name}.{f.__qualname__}({p.name})", p.name, p.default


def repeated_schema_defaults(module_name: str) -> list[str]:
    by_key: dict[str, list[tuple[str, Any]]] = {}
    for key, dotted, default in schema_leaves(schema()):
        by_key.setdefault(key, []).append((dotted, default))
    return sorted({
        f"{where}={default!r} (the schema's {dotted})"
        for where, name, default in defaults_of(module_name)
        for dotted, value in by_key.get(name, [])
        if same_value(default, value) and where not in NOT_THE_SETTING
    })  # fmt: skip


@pytest.mark.parametrize("module_name", ALL_MODULES)
def test_no_default_repeats_the_schemas_value(module_name: str) -> None:
    found = repeated_schema_defaults(module_name)
    assert not found, "the schema holds these; take them from the settings:\n" + "\n".join(found)


def test_every_exception_is_still_there() -> None:
    """An entry of NOT_THE_SETTING whose parameter is gone or renamed goes too (the list only shrinks)."""
    where = {
        w for m in {k.split("(")[0].rsplit(".", 1)[0] for k in NOT_THE_SETTING} for w, _, _ in defaults_of(m)
    }
    assert set(NOT_THE_SETTING) <= where
