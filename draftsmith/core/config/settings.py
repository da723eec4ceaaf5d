"""Settings objects built from the schema alone.

A stage's settings class lists its fields with their types and nothing else; `from_schema` turns it
into a dataclass whose defaults are the schema's (draftsmith/config.schema.yaml) and whose values are
checked against the schema's types, enums and bounds whenever an object is built (also by
`dataclasses.replace`). A default, a list of choices or a bound is therefore written once, in the
schema, and a new setting is one schema entry plus one annotated line:

    @from_schema("train", ops=("checkpoint_every", "loader_threads"), unset=("threads",))
    class TrainSettings(SchemaSettings):
        epochs: int
        lr: float
        ...

Where a field's value comes from, in this order: `paths` (a field named differently from its key, e.g.
"level" -> "evaluate.interval_level"); `ops`, the stage's operational knobs under `resources.<section>`;
the section's own key of the same name. A field the schema does not have (a run-time value such as the
devices a job was given) declares its own default in the class. `unset` fields default to None (the
library decides, e.g. torch's thread count) and are checked against the schema only when given.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

from draftsmith.core.config.config import renamed_hint, schema, spec_default

T = TypeVar("T")


class SchemaSettings:
    """The base of every `from_schema` class: what the decorator gives it, declared where a type checker
    sees it (no checker follows what a class decorator adds). A class whose fields are not all its own
    (`with_groups`) derives from GroupedSettings instead."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    schema_section: ClassVar[str]
    schema_paths: ClassVar[dict[str, str]]
    unset_fields: ClassVar[tuple[str, ...]]

    if TYPE_CHECKING:  # the dataclass's own __init__ (every field has the schema's default)

        def __init__(self, **values: Any) -> None: ...

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        """Build from a dict (a config section, a saved to_dict): missing keys take the schema's defaults;
        a key that is neither a field nor a scheduler knob of resources.<section> (gpus, runtime) is an
        error."""
        names = {f.name for f in dataclasses.fields(cls)}
        section = cls.schema_section
        scheduler = set(schema_spec("resources").get("properties", {}).get(section, {}).get("properties", {}))
        unknown = sorted(set(values) - names - scheduler)
        if unknown:
            raise ValueError(f"unknown {section} settings: {', '.join(unknown)}")
        return cls(**{k: v for k, v in values.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class GroupedSettings(SchemaSettings):
    """A `with_groups` class: its groups' fields and the group properties are added when it is built,
    out of a type checker's sight, so reading them is unchecked (Any)."""

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any: ...


REGISTRY: list[
    type
] = []  # every settings class built here (tests/unit/config/test_settings.py checks them all)


def schema_spec(path: str) -> dict[str, Any]:
    """The schema entry of a dotted key, e.g. "train.lr" or "resources.train.loader_threads"."""
    spec = schema()
    for part in path.split("."):
        props = spec.get("properties", {})
        if part not in props:
            raise KeyError(f"{path}: not a key of draftsmith/config.schema.yaml")
        spec = props[part]
    return spec


def schema_default(path: str) -> Any:
    """The schema's default of a dotted key (a fresh copy: defaults may be lists or dicts); an object's
    default holds its own keys' defaults, as the workflow's validate() and the CLI fill them in (the same
    settings, however they were built, key the same checkpoints)."""
    return spec_default(schema_spec(path))


def field_paths(
    cls: type, section: str, ops: Sequence[str] = (), paths: Mapping[str, str] | None = None
) -> dict[str, str]:
    """field name -> dotted schema key, for the fields of `cls` the schema has."""
    own = schema_spec(section).get("properties", {})
    out = {}
    for name in cls.__dict__.get("__annotations__", {}):
        if paths and name in paths:
            out[name] = paths[name]
        elif name in ops:
            out[name] = f"resources.{section}.{name}"
        elif name in own:
            out[name] = f"{section}.{name}"
    for path in out.values():
        schema_spec(path)  # a misspelt path fails at import, not at the first run
    return out


def from_schema(
    section: str,
    *,
    ops: Sequence[str] = (),
    paths: Mapping[str, str] | None = None,
    unset: Sequence[str] = (),
) -> Callable[[type[T]], type[T]]:
    """Class decorator: a dataclass of `section`'s settings with the schema's defaults and checks (see
    the module doc). The class may define `check(self)` for rules across fields (run after the schema's);
    it derives from SchemaSettings (`from_dict`, `to_dict`, `schema_paths`)."""

    def build(cls: type[T]) -> type[T]:
        where = field_paths(cls, section, ops, paths)
        if set(unset) - set(where):
            raise TypeError(
                f"{cls.__name__}: unset fields {sorted(set(unset) - set(where))} are not in the schema"
            )
        for name in where:
            if name in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__}.{name}: its default is the schema's ({where[name]}); remove it"
                )
            default = None if name in unset else schema_default(where[name])
            if isinstance(default, (dict, list)):
                setattr(
                    cls, name, dataclasses.field(default_factory=functools.partial(copy.deepcopy, default))
                )
            else:
                setattr(cls, name, default)
        missing = [
            n for n in cls.__dict__.get("__annotations__", {}) if n not in where and n not in cls.__dict__
        ]
        if missing:
            raise TypeError(f"{cls.__name__}: {missing} are not in the schema and have no default")
        if not issubclass(cls, SchemaSettings):
            raise TypeError(f"{cls.__name__}: a settings class derives from SchemaSettings")
        cls.schema_section = section
        cls.schema_paths = where
        cls.unset_fields = tuple(unset)
        cls.__post_init__ = _post_init  # type: ignore[attr-defined]
        out = dataclasses.dataclass(cls)
        REGISTRY.append(out)
        return out

    return build


@functools.cache
def _validator(paths: tuple[tuple[str, str], ...]) -> Any:
    import jsonschema

    spec = {"type": "object", "properties": {name: schema_spec(path) for name, path in paths}}
    return jsonschema.Draft202012Validator(spec)


def settings_errors(obj: Any) -> list[str]:
    """Every value of a settings object the schema refuses, one line each naming the config key."""
    paths = obj.schema_paths
    values = {
        name: getattr(obj, name)
        for name in paths
        if not (name in obj.unset_fields and getattr(obj, name) is None)
    }
    validator = _validator(tuple(sorted(paths.items())))
    errors = sorted(validator.iter_errors(values), key=lambda e: list(map(str, e.absolute_path)))
    lines = []
    for err in errors:
        name, *inner = [str(p) for p in err.absolute_path]
        where = ".".join([paths[name], *inner])
        lines.append(f"{where}: {err.message}{renamed_hint(where, err.instance)}")
    return lines


def _post_init(self: Any) -> None:
    errors = settings_errors(self)
    if errors:
        raise ValueError(f"invalid {self.schema_section} settings: " + "; ".join(errors))
    check = getattr(self, "check", None)
    if check is not None:
        check()


def _group_value(self: Any, group: type, names: tuple[str, ...]) -> Any:
    """A `with_groups` property: the group built from the settings object's values of its fields."""
    return group(**{k: getattr(self, k) for k in names})


def with_groups(**groups: type) -> Callable[[type[T]], type[T]]:
    """Class decorator, applied under `from_schema`: a settings class made of groups besides its own
    fields. Each group is a `from_schema` class of the same section holding one concept's knobs (the
    objective's, the batching's), so a knob of a group is one schema entry plus one field in the group.
    The class gains every field of every group, all in the schema's order (the section's keys, then
    resources.<section>'s: its to_dict is the same whichever group a key is in), and a property per
    group, of the group's name, that builds the group from the class's values."""

    def build(cls: type[T]) -> type[T]:
        sections = {group.schema_section for group in groups.values()}  # type: ignore[attr-defined]
        if len(sections) != 1:
            raise TypeError(f"{cls.__name__}: groups of several sections {sorted(sections)}")
        (section,) = sections
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for group in groups.values():
            for name, kind in group.__dict__["__annotations__"].items():
                annotations.setdefault(name, kind)
        order = list(schema_spec(section).get("properties", {}))
        order += list(schema_spec("resources").get("properties", {}).get(section, {}).get("properties", {}))
        position: dict[str, int] = {}
        for i, key in enumerate(order):
            position.setdefault(key, i)
        cls.__annotations__ = dict(
            sorted(annotations.items(), key=lambda kv: position.get(kv[0], len(order)))
        )
        for name, group in groups.items():
            names = tuple(f.name for f in dataclasses.fields(group))
            setattr(cls, name, property(functools.partial(_group_value, group=group, names=names)))
        return cls

    return build


def rule_settings(
    cls: type[SchemaSettings],
    config: Mapping[str, Any],
    only: Sequence[str] | None = None,
    drop: Sequence[str] = (),
) -> dict[str, Any]:
    """What a rule passes as `--settings` to the command whose settings class is `cls`: the config's value
    of every field whose key is of the class's section (a field of another section, such as target.dtype,
    and the resources.<section> knobs travel as options). `only` / `drop` narrow them to the fields that
    apply to this call (a mode of the command, a field the rule derives and gives as an option); a name
    that is no such field is an error, so no key is lost to a typo."""
    section = cls.schema_section
    keys = {
        name: path.split(".", 1)[1]
        for name, path in cls.schema_paths.items()
        if path.startswith(f"{section}.") and path.count(".") == 1
    }
    unknown = sorted(set(only or ()).union(drop) - set(keys))
    if unknown:
        raise KeyError(f"{cls.__name__}: {unknown} are not settings of its {section} section")
    names = [name for name in keys if (only is None or name in only) and name not in drop]
    return {keys[name]: config[section][keys[name]] for name in names}


def ops_fields(cls: type[SchemaSettings]) -> dict[str, str]:
    """resources.<section> key -> field name: the operational knobs of a settings class."""
    prefix = f"resources.{cls.schema_section}."
    return {path[len(prefix) :]: name for name, path in cls.schema_paths.items() if path.startswith(prefix)}


def rule_ops(cls: type[SchemaSettings], config: Mapping[str, Any]) -> dict[str, Any]:
    """What a rule passes as `--ops` to the command whose settings class is `cls`: the config's value of
    each of its operational knobs (how the job runs, not what it computes), but threads, which Snakemake
    gives the job (its {threads}, no more than the cores it has)."""
    knobs = config["resources"][cls.schema_section]
    return {key: knobs[key] for key in ops_fields(cls) if key != "threads"}


def compile_mode_of(value: str | bool) -> str:
    """extract.compile as "on"/"off"/its mode name (YAML may give true/false)."""
    return value if isinstance(value, str) else ("on" if value else "off")
