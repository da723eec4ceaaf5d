"""The evaluation's context comes from its prompts, not a fixed 2048 tokens (issue 43 item 2): vLLM's
max_model_len from the longest encoded prompt, and a prompt the target cannot hold refused before any
engine loads, naming its file and line."""

from __future__ import annotations

import json

import pytest
from helpers.workflow import DEFAULT_TARGET

from draftsmith.core.data.context import DRAFT_MARGIN, context_errors, evaluation_model_len, token_bound
from draftsmith.stages.evaluate import EvaluateSettings
from draftsmith.stages.evaluate.stage import evaluate_vllm

needs_target = pytest.mark.usefixtures("target_model")  # materialised once per session (conftest)
# ~3,000 tokens of SmolLM2's vocabulary: "word N" repeated
LONG = " ".join(f"word{i}" for i in range(1200))


def write_prompts(path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))


def test_the_length_is_the_longest_prompt_with_its_answer_and_the_drafts():
    assert (
        evaluation_model_len([10, 300, 42], max_new_tokens=64, num_draft_tokens=5)
        == 300 + 64 + 2 * 5 + DRAFT_MARGIN
    )
    assert evaluation_model_len([], 8, 3) == 8 + 2 * 3 + DRAFT_MARGIN


def test_a_prompt_past_the_targets_context_is_named_by_file_and_line():
    errors = context_errors("held-out set chat", ["a.jsonl:1", "a.jsonl:2"], [100, 8000], 256, 4, 8192,
                            "max_position_embeddings")  # fmt: skip
    assert len(errors) == 1 and errors[0].startswith(
        "held-out set chat: a.jsonl:2: the prompt is 8,000 tokens"
    )
    assert "needs 8,265 of the 8,192" in errors[0]  # 8,000 + 256 + 2 x 4 + 1


def test_the_byte_bound_never_undercounts():
    messages = [{"role": "user", "content": "héllo wörld " * 50}]
    assert token_bound(messages) >= len(messages[0]["content"].encode())


@needs_target
def test_evaluate_vllm_sizes_its_engines_from_the_prompts(monkeypatch, tmp_path):
    """A held-out prompt past 2048 tokens: every run is asked for the length it needs (not 2048)."""
    import draftsmith.stages.evaluate.vllm_runner as runner

    prompts = tmp_path / "long.jsonl"
    write_prompts(prompts, ["Hi.", LONG])
    asked = []

    def fake(**request):
        asked.append(request)
        raise RuntimeError("recorded")

    monkeypatch.setattr(runner, "run_vllm_subprocess", fake)
    settings = EvaluateSettings(
        num_prompts=0, max_new_tokens=16, num_draft_tokens=3, ngram=False, suffix=False
    )
    with pytest.raises(RuntimeError, match="recorded"):
        evaluate_vllm(DEFAULT_TARGET, {}, {"s": prompts}, {"s": tmp_path / "v.json"}, settings, None)
    longest = max(len(p) for p in asked[0]["prompts_token_ids"])
    assert longest > 2048
    assert asked[0]["max_model_len"] == longest + 16 + 2 * 3 + DRAFT_MARGIN


@needs_target
def test_evaluate_vllm_refuses_a_prompt_the_target_cannot_hold_before_any_engine(monkeypatch, tmp_path):
    import draftsmith.stages.evaluate.vllm_runner as runner

    prompts = tmp_path / "long.jsonl"
    write_prompts(prompts, ["Hi.", LONG * 4])  # ~12K tokens, SmolLM2 holds 8,192
    monkeypatch.setattr(runner, "run_vllm_subprocess", lambda **kw: pytest.fail("an engine was started"))
    settings = EvaluateSettings(
        num_prompts=0, max_new_tokens=16, num_draft_tokens=3, ngram=False, suffix=False
    )
    with pytest.raises(ValueError, match=rf"held-out set s: {prompts}:2: the prompt is [\d,]+ tokens"):
        evaluate_vllm(DEFAULT_TARGET, {}, {"s": prompts}, {"s": tmp_path / "v.json"}, settings, None)


@needs_target
def test_a_heldout_prompt_too_long_for_the_target_is_refused_at_start_by_file_and_line(tmp_path):
    """At the workflow's parse (workflow.startup.input_file_errors), before any job: line 2 is ~12K tokens, past
    SmolLM2's 8,192; a ~3K-token prompt (past 2048) fits and is no error."""
    from helpers.workflow import REPO
    from snakemake.utils import validate

    from draftsmith.core.workflow.startup import input_file_errors

    def errors_for(texts: list[str]) -> list[str]:
        heldout = tmp_path / "heldout.jsonl"
        write_prompts(heldout, texts)
        config = {"target": {"model": str(DEFAULT_TARGET)}, "prompts": {"heldout_path": str(heldout)}}
        validate(config, schema=str(REPO / "draftsmith" / "config.schema.yaml"))
        return [e for e in input_file_errors(config)[0] if "heldout" in e]

    assert errors_for(["Hi.", LONG]) == []
    errors = errors_for(["Hi.", LONG * 4])
    assert len(errors) == 1
    assert errors[0].startswith(f"prompts.heldout_path: {tmp_path / 'heldout.jsonl'}:2: the prompt is ")
    assert "of the 8,192 the target holds (max_position_embeddings)" in errors[0]


def test_the_plans_evaluation_line_holds_what_the_evaluation_asks_vllm_for():
    """The memory plan's evaluate (vLLM) line: a prompt of up to extract.max_seq_len with its whole answer
    and the draft positions (context.sequence_tokens), as evaluate_vllm sizes its engines."""
    from helpers.workflow import REPO

    from draftsmith.core.config.config import merged_config_files, text_config_json, with_defaults
    from draftsmith.core.planning.memory import GIB, plan, target_size

    config = with_defaults(merged_config_files([str(REPO / "configs" / "kimi-k2.5-8gpu.yaml")]))
    size = target_size(
        text_config_json(REPO / "tests" / "data" / "target-configs" / "kimi-k2.5"), None, "bfloat16"
    )
    (line,) = [n for n in plan(config, size, None, 141 * GIB) if n.stage == "evaluate (vLLM)"]
    assert f"KV cache, one {8192 + 512 + 2 * 3 + DRAFT_MARGIN:,}-token sequence" in line.parts


@needs_target
def test_the_evaluation_job_checks_its_plan_line_before_any_engine(monkeypatch, tmp_path):
    """Issue 43 item 4: the vLLM evaluation on GPUs checks its line of the plan again, at its prompts' own
    length on the job's device (nvidia-smi), before an engine loads."""
    import draftsmith.stages.evaluate.vllm_runner as runner

    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, ["Hi."])
    monkeypatch.setattr("draftsmith.core.planning.memory.detect_gpu_memory_gib", lambda: 0.5)
    monkeypatch.setattr(runner, "run_vllm_subprocess", lambda **kw: pytest.fail("an engine was started"))
    settings = EvaluateSettings(max_new_tokens=16, num_draft_tokens=3, gpus=1, dtype="bfloat16")
    with pytest.raises(
        ValueError, match=r"^evaluate \(vLLM\) needs \d+\.\d GB per GPU but has 0\.\d GB .*checked again"
    ):
        evaluate_vllm(DEFAULT_TARGET, {}, {"s": prompts}, {"s": tmp_path / "v.json"}, settings, None)
