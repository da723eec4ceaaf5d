"""bench.peer's table: validation accuracy per TTT step of every drafter and tokens per target forward
in vLLM per held-out set."""

from __future__ import annotations

from typing import Any

# Last measured (issue 23): SpecForge on older shards, and draftsmith's estimate across two datasets
LAST_MEASURED = {"specforge": [0.240, 0.195, 0.175], "draftsmith_estimate": [0.257, 0.200, 0.143]}


def fmt_acc(xs: list[float | None] | None) -> str:
    return " / ".join("  -  " if x is None else f"{x:.3f}" for x in (xs or []))


def table(result: dict[str, Any]) -> str:
    """The peer table: validation accuracy per TTT step (and each drafter's paired difference from
    SpecForge's), then tokens per target forward in vLLM per held-out set."""
    lines = ["drafter                val acc per TTT step     agreement per TTT step   train wall s",
             "---------------------  -----------------------  -----------------------  ------------"]  # fmt: skip
    for name, r in result["trainers"].items():
        v = r.get("validation") or {}
        wall = f"{r['wall_s']:>12.0f}" if r.get("wall_s") is not None else f"{'-':>12}"
        lines.append(f"{name:<21}  {fmt_acc(v.get('acc')):<23}  {fmt_acc(v.get('agreement')):<23}  {wall}")
    for name, d in (result.get("validation_difference") or {}).items():
        iv = " / ".join(
            f"{x:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            for x, (lo, hi) in zip(d["acc"], d["acc_interval95"], strict=True)
        )
        lines.append(f"{name} - specforge, val acc per TTT step [95% paired interval]: {iv}")
    lines.append(f"(last measured: SpecForge {fmt_acc(LAST_MEASURED['specforge'])}, "
                 f"draftsmith estimate {fmt_acc(LAST_MEASURED['draftsmith_estimate'])})")  # fmt: skip
    for set_name, row in (result.get("vllm") or {}).items():
        lines.append(f"vLLM, {set_name} ({row['num_prompts']} prompts, {row['tokens']} tokens), k = "
                     f"{result['vllm_settings']['num_draft_tokens']}: tokens per target forward (tau)")  # fmt: skip
        for label, e in row["drafters"].items():
            diff = ""
            if "interval95" in e:
                lo, hi = e["interval95"]
                diff = f"   {e['minus_specforge']:+.3f} [{lo:+.3f}, {hi:+.3f}] vs specforge"
            lines.append(f"  {label:<21} {e['tokens_per_forward']:.3f} ({e['tau']:.3f}){diff}")
    return "\n".join(lines)
