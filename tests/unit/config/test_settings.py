"""draftsmith/core/config/settings.py: settings objects take their defaults and checks from the schema alone."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest

from draftsmith.core.config.config import section_defaults
from draftsmith.core.config.settings import REGISTRY, from_schema, rule_settings, schema_default
from draftsmith.core.config.stage_settings import ManifestSettings, SummarySettings
from draftsmith.stages.generate import GenerateSettings
from draftsmith.stages.train import TrainSettings

# every module that defines a settings class (imported here so that each registers)
SETTINGS_MODULES = ("draftsmith.core.config.stage_settings", "draftsmith.core.evaluation.verdict")


def settings_classes() -> list[type]:
    for module in SETTINGS_MODULES:
        importlib.import_module(module)
    return list(REGISTRY)


def test_every_settings_objects_defaults_are_the_schemas() -> None:
    classes = settings_classes()
    assert {"TrainSettings", "GenerateSettings", "GateSettings"} <= {c.__name__ for c in classes}
    for cls in classes:
        built = cls()
        for name, path in cls.schema_paths.items():
            expected = None if name in cls.unset_fields else schema_default(path)
            assert getattr(built, name) == expected, f"{cls.__name__}.{name} is not {path}'s default"


def test_every_key_of_a_stage_section_is_a_setting() -> None:
    for cls, section in ((TrainSettings, "train"), (GenerateSettings, "generate")):
        assert set(section_defaults(section)) <= set(cls.schema_paths), cls.__name__


def test_values_are_checked_against_the_schema_with_the_key_named() -> None:
    with pytest.raises(ValueError, match=r"train\.lr: 0 is less than or equal to the minimum of 0"):
        TrainSettings(lr=0)
    with pytest.raises(ValueError, match=r"train\.loss_norm: 'token' is not one of \['position', 'sample'\]"):
        TrainSettings(loss_norm="token")
    with pytest.raises(ValueError, match=r"train\.epochs: 'two' is not of type 'integer'"):
        TrainSettings(epochs="two")
    with pytest.raises(ValueError, match=r"resources\.train\.loader_threads: -1 is less than the minimum"):
        replace(TrainSettings(), loader_threads=-1)  # replace() builds a new object: checked too
    with pytest.raises(ValueError, match=r"target\.dtype: 'float16' is not one of"):
        GenerateSettings(dtype="float16")  # a field named after another section's key


def test_unset_fields_default_to_none_and_are_checked_when_given() -> None:
    assert TrainSettings().threads is None  # torch's choice outside Snakemake
    assert TrainSettings(threads=2).threads == 2
    with pytest.raises(ValueError, match=r"resources\.train\.threads: 0 is less than the minimum of 1"):
        TrainSettings(threads=0)


def test_from_dict_fills_defaults_ignores_scheduler_knobs_and_refuses_unknown_keys() -> None:
    assert TrainSettings.from_dict({"lr": 0.01}) == TrainSettings(lr=0.01)
    assert TrainSettings.from_dict({"gpus": 4, "mem_mb": 100}) == TrainSettings()  # resources.train only
    with pytest.raises(ValueError, match="unknown train settings: bogus, lrr"):
        TrainSettings.from_dict({"lrr": 0.01, "bogus": 1})
    assert TrainSettings.from_dict(TrainSettings(seed=3).to_dict()) == TrainSettings(seed=3)


def test_mutable_defaults_are_fresh_copies() -> None:
    a, b = GenerateSettings(), GenerateSettings()
    a.server_args.append("--x")
    assert b.server_args == schema_default("generate.server_args")


def test_a_class_cannot_carry_its_own_default_for_a_schema_key() -> None:
    with pytest.raises(TypeError, match=r"Bad\.lr: its default is the schema's \(train\.lr\); remove it"):

        @from_schema("train")
        class Bad:
            lr: float = 0.1

    with pytest.raises(TypeError, match=r"\['nowhere'\] are not in the schema and have no default"):

        @from_schema("train")
        class Lost:
            lr: float
            nowhere: int


def test_the_commands_settings_classes_import_no_torch() -> None:
    """The Snakefile imports them to build each rule's --settings: torch would slow every parse."""
    import subprocess
    import sys

    probe = "import sys, draftsmith.core.config.stage_settings; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


def test_a_rule_passes_the_keys_of_its_commands_section_and_no_misspelt_one() -> None:
    config = {
        "extract": {**section_defaults("extract"), "zstd_level": 7},
        "evaluate": section_defaults("evaluate"),
    }
    values = rule_settings(ManifestSettings, config)
    assert values["zstd_level"] == 7 and "dtype" not in values  # target.dtype travels as --dtype
    assert set(values) == {
        name for name, path in ManifestSettings.schema_paths.items() if path == f"extract.{name}"
    }
    assert rule_settings(ManifestSettings, config, only=["zstd_level"]) == {"zstd_level": 7}
    assert "codec" not in rule_settings(ManifestSettings, config, drop=["codec"])
    assert set(rule_settings(SummarySettings, config)) >= {"gate", "interval_level"}  # keys, not field names
    with pytest.raises(KeyError, match="zstd_levle"):
        rule_settings(ManifestSettings, config, drop=["zstd_levle"])
