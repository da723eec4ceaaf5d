"""How the evaluation is shown: the verdict and the checks as text, the summary table as text, TSV and
HTML, and the plots `snakemake --report` embeds. Nothing here decides anything (draftsmith.core.verdict does).

    format_verdict, format_checks    the gate's words, verdict first
    format_table, format_tsv, format_html, write_report
    plot_training       loss and per-TTT-step accuracy during training, validation points
    plot_acceptance     acceptance per draft position over every decode step, with intervals, per set
    plot_per_forward    tokens per target forward with intervals per method and held-out set; measured and
                        projected speedup (serving point, chosen k)

Plots use matplotlib's Agg canvas directly: no display, no global pyplot state.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from draftsmith.core.atomic import atomic_path, write_json, write_text
from draftsmith.core.checks import checks_of, order_checks
from draftsmith.core.methods import method

# ---------------------------------------------------------------------------------------------- verdict


def format_speedups(entry: dict[str, Any] | None, concurrency: list[int] | None) -> str:
    """A method's projected speedup at each concurrency with its interval: "1.19x [1.12, 1.26] at 1, ..."."""
    if not entry or not entry.get("projected_speedup"):
        return "not projected"
    ivs = entry.get("projected_intervals") or [None] * len(entry["projected_speedup"])
    parts = []
    for value, iv, b in zip(entry["projected_speedup"], ivs, concurrency or [], strict=False):
        parts.append(f"{value:.2f}x" + (f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "") + f" at {b}")
    return ", ".join(parts)


def format_by_load(best: list[dict[str, Any]]) -> str:
    """The serving policy's best method per concurrency as ranges: "suffix decoding k=3 at 1-8, plain
    decoding at 16-256"."""
    spans: list[list[Any]] = []  # [named, first concurrency, last concurrency]
    for entry in best:
        named = _named(entry)
        if spans and spans[-1][0] == named:
            spans[-1][2] = entry["concurrency"]
        else:
            spans.append([named, entry["concurrency"], entry["concurrency"]])
    return ", ".join(f"{n} at {lo}" + (f"-{hi}" if hi != lo else "") for n, lo, hi in spans)


def _named(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "-"
    name = "plain decoding" if entry["method"] == "plain" else method(entry["method"]).label
    return name + (f" k={entry['k']}" if entry.get("k") else "")


def format_verdict(v: dict[str, Any]) -> str:
    """The verdict per held-out set, first line overall; each set's line names the method and draft
    length to serve, its projected speedup at every concurrency of the serving point, and the runner-up."""
    per_set = v.get("per_set", [])
    if per_set and v["deploy"] == "per held-out set":
        by_method: dict[str, list[str]] = {}
        for s in per_set:
            by_method.setdefault(_named(s) if s.get("method") else s["deploy"], []).append(s["heldout"])
        head = "VERDICT: deploy " + "; ".join(f"{m} on {', '.join(sets)}" for m, sets in by_method.items())
    else:  # what to serve first, then the next step when it is not serving
        first = per_set[0] if per_set else None
        deploy = _named(first) if first and first.get("method") else v["deploy"]
        head = f"VERDICT: DEPLOY {deploy}"
        if not v["action"].startswith("deploy") and v["action"] != "no speculation":
            head += f"; next: {v['action'].upper()}"
    lines = [head]
    for s in per_set:
        where = (s.get("points") or ["?"])[0].split(", concurrency")[0]
        lines.append(
            f"  {s['heldout']}: {s['action']} (deploy: {_named(s) if s.get('method') else s['deploy']})"
        )
        if s.get("projected_speedup"):
            lines.append(f"    projected on {where}: {format_speedups(s, s.get('concurrency'))}")
        if s.get("runner_up"):
            runner = s["runner_up"]
            lines.append(f"    runner-up: {_named(runner)}, {format_speedups(runner, s.get('concurrency'))}")
        if s.get("by_load"):
            lines.append(f"    by load: {format_by_load(s['by_load'])}")
        lines += [f"    - {r}" for r in s["reasons"]]
    return "\n".join(lines)


def format_checks(checks: Iterable[Any]) -> str:
    """The diagnosis as a text table, failed checks first; 'where' lines only under failed/warned ones."""
    rows = order_checks(list(checks))
    name_w = max(len(c.name) for c in rows)
    lines = [f"{'check'.ljust(name_w)}  status  value  [threshold]"]
    for c in rows:
        lines.append(f"{c.name.ljust(name_w)}  {c.status.upper():6}  {c.value}  [{c.threshold}]")
        if c.missed and c.where:
            lines.append(f"{'':{name_w}}  -> look at: {c.where}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- tables


def _half(interval: list[float] | None) -> float | None:
    return None if interval is None else (interval[1] - interval[0]) / 2


def _with_interval(value: float, interval: list[float] | None) -> str:
    return f"{value:.3f}" + (
        f" ± {_half(interval):.3f} [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
    )


def _cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if key == "tokens_per_forward":
        return _with_interval(value, row.get("tokens_per_forward_interval"))
    if key == "tau":
        return _with_interval(value, row.get("tau_interval"))
    if key == "acceptance_per_position":
        ivs = row.get("acceptance_intervals") or [None] * len(value)
        return " ".join(
            f"{v:.2f}" + (f"±{_half(iv):.2f}" if iv else "") for v, iv in zip(value, ivs, strict=True)
        )
    if key == "per_step_acceptance":
        return " ".join(f"{v:.2f}" for v in value)
    if key == "draft_share":
        return f"{value:.0%}"
    if key == "tokens_per_s":
        return f"{value:.1f}"
    if key == "speedup":
        return f"{value:.2f}x"
    if key == "projected_speedup":
        ivs = row.get("projected_intervals") or [None] * len(value)
        return " / ".join(
            f"{v:.2f}x" + (f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "")
            for v, iv in zip(value, ivs, strict=True)
        )
    if key == "k" and row.get("serving") and not row["serving"].get("measured_at_k"):
        return f"{value} (est.)"
    return str(value)


COLUMNS = [
    ("heldout", "held-out set"),
    ("method", "method"),
    ("measured_by", "measured by"),
    ("prompts", "prompts"),
    ("tokens", "tokens"),
    ("forwards", "target forwards"),
    ("tokens_per_forward", "tokens per target forward at K [interval]"),
    ("draft_share", "steps with a draft"),
    ("k", "chosen k"),
    ("projected_speedup", "projected speedup at k, per concurrency [interval]"),
    ("tau", "tau, draft steps only [interval]"),
    ("per_step_acceptance", "acceptance per position, every step"),
    ("acceptance_per_position", "acceptance per position, draft steps only"),
    ("tokens_per_s", "tokens/s here"),
    ("speedup", "speedup here"),
    ("outputs", "outputs"),
]


def _body(summary: dict[str, Any]) -> list[list[str]]:
    return [[_cell(r, k) for k, _ in COLUMNS] for r in summary["rows"]]


def format_table(summary: dict[str, Any]) -> str:
    """The summary table as aligned text."""
    header = [title for _, title in COLUMNS]
    body = _body(summary)
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(lines + ["", _footnote(summary)])


def _footnote(summary: dict[str, Any]) -> str:
    lines = [
        f"tokens per target forward: output tokens / target forwards, every step counted (plain decoding = 1.0); "
        f"intervals: {summary.get('level', 0.95):.0%} bootstrap over prompts.",
        "tau: vLLM's mean acceptance length, 1 + accepted / drafts over the steps that had a draft only: not a "
        "comparison between methods that draft on different shares of steps.",
    ]
    if summary.get("projection"):
        p = summary["projection"]
        lines.append(
            f"projected at the serving point ({'; '.join(p['points'] or [])}), the verdict deciding at the "
            f"first: {p['formula']}. k: the draft length with the highest projected speedup there, from the "
            "acceptance at K (est.) or re-measured in vLLM at k. Speed measured here on a CPU is not that "
            "hardware."
        )
    if any(r.get("key") == "hybrid" for r in summary.get("rows", [])):
        lines.append(
            "hybrid (suffix decoding where its tree drafts, the trained drafter elsewhere, as TensorRT-LLM "
            "combines EAGLE-3 with a suffix automaton): measured offline on the contract-check prompts only, "
            "a projection, never ranked; no engine serves it from these exports."
        )
    return "\n".join(lines)


def format_tsv(summary: dict[str, Any]) -> str:
    header = "\t".join(title for _, title in COLUMNS)
    return "\n".join([header, *("\t".join(row) for row in _body(summary))]) + "\n"


def format_html(summary: dict[str, Any], plots: dict[str, str] | None = None) -> str:
    """A self-contained HTML page: the verdict, the summary table, the diagnosis and the plots (`plots`:
    title -> base64 PNG), which Snakemake's report embeds too."""

    def table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    results = table([title for _, title in COLUMNS], _body(summary))
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
    notes = "".join(f"<p>{html.escape(line)}</p>" for line in _footnote(summary).splitlines())
    figures = "".join(
        f"<h2>{html.escape(title)}</h2><img style='max-width:100%' src='data:image/png;base64,{data}'>"
        for title, data in (plots or {}).items()
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>draftsmith evaluation</title>"
        f"<style>{style}</style></head><body>"
        f"<h2>Verdict</h2><pre>{html.escape(format_verdict(summary['verdict']))}</pre>"
        f"<h2>Evaluation: {html.escape(sets)}; up to {summary['max_new_tokens']} new tokens, "
        f"{summary['num_draft_tokens']} draft tokens, temperature {summary['temperature']}</h2>{results}{notes}"
        f"<h2>Gate: {gate}</h2>{diagnosis}{figures}</body></html>\n"
    )


def write_report(out_dir: str | Path, summary: dict[str, Any], metrics_rows: list[dict[str, Any]]) -> None:
    """summary.{json,tsv,html} and the plots into out_dir."""
    import base64

    out_dir = Path(out_dir)
    write_json(out_dir / "summary.json", summary)
    write_text(out_dir / "summary.tsv", format_tsv(summary))
    plot_training(out_dir / "training.png", metrics_rows)
    plot_acceptance(out_dir / "acceptance.png", summary)
    plot_per_forward(out_dir / "per_forward.png", summary)
    plots = {
        title: base64.b64encode((out_dir / name).read_bytes()).decode("ascii")
        for title, name in (
            ("Tokens per target forward and speedup", "per_forward.png"),
            ("Acceptance per draft position", "acceptance.png"),
            ("Training", "training.png"),
        )
    }
    write_text(out_dir / "summary.html", format_html(summary, plots))


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
    """Acceptance per draft position over every decode step (accepted there / target forwards: a step
    without a draft counts as a rejection, so methods that draft on few steps compare fairly) with its
    interval, per method and measurement, one panel per held-out set."""
    sets = list(summary["heldout_sets"])
    fig = _figure(10, 3.8 * len(sets))
    axes = fig.subplots(len(sets), 1, squeeze=False)[:, 0]
    k = summary["num_draft_tokens"]
    for ax, heldout in zip(axes, sets, strict=True):
        series = _method_rows(summary, heldout)
        width = 0.8 / max(len(series), 1)
        for s, r in enumerate(series):
            xs = [i + 1 - 0.4 + width * (s + 0.5) for i in range(k)]
            rates = (r.get("per_step_acceptance") or [0.0] * k)[:k]
            rates += [0.0] * (k - len(rates))
            ivs = (r.get("per_step_intervals") or [None] * k)[:k]
            ivs += [None] * (k - len(ivs))
            errs = [_err(v, iv) for v, iv in zip(rates, ivs, strict=True)]
            ax.bar(xs, rates, width, yerr=list(zip(*errs, strict=True)), capsize=2,
                   color=method(r["key"]).color, hatch="" if r["measured_by"] == "offline" else "//",
                   edgecolor="black", lw=0.5, label=f"{r['method']} ({r['measured_by']})")  # fmt: skip
        ax.set_xticks(range(1, k + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted per decode step (every step)")
        ax.set_ylim(0, 1.1)
        info = summary["heldout_sets"][heldout]
        ax.set_title(f"{heldout}: acceptance per position, {info['num_prompts']} prompts "
                     f"({summary['level']:.0%} intervals over prompts; hatched: vLLM)")  # fmt: skip
        ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def plot_per_forward(path: str | Path, summary: dict[str, Any]) -> None:
    """Left: tokens per target forward with its interval per method, measurement and held-out set (plain
    decoding = 1). Right: the speedup measured here and the one projected for memory-bound decoding."""
    fig = _figure(13, 4.4)
    left, right = fig.subplots(1, 2)
    labels, ticks, x = [], [], 0.0
    for heldout in summary["heldout_sets"]:
        for r in _method_rows(summary, heldout):
            color = method(r["key"]).color
            hatch = "" if r["measured_by"] == "offline" else "//"
            value = r["tokens_per_forward"]
            below, above = _err(value, r.get("tokens_per_forward_interval"))
            left.bar(x, value, yerr=[[below], [above]], capsize=3, color=color, hatch=hatch,
                     edgecolor="black", lw=0.5)  # fmt: skip
            left.text(x, value + above, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
            right.bar(x - 0.2, r["speedup"], 0.4, color=color, hatch=hatch, edgecolor="black", lw=0.5)
            if r.get("projected_speedup"):
                projected = r["projected_speedup"][0]
                iv = (r.get("projected_intervals") or [None])[0]
                below, above = _err(projected, iv)
                right.bar(x + 0.2, projected, 0.4, yerr=[[below], [above]], capsize=2, color="white",
                          edgecolor=color, lw=1.5)  # fmt: skip
                right.text(x + 0.2, projected + above, f"{projected:.2f}\nk={r['k']}", ha="center",
                           va="bottom", fontsize=6)  # fmt: skip
            ticks.append(x)
            labels.append(f"{method(r['key']).short}\n{r['measured_by']}\n{heldout}")
            x += 1
        x += 0.6  # a gap between held-out sets
    titles = [
        (
            left,
            f"tokens per target forward, every step counted ({summary['level']:.0%} interval over prompts)",
        ),
        (
            right,
            "speedup over plain decoding: measured here (filled), projected at the serving point's first "
            f"concurrency at the chosen k (outline; {((summary.get('projection') or {}).get('points') or ['-'])[0]})",
        ),
    ]
    for ax, title in titles:
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_title(title, fontsize=9)
    _save(fig, path)
