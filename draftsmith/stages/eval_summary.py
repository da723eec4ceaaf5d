"""The evaluation summary: per held-out set and method, measured offline and in vLLM.

The figure that compares methods is tokens per target forward, every decode step counted, with its
interval over prompts; beside it the share of steps that had a draft, vLLM's tau and acceptance per draft
position under their own names (counted over the steps that had a draft), the speed measured here only
where it was measured fairly (`fair: true`), and the speedup projected to the serving point
(draftsmith.core.evaluation.cost). The gate's checks and verdict (draftsmith.core.evaluation.verdict), tokens per target
forward per prompt category (MT-Bench's) and the pre-flight's lines come with it.

    summarize(...)        offline.json + vllm.json per held-out set, data_config.json, the export,
                          metrics.jsonl -> the summary dict (rows with intervals, headline, checks, verdict,
                          and the provenance the model card shows: target, data, vocabulary, training)
    summarize_files(...)  reads those files, writes summary.{json,tsv,html} and the plots (draftsmith.core.evaluation.report)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftsmith.core.config.stage_args import BAD_INPUT, arg
from draftsmith.core.config.stage_settings import GateSettings, SummarySettings
from draftsmith.core.evaluation.cost import FORMULA
from draftsmith.core.evaluation.methods import PLAIN, method, ordered
from draftsmith.core.evaluation.projection import method_projection, set_projection, summary_of
from draftsmith.core.evaluation.stats import bootstrap_ratio
from draftsmith.core.evaluation.verdict import (
    FIGURE,
    PER_DRAFT,
    PER_FORWARD,
    diagnose,
    fair_speed,
    learning_curve,
    passed,
    per_prompt_counts,
    verdict,
)


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON object from a file, or a ValueError naming the file (bad input: one line, exit 2)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise ValueError(f"{path}: not valid JSON ({type(err).__name__}: {err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object ({type(value).__name__})")
    return value


def read_metrics(path: str | Path | None) -> list[dict[str, Any]]:
    """metrics.jsonl rows (train/val/resume); [] when the file is absent."""
    if path is None or not Path(path).is_file():
        return []
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not JSON ({err})") from err
    return rows


def _measurements(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(measured by, results) of one held-out set: offline when it ran, then vLLM when it ran."""
    offline = [("offline", results["offline"])] if results.get("offline_measured", True) else []
    return offline + ([("vLLM", results["vllm"])] if results.get("vllm") else [])


def intervals(results: dict[str, Any], prompt_ids: list[str], settings: GateSettings) -> dict[str, Any]:
    """Tokens per target forward, tau and acceptance per position of one method with their bootstrap
    intervals over prompts (None without per-prompt counts)."""
    per_forward = per_prompt_counts(results, prompt_ids, PER_FORWARD)
    per_draft = per_prompt_counts(results, prompt_ids, PER_DRAFT)
    if per_forward is None or per_draft is None:
        return {"tokens_per_forward_interval": None, "tau_interval": None, "acceptance_intervals": None,
                "per_step_intervals": None}  # fmt: skip
    _, lo, hi = bootstrap_ratio(per_forward[0], per_forward[1], *settings.bootstrap)
    _, tau_lo, tau_hi = bootstrap_ratio(per_draft[0], per_draft[1], *settings.bootstrap)
    rows = {r["id"]: r for r in results["per_prompt"]}
    k = len(results["acceptance_rate_per_position"])
    per_pos, per_step = [], []
    for i in range(k):
        num = [(rows[p].get("accepted_per_pos") or [0] * k)[i] for p in prompt_ids]
        per_pos.append(list(bootstrap_ratio(num, per_draft[1], *settings.bootstrap)[1:]))
        per_step.append(list(bootstrap_ratio(num, per_forward[1], *settings.bootstrap)[1:]))
    return {
        "tokens_per_forward_interval": [lo, hi],
        "tau_interval": [1.0 + tau_lo, 1.0 + tau_hi],
        "acceptance_intervals": per_pos,
        "per_step_intervals": per_step,
    }


def _outputs(by: str, results: dict[str, Any], data: dict[str, Any]) -> str:
    """Whether a method's outputs equal plain decoding's: token for token when greedy (a sampled
    output is lossless in distribution only, not comparable prompt by prompt)."""
    if data.get("temperature", 0.0) > 0:
        return "sampled"
    if by == "offline":
        return {True: "= plain (lossless)", False: "DIFFER from plain", None: "sampled"}[results["lossless"]]
    return f"= plain on {results['outputs_equal_plain']}/{data['num_prompts']}"


def judged_by(results: dict[str, Any]) -> str:
    """Which measurement of a set is judged: vLLM's where it ran (what serving sees), else offline."""
    return "vLLM" if results.get("vllm") else "offline"


def summary_rows(
    sets: dict[str, dict[str, Any]],
    settings: GateSettings,
    projections: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The summary table: per held-out set, plain decoding and each method, offline and in vLLM. The
    judged measurement's rows carry the method's serving projection (draftsmith.core.evaluation.projection): its chosen
    draft length, tokens per target forward there and the projected speedup at each concurrency."""
    rows = []
    for heldout, results in sets.items():
        projected = (projections or {}).get(heldout) or {}
        judged = judged_by(results)
        concurrencies = projected.get("concurrency") or []
        for by, data in _measurements(results):
            rows.append({
                "heldout": heldout, "method": PLAIN.label, "key": None, "measured_by": by,
                "prompts": data["num_prompts"], "tokens": data["plain"]["tokens"],
                "forwards": data["plain"]["tokens"], "tokens_per_forward": 1.0,
                "tokens_per_forward_interval": None, "draft_share": 0.0, "k": 0,
                "projected_speedup": [1.0] * len(concurrencies) if by == judged and concurrencies else None,
                "projected_intervals": None, "tau": None, "tau_interval": None,
                "acceptance_per_position": None, "acceptance_intervals": None,
                **_speed_here(data, data["plain"]["tokens_per_s"], 1.0), "outputs": "reference",
            })  # fmt: skip
        keys = ordered(
            set(results["offline"]["methods"]) | set((results.get("vllm") or {}).get("methods", {}))
        )
        for key in keys:
            for by, data in _measurements(results):
                m = data["methods"].get(key)
                if m is None:
                    continue
                p = projected.get("methods", {}).get(key)
                mine = p is not None and (
                    p.get("measured_by") == by if p.get("projection_only") else by == judged
                )
                serving = summary_of(p) if mine else None
                rows.append({
                    "heldout": heldout, "method": method(key).label, "key": key, "measured_by": by,
                    "prompts": data["num_prompts"], "tokens": m["tokens"], "forwards": m["forwards"],
                    "tokens_per_forward": m["tokens_per_forward"],
                    **intervals(m, data["prompt_ids"], settings),
                    "draft_share": m["draft_share"],
                    "k": serving["k"] if serving else data["num_draft_tokens"],
                    "serving": serving,
                    "projected_speedup": serving["projected_speedup"] if serving else None,
                    "projected_intervals": serving["projected_intervals"] if serving else None,
                    "tau": m["tau"], "acceptance_per_position": m["acceptance_rate_per_position"],
                    "per_step_acceptance": _per_step(m),
                    **_speed_here(data, m["tokens_per_s"], m["speedup"]),
                    "outputs": _outputs(by, m, data),
                })  # fmt: skip
    return rows


def _speed_here(data: dict[str, Any], tokens_per_s: float, speedup: float) -> dict[str, Any]:
    """The speed measured here, kept only where it was measured fairly (None otherwise: not shown)."""
    fair = fair_speed(data)
    return {
        "tokens_per_s": tokens_per_s if fair else None,
        "speedup": speedup if fair else None,
        "speed_fair": fair,
    }


def category_of(prompt_id: str) -> str | None:
    """A prompt's category where its id carries one ("writing/81": MT-Bench's), else None."""
    head, sep, _ = str(prompt_id).partition("/")
    return head if sep else None


def by_category(data: dict[str, Any]) -> dict[str, Any] | None:
    """Tokens per target forward per prompt category and method (plain decoding: 1.0), from the
    per-prompt rows of one measurement; None unless its prompt ids name two categories or more."""
    categories = {p: category_of(p) for p in data.get("prompt_ids") or []}
    named = {p: c for p, c in categories.items() if c is not None}
    if len(named) < len(categories) or len(set(named.values())) < 2:
        return None
    out: dict[str, Any] = {}
    for c in dict.fromkeys(named.values()):  # in the set's order
        out[c] = {"prompts": sum(v == c for v in categories.values()), "methods": {}}
    for key in ordered(list(data.get("methods", {}))):
        counts: dict[str, list[int]] = {}
        for r in data["methods"][key].get("per_prompt") or []:
            category = named.get(r["id"])
            if category is not None:
                tokens_forwards = counts.setdefault(category, [0, 0])
                tokens_forwards[0] += int(r["tokens"])
                tokens_forwards[1] += int(r["forwards"])
        for c, (tokens, forwards) in counts.items():
            out[c]["methods"][key] = tokens / forwards if forwards else None
    return out


def _per_step(m: dict[str, Any]) -> list[float] | None:
    """Acceptance at each draft position over every decode step (the steps that did not draft count as
    rejections): what a position buys per step, comparable across methods that draft on few steps."""
    rows = m.get("per_prompt")
    per_pos: list[Any] | None
    if rows and all(r.get("accepted_per_pos") is not None for r in rows):
        per_pos = [sum(col) for col in zip(*(r["accepted_per_pos"] for r in rows), strict=True)]
        forwards = sum(r["forwards"] for r in rows)
    else:
        per_pos, forwards = m.get("accepted_per_pos"), m.get("forwards")
    if not per_pos or not forwards:
        return None
    return [a / forwards for a in per_pos]


def headline(rows: list[dict[str, Any]], sets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per held-out set, each method's tokens per target forward (with interval and the share of steps
    that drafted), its draft length and projected speedup at the serving point, tau beside it, from vLLM
    where it measured the set (what serving sees), else offline."""
    out: dict[str, Any] = {}
    for heldout, results in sets.items():
        by = judged_by(results)
        methods = {}
        for r in rows:
            if r["heldout"] == heldout and r["measured_by"] == by and r["key"]:
                methods[r["key"]] = {
                    name: r[name]
                    for name in ("tokens_per_forward", "tokens_per_forward_interval", "draft_share", "k",
                                 "projected_speedup", "projected_intervals", "tau", "tau_interval", "speedup")
                }  # fmt: skip
        out[heldout] = {"measured_by": by, "prompts": results[by.lower()]["num_prompts"], "methods": methods}
    return out


def project_sets(
    sets: dict[str, dict[str, Any]],
    serving: dict[str, Any],
    target_path: str | Path,
    drafters: Mapping[str, str | Path],
    settings: GateSettings,
) -> dict[str, dict[str, Any]]:
    """Every set's judged measurement projected to the serving point (evaluate.serving), with the serving
    policy over its concurrency grid (1, 2, 4, ... to the largest configured)."""
    from draftsmith.core.evaluation.cost import drafter_cost, serving_bytes, serving_points, target_cost
    from draftsmith.core.evaluation.policy import concurrency_grid

    bytes_per = serving_bytes(serving)
    target = target_cost(target_path, bytes_per)
    costs = {key: drafter_cost(path, bytes_per) for key, path in drafters.items()}
    out = {}
    for heldout, results in sets.items():
        data = results["vllm"] if results.get("vllm") else results["offline"]
        context = data.get("context_tokens") or _offline_context(results["offline"])
        points = serving_points(serving, context)
        grid = serving_points({**serving, "concurrency": concurrency_grid(serving)}, context)
        out[heldout] = set_projection(data, target, costs, points, settings.bootstrap, grid)
        # the hybrid (suffix decoding, else the drafter) is measured offline only: a projection, never ranked
        offline = results["offline"] if results.get("offline_measured", True) else {}
        hybrid = (offline.get("methods") or {}).get("hybrid")
        if hybrid and "eagle3" in costs:
            projected = method_projection(
                "hybrid", hybrid, int(offline["num_draft_tokens"]), target, points, costs["eagle3"],
                settings.bootstrap,
            )  # fmt: skip
            if projected is not None:
                out[heldout]["methods"]["hybrid"] = {
                    **projected,
                    "projection_only": True,
                    "measured_by": "offline",
                }
    return out


def acceptance_vs_break_even(projection: dict[str, Any] | None) -> dict[str, Any] | None:
    """The trained drafter's measured acceptance per position (given the one before) against the one
    acceptance a it must reach at every position to match the best free method (or plain decoding) at
    the first concurrency, its lowest over k (None: no k can), and its ceiling there (every draft
    accepted, its best k); None without the drafter's projection."""
    room = (projection or {}).get("drafter_room")
    if not room or projection is None:
        return None
    return {
        "position_acceptance": room["position_acceptance"],
        "break_even": room["break_even"][0],
        "ceiling": room["ceiling"][0],
        "to_beat": {"method": room["to_beat_method"][0], "speedup": room["to_beat"][0]},
        "point": projection["points"][0],
    }


def _preflight_brief(preflight: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the report shows of the pre-flight: its one line per set and whether a drafter could pay."""
    if not preflight:
        return None
    sets = list(preflight.get("sets", {}).values())
    return {
        # the serving point's projection, then this CPU's where a measured profile gave one
        "lines": [s["line"] for s in sets if s.get("line")]
        + [s["this_cpu"]["line"] for s in sets if (s.get("this_cpu") or {}).get("line")],
        "drafter_can_pay": preflight.get("drafter_can_pay"),
        "mode": preflight.get("mode"),
    }


def _offline_context(offline: dict[str, Any]) -> float:
    """Mean prompt plus half the output, from the offline measurement's per-prompt rows."""
    rows = offline.get("per_prompt") or []
    if not rows:
        return 512.0
    return sum(r.get("prompt_tokens", 0) + r.get("plain_tokens", 0) / 2 for r in rows) / len(rows)


def provenance(
    manifest: dict[str, Any],
    export_config: dict[str, Any],
    by_source: dict[str, dict[str, int]] | None = None,
    vocab: dict[str, Any] | None = None,
    prompts: dict[str, Any] | None = None,
    target: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the drafter was made from, as the model card shows it: the target (`target`: the config's
    target section), the training data (the manifest, samples and tokens per source `by_source`, the
    prompts stage's summary), the draft vocabulary (vocab_map.pt's counts) and training (the export's
    draftsmith block)."""
    training = (export_config.get("draftsmith") or {}).get("training") or {}
    run = training.get("summary") or {}
    samples = sum(r["samples"] for r in (by_source or {}).values())
    tokens = sum(r["tokens"] for r in (by_source or {}).values())
    original = (by_source or {}).get("original", {"samples": 0, "tokens": 0})
    return {
        "target": {
            **{k: (target or {}).get(k) for k in ("model", "revision", "gguf_wheel", "gguf_file")},
            "path": manifest.get("target"),
            "architecture": manifest.get("target_architecture"),
            "num_layers": manifest.get("num_layers"),
            "hidden_size": manifest.get("hidden_size"),
        },
        "data": {
            "prompt_source": (prompts or {}).get("source"),
            "conversations": (prompts or {}).get("train"),
            "heldout_prompts": (prompts or {}).get("heldout"),
            "samples": manifest.get("num_samples"),
            "tokens": manifest.get("num_tokens"),
            "masked_tokens": manifest.get("num_masked_tokens"),
            "by_source": by_source,
            "original_share": original["samples"] / samples if samples else None,
            "original_token_share": original["tokens"] / tokens if tokens else None,
            "teacher_agreement_by_source": manifest.get("teacher_agreement_by_source"),
            "aux_layer_ids": manifest.get("aux_layer_ids"),
            "storage_dtype": manifest.get("dtype"),
        },
        "vocab": {
            k: vocab[k]
            for k in (
                "draft_vocab_size",
                "target_vocab_size",
                "coverage",
                "counted_tokens",
                "distinct_tokens",
            )
            if k in vocab
        }
        if vocab
        else None,
        "training": {
            "settings": training.get("settings"),
            **{
                k: run.get(k)
                for k in (
                    "steps",
                    "epochs",
                    "trained_tokens",
                    "train_samples",
                    "val_samples",
                    "val_acc",
                    "val_agreement",
                    "device",
                    "wall_s",
                )
            },  # fmt: skip
        },
    }


def samples_by_source(manifest_path: str | Path) -> dict[str, dict[str, int]]:
    """Samples and tokens per sample source ("regenerated", "original") over the manifest's shards,
    from their headers and token offsets only."""
    from draftsmith.core.data.manifest import DataError, load_manifest
    from draftsmith.core.data.shards import ShardReader

    out: dict[str, dict[str, int]] = {}
    try:
        shards = load_manifest(manifest_path)["shards"]
    except DataError as err:  # bad input here: one line, exit 2
        raise ValueError(str(err)) from None
    for shard in shards:
        with ShardReader(shard["path"]) as reader:
            sources = reader.meta.get("sample_sources") or ["regenerated"] * len(reader)
            for i, source in enumerate(sources):
                row = out.setdefault(source, {"samples": 0, "tokens": 0})
                row["samples"] += 1
                row["tokens"] += reader.num_tokens(i)
    return dict(sorted(out.items()))


def summarize(
    sets: dict[str, dict[str, Any]],
    manifest: dict[str, Any],
    export_config: dict[str, Any],
    export_problems: list[str],
    current_fingerprint: str | None,
    metrics_rows: list[dict[str, Any]],
    settings: GateSettings,
    projections: dict[str, dict[str, Any]] | None = None,
    origin: dict[str, Any] | None = None,
    *,
    serving: dict[str, Any] | None,
    preflight_result: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the report, the gate and the model card need, in one JSON-able dict. sets: held-out
    set name -> {"offline": offline.json, "vllm": vllm.json or None}; projections: `project_sets` (the
    serving point's figures); origin: `provenance` (None: from the manifest and export alone); serving:
    evaluate.serving, as projected; preflight_result: the pre-flight's preflight.json (its lines lead
    the report)."""
    checks = diagnose(
        sets, manifest, export_config, export_problems, current_fingerprint, metrics_rows, settings,
        projections=projections,
    )  # fmt: skip
    rows = summary_rows(sets, settings, projections)
    off = next(iter(sets.values()))["offline"]
    return {
        "figure": FIGURE,
        "heldout_sets": {
            name: {
                "prompts": r["offline"]["prompts"],
                "num_prompts": (r.get("vllm") or r["offline"])["num_prompts"],
                "offline_prompts": r["offline"]["num_prompts"] if r.get("offline_measured", True) else 0,
                "max_new_tokens": r["offline"]["max_new_tokens"],
                "plain_tokens": (r.get("vllm") or r["offline"])["plain"]["tokens"],
                "vllm_measured": r.get("vllm") is not None,
                "policy": (projections or {}).get(name, {}).get("policy"),
                "acceptance_vs_break_even": acceptance_vs_break_even((projections or {}).get(name)),
                "by_category": by_category(r["vllm"] if r.get("vllm") else r["offline"]),
            }
            for name, r in sets.items()
        },
        "max_new_tokens": off["max_new_tokens"],
        "num_draft_tokens": off["num_draft_tokens"],
        "temperature": off["temperature"],
        "level": settings.level,
        "vllm_measured": any(r.get("vllm") is not None for r in sets.values()),
        "lossless": off["methods"]["eagle3"].get("lossless"),
        "headline": headline(rows, sets),
        "method_settings": _method_settings(sets),
        "projection": {
            "formula": FORMULA,
            "serving": serving,
            "points": next(iter(projections.values()))["points"] if projections else None,
            "concurrency": next(iter(projections.values()))["concurrency"] if projections else None,
            "ranking": {name: p["ranking"] for name, p in projections.items()},
        }
        if projections
        else None,
        "rows": rows,
        "speed_fair": any(r["speed_fair"] for r in rows),
        "preflight": _preflight_brief(preflight_result),
        "learning": learning_curve(metrics_rows),
        "settings": {
            "gate": settings.all_modes,
            "max_tau_gap": settings.max_tau_gap,
            "max_acc_gap": settings.max_acc_gap,
            "min_val_gain": settings.min_val_gain,
            "level": settings.level,
            "resamples": settings.resamples,
        },
        "provenance": origin if origin is not None else provenance(manifest, export_config),
        "checks": [c.to_dict() for c in checks],
        "verdict": verdict(checks, projections),
        "gate_passed": passed(checks),
    }


# ------------------------------------------------------------------------------------------- from files


def load_sets(offline: Mapping[str, str | Path], vllm: Mapping[str, str | Path]) -> dict[str, dict[str, Any]]:
    """Held-out set name -> {"offline": ..., "vllm": ... or None}, read from the files. With vLLM on, the
    offline run is the contract check on the first `evaluate.offline_num_prompts` of the prompts vLLM
    decoded: offline prompt ids that are not the first of vLLM's are an error. Without any offline
    measurement (evaluate.offline: false), vLLM's fills both places: the contract columns then compare
    vLLM with itself, which the summary says (`offline_measured`)."""
    if offline and set(vllm) - set(offline):
        raise ValueError(
            f"vLLM results for held-out set(s) {sorted(set(vllm) - set(offline))} without offline results"
        )
    sets = {}
    for name in offline or vllm:
        served = read_json_object(vllm[name]) if name in vllm else None
        if not offline:
            sets[name] = {"offline": served, "vllm": served, "offline_measured": False}
            continue
        off = read_json_object(offline[name])
        if served is not None and served["prompt_ids"][: len(off["prompt_ids"])] != off["prompt_ids"]:
            raise ValueError(f"{vllm[name]} and {offline[name]} decoded different prompts; rerun both")
        sets[name] = {"offline": off, "vllm": served, "offline_measured": True}
    return sets


def summarize_files(
    offline: Mapping[str, str | Path],
    vllm: Mapping[str, str | Path],
    manifest_path: str | Path,
    drafter: str | Path,
    target_path: str | Path,
    metrics: str | Path | None,
    out: str | Path,
    settings: GateSettings,
    serving: dict[str, Any] | None,
    vocab_path: str | Path | None = None,
    prompts_summary: str | Path | None = None,
    target_source: dict[str, Any] | None = None,
    preflight_json: str | Path | None = None,
) -> dict[str, Any]:
    """Load the evaluation's inputs, summarise, and write summary.{json,tsv,html} and the plots to out
    (training writes its TensorBoard curves itself, as it goes). The vocabulary map, the prompts
    stage's summary and the config's target section (`target_source`) go into the provenance; the
    pre-flight's preflight.json (`preflight_json`), where it exists, leads the report."""
    from draftsmith.core.data.chat import template_fingerprint
    from draftsmith.core.evaluation.report import write_report
    from draftsmith.core.export.formats import check_against_target
    from draftsmith.core.model.target import load_tokenizer

    sets = load_sets(offline, vllm)
    manifest = read_json_object(manifest_path)
    export_config = read_json_object(Path(drafter) / "config.json")
    problems = check_against_target(drafter, target_path)
    fingerprint = template_fingerprint(load_tokenizer(target_path))
    rows = read_metrics(metrics)
    drafters = {"eagle3": drafter}
    untrained = _untrained_export(sets)
    if untrained:
        drafters["untrained"] = untrained
    projections = project_sets(sets, serving, target_path, drafters, settings) if serving else None
    vocab = None
    if vocab_path is not None:
        from draftsmith.core.data.vocab import load_vocab_map

        vocab = {k: v for k, v in load_vocab_map(vocab_path).items() if not hasattr(v, "shape")}
    prompts = read_json_object(prompts_summary) if prompts_summary else None
    origin = provenance(
        manifest, export_config, samples_by_source(manifest_path), vocab, prompts, target_source
    )
    summary = summarize(
        sets, manifest, export_config, problems, fingerprint, rows, settings, projections, origin,
        serving=serving, preflight_result=_read_optional(preflight_json),
    )  # fmt: skip
    write_report(out, summary, rows)
    return summary


def _read_optional(path: str | Path | None) -> dict[str, Any] | None:
    """A JSON input that may not exist (the pre-flight does not run without vLLM)."""
    if path is None or not Path(path).is_file():
        return None
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _untrained_export(sets: dict[str, dict[str, Any]]) -> str | None:
    """The untrained drafter's export folder as the measurement recorded it, if it still exists."""
    for results in sets.values():
        for data in (results.get("vllm"), results.get("offline")):
            path = ((data or {}).get("methods", {}).get("untrained") or {}).get("drafter")
            if path and Path(path).is_dir():
                return path
    return None


def _method_settings(sets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The free methods' settings as measured (what their serve commands must repeat)."""
    out: dict[str, Any] = {}
    for results in sets.values():
        data = results.get("vllm") or results.get("offline") or {}
        for key, m in data.get("methods", {}).items():
            if m.get("settings"):
                out.setdefault(key, m["settings"])
    return out


@dataclasses.dataclass
class SummaryPaths:
    offline: dict[str, str] = arg(
        "--offline",
        "offline.json of a held-out set (repeat per set; the first set's speed is judged). Without any, "
        "vLLM's measurement alone fills the summary (evaluate.offline: false).",
        kind="named",
    )
    vllm: dict[str, str] = arg("--vllm", "vllm.json of a held-out set, if measured.", kind="named")
    manifest: str = arg("--manifest", "data_config.json (the manifest stage's).", required=True, exists=True)
    drafter: str = arg("--drafter", "The trained drafter export.", kind="dir", required=True, exists=True)
    target: str = arg("--target", "Target model folder.", kind="dir", required=True, exists=True)
    metrics: str | None = arg("--metrics", "Training metrics.jsonl.")
    out: str = arg("--out", "Folder for tables and plots.", kind="dir", required=True)
    vocab: str | None = arg(
        "--vocab", "vocab_map.pt: the draft vocabulary's size and coverage, for the model card.", exists=True
    )
    prompts_summary: str | None = arg(
        "--prompts-summary",
        "The prompts stage's summary.json: where the training prompts came from, for the model card.",
        exists=True,
    )
    preflight_json: str | None = arg(
        "--preflight-json",
        "The pre-flight's preflight.json: its lines lead summary.html. Skipped where it does not exist.",
    )
    target_source: dict[str, Any] | None = arg(
        "--target-source",
        "The config's target section (model, revision, gguf_wheel, gguf_file) as JSON: what the model "
        "card names as the target.",
        kind="json",
    )


Settings, Paths = SummarySettings, SummaryPaths
EXITS = {ValueError: BAD_INPUT}  # a junk input file included: one line naming it


def run(paths: SummaryPaths, settings: SummarySettings) -> list[str]:
    """Summary table with intervals, diagnosis, verdict and plots of an evaluation on one or more held-out
    sets: summary.{json,tsv,html}, training.png, acceptance.png, per_forward.png. Never fails on the
    verdict; `draftsmith gate` does."""
    from draftsmith.core.evaluation.report import format_verdict

    if not paths.offline and not paths.vllm:
        raise ValueError("give each held-out set's --offline or --vllm measurement (or both)")
    for path in [*paths.offline.values(), *paths.vllm.values()]:
        if not Path(path).is_file():
            raise ValueError(f"--offline/--vllm: {path} does not exist")
    summary = summarize_files(
        paths.offline, paths.vllm, paths.manifest, paths.drafter, paths.target, paths.metrics, paths.out,
        settings.gate_settings(), settings.serving, vocab_path=paths.vocab,
        prompts_summary=paths.prompts_summary, target_source=paths.target_source,
        preflight_json=paths.preflight_json,
    )  # fmt: skip
    gate = "passes" if summary["gate_passed"] else "FAILS"
    return [format_verdict(summary["verdict"]), f"summary written to {paths.out}; gate {gate}"]
