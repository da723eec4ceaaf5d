"""The registries (one record per drafter kind, method, benchmark set) against the schema's enums and
keys, and each record's dotted paths against the code they name: adding a kind, a method or a benchmark
is its files, one record and the schema (docs/changing.md), and these tests say which one is missing."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from helpers.model import EXPORT_AUX_IDS, make_drafter

from draftsmith.core.config.settings import schema_default, schema_spec
from draftsmith.core.data.benchmarks import BENCHMARKS
from draftsmith.core.evaluation.cost import DEVICES, THIS_CPU
from draftsmith.core.evaluation.engines import ENGINES, drafting_fields
from draftsmith.core.evaluation.methods import FREE_METHODS, METHODS, PLAIN
from draftsmith.core.evaluation.policy import DRAFTING_SHAPES, SCHEDULED, UNSERVED
from draftsmith.core.evaluation.verdict import ACTIONS, DEPLOY_ACTION
from draftsmith.core.export.formats import load_drafter, save_drafter
from draftsmith.core.export.formats.vllm import save_eagle3
from draftsmith.core.model.kinds import KINDS, Kind, kind, kind_of_export
from draftsmith.core.workflow.startup import NAMED_HELDOUT_SETS
from draftsmith.stages.evaluate import EAGLE_METHODS, EvaluateSettings
from draftsmith.stages.evaluate.stage import free_methods, method_runs


def test_the_schema_kinds_are_the_registry() -> None:
    assert schema_spec("train.drafter.kind")["enum"] == list(KINDS)
    assert schema_spec("train.drafter.kind")["default"] in KINDS


@pytest.mark.parametrize("name", list(KINDS))
def test_every_dotted_path_resolves(name: str) -> None:
    record = kind(name)
    attributes = ("model", "loss", "proposer", "param_count", "writer", "reader")
    for attribute in (*attributes, "checker") if record.checker else attributes:
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


# ------------------------------------------------------------------------------------------ methods


def test_every_method_names_its_schema_keys() -> None:
    evaluate = schema_spec("evaluate")["properties"]
    for m in METHODS.values():
        if m.measure:
            assert evaluate[m.measure]["type"] == "boolean", f"{m.key}: evaluate.{m.measure}"
        if m.settings:
            assert evaluate[m.settings]["type"] == "object", f"{m.key}: evaluate.{m.settings}"
    # every evaluate flag named after a method is that method's switch
    flags = {k for k, spec in evaluate.items() if spec.get("type") == "boolean" and k in METHODS}
    assert flags == {m.measure for m in METHODS.values() if m.measure}


def test_a_free_method_is_whole() -> None:
    """A free method proposes offline and in vLLM from its settings alone, and a verdict can deploy it."""
    assert FREE_METHODS == ("ngram", "suffix")
    for key in FREE_METHODS:
        m = METHODS[key]
        assert m.served and m.deploy and m.measure and m.settings and m.proposer and m.vllm
        proposer = m.offline_proposer({})  # the schema's settings
        proposer.reset([5, 6, 7, 5, 6])
        assert isinstance(proposer.propose(2), list)
        assert m.vllm_config(None, 3, {})["method"] == key


def test_the_verdict_and_policy_derive_from_the_records() -> None:
    assert set(DEPLOY_ACTION) == {m.key for m in (*METHODS.values(), PLAIN) if m.deploy}
    assert set(DEPLOY_ACTION.values()) <= set(ACTIONS)
    assert set(UNSERVED) == {"untrained", "hybrid"} and set(SCHEDULED) == {"eagle3", "ngram"}
    assert set(DRAFTING_SHAPES) == {k.drafting for k in KINDS.values()}
    assert set(EAGLE_METHODS) == {"eagle3", "untrained"}


def test_the_free_methods_measured_follow_the_flags() -> None:
    on = EvaluateSettings()
    assert set(free_methods(on)) == set(FREE_METHODS)
    assert free_methods(on)["ngram"] == schema_default("evaluate.ngram_lookup")
    off = EvaluateSettings(ngram=False)
    assert set(free_methods(off)) == {"suffix"}
    runs = method_runs({"eagle3": "d"}, free_methods(off))
    assert [(r.name, r.kind) for r in runs] == [("plain", None), ("eagle3", "eagle3"), ("suffix", "suffix")]


# ---------------------------------------------------------------------------------------- benchmarks


def test_every_benchmark_has_its_wheel_setting_and_is_a_named_set() -> None:
    evaluate = schema_spec("evaluate")["properties"]
    wheels = {k for k in evaluate if k.endswith("_wheel")}
    assert wheels == {b.wheel_setting for b in BENCHMARKS.values()}
    assert set(BENCHMARKS) <= set(NAMED_HELDOUT_SETS)


def test_the_cli_offers_every_benchmark() -> None:
    from draftsmith.cli import main

    command = main.commands["benchmark-prompts"]
    choice = next(p for p in command.params if p.name == "name").type
    assert sorted(choice.choices) == sorted(BENCHMARKS)


def test_the_schema_devices_are_the_cost_models() -> None:
    assert schema_spec("evaluate.serving.device")["enum"] == [*DEVICES, THIS_CPU]
