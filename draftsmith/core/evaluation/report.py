"""How the evaluation is shown: the verdict and the checks as text, the summary table as text, TSV and
HTML, and the plots `snakemake --report` embeds. Nothing here decides anything (draftsmith.core.evaluation.verdict does).

    format_verdict, format_checks    the gate's words, verdict first
    decision_rows       per set what to serve, its projected speedup, where it pays, the drafter's room
    format_table, format_tsv, format_html, write_report
    plot_training       loss and per-TTT-step accuracy during training, validation points
    plot_acceptance     acceptance per draft position over every decode step, with intervals, per set
    plot_per_forward    per set, projected speedup against concurrency over the policy's grid: one line
                        per method, the drafter's ceiling dashed, 1.0x and the crossover marked

Speed measured here (tokens/s, its ratio to plain decoding) is shown only where a measurement says it
was measured fairly (`speed_fair`); GPU projections and CPU measurements never share a chart.

Plots use matplotlib's Agg canvas directly: no display, no global pyplot state.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from draftsmith.core.evaluation.checks import checks_of, order_checks
from draftsmith.core.evaluation.methods import method, ordered
from draftsmith.core.io.atomic import atomic_path, write_json, write_text

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
SPEED_HERE = ("tokens_per_s", "speedup")  # shown only where measured fairly


def columns(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's columns: the speed measured here only where some row was measured fairly."""
    fair = any(r.get("speed_fair") for r in summary["rows"])
    return [(k, t) for k, t in COLUMNS if fair or k not in SPEED_HERE]


def _body(summary: dict[str, Any]) -> list[list[str]]:
    return [[_cell(r, k) for k, _ in columns(summary)] for r in summary["rows"]]


def format_table(summary: dict[str, Any]) -> str:
    """The summary table as aligned text."""
    header = [title for _, title in columns(summary)]
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
    if not any(r.get("speed_fair") for r in summary.get("rows", [])):
        lines.append(
            "speed here (tokens/s on this machine) not shown: its engines ran beside other jobs, not alone, "
            "in paired rounds on the same prompts."
        )
    if any(r.get("key") == "hybrid" for r in summary.get("rows", [])):
        lines.append(
            "hybrid (suffix decoding where its tree drafts, the trained drafter elsewhere, as TensorRT-LLM "
            "combines EAGLE-3 with a suffix automaton): measured offline on the contract-check prompts only, "
            "a projection, never ranked; no engine serves it from these exports."
        )
    return "\n".join(lines)


def format_tsv(summary: dict[str, Any]) -> str:
    header = "\t".join(title for _, title in columns(summary))
    return "\n".join([header, *("\t".join(row) for row in _body(summary))]) + "\n"


def _pays(policy: dict[str, Any] | None, key: str | None) -> str:
    """Where the chosen method pays, from the serving policy: the best method per range of
    concurrencies, then the chosen method's crossover (past it, plain decoding beats it)."""
    if not policy:
        return "no serving policy (evaluate.serving not set)"
    where = format_by_load(policy["best"])
    if key and key != "plain" and key in policy.get("crossover", {}):
        cross = policy["crossover"][key]
        name = method(key).label
        if cross is None:
            where += f"; {name} beats plain decoding up to {policy['grid'][-1]} (the grid's end)"
        elif cross == 0:
            where += f"; {name} never beats plain decoding"
        else:
            where += f"; crossover: {name} beats plain decoding up to {cross}, not past it"
    return where


def _room(room: dict[str, Any] | None) -> str:
    """The trained drafter's measured acceptance per position against its break-even."""
    if not room:
        return "no trained drafter measured"
    measured = " / ".join(f"{a:.2f}" for a in room["position_acceptance"])
    beat = room["to_beat"]
    to_beat = f"{_named({'method': beat['method']})} {beat['speedup']:.2f}x"
    if room["break_even"] is None:
        need = f"none reaches {to_beat}: its ceiling is {room['ceiling']:.2f}x"
    else:
        need = f"break-even {room['break_even']:.2f} to match {to_beat} (ceiling {room['ceiling']:.2f}x)"
    return f"accepts {measured} per position; {need}"


DECISION = ["held-out set", "serve", "projected speedup [interval]", "where it pays (concurrency)",
            "trained drafter: acceptance vs break-even"]  # fmt: skip


def _check_value(check: Any, summary: dict[str, Any]) -> str:
    """A check's value as the page shows it: the speed check's figure only where measured fairly."""
    if check.group == "speed" and not any(r.get("speed_fair") for r in summary["rows"]):
        return "not shown: the engines ran beside other jobs (no fair measurement)"
    return check.value


def decision_rows(summary: dict[str, Any]) -> list[list[str]]:
    """Per held-out set the decision a reader needs first: the method and k to serve, its projected
    speedup at the serving point's first concurrency with its interval, the concurrencies where it pays
    (the policy's ranges and crossover) and the drafter's acceptance against its break-even."""
    rows = []
    for s in summary["verdict"].get("per_set", []):
        info = summary["heldout_sets"].get(s["heldout"], {})
        speedup = "not projected"
        if s.get("projected_speedup"):
            iv = (s.get("projected_intervals") or [None])[0]
            where = (s.get("points") or ["?"])[0].split(", context")[0]
            speedup = f"{s['projected_speedup'][0]:.2f}x" + (f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "")
            speedup += f" ({where})"
        serve = _named(s) if s.get("method") else s["deploy"]
        rows.append([s["heldout"], serve, speedup, _pays(info.get("policy"), s.get("method")),
                     _room(info.get("acceptance_vs_break_even"))])  # fmt: skip
    return rows


def category_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Tokens per target forward per prompt category (MT-Bench's), one row per set and category."""
    keys = ordered([k for info in summary["heldout_sets"].values() for c in (info.get("by_category") or {}).values()
                    for k in c["methods"]])  # fmt: skip
    rows = []
    for name, info in summary["heldout_sets"].items():
        for category, c in (info.get("by_category") or {}).items():
            cells = [f"{c['methods'][k]:.3f}" if c["methods"].get(k) is not None else "-" for k in keys]
            rows.append([name, category, str(c["prompts"]), *cells])
    return ["held-out set", "category", "prompts", *(method(k).label for k in keys)], rows


def format_html(
    summary: dict[str, Any], plots: dict[str, str] | None = None, chart: str | None = None
) -> str:
    """A self-contained HTML page read at a glance: the pre-flight's lines (where it ran), the decision
    per held-out set, the projected speedup against concurrency (`chart`: base64 PNG), then the verdict,
    the tables, the gate's diagnosis and the other plots (`plots`: title -> base64 PNG), which
    Snakemake's report embeds too."""

    def table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        opening = f"<table class='{cls}'>" if cls else "<table>"
        return f"{opening}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    results = table([title for _, title in columns(summary)], _body(summary), "wide")
    checks = order_checks(checks_of(summary))
    diagnosis = table(
        ["check", "status", "value", "threshold", "where to look"],
        [[c.name, c.status.upper(), _check_value(c, summary), c.threshold, c.where if c.missed else ""]
         for c in checks],
    )  # fmt: skip
    gate = "PASSED" if summary["gate_passed"] else "FAILED"
    # everything wraps inside 1280 px: long cells break, the wide table shrinks its type
    style = (
        "body{font-family:sans-serif;font-size:14px;max-width:1240px;margin:8px auto}"
        "table{border-collapse:collapse;margin:8px 0;width:100%}"
        "td,th{border:1px solid #bbb;padding:3px 6px;text-align:left;vertical-align:top;"
        "overflow-wrap:break-word}th{background:#eee}table.wide{font-size:11px}"
        "pre{white-space:pre-wrap;overflow-wrap:break-word}.pre{background:#f6f6f6;padding:4px 10px}"
        "img{max-width:100%}"
    )
    sets = ", ".join(
        f"{name}: {s['num_prompts']} prompts, {s['plain_tokens']} tokens"
        for name, s in summary["heldout_sets"].items()
    )
    notes = "".join(f"<p>{html.escape(line)}</p>" for line in _footnote(summary).splitlines())
    figures = "".join(
        f"<h2>{html.escape(title)}</h2><img src='data:image/png;base64,{data}'>"
        for title, data in (plots or {}).items()
    )
    first = ""
    pre = summary.get("preflight")
    if pre and pre.get("lines"):
        lines = "".join(f"<li>{html.escape(line)}</li>" for line in pre["lines"])
        first = f"<div class='pre'><h2>Pre-flight, before training</h2><ul>{lines}</ul></div>"
    lead = (
        f"<h2>Projected speedup against concurrency</h2><img src='data:image/png;base64,{chart}'>"
        if chart
        else ""
    )
    header, rows = category_rows(summary)
    categories = f"<h2>Tokens per target forward per category</h2>{table(header, rows)}" if rows else ""
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>draftsmith evaluation</title>"
        f"<style>{style}</style></head><body>{first}"
        f"<h2>Decision per held-out set</h2>{table(DECISION, decision_rows(summary))}{lead}"
        f"<h2>Verdict</h2><pre>{html.escape(format_verdict(summary['verdict']))}</pre>"
        f"<h2>Evaluation: {html.escape(sets)}; up to {summary['max_new_tokens']} new tokens, "
        f"{summary['num_draft_tokens']} draft tokens, temperature {summary['temperature']}</h2>{results}{notes}"
        f"{categories}<h2>Gate: {gate}</h2>{diagnosis}{figures}</body></html>\n"
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

    def encoded(name: str) -> str:
        return base64.b64encode((out_dir / name).read_bytes()).decode("ascii")

    plots = {"Acceptance per draft position": encoded("acceptance.png"), "Training": encoded("training.png")}
    write_text(out_dir / "summary.html", format_html(summary, plots, chart=encoded("per_forward.png")))


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
    right.set_ylabel("top-1 accuracy")  # what filled and hollow mean goes in the title: a long label is cut
    right.set_title("accuracy per TTT step (step j = draft position j+1)\nfilled: the data's token; "
                    "hollow: the target's top-1", fontsize=10)  # fmt: skip
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
    """Per held-out set, one panel: projected speedup over plain decoding against concurrency over the
    serving policy's grid, one line per method at its best k there, the trained drafter's ceiling
    (every draft accepted) dashed, 1.0x (plain decoding) and each method's crossover marked. Projections
    only: speed measured on this machine is another device and never shares the chart."""
    sets = list(summary["heldout_sets"])
    ncols = min(len(sets), 2)
    nrows = -(-len(sets) // ncols)
    fig = _figure(6.2 * ncols, 5.0 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    points = {s["heldout"]: (s.get("points") or [""])[0] for s in summary["verdict"].get("per_set", [])}
    for ax, name in zip(axes, sets, strict=False):
        policy = summary["heldout_sets"][name].get("policy")
        if not policy:
            ax.text(0.5, 0.5, "not projected (no evaluate.serving)", ha="center", va="center",
                    transform=ax.transAxes)  # fmt: skip
            ax.set_title(name, fontsize=10)
            continue
        grid = policy["grid"]
        crossed = False
        for key in ordered(list(policy["methods"])):
            at = policy["methods"][key]
            m = method(key)
            ax.plot(grid, [e["speedup"] for e in at], "o-", color=m.color, lw=1.6, ms=4,
                    label=f"{m.short} (best k: {_k_range(at)})")  # fmt: skip
            cross = policy["crossover"].get(key)
            if cross:  # the last concurrency where it still beats plain decoding
                y = next(e["speedup"] for e in at if e["concurrency"] == cross)
                ax.plot([cross], [y], "X", color=m.color, ms=11, mec="black",
                        label=None if crossed else "crossover (last load it pays)")  # fmt: skip
                crossed = True
        if policy.get("drafter_ceiling"):
            ax.plot(grid, policy["drafter_ceiling"], "--", color=method("eagle3").color, lw=1.4,
                    label="drafter ceiling (every draft accepted)")  # fmt: skip
        ax.axhline(1.0, color="black", lw=1.0, ls=":", label="plain decoding (1.0x)")
        plain = [e["concurrency"] for e in policy["best"] if e["method"] == "plain"]
        if plain:  # where no speculation is the best choice: shaded, past the set's crossover
            ax.axvspan(plain[0] / 2**0.5, grid[-1] * 2**0.5, color="grey", alpha=0.12,
                       label=f"serve plain decoding (from {plain[0]})")  # fmt: skip
            ax.set_xlim(grid[0] / 2**0.5, grid[-1] * 2**0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(grid)
        ax.set_xticklabels([str(c) for c in grid], fontsize=8)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("projected speedup over plain decoding")
        where = points.get(name, "").split(", concurrency")[0]
        ax.set_title(f"{name}: projected on {where}" if where else name, fontsize=10)
        # below the axes: a legend never hides a line
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
        ax.grid(alpha=0.3)
    for ax in axes[len(sets) :]:
        ax.set_visible(False)
    _save(fig, path)


def _k_range(at: list[dict[str, Any]]) -> str:
    ks = sorted({e["k"] for e in at})
    return str(ks[0]) if len(ks) == 1 else f"{ks[0]}-{ks[-1]}"
