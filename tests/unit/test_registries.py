"""The registries (one record per drafter kind, method, benchmark set) against the schema's enums and
keys, and each record's dotted paths against the code they name: adding a kind, a method or a benchmark
is its files, one record and the schema (docs/changing.md), and these tests say which one is missing."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from helpers import EXPORT_AUX_IDS, make_drafter

from draftsmith.core.engines import ENGINES, drafting_fields
from draftsmith.core.export_formats import load_drafter, save_drafter
from draftsmith.core.export_formats.vllm import save_eagle3
from draftsmith.core.kinds import KINDS, Kind, kind, kind_of_export
from draftsmith.core.settings import schema_spec


def test_the_schema_kinds_are_the_registry() -> None:
    assert schema_spec("train.drafter.kind")["enum"] == list(KINDS)
    assert schema_spec("train.drafter.kind")["default"] in KINDS


@pytest.mark.parametrize("name", list(KINDS))
def test_every_dotted_path_resolves(name: str) -> None:
    record = kind(name)
    for attribute in ("model", "loss", "proposer", "param_count", "writer", "reader"):
        assert callable(record.load(attribute)), f"{name}.{attribute} = {getattr(record, attribute)}"
    # every writer takes save_drafter's arguments, in its order
    expected = list(inspect.signature(save_eagle3).parameters)
    assert list(inspect.signature(record.load("writer")).parameters)[: len(expected)] == expected
    assert record.drafting in ("chain", "parallel", "block")
    assert "vllm" in record.forms and set(record.forms) <= set(ENGINES)


def test_an_unknown_kind_is_one_line_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"^train\.drafter\.kind='eagle4' must be one of \[") as e:
        kind("eagle4")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", list(KINDS))
def test_each_kind_is_written_read_and_served_as_itself(tmp_path, name: str) -> None:
    """The kind's writer, `kind_of_export` on what it wrote (the fields an engine reads, the draftsmith
    block left out), its reader, and what vLLM is told beside it."""
    model = make_drafter(seed=1, kind=name, mask_token_id=7 if kind(name).masked else None)
    out = save_drafter(model, tmp_path / name, EXPORT_AUX_IDS, "/t", "vllm", None, torch.float32)
    config = json.loads((out / "config.json").read_text())
    config.pop("draftsmith")
    assert kind_of_export(config) == name
    loaded, _ = load_drafter(out)
    assert type(loaded) is type(model) and loaded.cfg.kind == name
    assert drafting_fields(out) == dict(kind(name).vllm_fields)


def test_a_record_is_frozen() -> None:
    with pytest.raises(AttributeError):
        KINDS["eagle3"].tag = "x"  # type: ignore[misc]
    assert isinstance(KINDS["eagle3"], Kind)
