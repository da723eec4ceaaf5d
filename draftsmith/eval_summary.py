"""The evaluation summary: one table per held-out set (trained drafter, untrained drafter, n-gram lookup;
offline and in vLLM) with 95% intervals over prompts, the gate's checks and verdict, the plots that
`snakemake --report` shows, and TensorBoard event files.

    summarize(...)          per held-out set offline.json + vllm.json, data_config.json, the export,
                            metrics.jsonl -> summary dict (rows with intervals, checks, verdict)
    write_summary(...)      summary.json, summary.tsv, summary.html (the verdict first, then the table)
    plot_training           loss and per-TTT-step accuracy during training, validation points
    plot_acceptance         acceptance per draft position with intervals, per held-out set
    plot_tau_speedup        tau with intervals per method and held-out set; speedup over plain decoding
    write_tensorboard       training curves and evaluation results under results/tensorboard/<run>/
    format_table            the table as text, printed at the end of the run

Plots use matplotlib's Agg canvas directly: no display, no global pyplot state.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_dir, atomic_path, write_json, write_text
from draftsmith.gate import (
    Check,
    GateSettings,
    bootstrap_rate,
    diagnose,
    format_verdict,
    learning_curve,
    order_checks,
    passed,
    per_prompt_counts,
    verdict,
)

LABELS = {"eagle3": "trained drafter", "untrained": "untrained drafter", "ngram": "n-gram lookup"}
SHORT = {"eagle3": "trained", "untrained": "untrained", "ngram": "n-gram"}
METHOD_ORDER = ("eagle3", "untrained", "ngram")
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


def _methods(results: dict[str, Any]) -> list[str]:
    names = set(results["offline"]["methods"]) | set((results.get("vllm") or {}).get("methods", {}))
    return [m for m in METHOD_ORDER if m in names] + sorted(names - set(METHOD_ORDER))


def _engines(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("offline", results["offline"])] + ([("vLLM", results["vllm"])] if results.get("vllm") else [])


def intervals(method: dict[str, Any], prompt_ids: list[str], settings: GateSettings) -> dict[str, Any]:
    """tau and acceptance per position with their bootstrap intervals over prompts (None without
    per-prompt counts)."""
    counts = per_prompt_counts(method, prompt_ids)
    if counts is None:
        return {"tau_interval": None, "acceptance_intervals": None}
    accepted, drafts = counts
    args = (settings.level, settings.resamples, settings.seed)
    _, lo, hi = bootstrap_rate(accepted, drafts, *args)
    rows = {r["id"]: r for r in method["per_prompt"]}
    k = len(method["acceptance_rate_per_position"])
    per_pos = []
    for i in range(k):
        num = [(rows[p].get("accepted_per_pos") or [0] * k)[i] for p in prompt_ids]
        per_pos.append(list(bootstrap_rate(num, drafts, *args)[1:]))
    return {"tau_interval": [1.0 + lo, 1.0 + hi], "acceptance_intervals": per_pos}


def summary_rows(sets: dict[str, dict[str, Any]], settings: GateSettings) -> list[dict[str, Any]]:
    """The summary table: per held-out set, plain decoding and each method, per engine."""
    rows = []
    for heldout, results in sets.items():
        for engine, data in _engines(results):
            rows.append({"heldout": heldout, "method": "plain decoding", "engine": engine,
                         "prompts": data["num_prompts"], "tokens": data["plain"]["tokens"], "tau": None,
                         "tau_interval": None, "acceptance_per_position": None, "acceptance_intervals": None,
                         "tokens_per_s": data["plain"]["tokens_per_s"], "speedup": 1.0,
                         "outputs": "reference"})  # fmt: skip
        for name in _methods(results):
            for engine, data in _engines(results):
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
                        "heldout": heldout,
                        "method": LABELS.get(name, name),
                        "key": name,
                        "engine": engine,
                        "prompts": data["num_prompts"],
                        "tokens": m["tokens"],
                        "tau": m["tau"],
                        **intervals(m, data["prompt_ids"], settings),
                        "acceptance_per_position": m["acceptance_rate_per_position"],
                        "tokens_per_s": m["tokens_per_s"],
                        "speedup": m["speedup"],
                        "outputs": outputs,
                    }
                )
    return rows


def summarize(
    sets: dict[str, dict[str, Any]],
    manifest: dict[str, Any],
    export_config: dict[str, Any],
    export_problems: list[str],
    current_fingerprint: str | None,
    metrics_rows: list[dict[str, Any]],
    settings: GateSettings,
) -> dict[str, Any]:
    """Everything the report and the gate need, in one JSON-able dict. sets: held-out set name ->
    {"offline": offline.json, "vllm": vllm.json or None}."""
    checks = diagnose(
        sets, manifest, export_config, export_problems, current_fingerprint, metrics_rows, settings
    )
    rows = summary_rows(sets, settings)
    first_name, first = next(iter(sets.items()))
    off = first["offline"]
    judged = [r for r in rows if r["heldout"] == first_name and r.get("key") == "eagle3"]
    served = next((r for r in judged if r["engine"] == "vLLM"), None)
    offline_row = next(r for r in judged if r["engine"] == "offline")
    return {
        "heldout_sets": {
            name: {
                "prompts": r["offline"]["prompts"],
                "num_prompts": r["offline"]["num_prompts"],
                "max_new_tokens": r["offline"]["max_new_tokens"],
                "plain_tokens": r["offline"]["plain"]["tokens"],
                "vllm_measured": r.get("vllm") is not None,
            }
            for name, r in sets.items()
        },
        "num_prompts": off["num_prompts"],
        "max_new_tokens": off["max_new_tokens"],
        "num_draft_tokens": off["num_draft_tokens"],
        "temperature": off["temperature"],
        "level": settings.level,
        "vllm_measured": first.get("vllm") is not None,
        "headline": {
            "heldout": first_name,
            "offline_tau": offline_row["tau"],
            "offline_tau_interval": offline_row["tau_interval"],
            "vllm_tau": served["tau"] if served else None,
            "vllm_tau_interval": served["tau_interval"] if served else None,
            "offline_acceptance_per_position": offline_row["acceptance_per_position"],
            "vllm_acceptance_per_position": served["acceptance_per_position"] if served else None,
            "offline_speedup": offline_row["speedup"],
            "vllm_speedup": served["speedup"] if served else None,
            "lossless": off["methods"]["eagle3"]["lossless"],
        },
        "rows": rows,
        "learning": learning_curve(metrics_rows),
        "settings": {
            "gate": settings.modes,
            "max_tau_gap": settings.max_tau_gap,
            "max_acc_gap": settings.max_acc_gap,
            "min_val_gain": settings.min_val_gain,
            "level": settings.level,
            "resamples": settings.resamples,
        },
        "checks": [c.to_dict() for c in checks],
        "verdict": verdict(checks),
        "gate_passed": passed(checks),
    }


def checks_of(summary: dict[str, Any]) -> list[Check]:
    return [Check(**c) for c in summary["checks"]]


# ----------------------------------------------------------------------------------------------- tables


def _half(interval: list[float] | None) -> float | None:
    return None if interval is None else (interval[1] - interval[0]) / 2


def _cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if key == "acceptance_per_position":
        ivs = row.get("acceptance_intervals") or [None] * len(value)
        return " ".join(
            f"{v:.2f}" + (f"±{_half(iv):.2f}" if iv else "") for v, iv in zip(value, ivs, strict=True)
        )
    if key == "tau":
        iv = row.get("tau_interval")
        return f"{value:.3f}" + (f" ± {_half(iv):.3f} [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else "")
    if key == "tokens_per_s":
        return f"{value:.1f}"
    if key == "speedup":
        return f"{value:.2f}x"
    return str(value)


COLUMNS = [
    ("heldout", "held-out set"),
    ("method", "method"),
    ("engine", "engine"),
    ("prompts", "prompts"),
    ("tokens", "tokens"),
    ("tau", "tau ± 95% [interval]"),
    ("acceptance_per_position", "acceptance per position ± 95%"),
    ("tokens_per_s", "tokens/s"),
    ("speedup", "speedup"),
    ("outputs", "outputs"),
]


def format_table(summary: dict[str, Any]) -> str:
    """The summary table as aligned text."""
    header = [title for _, title in COLUMNS]
    body = [[_cell(r, k) for k, _ in COLUMNS] for r in summary["rows"]]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(lines)


def format_tsv(summary: dict[str, Any]) -> str:
    header = "\t".join(title for _, title in COLUMNS)
    body = ["\t".join(_cell(r, k) for k, _ in COLUMNS) for r in summary["rows"]]
    return "\n".join([header, *body]) + "\n"


def format_html(summary: dict[str, Any]) -> str:
    """A self-contained HTML page: the verdict, the summary table and the diagnosis (Snakemake's report
    embeds it)."""

    def table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    results = table(
        [title for _, title in COLUMNS], [[_cell(r, k) for k, _ in COLUMNS] for r in summary["rows"]]
    )
    checks = order_checks(checks_of(summary))
    diagnosis = table(
        ["check", "status", "value", "threshold", "where to look"],
        [[c.name, c.status.upper(), c.value, c.threshold, c.where if c.missed else ""] for c in checks],
    )
    gate = "PASSED" if summary["gate_passed"] else "FAILED"
    style = (
        "body{font-family:sans-serif;font-size:14px}table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #bbb;padding:3px 8px;text-align:left}th{background:#eee}"
    )
    sets = ", ".join(
        f"{name}: {s['num_prompts']} prompts, {s['plain_tokens']} tokens"
        for name, s in summary["heldout_sets"].items()
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>draftsmith evaluation</title>"
        f"<style>{style}</style></head><body>"
        f"<h2>Verdict</h2><pre>{html.escape(format_verdict(summary['verdict']))}</pre>"
        f"<h2>Evaluation: {html.escape(sets)}; up to {summary['max_new_tokens']} new tokens, "
        f"{summary['num_draft_tokens']} draft tokens, temperature {summary['temperature']}; "
        f"intervals: {summary['level']:.0%} bootstrap over prompts</h2>{results}"
        f"<h2>Gate: {gate}</h2>{diagnosis}</body></html>\n"
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
        apts = [
            (r["step"], r["agreement"][j])
            for r in val
            if len(r.get("agreement") or []) > j and r["agreement"][j] is not None
        ]
        if apts:
            right.plot(
                *zip(*apts, strict=True), "o", mfc="none", color=color, label=f"val step {j}, agreement"
            )
    right.set_ylim(0, 1.02)
    right.set_xlabel("optimizer step")
    right.set_ylabel("top-1 accuracy (filled: the data's token; hollow: the target's top-1)")
    right.set_title("accuracy per TTT step (step j = draft position j+1)")
    right.legend(fontsize=7, ncol=2)
    _save(fig, path)


def _method_rows(summary: dict[str, Any], heldout: str) -> list[dict[str, Any]]:
    return [r for r in summary["rows"] if r["heldout"] == heldout and r.get("key")]


def _err(value: float, interval: list[float] | None) -> tuple[float, float]:
    """(below, above) error-bar lengths; zero without an interval."""
    if interval is None:
        return 0.0, 0.0
    return max(value - interval[0], 0.0), max(interval[1] - value, 0.0)


def plot_acceptance(path: str | Path, summary: dict[str, Any]) -> None:
    """Acceptance rate per draft position with its interval, per method and engine, one panel per
    held-out set."""
    sets = list(summary["heldout_sets"])
    fig = _figure(10, 3.8 * len(sets))
    axes = fig.subplots(len(sets), 1, squeeze=False)[:, 0]
    k = summary["num_draft_tokens"]
    for ax, heldout in zip(axes, sets, strict=True):
        series = _method_rows(summary, heldout)
        width = 0.8 / max(len(series), 1)
        for s, r in enumerate(series):
            xs = [i + 1 - 0.4 + width * (s + 0.5) for i in range(k)]
            rates = r["acceptance_per_position"]
            ivs = r.get("acceptance_intervals") or [None] * k
            errs = [_err(v, iv) for v, iv in zip(rates, ivs, strict=True)]
            ax.bar(xs, rates, width, yerr=list(zip(*errs, strict=True)), capsize=2,
                   color=METHOD_COLORS.get(r["key"], "tab:olive"), hatch="" if r["engine"] == "offline" else "//",
                   edgecolor="black", lw=0.5, label=f"{r['method']} ({r['engine']})")  # fmt: skip
        ax.set_xticks(range(1, k + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.1)
        info = summary["heldout_sets"][heldout]
        ax.set_title(f"{heldout}: acceptance per position, {info['num_prompts']} prompts "
                     f"({summary['level']:.0%} intervals over prompts; hatched: vLLM)")  # fmt: skip
        ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def plot_tau_speedup(path: str | Path, summary: dict[str, Any]) -> None:
    """Left: tau with its interval per method, engine and held-out set. Right: speedup over plain
    decoding (judged only on the hardware where speculation can pay; see the speedup check)."""
    fig = _figure(12, 4.2)
    left, right = fig.subplots(1, 2)
    labels, x = [], 0
    ticks = []
    for heldout in summary["heldout_sets"]:
        for r in _method_rows(summary, heldout):
            color = METHOD_COLORS.get(r["key"], "tab:olive")
            hatch = "" if r["engine"] == "offline" else "//"
            below, above = _err(r["tau"], r.get("tau_interval"))
            left.bar(x, r["tau"], yerr=[[below], [above]], capsize=3, color=color, hatch=hatch,
                     edgecolor="black", lw=0.5)  # fmt: skip
            left.text(x, r["tau"] + above, f"{r['tau']:.2f}", ha="center", va="bottom", fontsize=7)
            right.bar(x, r["speedup"], color=color, hatch=hatch, edgecolor="black", lw=0.5)
            right.text(x, r["speedup"], f"{r['speedup']:.2f}", ha="center", va="bottom", fontsize=7)
            ticks.append(x)
            labels.append(f"{SHORT.get(r['key'], r['key'])}\n{r['engine']}\n{heldout}")
            x += 1
        x += 0.6  # a gap between held-out sets
    for ax, title in [(left, f"mean acceptance length tau ({summary['level']:.0%} interval over prompts)"),
                      (right, "speedup over plain decoding (tokens/s ratio)")]:  # fmt: skip
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_title(title, fontsize=9)
    _save(fig, path)


# ------------------------------------------------------------------------------------------ tensorboard


def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def write_tensorboard(log_dir: str | Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> bool:
    """Training curves (loss, accuracy per TTT step) and the evaluation (tau with its interval and
    acceptance per position, per held-out set, method and engine; the verdict as text) as TensorBoard
    event files in log_dir, which is replaced whole. False when the optional tensorboard extra is not
    installed."""
    if not tensorboard_available():
        return False
    from torch.utils.tensorboard import SummaryWriter

    with atomic_dir(log_dir) as tmp:
        writer = SummaryWriter(log_dir=str(tmp))
        last = 0
        for r in rows:
            kind = r.get("kind")
            if kind not in ("train", "val") or r.get("step") is None:
                continue
            step = last = int(r["step"])
            if r.get("loss") is not None:
                writer.add_scalar(f"{kind}/loss", r["loss"], step)
            for j, a in enumerate(r.get("acc") or []):
                if a is not None:
                    writer.add_scalar(f"{kind}/accuracy_ttt_step_{j}", a, step)
            for j, a in enumerate(r.get("agreement") or []):
                if a is not None:
                    writer.add_scalar(f"{kind}/agreement_ttt_step_{j}", a, step)
        for r in summary["rows"]:
            if not r.get("key"):
                continue
            tag = f"eval_{r['heldout']}/{r['key']}_{r['engine']}"
            writer.add_scalar(f"{tag}/tau", r["tau"], last)
            if r.get("tau_interval"):
                writer.add_scalar(f"{tag}/tau_low", r["tau_interval"][0], last)
                writer.add_scalar(f"{tag}/tau_high", r["tau_interval"][1], last)
            for i, a in enumerate(r["acceptance_per_position"]):
                writer.add_scalar(f"{tag}/acceptance_position_{i + 1}", a, last)
            writer.add_scalar(f"{tag}/speedup", r["speedup"], last)
        writer.add_text("verdict", "```\n" + format_verdict(summary["verdict"]) + "\n```", last)
        writer.close()
        for f in Path(tmp).rglob("*"):
            if f.is_file():
                f.chmod(0o644)
    return True


# ------------------------------------------------------------------------------------------- from files


def load_sets(offline: dict[str, str | Path], vllm: dict[str, str | Path]) -> dict[str, dict[str, Any]]:
    """Held-out set name -> {"offline": ..., "vllm": ... or None}, read from the files. With vLLM on, the
    offline run is the contract check on the first `evaluate.offline_num_prompts` of the prompts vLLM
    decoded: a vLLM result without an offline one, or offline prompt ids that are not the first of
    vLLM's, is an error."""
    extra = sorted(set(vllm) - set(offline))
    if extra:
        raise ValueError(f"vLLM results for held-out set(s) {extra} without offline results")
    sets = {}
    for name, path in offline.items():
        off = json.loads(Path(path).read_text(encoding="utf-8"))
        served = json.loads(Path(vllm[name]).read_text(encoding="utf-8")) if name in vllm else None
        if served is not None and served["prompt_ids"][: len(off["prompt_ids"])] != off["prompt_ids"]:
            raise ValueError(f"{vllm[name]} and {path} decoded different prompts; rerun both")
        sets[name] = {"offline": off, "vllm": served}
    return sets


def summarize_files(
    offline: dict[str, str | Path],
    vllm: dict[str, str | Path],
    manifest_path: str | Path,
    drafter: str | Path,
    target_path: str | Path,
    metrics: str | Path | None,
    out: str | Path,
    settings: GateSettings,
    tensorboard_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Load the evaluation's inputs, summarise, and write summary.{json,tsv,html}, the plots to out and
    (with the tensorboard extra) event files to tensorboard_dir."""
    from draftsmith.chat import template_fingerprint
    from draftsmith.export import check_export
    from draftsmith.target import load_tokenizer, text_config_dict

    sets = load_sets(offline, vllm)
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
    summary = summarize(sets, manifest, export_config, problems, fingerprint, rows, settings)
    out = Path(out)
    write_summary(out, summary)
    plot_training(out / "training.png", rows)
    plot_acceptance(out / "acceptance.png", summary)
    plot_tau_speedup(out / "tau_speedup.png", summary)
    if tensorboard_dir is not None:
        summary["tensorboard"] = (
            str(tensorboard_dir) if write_tensorboard(tensorboard_dir, rows, summary) else None
        )
    return summary
