"""No function repeats a default the schema holds: a setting's default is written once, in
draftsmith/config.schema.yaml, and reaches a stage through its settings object (issue 34). The walk
covers every public function and method of every stage module, and of the core modules that implement
one section's settings; a parameter named after a key of the sections the module reads (a stage's own,
its `resources.<stage>` knobs and `target`) may not have a default. (Those found drifted from the schema:
write_shard(codec='none') vs zstd-planes, max_prompt_chars=0 vs 1500, pack_window=1 vs 256.)"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import draftsmith.stages
from draftsmith.core.config import section_schema

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
    "draftsmith.core.prompt_sources": ("prompts",),
    "draftsmith.core.estimate": ("extract",),
    "draftsmith.core.shards": ("extract",),
    "draftsmith.core.loader": ("train",),
    "draftsmith.core.objective": ("train",),
    "draftsmith.core.optimizers": ("train",),
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
