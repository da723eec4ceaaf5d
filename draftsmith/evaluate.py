"""Evaluate a drafter: speculative vs plain greedy decoding on held-out prompts, the lossless check,
acceptance per draft position, tau, wall-clock speedup, a plot, and the tau gate.

The target runs in float32: in bf16, near-tied logits flip between the one-token path of plain
decoding and the multi-token verify path, so outputs diverge although nothing is wrong
(research/calibration-and-prompts.md). In float32 any divergence is a bug and fails hard.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from draftsmith.atomic import atomic_path, write_json
from draftsmith.speculate import (
    SpecResult,
    first_difference,
    greedy_decode,
    position_counts,
    speculative_decode,
)


class GateFailed(RuntimeError):
    """tau is below the configured minimum: the drafter would not pay for itself."""


class NotLossless(RuntimeError):
    """Speculative decoding produced different tokens than plain greedy decoding."""


def read_eval_prompts(path: str | Path, num_prompts: int) -> list[dict]:
    """The first `num_prompts` records {"id", "messages"} of a prompt JSONL file (0 or less: all),
    validated by `draftsmith.prompts` (which also accepts the `conversations` and `prompt` shapes)."""
    from draftsmith.prompts import read_prompt_file

    prompts = read_prompt_file(path)
    if num_prompts > 0:
        prompts = prompts[:num_prompts]
    if not prompts:
        raise ValueError(f"{path}: no prompts to evaluate")
    return prompts


def eos_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Stop ids: the generation config's eos_token_id (int or list) plus the tokenizer's eos token."""
    ids: list[int] = []
    gen = getattr(generation_config, "eos_token_id", None)
    if gen is not None:
        ids.extend([gen] if isinstance(gen, int) else list(gen))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    out = sorted({int(i) for i in ids})
    if not out:
        raise ValueError("neither the tokenizer nor the generation config names an eos token")
    return out


def aux_ids_from_export(config: dict) -> list[int]:
    """Input-convention aux layer ids of a drafter export's config.json.

    Prefers draftsmith's own record (`draftsmith.aux_layer_ids_input`); otherwise converts
    `eagle_config.eagle_aux_hidden_state_layer_ids` from the convention the export declares
    (`draftsmith.aux_layer_convention`), and for a foreign export assumes vLLM's "input" convention.
    """
    from draftsmith.layers import convert_layer_ids

    block = config.get("draftsmith") or {}
    if block.get("aux_layer_ids_input") is not None:
        return [int(i) for i in block["aux_layer_ids_input"]]
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError(
            "the drafter export's config.json has no eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    return convert_layer_ids(ids, block.get("aux_layer_convention", "input"), "input")


def _check_pair(target: Any, drafter: Any, aux_ids: list[int]) -> None:
    from draftsmith.layers import validate_aux_layers

    tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    validate_aux_layers(aux_ids, tcfg.num_hidden_layers)
    dcfg = drafter.cfg
    problems = []
    if dcfg.num_aux != len(aux_ids):
        problems.append(f"drafter fuses {dcfg.num_aux} aux layers, the export names {len(aux_ids)}")
    if dcfg.target_hidden_size != tcfg.hidden_size:
        problems.append(
            f"drafter expects target hidden size {dcfg.target_hidden_size}, target has {tcfg.hidden_size}"
        )
    if dcfg.target_vocab_size != tcfg.vocab_size:
        problems.append(
            f"drafter expects target vocabulary {dcfg.target_vocab_size}, target has {tcfg.vocab_size}"
        )
    if problems:
        raise ValueError("drafter does not fit the target: " + "; ".join(problems))


def summarize(rows: list[dict], results: list[SpecResult], num_draft_tokens: int) -> dict[str, Any]:
    """Aggregate per-prompt rows (with plain/spec seconds and token counts) and their SpecResults."""
    accepted = [n for r in results for n in r.accepted]
    accepts, proposals = position_counts(accepted, num_draft_tokens)
    steps = len(accepted)
    plain_tokens = sum(r["plain_tokens"] for r in rows)
    spec_tokens = sum(r["spec_tokens"] for r in rows)
    plain_s = sum(r["plain_seconds"] for r in rows)
    spec_s = sum(r["spec_seconds"] for r in rows)
    plain_tps = plain_tokens / plain_s if plain_s > 0 else 0.0
    spec_tps = spec_tokens / spec_s if spec_s > 0 else 0.0
    return {
        "tau": 1.0 + sum(accepted) / steps if steps else 1.0,
        "mean_accepted_tokens": sum(accepted) / steps if steps else 0.0,
        "draft_acceptance_rate": sum(accepted) / sum(proposals) if sum(proposals) else 0.0,
        "acceptance_rate_per_position": [
            a / p if p else 0.0 for a, p in zip(accepts, proposals, strict=True)
        ],
        "accepted_per_position": accepts,
        "proposed_per_position": proposals,
        "verify_steps": steps,
        "plain": {"tokens": plain_tokens, "seconds": plain_s, "tokens_per_s": plain_tps},
        "speculative": {"tokens": spec_tokens, "seconds": spec_s, "tokens_per_s": spec_tps},
        "speedup": spec_tps / plain_tps if plain_tps > 0 else 0.0,
    }


def plot_acceptance(path: str | Path, summary: dict[str, Any]) -> None:
    """Left: acceptance rate per draft position; right: tokens/s plain vs speculative."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    rates = summary["acceptance_rate_per_position"]
    xs = list(range(1, len(rates) + 1))
    left.bar(xs, rates, color="tab:blue")
    for x, r in zip(xs, rates, strict=True):
        left.text(x, r + 0.01, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    left.set_xticks(xs)
    left.set_ylim(0, 1.05)
    left.set_xlabel("draft position")
    left.set_ylabel("acceptance rate (first i drafts all accepted)")
    left.set_title(f"acceptance per position ({summary['num_prompts']} prompts)")
    tps = [summary["plain"]["tokens_per_s"], summary["speculative"]["tokens_per_s"]]
    right.bar(
        ["plain greedy", f"speculative (k={summary['num_draft_tokens']})"],
        tps,
        color=["tab:gray", "tab:green"],
    )
    right.set_ylabel("tokens / s (wall clock)")
    right.set_title(f"tau {summary['tau']:.2f}, speedup {summary['speedup']:.2f}x")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def format_table(summary: dict[str, Any]) -> str:
    rates = summary["acceptance_rate_per_position"]
    lines = [
        f"tau (mean acceptance length)  {summary['tau']:.3f}   (gate: >= {summary['min_tau']})",
        "acceptance per position       " + "  ".join(f"{i + 1}:{r:.3f}" for i, r in enumerate(rates)),
        f"plain greedy                  {summary['plain']['tokens_per_s']:.1f} tok/s",
        f"speculative                   {summary['speculative']['tokens_per_s']:.1f} tok/s",
        f"speedup                       {summary['speedup']:.2f}x",
        f"lossless                      {summary['lossless']} ({summary['num_prompts']} prompts)",
    ]
    return "\n".join(lines)


def gate_message(tau: float, min_tau: float) -> str:
    return (
        f"tau {tau:.3f} is below the gate min_tau={min_tau}: the drafter's proposals are rarely accepted. "
        "Check, in order: the teacher agreement recorded in data_config.json (argmax of the stored final "
        "state vs the next trace token: low means wrong layers, norm or template), the aux layer ids and "
        "their convention (draftsmith/vLLM count 'input to layer k' = hidden_states[k]; SGLang/SpecForge "
        "count outputs, one lower), and that the chat template of training and evaluation is the same."
    )


def evaluate(
    target_path: str | Path,
    drafter_dir: str | Path,
    prompts_path: str | Path,
    out_dir: str | Path,
    num_prompts: int,
    max_new_tokens: int,
    num_draft_tokens: int,
    min_tau: float,
    threads: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run plain and speculative greedy decoding on held-out prompts; write out_dir/summary.json and
    out_dir/acceptance.png; raise NotLossless on any token difference, GateFailed when tau < min_tau
    (both after the outputs are written)."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.chat import render_prompt
    from draftsmith.export import load_drafter

    if threads and threads > 0:
        torch.set_num_threads(threads)
    target_path, drafter_dir, out_dir = Path(target_path), Path(drafter_dir), Path(out_dir)
    if not (target_path / "config.json").is_file():
        raise FileNotFoundError(f"target model folder {target_path} has no config.json")
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    drafter, export_config = load_drafter(drafter_dir, dtype=torch.float32)
    drafter = drafter.to(device).eval()
    aux_ids = aux_ids_from_export(export_config)
    _check_pair(target, drafter, aux_ids)
    embed = target.get_input_embeddings()
    eos = eos_token_ids(tokenizer, getattr(target, "generation_config", None))
    prompts = read_eval_prompts(prompts_path, num_prompts)
    encoded = [torch.tensor([render_prompt(tokenizer, p["messages"])], device=device) for p in prompts]

    # warm-up (allocator, kernels) so the first timed prompt is not penalised
    warm = min(4, max_new_tokens)
    greedy_decode(target, encoded[0], warm, eos)
    speculative_decode(target, drafter, embed, aux_ids, encoded[0], warm, num_draft_tokens, eos)

    rows: list[dict] = []
    results: list[SpecResult] = []
    mismatches: list[dict] = []
    bar = tqdm(list(zip(prompts, encoded, strict=True)), desc="evaluate", unit="prompt")
    for prompt, ids in bar:
        t0 = time.perf_counter()
        plain = greedy_decode(target, ids, max_new_tokens, eos)
        plain_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        spec = speculative_decode(target, drafter, embed, aux_ids, ids, max_new_tokens, num_draft_tokens, eos)
        spec_s = time.perf_counter() - t0
        diff = first_difference(plain, spec.tokens)
        if diff is not None:
            mismatches.append(
                {
                    "id": prompt["id"],
                    "position": diff,
                    "plain": plain[diff] if diff < len(plain) else None,
                    "speculative": spec.tokens[diff] if diff < len(spec.tokens) else None,
                }
            )
        results.append(spec)
        rows.append(
            {
                "id": prompt["id"],
                "prompt_tokens": int(ids.shape[1]),
                "plain_tokens": len(plain),
                "spec_tokens": len(spec.tokens),
                "plain_seconds": plain_s,
                "spec_seconds": spec_s,
                "plain_tokens_per_s": len(plain) / plain_s if plain_s > 0 else 0.0,
                "spec_tokens_per_s": len(spec.tokens) / spec_s if spec_s > 0 else 0.0,
                "verify_steps": spec.steps,
                "tau": spec.tau,
                "accepted": spec.accepted,
                "match": diff is None,
                "first_mismatch": diff,
            }
        )
        acc = [n for r in results for n in r.accepted]
        bar.set_postfix(tau=f"{1 + sum(acc) / max(len(acc), 1):.2f}", mismatches=len(mismatches))
    bar.close()

    summary: dict[str, Any] = {
        "target": str(target_path),
        "drafter": str(drafter_dir),
        "prompts": str(prompts_path),
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "num_draft_tokens": num_draft_tokens,
        "aux_layer_ids": aux_ids,
        "aux_layer_convention": "input",
        "target_dtype": "float32",
        "device": device,
        "threads": torch.get_num_threads(),
        "eos_token_ids": eos,
        **summarize(rows, results, num_draft_tokens),
        "lossless": not mismatches,
        "mismatches": mismatches,
        "min_tau": min_tau,
    }
    summary["gate_passed"] = bool(not mismatches and summary["tau"] >= min_tau)
    summary["per_prompt"] = rows
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "summary.json", summary)
    plot_acceptance(out_dir / "acceptance.png", summary)
    print(format_table(summary))

    if mismatches:
        first = mismatches[0]
        raise NotLossless(
            f"speculative decoding is not lossless on {len(mismatches)} of {len(prompts)} prompts; first: prompt "
            f"{first['id']!r} differs at generated position {first['position']} (plain {first['plain']}, "
            f"speculative {first['speculative']}). The target runs in float32, so this is "
            "likely a bug in draftsmith.speculate (cache crop / verify indexing); an exact float32 near-tie of "
            "the top two logits is possible but rare."
        )
    if summary["tau"] < min_tau:
        raise GateFailed(gate_message(summary["tau"], min_tau))
    return summary
