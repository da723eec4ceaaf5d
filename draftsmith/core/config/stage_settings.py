"""Every command's settings class: the config keys it reads, torch-free.

The Snakefile imports these (torch would slow every parse) and builds each rule's `--settings` from the
class of the command it calls (`rule_settings`; core/workflow/rule_args.py: `settings_json`), and its `--ops`
from the class's operational knobs (`rule_ops`, `ops_json`); the command parses them into the same class
(draftsmith/cli_options.py). A key is read by a command exactly when it
is a field of its class, so a rule cannot drop one (tests/unit/workflow/test_rules.py plans every command with
every key changed and finds each in the command it reaches). How a class is built from the schema:
core/config/settings.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from draftsmith.core.config.config import SETTINGS_OPS
from draftsmith.core.config.settings import (
    GroupedSettings,
    SchemaSettings,
    from_schema,
    schema_spec,
    with_groups,
)

TRACKERS = {
    "wandb": "wandb",
    "mlflow": "mlflow",
}  # report_to name -> the module it needs (core/training/tracking.py)


def missing_trackers(report_to: list[str]) -> list[str]:
    """The trackers asked for whose package is not installed."""
    return [name for name in report_to if importlib.util.find_spec(TRACKERS[name]) is None]


# every check that evaluate.gate can make blocking, with its default mode (the schema's)
DEFAULT_MODES = {name: spec["default"] for name, spec in schema_spec("evaluate.gate")["properties"].items()}


@from_schema(
    "evaluate",
    paths={
        "modes": "evaluate.gate",
        "level": "evaluate.interval_level",
        "resamples": "evaluate.bootstrap_resamples",
    },
)
class GateSettings(SchemaSettings):
    """What the gate judges with: which checks block (evaluate.gate, every check given its mode), the
    tolerances, and the bootstrap's level and resamples. Defaults and choices in config.schema.yaml."""

    modes: dict[str, str]
    max_tau_gap: float | None  # None: tau_tolerance's statistical band
    max_acc_gap: float  # train - validation first-draft accuracy above this: more data
    min_val_gain: float  # last validation gain above this: still learning
    level: float
    resamples: int
    bootstrap_seed: int = 0  # not a setting: the same resamples in every run, so intervals repeat

    def mode(self, check: str) -> str:
        """A check's mode: as given in evaluate.gate, else the schema's default."""
        return self.modes.get(check, DEFAULT_MODES[check])

    @property
    def all_modes(self) -> dict[str, str]:
        return {name: self.mode(name) for name in DEFAULT_MODES}

    @classmethod
    def from_evaluate(cls, values: dict[str, Any], modes: dict[str, str]) -> GateSettings:
        """From the `evaluate` section's keys (interval_level, bootstrap_resamples, ...) and the modes."""
        return cls(
            modes=modes,
            max_tau_gap=values["max_tau_gap"],
            max_acc_gap=values["max_acc_gap"],
            min_val_gain=values["min_val_gain"],
            level=values["interval_level"],
            resamples=values["bootstrap_resamples"],
        )

    @property
    def bootstrap(self) -> tuple[float, int, int]:
        """(level, resamples, seed) for draftsmith.core.evaluation.stats."""
        return self.level, self.resamples, self.bootstrap_seed


@from_schema("target")
class TargetSettings(SchemaSettings):
    """Where the target comes from: a Hub id (`model`, at `revision`) or the embedded default's wheel."""

    model: str
    revision: str | None
    gguf_wheel: str | None
    gguf_file: str


@from_schema("prompts")
class PromptSettings(SchemaSettings):
    """The `prompts` settings that choose the prompts (sharegpt_wheel and code_wheels name downloads,
    which reach the stage as files: see prepare_prompts)."""

    source: str
    path: str | None
    split: str
    subset: str | None
    revision: str | None
    columns: dict[str, str]
    max_prompts: int
    num_heldout: int
    heldout_path: str | None
    max_prompt_chars: int
    seed: int
    code_prompts: int


@from_schema("generate", ops=SETTINGS_OPS["generate"], paths={"dtype": "target.dtype"})
class GenerateSettings(SchemaSettings):
    """The `generate` config section with its operational knobs (resources.generate) and the target's
    dtype; defaults, choices and meanings in config.schema.yaml."""

    backend: str
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    dtype: str  # target.dtype; the back-end resolves auto for its device (precision.compute_dtype)
    batch_size: int
    batch_tokens: int
    base_url: str | None
    model: str | None
    api_key_env: str | None
    concurrency: int
    timeout_s: float
    max_retries: int
    backoff_s: float
    max_consecutive_failures: int
    request_token_ids: bool
    server_args: list[str]
    server_host: str
    server_startup_timeout_s: float
    gpus: int  # the job's GPUs (resources.generate.gpus): the vllm-server back-end uses all of them
    tensor_parallel: int  # GPUs per engine (0: memory.engine_layout decides); the rest data parallel
    gpu_memory_utilization: float
    reasoning: str
    multi_turn: str
    max_prompt_tokens: int
    oversized_prompts: str
    max_failed_fraction: float
    original_answers_share: float
    devices: list[str] | None = None  # vllm-server: the job's GPU ids (not a config key); None = inherited
    gpu_memory_gib: float | None = None  # each GPU's memory for the engine layout (None: detected here)

    def check(self) -> None:
        """What the schema cannot say: the openai back-end needs an endpoint."""
        if self.backend == "openai" and not self.base_url:
            raise ValueError("generate.base_url is required with backend 'openai' (e.g. http://host:8000/v1)")

    def sampling(self) -> dict[str, Any]:
        """The request's sampling fields (same meaning as the transformers back-end's)."""
        return {
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }


@from_schema("extract")
class TokenizeSettings(SchemaSettings):
    """The `extract` keys tokenize decides: the shard plan and the longest sample."""

    num_shards: int
    max_seq_len: int


@from_schema(
    "extract",
    ops=("threads", "gpus", "gpu_memory_utilization", "tensor_parallel", "scratch", "idle_timeout_s"),
    paths={"dtype": "target.dtype"},
    unset=("threads",),
)
class ExtractSettings(SchemaSettings):
    """What the extract stage computes and stores (the `extract` section's result keys), the compute
    dtype, and how the job runs (resources.extract: threads, GPUs and their engine layout)."""

    aux_layers: list[int] | None
    batch_tokens: int
    codec: str
    zstd_level: int
    storage_dtype: str  # how a shard stores the states (core/data/shards.py)
    backend: str
    compile: str | bool  # YAML reads a bare on/off as a boolean; should_compile takes auto/on/off
    vllm_eager: bool
    dtype: str  # target.dtype: the compute dtype (auto resolves per device, precision.compute_dtype)
    threads: int | None  # None: torch's choice
    gpus: int
    gpu_memory_utilization: float
    tensor_parallel: int
    scratch: str | None  # vLLM's per-request states files: node-local (None or "": $TMPDIR)
    idle_timeout_s: int  # an engine without progress this long is killed (run_engine_processes)


@from_schema("extract", paths={"dtype": "target.dtype", "epochs": "train.epochs"})
class EstimateSettings(SchemaSettings):
    """The extraction settings an estimate is for: what the job would capture, compress and store."""

    aux_layers: list[int] | None
    batch_tokens: int
    codec: str
    zstd_level: int
    storage_dtype: str
    dtype: str  # target.dtype: the compute dtype of a probe (auto resolves for this machine)
    epochs: int  # train.epochs: the prefills a stream runs (mode_lines)


@from_schema("extract", paths={"dtype": "target.dtype"})
class ManifestSettings(SchemaSettings):
    """The `extract` key the manifest checks the shards against; for a stream manifest also the keys
    that decide the states the train job captures (those the extract rule passes)."""

    min_teacher_agreement: float
    aux_layers: list[int] | None
    batch_tokens: int
    storage_dtype: str
    backend: str
    compile: str | bool
    vllm_eager: bool
    dtype: str  # target.dtype: the compute dtype
    codec: str  # hybrid: its cache shards'
    zstd_level: int


@from_schema("vocab")
class VocabSettings(SchemaSettings):
    size: int  # draft vocabulary size


@from_schema("train", ops=("checkpoint_ttt",))
class ObjectiveSettings(SchemaSettings):
    """The train keys the TTT objective is built from (TrainSettings' `objective` group): a new loss
    knob is its schema entry, a field here and the Objective field of the same name that uses it.
    Meanings in config.schema.yaml."""

    ttt_steps: int
    ttt_decay: float  # step j weighs ttt_decay**j ...
    ttt_step_weights: list[float] | None  # ... unless given here, one per step
    lk_loss: str  # none | alpha | lambda: train on the expected acceptance too (LK losses)
    lk_kl_scale: float
    lk_kl_decay: float
    noise_std: float  # uniform noise U(-std, std) on the aux states
    precision: str  # auto | bf16 | fp32 (train_precision resolves auto per device)
    loss_norm: str
    mask_offset: int
    loss_positions: str
    ttt_prefix: str
    ttt_positions: str
    checkpoint_ttt: bool  # recompute each TTT step's activations in the backward pass (less memory)

    def check(self) -> None:
        weights = self.ttt_step_weights
        if weights is not None and len(weights) != self.ttt_steps:
            raise ValueError(f"train.ttt_step_weights: {len(weights)} weights for ttt_steps {self.ttt_steps}")


@from_schema("train", ops=("loader_threads",))
class BatchSettings(SchemaSettings):
    """The train keys the loader reads (TrainSettings' `batching` group): which samples are held out and
    how they are batched; meanings in config.schema.yaml."""

    batch_tokens: int  # token budget per optimizer step (padded size of a batch of whole samples)
    max_seq_len: int  # longer samples are truncated
    val_fraction: float  # held-out samples, chosen by a hash of the sample id
    seed: int  # the shuffle's (with the epoch)
    pack_window: int
    loader_threads: int  # background threads decoding the next batches; 0 = decode in the loop


@from_schema("train", ops=SETTINGS_OPS["train"], unset=("threads",))
@with_groups(objective=ObjectiveSettings, batching=BatchSettings)
class TrainSettings(GroupedSettings):
    """The `train` config section and the train job's operational knobs; defaults, choices and meanings
    in config.schema.yaml (the objective and optimiser choices were picked by bench/ablate.py). The loss's
    knobs are the `objective` group's (core/training/objective.py: ObjectiveSettings), the loader's the `batching`
    group's (core/data/loader.py: BatchSettings); the fields here are the rest."""

    epochs: int
    max_steps: int | None  # stop early (tests, the untrained drafter's 0); the LR schedule is unchanged
    lr: float
    weight_decay: float  # on matrices only (norm weights are not decayed)
    warmup_steps: int
    grad_clip: float  # max global grad norm
    seed: int  # the drafter's initialisation (and the shuffle's, in `batching`)
    head_init: str
    adam_beta2: float
    optimizer: str  # adamw | muon (Muon for the weight matrices, AdamW for the rest)
    muon_lr_scale: float
    muon_weight_decay: float
    layer_init: str
    drafter: dict[str, Any]  # train.drafter: explicit shape; nulls = derived from the target
    threads: int | None  # torch.set_num_threads; None = torch's choice (the rule passes the job's)
    checkpoint_every: int  # also checkpoint every N steps (always at epoch ends); 0 = epoch ends only
    micro_batch_tokens: int  # a rank's share of a batch in passes of at most this many tokens; 0 = one pass
    report_to: list[str]  # trackers besides TensorBoard that get the live curves (wandb, mlflow)
    hidden_states: str  # files | stream | hybrid (the manifest says which; the rule picks the manifest)
    keep_hidden_cache: bool  # hybrid: keep the cache shards after training (resources.train)
    engine_gpus: int  # stream / hybrid on GPUs: 0 = an engine beside each rank; N = the first N GPUs

    def check(self) -> None:
        self.objective  # noqa: B018 (building the group runs its own checks: ObjectiveSettings.check)
        missing = missing_trackers(self.report_to)
        if missing:
            names = ", ".join(missing)
            raise ValueError(f"resources.train.report_to: {names} not installed (pip install {names})")


@from_schema("train", ops=("threads",), unset=("threads",))
class UntrainedSettings(SchemaSettings):
    """What the untrained baseline reads (`draftsmith untrained-drafter`): what decides training's starting
    point, which the baseline is (the drafter's shape, its initialisation and seed); the rest of training
    is not run (0 steps)."""

    seed: int
    head_init: str
    layer_init: str
    drafter: dict[str, Any]
    threads: int | None  # torch.set_num_threads; None = torch's choice


@from_schema(
    "evaluate",
    ops=("threads", "gpus", "gpu_memory_utilization", "vllm_timeout_s"),
    paths={"dtype": "target.dtype"},
    unset=("threads",),
)
class EvaluateSettings(SchemaSettings):
    """What both measurements take: the `evaluate` section's measurement keys, target.dtype (vLLM's dtype
    on GPUs) and the job's operational knobs (resources.evaluate); meanings in config.schema.yaml."""

    num_prompts: int  # first N prompts of a set (0 = all) ...
    set_num_prompts: dict[str, int]  # ... unless a set has its own count here
    max_new_tokens: int
    num_draft_tokens: int
    temperature: float  # 0 = greedy (lossless token for token); > 0 = speculative sampling
    seed: int
    ngram: bool
    ngram_lookup: dict[str, int]
    suffix: bool
    suffix_decoding: dict[str, Any]
    hybrid: bool  # offline only
    serving: dict[str, Any]  # vLLM: the serving point whose best draft lengths it re-measures ...
    remeasure_chosen_k: bool  # ... when this is on, and its estimate is this close to another choice:
    remeasure_margin: float
    preflight: str  # block | warn: what the pre-flight does where no drafter can pay
    vllm_eager: bool | None  # None: eager on a CPU, torch.compile + CUDA graphs on GPUs
    dtype: str
    threads: int | None  # torch.set_num_threads (offline); None = torch's choice
    gpus: int
    gpu_memory_utilization: float
    vllm_timeout_s: float


# The evaluation's three commands each read a part of the section: what both measurements decode (the
# same lengths, draft count, sampling and free methods' settings), and what each adds. Their stage code
# takes these classes, so the type checker refuses a read of a field outside them; EvaluateSettings above
# (every field of each) is what bench/ and the tests build.


@from_schema("evaluate", ops=("threads", "gpus"), unset=("threads",))
class OfflineEvaluateSettings(SchemaSettings):
    """`draftsmith evaluate`: the offline measurement (the contract check beside vLLM's). Suffix
    decoding's offline twin joins the contract check and the hybrid is measured offline only."""

    num_prompts: int  # the rule derives it per set (core/workflow/rule_args.py: offline_options) ...
    max_new_tokens: int
    num_draft_tokens: int
    temperature: float
    seed: int
    ngram: bool  # ... and this one (off beside vLLM, which measures it)
    ngram_lookup: dict[str, int]
    suffix: bool
    suffix_decoding: dict[str, Any]
    hybrid: bool
    threads: int | None
    gpus: int


@from_schema(
    "evaluate",
    ops=("gpus", "gpu_memory_utilization", "vllm_timeout_s"),
    paths={"dtype": "target.dtype"},
)
class VllmEvaluateSettings(SchemaSettings):
    """`draftsmith evaluate-vllm`: the prompts, the methods, the serving point whose best draft lengths
    it re-measures, eager or CUDA graphs (null: by device), vLLM's dtype and the job's engine knobs."""

    num_prompts: int
    set_num_prompts: dict[str, int]  # the rule gives each set's count as --set-num-prompts
    max_new_tokens: int
    num_draft_tokens: int
    temperature: float
    seed: int
    ngram: bool
    ngram_lookup: dict[str, int]
    suffix: bool
    suffix_decoding: dict[str, Any]
    serving: dict[str, Any]
    remeasure_chosen_k: bool
    remeasure_margin: float
    vllm_eager: bool | None
    dtype: str
    gpus: int
    gpu_memory_utilization: float
    vllm_timeout_s: float


@from_schema(
    "evaluate",
    ops=("gpus", "gpu_memory_utilization", "vllm_timeout_s"),
    paths={"dtype": "target.dtype"},
)
@with_groups(vllm=VllmEvaluateSettings)
class PreflightSettings(GroupedSettings):
    """`draftsmith preflight`: what the vLLM measurement reads (the free methods run as it runs them) and
    what the pre-flight does where no drafter can pay."""

    preflight: str  # block | warn


@from_schema("evaluate", paths={"modes": "evaluate.gate", "level": "evaluate.interval_level",
                                "resamples": "evaluate.bootstrap_resamples"})  # fmt: skip
class SummarySettings(SchemaSettings):
    """What the summary judges with (GateSettings' keys) and the serving point it projects to."""

    modes: dict[str, str]
    max_tau_gap: float | None
    max_acc_gap: float
    min_val_gain: float
    level: float
    resamples: int
    serving: dict[str, Any]

    def gate_settings(self) -> GateSettings:
        names = [f.name for f in dataclasses.fields(GateSettings) if f.name in self.schema_paths]
        return GateSettings(**{name: getattr(self, name) for name in names})
