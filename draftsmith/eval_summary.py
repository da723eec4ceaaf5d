"""The evaluation summary: one table (offline and vLLM, drafter and baselines), the diagnosis, and the
plots that `snakemake --report` shows.

    summarize(...)        offline.json + vllm.json + data_config.json + export + metrics.jsonl
                          -> summary dict (rows, checks, gate verdict)
    write_summary(...)    summary.json, summary.tsv, summary.html (the table for the report)
    plot_training         loss and per-TTT-step accuracy during training, validation points
    plot_acceptance       acceptance per draft position, drafter / untrained / n-gram, offline and vLLM
    plot_tau_speedup      tau and speedup bars with the gate's thresholds
    format_table          the table as text, printed at the end of the run

Plots use matplotlib's Agg canvas directly: no display, no global pyplot state.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_path, write_json, write_text
from draftsmith.gate import Check, Thresholds, diagnose, passed

LABELS = {"eagle3": "trained drafter", "untrained": "untrained drafter", "ngram": "n-gram lookup"}
SHORT = {"eagle3": "trained", "untrained": "untrained", "ngram": "n-gram"}
METHOD_ORDER = ("eagle3", "untrained", "ngram")
ENGINE_COLORS = {"offline": ("tab:blue", "tab:cyan"), "vLLM": ("tab:orange", "gold")}
METHOD_COLORS = {"eagle3": "tab:green", "untrained": "tab:gray", "ngram": "tab:purple"}


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


def _methods(offline: dict[str, Any], vllm: dict[str, Any] | None) -> list[str]:
    names = set(offline["methods"]) | set((vllm or {}).get("methods", {}))
    return [m for m in METHOD_ORDER if m in names] + sorted(names - set(METHOD_ORDER))


def summary_rows(offline: dict[str, Any], vllm: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The summary table: plain decoding and each method, per engine."""
    rows = []
    engines = [("offline", offline)] + ([("vLLM", vllm)] if vllm else [])
    for engine, data in engines:
        plain = data["plain"]
        rows.append({"method": "plain decoding", "engine": engine, "tau": None, "acceptance_per_position": None,
                     "tokens_per_s": plain["tokens_per_s"], "speedup": 1.0, "outputs": "reference"})  # fmt: skip
    for name in _methods(offline, vllm):
        for engine, data in engines:
            m = data["methods"].get(name)
            if m is None:
                continue
            if engine == "offline":
                outputs = {True: "= plain (lossless)", False: "DIFFER from plain", None: "sampled"}[
                    m["lossless"]
                ]
            else:
                outputs = f"= plain on {m['outputs_equal_plain']}/{data['num_prompts']}"
            rows.append(
                {
                    "method": LABELS.get(name, name),
                    "engine": engine,
                    "tau": m["tau"],
                    "acceptance_per_position": m["acceptance_rate_per_position"],
                    "tokens_per_s": m["tokens_per_s"],
                    "speedup": m["speedup"],
                    "outputs": outputs,
                }
            )
    return rows


def summarize(
    offline: dict[str, Any],
    vllm: dict[str, Any] | None,
    manifest: dict[str, Any],
    export_config: dict[str, Any],
    export_problems: list[str],
    current_fingerprint: str | None,
    metrics_rows: list[dict[str, Any]],
    thresholds: Thresholds,
) -> dict[str, Any]:
    """Everything the report and the gate need, in one JSON-able dict."""
    from draftsmith.gate import training_accuracy

    checks = diagnose(
        offline, vllm, manifest, export_config, export_problems, current_fingerprint, metrics_rows, thresholds
    )
    off = offline["methods"]["eagle3"]
    served = (vllm or {}).get("methods", {}).get("eagle3")
    return {
        "num_prompts": offline["num_prompts"],
        "max_new_tokens": offline["max_new_tokens"],
        "num_draft_tokens": offline["num_draft_tokens"],
        "temperature": offline["temperature"],
        "vllm_measured": vllm is not None,
        "headline": {
            "offline_tau": off["tau"],
            "vllm_tau": served["tau"] if served else None,
            "offline_acceptance_per_position": off["acceptance_rate_per_position"],
            "vllm_acceptance_per_position": served["acceptance_rate_per_position"] if served else None,
            "offline_speedup": off["speedup"],
            "vllm_speedup": served["speedup"] if served else None,
            "lossless": off["lossless"],
        },
        "rows": summary_rows(offline, vllm),
        "training": training_accuracy(metrics_rows),
        "thresholds": {
            "min_tau": thresholds.min_tau,
            "min_speedup": thresholds.min_speedup,
            "max_tau_gap": thresholds.max_tau_gap,
            "max_acc_gap": thresholds.max_acc_gap,
        },
        "checks": [c.to_dict() for c in checks],
        "gate_passed": passed(checks),
    }


def checks_of(summary: dict[str, Any]) -> list[Check]:
    return [Check(**c) for c in summary["checks"]]


# ----------------------------------------------------------------------------------------------- tables


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if key == "acceptance_per_position":
        return " ".join(f"{v:.2f}" for v in value)
    if key == "tau":
        return f"{value:.3f}"
    if key == "tokens_per_s":
        return f"{value:.1f}"
    if key == "speedup":
        return f"{value:.2f}x"
    return str(value)


COLUMNS = [
    ("method", "method"),
    ("engine", "engine"),
    ("tau", "tau"),
    ("acceptance_per_position", "acceptance per position"),
    ("tokens_per_s", "tokens/s"),
    ("speedup", "speedup"),
    ("outputs", "outputs"),
]


def format_table(summary: dict[str, Any]) -> str:
    """The summary table as aligned text."""
    header = [title for _, title in COLUMNS]
    body = [[_cell(r[k], k) for k, _ in COLUMNS] for r in summary["rows"]]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(lines)


def format_tsv(summary: dict[str, Any]) -> str:
    header = "\t".join(title for _, title in COLUMNS)
    body = ["\t".join(_cell(r[k], k) for k, _ in COLUMNS) for r in summary["rows"]]
    return "\n".join([header, *body]) + "\n"


def format_html(summary: dict[str, Any]) -> str:
    """A self-contained HTML page: the summary table and the diagnosis (Snakemake's report embeds it)."""
    from draftsmith.gate import order_checks

    def table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    results = table(
        [title for _, title in COLUMNS], [[_cell(r[k], k) for k, _ in COLUMNS] for r in summary["rows"]]
    )
    checks = order_checks(checks_of(summary))
    diagnosis = table(
        ["check", "status", "value", "threshold", "where to look"],
        [
            [c.name, c.status.upper(), c.value, c.threshold, c.where if c.status != "pass" else ""]
            for c in checks
        ],
    )
    verdict = "PASSED" if summary["gate_passed"] else "FAILED"
    style = (
        "body{font-family:sans-serif;font-size:14px}table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #bbb;padding:3px 8px;text-align:left}th{background:#eee}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>draftsmith evaluation</title>"
        f"<style>{style}</style></head><body>"
        f"<h2>Evaluation: {summary['num_prompts']} held-out prompts, {summary['max_new_tokens']} new tokens, "
        f"{summary['num_draft_tokens']} draft tokens, temperature {summary['temperature']}</h2>{results}"
        f"<h2>Gate: {verdict}</h2>{diagnosis}</body></html>\n"
    )


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> None:
    out_dir = Path(out_dir)
    write_json(out_dir / "summary.json", summary)
    write_text(out_dir / "summary.tsv", format_tsv(summary))
    write_text(out_dir / "summary.html", format_html(summary))


# ----------------------------------------------------------------------------------------------- plots


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def plot_training(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Left: training loss per step, validation loss per epoch. Right: top-1 accuracy per TTT step."""
    fig = _figure(11, 4)
    left, right = fig.subplots(1, 2)
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    if not train:
        for ax in (left, right):
            ax.text(0.5, 0.5, "no training metrics", ha="center", va="center", transform=ax.transAxes)
        _save(fig, path)
        return
    steps = [r["step"] for r in train]
    left.plot(steps, [r["loss"] for r in train], color="tab:blue", lw=1, label="train (weighted TTT loss)")
    if val:
        left.plot(
            [r["step"] for r in val], [r["loss"] for r in val], "o", color="tab:red", label="validation"
        )
    left.set_xlabel("optimizer step")
    left.set_ylabel("loss")
    left.set_title("training loss")
    left.legend(fontsize=8)
    ttt = max(len(r.get("acc") or []) for r in train)
    cmap = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink"]
    for j in range(ttt):
        color = cmap[j % len(cmap)]
        pts = [
            (r["step"], r["acc"][j]) for r in train if len(r.get("acc") or []) > j and r["acc"][j] is not None
        ]
        if pts:
            right.plot(*zip(*pts, strict=True), color=color, lw=1, alpha=0.8, label=f"train step {j}")
        vpts = [
            (r["step"], r["acc"][j]) for r in val if len(r.get("acc") or []) > j and r["acc"][j] is not None
        ]
        if vpts:
            right.plot(*zip(*vpts, strict=True), "o", color=color, label=f"val step {j}")
    right.set_ylim(0, 1.02)
    right.set_xlabel("optimizer step")
    right.set_ylabel("top-1 accuracy vs the target's token")
    right.set_title("accuracy per TTT step (step j = draft position j+1)")
    right.legend(fontsize=7, ncol=2)
    _save(fig, path)


def _series(offline: dict[str, Any], vllm: dict[str, Any] | None) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for name in _methods(offline, vllm):
        for engine, data in [("offline", offline), ("vLLM", vllm)]:
            if data and name in data["methods"]:
                out.append((name, engine, data["methods"][name]))
    return out


def plot_acceptance(path: str | Path, offline: dict[str, Any], vllm: dict[str, Any] | None) -> None:
    """Acceptance rate per draft position (accepted at position i / drafts) for every method and engine."""
    fig = _figure(10, 4.2)
    ax = fig.subplots(1, 1)
    series = _series(offline, vllm)
    k = offline["num_draft_tokens"]
    width = 0.8 / max(len(series), 1)
    for s, (name, engine, m) in enumerate(series):
        xs = [i + 1 - 0.4 + width * (s + 0.5) for i in range(k)]
        rates = m["acceptance_rate_per_position"]
        hatch = "" if engine == "offline" else "//"
        ax.bar(xs, rates, width, color=METHOD_COLORS.get(name, "tab:olive"), hatch=hatch, edgecolor="black",
               lw=0.5, label=f"{LABELS.get(name, name)} ({engine})")  # fmt: skip
        for x, r in zip(xs, rates, strict=True):
            ax.text(x, r + 0.01, f"{r:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(1, k + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (first i drafts all accepted)")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"acceptance per position, {offline['num_prompts']} held-out prompts (hatched: vLLM)")
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def plot_tau_speedup(
    path: str | Path, offline: dict[str, Any], vllm: dict[str, Any] | None, min_tau: float, min_speedup: float
) -> None:
    """Left: tau per method and engine with min_tau. Right: speedup over plain decoding with min_speedup."""
    fig = _figure(11, 4)
    left, right = fig.subplots(1, 2)
    series = _series(offline, vllm)
    labels = [f"{SHORT.get(n, n)}\n{e}" for n, e, _ in series]
    colors = [METHOD_COLORS.get(n, "tab:olive") for n, _, _ in series]
    hatches = ["" if e == "offline" else "//" for _, e, _ in series]
    xs = list(range(len(series)))
    for ax, key, line, title in [
        (left, "tau", min_tau, "mean acceptance length tau"),
        (right, "speedup", min_speedup, "speedup over plain decoding (tokens/s ratio)"),
    ]:
        values = [m[key] for _, _, m in series]
        for x, v, c, h in zip(xs, values, colors, hatches, strict=True):
            ax.bar(x, v, color=c, hatch=h, edgecolor="black", lw=0.5)
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(line, color="tab:red", ls="--", lw=1, label=f"gate minimum {line}")
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7)
    _save(fig, path)


# ------------------------------------------------------------------------------------------- from files


def summarize_files(
    offline: str | Path,
    vllm_path: str | Path | None,
    manifest_path: str | Path,
    drafter: str | Path,
    target_path: str | Path,
    metrics: str | Path | None,
    out: str | Path,
    min_tau: float,
    min_speedup: float,
    max_tau_gap: float | None,
    max_acc_gap: float,
) -> dict[str, Any]:
    """Load the evaluation's inputs, summarise, and write summary.{json,tsv,html} and the plots to out."""
    from draftsmith.chat import template_fingerprint
    from draftsmith.export import check_export
    from draftsmith.target import load_tokenizer, text_config_dict

    offline_data = json.loads(Path(offline).read_text(encoding="utf-8"))
    vllm_data = json.loads(Path(vllm_path).read_text(encoding="utf-8")) if vllm_path else None
    manifest = json.loads(Path(manifest_path).read_text(encoding="utf-8"))
    export_config = json.loads((Path(drafter) / "config.json").read_text(encoding="utf-8"))
    target_config = text_config_dict(target_path)
    problems = check_export(
        drafter,
        target_num_layers=target_config.get("num_hidden_layers"),
        target_vocab_size=target_config.get("vocab_size"),
    )
    fingerprint = template_fingerprint(load_tokenizer(target_path))
    rows = read_metrics(metrics)
    thresholds = Thresholds(min_tau, min_speedup, max_tau_gap, max_acc_gap)
    summary = summarize(
        offline_data, vllm_data, manifest, export_config, problems, fingerprint, rows, thresholds
    )
    out = Path(out)
    write_summary(out, summary)
    plot_training(out / "training.png", rows)
    plot_acceptance(out / "acceptance.png", offline_data, vllm_data)
    plot_tau_speedup(out / "tau_speedup.png", offline_data, vllm_data, min_tau, min_speedup)
    return summary
