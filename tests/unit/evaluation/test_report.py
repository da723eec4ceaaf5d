"""summary.html read at a glance: the pre-flight's lines, the decision per set, one chart of projected
speedup against concurrency, then the tables; speed measured here only where measured fairly."""

from __future__ import annotations

import json

from helpers.evaluation import tiny_summary

from draftsmith.core.evaluation.report import decision_rows, format_table, format_tsv, write_report
from draftsmith.core.export.model_card import speed_section

PNG = b"\x89PNG\r\n\x1a\n"
PREFLIGHT = {
    "sets": {
        "heldout": {
            "line": "heldout: serve ngram (k = 3) at 1.86x (H100-80GB, concurrency 1); a perfect drafter"
        },
        "handwritten": {"line": "handwritten: serve plain decoding at 1.00x"},
    },
    "drafter_can_pay": False,
    "mode": "warn",
}


def test_speed_here_is_shown_only_where_measured_fairly(tmp_path):
    unfair, fair = tiny_summary(), tiny_summary(fair=True)
    assert not unfair["speed_fair"] and all(r["tokens_per_s"] is None and r["speedup"] is None
                                            for r in unfair["rows"])  # fmt: skip
    assert fair["speed_fair"] and all(r["speedup"] is not None for r in fair["rows"])
    for text in (format_tsv(unfair), format_table(unfair)):
        assert "speedup here" not in text and "tokens/s here" not in text
    assert "speed here (tokens/s on this machine) not shown" in format_table(unfair)
    assert "speedup here" in format_tsv(fair) and "tokens/s here" in format_table(fair)
    write_report(tmp_path / "u", unfair, [])
    page = (tmp_path / "u" / "summary.html").read_text()
    assert "speedup here" not in page and "0.70x plain" not in page  # nor in the speed check's value
    write_report(tmp_path / "f", fair, [])
    assert "speedup here" in (tmp_path / "f" / "summary.html").read_text()
    # the card: no measured-here column unless fair
    card, fair_card = "\n".join(speed_section(unfair)), "\n".join(speed_section(fair))
    assert "measured here" not in card and "| 0.70x |" not in card and "measured here" in fair_card


def test_report_opens_with_the_decision_and_one_chart(tmp_path):
    summary = tiny_summary(preflight=PREFLIGHT)
    assert summary["preflight"]["lines"][0].startswith("heldout: serve ngram")
    write_report(tmp_path, summary, [])
    page = (tmp_path / "summary.html").read_text()
    order = ["Pre-flight, before training", "heldout: serve ngram", "Decision per held-out set",
             "Projected speedup against concurrency", "<h2>Verdict", "<table class='wide'>", "Gate: "]  # fmt: skip
    at = [page.index(text) for text in order]
    assert at == sorted(at), at
    assert page.count("data:image/png;base64,") == 3  # the chart, then acceptance and training
    assert (tmp_path / "per_forward.png").read_bytes()[:8] == PNG
    rows = {r[0]: r for r in decision_rows(summary)}
    assert list(rows) == ["heldout", "handwritten"]
    s, serve, speedup, pays, room = rows["heldout"]
    assert serve == "n-gram lookup k=3" and speedup.startswith("1.86x [1.86, 1.86]")
    assert "n-gram lookup k=3 at 1-32" in pays and "beats plain decoding up to 32" in pays
    assert "accepts 0.29 / 0.26 / 0.33 per position" in room and "ceiling is 1.45x" in room
    # without a pre-flight the page starts with the decision
    write_report(tmp_path / "none", tiny_summary(), [])
    assert "Pre-flight" not in (tmp_path / "none" / "summary.html").read_text()


def test_policy_carries_the_drafters_ceiling_over_its_grid():
    summary = tiny_summary()
    for name, info in summary["heldout_sets"].items():
        policy = info["policy"]
        assert len(policy["drafter_ceiling"]) == len(policy["grid"]) == 6, name
        # the ceiling at the first concurrency is the room's (every draft accepted, the best k)
        assert abs(policy["drafter_ceiling"][0] - info["acceptance_vs_break_even"]["ceiling"]) < 1e-9
    json.dumps(summary)
