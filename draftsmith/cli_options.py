"""A stage's command, generated from the stage: an option for every field of its paths dataclass (as its
`arg` spells it, draftsmith/core/config/stage_args.py) and for every setting of its settings class, named after
the setting's key (`--batch-tokens`; a boolean `--key/--no-key`), typed by the schema (an enum is a
choice), the schema's description as help. Parsing only: the stage's `run(paths, settings)` does the work.

Settings are resolved in one way for every command: the schema's defaults < the --settings JSON (the
config section the rules pass) < the options given (an option not given is None and decides nothing).
"""

from __future__ import annotations

import json
import os
import sys
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click

from draftsmith.core.config.config import deep_merge, section_errors, settings_defaults
from draftsmith.core.config.settings import ops_fields, schema_spec
from draftsmith.core.config.stage_args import BAD_INPUT, Arg, args_of

_CLICK_TYPES = {"integer": int, "number": float, "string": str}
_ITEM_TYPES = {"integer": int, "number": float, "string": str, "boolean": bool}

# options named otherwise than their key, kept as the rules and users spell them
ALIASES = {"gguf_wheel": ("--wheel",), "columns": ("--column",), "gate": ("--check",)}


def fail(message: str, code: int) -> typing.NoReturn:
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(code)


def json_object(raw: str | None, param_hint: str = "--settings") -> dict[str, Any]:
    """A JSON object given inline or as @file (how the rules pass a config section)."""
    if not raw:
        return {}
    try:
        text = Path(raw[1:]).read_text(encoding="utf-8") if raw.startswith("@") else raw
    except OSError as err:
        raise click.BadParameter(f"cannot read {raw[1:]}: {err.strerror}", param_hint=param_hint) from err
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise click.BadParameter(f"not a JSON object: {err}", param_hint=param_hint) from err
    if not isinstance(value, dict):
        raise click.BadParameter("expected a JSON object", param_hint=param_hint)
    return value


def resolve(settings_json: str | None, section: str) -> dict[str, Any]:
    """The schema's defaults of `section` (with its operational knobs, see settings_defaults) < the
    --settings JSON. Unknown keys in the JSON are bad input (exit 2)."""
    values = settings_defaults(section)
    given = json_object(settings_json)
    unknown = sorted(set(given) - set(values))
    if unknown:
        raise click.BadParameter(
            f"unknown key(s) {', '.join(unknown)} (not in {section})", param_hint="--settings"
        )
    errors = section_errors(section, given)
    if errors:
        raise click.BadParameter("\n  ".join(errors), param_hint="--settings")
    return deep_merge(values, given)


def settings_from(cls: Any, settings_json: str | None, options: dict[str, Any]) -> Any:
    """The settings object: resolve's values for the fields of the section and its knobs, then the --ops
    JSON's knobs (options["ops_json"]), then the options given (a NAME=VALUE option's pairs over the
    JSON's); a value the schema refuses is bad input."""
    section = cls.schema_section
    values = resolve(settings_json, section)
    fields: dict[str, Any] = {}
    for name, path in cls.schema_paths.items():
        where, key = path.rsplit(".", 1)
        if where in (section, f"resources.{section}") and key in values:
            fields[name] = values[key]
    options = dict(options)
    ops, knobs = json_object(options.pop("ops_json", None), "--ops"), ops_fields(cls)
    unknown = sorted(set(ops) - set(knobs))
    if unknown:
        raise click.BadParameter(
            f"unknown key(s) {', '.join(unknown)} (not in resources.{section})", param_hint="--ops"
        )
    fields.update({knobs[key]: value for key, value in ops.items()})
    for name, value in options.items():
        if isinstance(value, dict):
            fields[name] = {**(fields.get(name) or {}), **value}
        elif value is not None:
            fields[name] = value
    try:
        return cls.from_dict(fields)
    except (ValueError, TypeError) as err:
        fail(str(err), BAD_INPUT)


def settings_param(section: str) -> click.Option:
    return click.Option(
        ["--settings", "settings_json"],
        help=f"The `{section}` config section (or some of its keys) as a JSON object or @file; keys "
        "missing take the schema's defaults, options typed here override it.",
    )


def _scalars(spec: dict[str, Any]) -> list[str]:
    types = spec.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    return [t for t in types if t != "null"]


def _flat(spec: dict[str, Any]) -> bool:
    """An object whose values are single scalars: given as NAME=VALUE pairs."""
    inner = [spec["additionalProperties"]] if isinstance(spec.get("additionalProperties"), dict) else []
    inner += list(spec.get("properties", {}).values())
    return bool(inner) and all(
        "enum" in v or _scalars(v) in (["integer"], ["number"], ["string"]) for v in inner
    )


def _list_of(kind: type) -> Callable[[Any, Any, Any], Any]:
    """An option's callback: "a,b" or a JSON list -> [a, b] of `kind`; None stays None."""

    def parse(ctx: Any, param: Any, text: str | None) -> list[Any] | None:
        if text is None:
            return None
        try:
            items = json.loads(text) if text.lstrip().startswith("[") else [x for x in text.split(",") if x]
            return [kind(x) for x in items]
        except (ValueError, TypeError) as err:
            raise click.BadParameter(
                f"{text!r} is not a comma-separated list of {kind.__name__}: {err}"
            ) from err

    return parse


def _pairs(kind: type | None) -> Callable[[Any, Any, Any], Any]:
    """An option's callback: repeated NAME=VALUE -> {name: value}; a malformed or repeated name is bad usage."""

    def parse(ctx: Any, param: Any, values: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for v in values:
            name, sep, value = v.partition("=")
            if not sep or not name or not value or name in out:
                raise click.BadParameter(f"expected NAME=VALUE with distinct names, got {v!r}")
            try:
                out[name] = kind(value) if kind else value
            except ValueError as err:
                raise click.BadParameter(f"{v!r}: {err}") from err
        return out

    return parse


def setting_option(name: str, path: str) -> click.Option | None:
    """The option of settings field `name` (schema key `path`): None for what only --settings gives (an
    object of objects, a value of several types that no choice lists)."""
    spec = schema_spec(path)
    key = path.rsplit(".", 1)[1]
    flag = "--" + key.replace("_", "-")
    default = spec.get("default")
    shown = {True: "on", False: "off"}.get(default, default) if isinstance(default, bool) else default
    described = " ".join(str(spec.get("description", "")).split())
    scalars = _scalars(spec)
    decls = [flag, *ALIASES.get(key, ())]
    kw: dict[str, Any] = {}
    if "enum" in spec and any(isinstance(e, str) for e in spec["enum"]):
        kw["type"] = click.Choice([e for e in spec["enum"] if isinstance(e, str)])
    elif scalars == ["boolean"]:
        decls = [f"{flag}/--no-{key.replace('_', '-')}"]
    elif len(scalars) == 1 and scalars[0] in _CLICK_TYPES:
        kw["type"] = _CLICK_TYPES[scalars[0]]
    elif scalars == ["array"] and _scalars(spec.get("items", {})) in ([t] for t in _ITEM_TYPES):
        kw["callback"] = _list_of(_ITEM_TYPES[_scalars(spec["items"])[0]])
        described += " (comma-separated, or a JSON list)"
    elif scalars == ["array"] and "enum" in spec.get("items", {}):
        kw["callback"] = _list_of(str)
        described += " (comma-separated, or a JSON list)"
    elif scalars == ["object"] and _flat(spec):
        inner = spec.get("additionalProperties") or {}
        kinds = _scalars(inner)
        kw.update(multiple=True, metavar="NAME=VALUE")
        kw["callback"] = _pairs(
            _ITEM_TYPES.get(kinds[0]) if len(kinds) == 1 and "enum" not in inner else None
        )
        names = f", NAME one of {', '.join(spec['properties'])}" if spec.get("properties") else ""
        described += f" (NAME=VALUE, repeat{names}; over the --settings JSON's)"
    else:
        return None
    help = f"{described} [{path.rsplit('.', 1)[0]}.{key}; default: {json.dumps(shown)}]".strip()
    return click.Option([*decls, name], default=None, help=help, **kw)


def ops_param(cls: Any) -> list[click.Option]:
    """--ops, where a settings class has operational knobs: all of them in one JSON object."""
    knobs = ops_fields(cls)
    if not knobs:
        return []
    section = cls.schema_section
    return [
        click.Option(
            ["--ops", "ops_json"],
            help=f"The job's operational knobs (resources.{section}: {', '.join(knobs)}) as a JSON object "
            "or @file: how it runs, not what it computes (the rules pass them as a resource, so changing "
            "one reruns nothing); keys missing take the schema's defaults, options typed here override it.",
        )
    ]


def command_settings_params(cls: Any) -> list[click.Parameter]:
    """Every option a command takes for its settings: --settings, --ops and one per setting."""
    return [settings_param(cls.schema_section), *ops_param(cls), *settings_params(cls)]


def settings_params(cls: Any) -> list[click.Parameter]:
    """An option for every setting of a settings class that one option can give, in its fields' order."""
    options = [setting_option(name, path) for name, path in cls.schema_paths.items()]
    return [option for option in options if option is not None]


def _path_type(a: Arg) -> click.Path:
    return click.Path(file_okay=a.kind != "dir", dir_okay=a.kind != "file", exists=a.exists)


def arg_param(name: str, a: Arg) -> click.Parameter:
    """The option (or argument, when a.option is NAME) of a paths field."""
    if a.kind in ("file", "dir", "path"):
        kind: Any = _path_type(a)
    elif a.choices:
        kind = click.Choice(a.choices)
    elif a.kind in ("int", "float"):
        base = int if a.kind == "int" else float
        kind = (
            base
            if a.minimum is None
            else (click.IntRange(min=int(a.minimum)) if base is int else click.FloatRange(min=a.minimum))
        )
    else:
        kind = str
    if not a.option.startswith("-"):
        nargs = -1 if a.multiple else 1
        return click.Argument([name], type=kind, nargs=nargs, required=a.required, metavar=a.option)
    kw: dict[str, Any] = {"help": a.help, "required": a.required, "envvar": a.envvar, "default": a.default}
    if a.kind == "flag":
        return click.Option([a.option, name], is_flag=True, **kw)
    if a.kind == "named":
        kw.update(multiple=True, metavar="SET=PATH", callback=_pairs(None))
    elif a.kind == "json":
        kw["callback"] = lambda ctx, param, raw: json_object(raw, a.option) if raw else None
    if a.multiple:
        kw["multiple"] = True
    if a.default is not None:
        kw["show_default"] = True
    return click.Option([a.option, name], type=kind, **kw)


def _exit_code(exits: dict[type[BaseException], int], err: BaseException) -> int:
    return next(code for kind, code in exits.items() if isinstance(err, kind))


def stage_command(name: str, run: Callable[..., Iterable[str]], exits: dict[type[BaseException], int]) -> Any:
    """The command `name` of a stage's run(paths[, settings]): its options from the two classes its
    signature names, its help from its docstring; the lines it yields are printed, an error of `exits`
    is one line and its exit code. Outputs marked sealed are unsealed first and sealed when it succeeds."""
    from draftsmith.core.io.digests import seal, unseal

    hints = typing.get_type_hints(run)
    paths_class, settings_class = hints["paths"], hints.get("settings")
    args = args_of(paths_class)
    params = [arg_param(field, a) for field, a in args.items()]
    if settings_class is not None:
        params += command_settings_params(settings_class)
    names = [p.name for p in params]
    clash = {n for n in names if names.count(n) > 1}
    if clash:
        raise TypeError(f"{name}: {sorted(clash)} are both a path and a setting")

    def callback(settings_json: str | None = None, **kw: Any) -> None:
        paths = paths_class(**{field: kw.pop(field) for field in args})
        call = [paths]
        if settings_class is not None:
            call.append(settings_from(settings_class, settings_json, kw))
        outputs = [getattr(paths, f) for f, a in args.items() if a.sealed and getattr(paths, f)]
        outputs = outputs if os.environ.get("RANK", "0") == "0" else []  # under torchrun rank 0 writes
        unseal(outputs)
        try:
            for line in run(*call):
                click.echo(line)
        except tuple(exits) as err:
            fail(str(err), _exit_code(exits, err))
        seal(outputs, name)

    return click.Command(name, callback=callback, params=params, help=run.__doc__)
