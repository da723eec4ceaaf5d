"""What a stage's `run(paths, settings)` takes besides its settings: the fields of its paths dataclass,
each made with `arg`, which also says how the command line spells it (draftsmith/cli_options.py builds
the command from them). A stage's settings come from the schema; these are the run's own inputs and
outputs (files, folders) and the few facts of one job that are no config key (e.g. the GPUs' memory).

A stage module exports its `Settings` (from_schema), its paths dataclass, `run(paths, settings)` that
returns (or yields, to print as it goes) the lines to print, and `EXITS`: its error classes -> exit code,
the more specific first. A stage without settings takes `run(paths)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# the exit codes of every command (README "Exit codes"); a stage's EXITS maps its errors to them
FAILED, BAD_INPUT, GATE = 1, 2, 3

KINDS = ("file", "dir", "path", "text", "int", "float", "flag", "named", "json")


@dataclasses.dataclass(frozen=True)
class Arg:
    """How one field of a paths dataclass is given on the command line.

    `option` is "--name" (an option) or "NAME" (a positional argument). kind: file, dir or path (a
    path; `exists`: it must exist), text, int, float, flag (on when given), named (repeated NAME=VALUE,
    read as a dict), json (a JSON object, inline or @file). `multiple`: repeatable, a tuple. `sealed`: an
    output whose digest the stage records when it succeeds (core/io/digests.py)."""

    option: str
    help: str
    kind: str
    required: bool
    exists: bool
    multiple: bool
    sealed: bool
    choices: tuple[str, ...] | None
    envvar: str | None
    minimum: float | None
    default: Any


def arg(
    option: str,
    help: str,
    *,
    kind: str = "file",
    required: bool = False,
    exists: bool = False,
    multiple: bool = False,
    sealed: bool = False,
    choices: tuple[str, ...] | None = None,
    envvar: str | None = None,
    minimum: float | None = None,
    default: Any = None,
) -> Any:
    """A field of a stage's paths dataclass that the command line gives as `option` (see Arg)."""
    if kind not in KINDS:
        raise ValueError(f"{option}: kind {kind!r} is not one of {', '.join(KINDS)}")
    spec = Arg(option, help, kind, required, exists, multiple, sealed, choices, envvar, minimum, default)
    empty: Any = {} if kind == "named" else () if multiple else None
    value = default if default is not None else empty
    if isinstance(value, (dict, tuple)):
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata={"arg": spec})
    return dataclasses.field(default=value, metadata={"arg": spec})


def args_of(paths_class: type) -> dict[str, Arg]:
    """field name -> its Arg, in the order of the fields."""
    return {f.name: f.metadata["arg"] for f in dataclasses.fields(paths_class) if "arg" in f.metadata}
