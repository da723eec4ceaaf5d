"""The generate stage's bookkeeping and the training sequences it leads to (no model runs, seconds)."""

import json
import logging

import pytest
from click.testing import CliRunner
from helpers.workflow import REPO

from draftsmith.backends.common import CPU_KV_CACHE_GIB, Answer, oversized, vllm_child_env
from draftsmith.backends.hf import length_batches
from draftsmith.backends.openai import check_served_prompt
from draftsmith.core.config.config import section_defaults
from draftsmith.core.data.chat import assistant_message, merge_turns, render_prompt, render_with_response
from draftsmith.stages.generate import (
    Conversation,
    GenerateSettings,
    Progress,
    describe,
    generate_traces,
    generation_points,
    original_row,
    prompt_line_numbers,
    read_partial,
    summarize,
    trace_row,
    uses_original,
    warn_truncated,
)
from draftsmith.stages.tokenize import TokenizeSettings, trace_sequences, turn_contexts

TARGET = REPO / "resources" / "SmolLM2-135M-Instruct"
# the default target, materialised once per session where a fresh clone has none yet (conftest)
pytestmark = pytest.mark.usefixtures("target_model")

# A Qwen3-like thinking template: reasoning rendered in <think> for the last assistant turn only (older
# turns lose their reasoning, as Qwen3 does), ChatML otherwise.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content is defined and message.reasoning_content and loop.last %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture
def thinking_tokenizer(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = THINKING_TEMPLATE
    return tok


def answer(text, reasoning=None, ids=None, prompt_ids=None, finish="stop"):
    return Answer(text, reasoning, finish, len(prompt_ids or []), len(ids or text.split()), prompt_ids, ids)


MULTI = {
    "id": "mt",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An answer from another model."},
        {"role": "user", "content": "And a vegetable?"},
    ],
}


# ----------------------------------------------------------------------------- turns


def test_generation_points_regenerate_every_assistant_turn():
    assert generation_points(MULTI["messages"], "regenerate") == [2, 4]
    assert generation_points(MULTI["messages"], "last") == [4]
    assert generation_points([{"role": "user", "content": "x"}], "regenerate") == [1]


def test_conversation_regenerates_history_with_own_answers():
    conv = Conversation(MULTI, 7, "regenerate")
    assert conv.context() == MULTI["messages"][:2]
    conv.answers.append(answer("Apple."))
    ctx = conv.context()
    assert ctx[2] == {"role": "assistant", "content": "Apple."}  # the model's own answer, not the prompt's
    assert ctx[3] == MULTI["messages"][3] and len(ctx) == 4
    assert not conv.done
    conv.answers.append(answer("Carrot."))
    assert conv.done and conv.context(1) == ctx
    assert conv.where("p.jsonl") == "p.jsonl:7"
    # "last": the prompt's assistant message stays as given and only the final turn is answered
    last = Conversation(MULTI, None, "last")
    assert last.context() == MULTI["messages"]


def test_trace_row_keeps_earlier_turns_and_reasoning():
    conv = Conversation(MULTI, None, "regenerate")
    conv.answers = [answer("Apple.", "fruit?", [10, 2], [1, 2]), answer("Carrot.", None, [11, 2], [1, 2, 3])]
    conv.prompt_ids = [[1, 2], [1, 2, 3]]
    row = trace_row(conv, "openai", "m", "fp")
    assert row["response"] == "Carrot." and "reasoning" not in row
    assert row["messages"][2]["content"] == "Apple."
    assert row["turns"] == [
        {
            "response": "Apple.",
            "reasoning": "fruit?",
            "prompt_token_ids": [1, 2],
            "response_token_ids": [10, 2],
            "prompt_tokens": 2,
            "completion_tokens": 2,
            "finish_reason": "stop",
        }
    ]
    assert (row["backend"], row["model"], row["template"]) == ("openai", "m", "fp")
    # a text-only server: no token ids stored, tokenize re-renders the text
    text = Conversation({"id": "t", "messages": [{"role": "user", "content": "hi"}]}, None, "regenerate")
    text.answers, text.prompt_ids = [answer("hello")], [[1, 2]]
    assert "response_token_ids" not in trace_row(text, "openai", "m", "fp")


def test_summary_counts_truncation_reasoning_and_tokens():
    rows = [
        {"id": "a", "finish_reason": "stop", "reasoning": "r", "prompt_tokens": 5, "completion_tokens": 7},
        {"id": "b", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 9},
        {
            "id": "c",
            "finish_reason": "stop",
            "prompt_tokens": 4,
            "completion_tokens": 2,
            "turns": [
                {"finish_reason": "length", "reasoning": "x", "prompt_tokens": 1, "completion_tokens": 1}
            ],
        },
    ]
    s = summarize(rows, generated_now=2, new_tokens=11, seconds=2.0)
    assert (s["done"], s["turns"], s["truncated"], s["reasoning_captured"]) == (3, 4, 2, 2)
    assert s["reasoning_capture_rate"] == round(2 / 3, 4)
    assert (s["prompt_tokens"], s["completion_tokens"], s["tokens"], s["tokens_per_second"]) == (
        13,
        19,
        11,
        5.5,
    )


def test_oversized_rule():
    assert oversized(100, 10, max_prompt_tokens=50, context_len=None)
    assert not oversized(50, 10, max_prompt_tokens=50, context_len=10)  # the explicit limit wins
    assert oversized(95, 10, max_prompt_tokens=0, context_len=100)  # the answer would not fit
    assert not oversized(90, 10, max_prompt_tokens=0, context_len=100)
    assert not oversized(10**6, 10, max_prompt_tokens=0, context_len=None)


def test_served_prompt_must_match_template():
    check_served_prompt(None, [1, 2], "fp")  # a server that returns no ids cannot be checked
    check_served_prompt([1, 2], [1, 2], "fp")
    with pytest.raises(RuntimeError, match="first difference at token 1"):
        check_served_prompt([1, 9, 3], [1, 2, 3], "fp")


# ----------------------------------------------------------------------------- files


def test_read_partial_cuts_a_torn_line(tmp_path):
    path = tmp_path / "t.jsonl.partial"
    path.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "resp')
    assert list(read_partial(path)) == ["a", "b"]
    assert path.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'  # appends start on a clean line


def test_read_partial_keeps_the_lines_after_a_garbled_one(tmp_path, caplog):
    """A garbled line in the middle loses only itself (was: every finished trace after it)."""
    path = tmp_path / "t.jsonl.partial"
    path.write_bytes(b'{"id": "a"}\n{"id": "b", "resp\x00\x00onse"\n{"id": "c"}\n{"no id": 1}\n{"id": "d"}\n')
    with caplog.at_level(logging.WARNING, logger="draftsmith.stages.generate"):
        assert list(read_partial(path)) == ["a", "c", "d"]
    assert [m for m in caplog.messages if "not a complete trace line" in m] == [
        f"{path}:2: not a complete trace line; dropped, its prompt is generated again",
        f"{path}:4: not a complete trace line; dropped, its prompt is generated again",
    ]
    assert path.read_bytes() == b'{"id": "a"}\n{"id": "c"}\n{"id": "d"}\n'


def test_progress_estimate_follows_finished_answers():
    """The bar's total starts at max_new_tokens per answer and becomes the mean of finished answers, so
    the ETA is not the worst case all stage long; dropped answers leave the total."""
    p = Progress(answers=10, max_new_tokens=100, enabled=False)
    assert p.total == 1000
    p.tokens(20)
    p.finished(2, 20)  # two short answers: 10 tokens each
    assert p.n == 20 and p.total == 20 + 8 * 10
    p.finished(0, 0, dropped=3)  # an oversized prompt's three turns will never come
    assert p.total == 20 + 5 * 10
    p.close()


def test_truncation_warning_and_summary_line(caplog):
    summary = {
        "done": 10, "samples": 10, "generated_now": 4, "truncated": 3, "errors": 1, "skipped": {"oversized": 2},
        "reasoning_capture_rate": 0.5, "tokens": 1234, "seconds": 12.3, "tokens_per_second": 100.3,
    }  # fmt: skip
    line = describe(summary, 160)
    assert line == (
        "generate: 10 traces (4 now), 3 truncated at 160 tokens, 1 errors, 2 skipped; reasoning captured "
        "50%; 1234 new tokens in 12 s (100 tok/s)"
    )
    with caplog.at_level(logging.WARNING, logger="draftsmith.stages.generate"):
        assert warn_truncated(summary, 160)  # 30% > 20%
        assert not warn_truncated({**summary, "truncated": 2}, 160)  # 20%: not more than the share
    assert len(caplog.records) == 1 and "30% of the traces (3 of 10)" in caplog.messages[0]


def test_token_ticker_counts_tokens_before_eos(tiny_llama):
    """generate_batch reports each decoding step's kept tokens: their sum is the responses' length."""
    from draftsmith.backends.hf import generate_batch

    ticks = []
    gens = generate_batch(tiny_llama, [[5, 6, 7], [8, 9]], 12, {3, 4}, 0, 0.0, 1.0, on_tokens=ticks.append)
    assert len(ticks) >= 1 and sum(ticks) == sum(len(g.response_ids) for g in gens)


def test_prompt_line_numbers_skip_blank_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('\ufeff{"prompt": "a"}\n\n  \n{"prompt": "b"}\n{"prompt": "c"}\n', encoding="utf-8")
    assert prompt_line_numbers(path) == [1, 4, 5]


def test_settings_validation_names_the_key():
    assert GenerateSettings.from_dict(section_defaults("generate")).backend == "transformers"
    with pytest.raises(ValueError, match="base_url is required"):
        GenerateSettings.from_dict({"backend": "openai"})
    with pytest.raises(ValueError, match="generate.reasoning"):
        GenerateSettings.from_dict({"reasoning": "sometimes"})
    with pytest.raises(ValueError, match="unknown generate settings: concurency"):
        GenerateSettings.from_dict({"concurency": 4})


def test_cli_options_leave_defaults_to_the_schema():
    """Options not given are None, so the settings section (or the schema) decides (see test_cli.py)."""
    from draftsmith.cli import stage

    generate = stage("generate")
    defaults = section_defaults("generate")
    ctx = generate.make_context(
        "generate", ["--target", str(TARGET), "--prompts", __file__, "--out", "o", "--summary", "s"]
    )
    for name, value in ctx.params.items():  # what the command receives when the option is not given
        if name in defaults:
            assert value is None, name
    assert CliRunner().invoke(generate, ["--help"]).exit_code == 0


# ----------------------------------------------------------------------------- training sequences


def test_reasoning_rendered_in_the_templates_thinking_format(thinking_tokenizer):
    msgs = [{"role": "user", "content": "2+2?"}]
    ids, mask = render_with_response(thinking_tokenizer, msgs, "4", "two plus two is four")
    masked = thinking_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert masked.startswith("<think>\ntwo plus two is four\n</think>\n\n4")
    assert ids[: mask.index(1)] == render_prompt(thinking_tokenizer, msgs)


def test_reasoning_with_a_template_that_drops_it_fails_loudly(tokenizer):
    msgs = [{"role": "user", "content": "2+2?"}]
    with pytest.raises(ValueError, match="no thinking format"):
        render_with_response(tokenizer, msgs, "4", "two plus two")
    assert render_with_response(tokenizer, msgs, "4") == render_with_response(tokenizer, msgs, "4", None)
    assert assistant_message("4") == {"role": "assistant", "content": "4"}


def test_merge_turns_masks_nested_turns_and_separates_the_rest():
    final = ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 1])
    nested = ([1, 2, 3], [0, 1, 1])
    rewritten = ([1, 9, 3], [0, 1, 1])
    (ids, mask), separate = merge_turns([nested, rewritten, final])
    assert ids == final[0] and mask == [0, 1, 1, 0, 0, 1]
    assert separate == [1]


def _multi_turn_row(tokenizer, first_reasoning=None, with_ids=True):
    """A regenerated two-turn trace as generate.py writes it, built with `tokenizer`'s template."""
    conv = Conversation(MULTI, None, "regenerate")
    for text, reasoning in (("Apple.", first_reasoning), ("Carrot.", None)):
        prompt = render_prompt(tokenizer, conv.context())
        full, mask = render_with_response(tokenizer, conv.context(), text, reasoning)
        response = full[len(prompt) :][:-1]  # the generated ids end at <|im_end|>, before the newline
        conv.answers.append(answer(text, reasoning, response if with_ids else None, prompt))
        conv.prompt_ids.append(prompt)
    return trace_row(conv, "openai", "m", "fp")


@pytest.mark.parametrize("with_ids", [True, False])
def test_multi_turn_trace_masks_every_regenerated_turn(tokenizer, with_ids):
    row = json.loads(json.dumps(_multi_turn_row(tokenizer, with_ids=with_ids)))  # as read from the file
    assert [m["role"] for m in turn_contexts(row["messages"], 2)[1]] == [
        "system",
        "user",
        "assistant",
        "user",
    ]
    [(sample_id, ids, mask)] = trace_sequences(tokenizer, row)
    assert sample_id == "mt"
    spans = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert "Apple." in spans and "Carrot." in spans and "Name a fruit" not in spans
    assert "another model" not in tokenizer.decode(ids)  # the prompt's own answer was replaced


def test_turn_whose_history_the_template_rewrites_becomes_its_own_sample(thinking_tokenizer):
    # The thinking template drops turn 0's reasoning from the history of turn 1, so turn 0 as generated
    # (with <think>) is not inside the final sequence: it is trained as a separate sample.
    row = _multi_turn_row(thinking_tokenizer, first_reasoning="a fruit grows on trees", with_ids=False)
    seqs = trace_sequences(thinking_tokenizer, row)
    assert [s[0] for s in seqs] == ["mt", "mt#turn0"]
    final_masked = thinking_tokenizer.decode([t for t, m in zip(seqs[0][1], seqs[0][2], strict=True) if m])
    assert "Carrot." in final_masked and "Apple." not in final_masked
    turn0_masked = thinking_tokenizer.decode([t for t, m in zip(seqs[1][1], seqs[1][2], strict=True) if m])
    assert turn0_masked.startswith("<think>\na fruit grows on trees\n</think>") and "Apple." in turn0_masked
    # Without reasoning the same conversation nests again: one sample, both answers masked.
    [(_, ids, mask)] = trace_sequences(
        thinking_tokenizer, _multi_turn_row(thinking_tokenizer, with_ids=False)
    )
    both = thinking_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert "Apple." in both and "Carrot." in both


def test_tokenize_refuses_a_served_prompt_from_another_template(tokenizer):
    row = _multi_turn_row(tokenizer)
    row["turns"][0]["prompt_token_ids"] = row["turns"][0]["prompt_token_ids"][1:]
    with pytest.raises(ValueError, match="turn 0: prompt renders to other tokens"):
        trace_sequences(tokenizer, row)


def test_length_batches_cap_rows_and_padded_tokens():
    lengths = [10, 300, 12, 11, 1200, 290, 13]
    # rows only: sorted by length, 3 per batch
    assert length_batches(lengths, 3) == [[0, 3, 2], [6, 5, 1], [4]]
    # a token budget splits the long tail: 2 x 300 > 500, so each long prompt stands alone
    assert length_batches(lengths, 8, 500) == [[0, 3, 2, 6], [5], [1], [4]]
    # every index exactly once, however tight the budget
    assert sorted(i for b in length_batches(lengths, 4, 1) for i in b) == list(range(len(lengths)))


# ----------------------------------------------------------------------------- original answers

ORIGINAL = {
    "id": "og",
    "messages": [{"role": "user", "content": "Name a fruit."}],
    "conversation": [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple, from the dataset."},
        {"role": "user", "content": "And a vegetable?"},
        {"role": "assistant", "content": "Carrot, from the dataset."},
    ],
}


def test_original_row_trains_every_dataset_answer(tokenizer):
    row = json.loads(json.dumps(original_row(ORIGINAL, "fp")))  # as read from the file
    assert row["source"] == "original" and row["response"] == "Carrot, from the dataset."
    assert [t["response"] for t in row["turns"]] == ["Apple, from the dataset."]
    assert row["messages"] == ORIGINAL["conversation"][:3]
    [(sample_id, ids, mask)] = trace_sequences(tokenizer, row)
    assert sample_id == "og"
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert "Apple, from the dataset." in trained and "Carrot, from the dataset." in trained
    assert "Name a fruit" not in trained and "vegetable" not in trained
    summary = summarize([row], 0, 0, 1.0)
    assert summary["original_answers"] == 1 and summary["completion_tokens"] == 0
    # no conversation, or an answer before any question: regenerate instead
    assert original_row({"id": "p", "messages": ORIGINAL["messages"]}, "fp") is None
    odd = {**ORIGINAL, "conversation": [{"role": "assistant", "content": "x"}, *ORIGINAL["conversation"]]}
    assert original_row(odd, "fp") is None


def test_uses_original_is_a_stable_share():
    ids = [f"p{i}" for i in range(2000)]
    chosen = [i for i in ids if uses_original(i, 0.7, 0)]
    assert 0.65 < len(chosen) / len(ids) < 0.75
    assert chosen == [i for i in ids if uses_original(i, 0.7, 0)]  # stable across calls
    assert set(chosen) <= {i for i in ids if uses_original(i, 0.9, 0)}  # a larger share adds prompts
    assert not any(uses_original(i, 0.0, 0) for i in ids) and all(uses_original(i, 1.0, 0) for i in ids)


def test_generate_writes_original_answers_without_generating(tmp_path):
    """Share 1 with only dataset conversations: every trace is an original, no model runs (the
    transformers engine has nothing to do); the summary counts them; the tokens carry the source."""
    from draftsmith.core.data.tokens import load_tokens
    from draftsmith.stages.tokenize import tokenize_traces

    prompts = tmp_path / "p.jsonl"
    rows = [{**ORIGINAL, "id": f"og{i}"} for i in range(3)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, summary = tmp_path / "traces.jsonl", tmp_path / "s.json"
    s = GenerateSettings(original_answers_share=1.0)
    result = generate_traces(str(TARGET), str(prompts), str(out), str(summary), s)
    assert result["original_answers"] == 3 and result["generated_now"] == 0
    traces = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["id"] for t in traces] == ["og0", "og1", "og2"]
    assert all(t["source"] == "original" for t in traces)
    tokenize_traces(
        str(TARGET),
        str(out),
        str(tmp_path / "tokens.safetensors"),
        TokenizeSettings(num_shards=1, max_seq_len=1024),
    )
    _, meta = load_tokens(tmp_path / "tokens.safetensors")
    assert meta["sample_sources"] == ["original"] * 3
    with pytest.raises(ValueError, match="original_answers_share"):
        GenerateSettings(original_answers_share=1.5).check()


def test_vllm_children_get_no_thread_caps_and_a_fixed_cpu_kv_cache():
    env = vllm_child_env({"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "PATH": "/bin"}, cpu=True)
    assert env == {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": CPU_KV_CACHE_GIB}
    assert (
        vllm_child_env({"VLLM_CPU_KVCACHE_SPACE": "8"}, cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == "8"
    )  # a user's own


def test_the_cpu_kv_cache_is_set_only_for_vllms_cpu_build():
    """CPU-only settings apply only on CPU: the CUDA build gets no VLLM_CPU_KVCACHE_SPACE."""
    assert vllm_child_env({"OMP_NUM_THREADS": "2"}, cpu=False) == {}
    assert vllm_child_env({"VLLM_TARGET_DEVICE": "cuda"}) == {"VLLM_TARGET_DEVICE": "cuda"}  # vLLM's own rule


def test_served_traffic_trains_on_the_served_answer_and_its_reasoning(thinking_tokenizer):
    """A served request + response (tests/data/shapes/served.jsonl) becomes an original-answer trace
    whose reasoning is trained in the template's thinking format, as the server generated it."""
    from draftsmith.core.data.prompt_sources import read_jsonl_prompts

    prompts, _ = read_jsonl_prompts(REPO / "tests" / "data" / "shapes" / "served.jsonl", 0, None)
    row = json.loads(json.dumps(original_row(prompts[0], "fp")))  # as read back from traces.jsonl
    assert row["response"] == "144." and row["reasoning"] == "12 * 12 = 144."
    assert row["messages"] == [{"role": "user", "content": "What is 12 * 12?"}]
    [(_, ids, mask)] = trace_sequences(thinking_tokenizer, row)
    trained = thinking_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained.startswith("<think>\n12 * 12 = 144.\n</think>\n\n144.")
    # an earlier served answer keeps its reasoning in its own turn, the context holds its text only
    turns = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning": "R2"},
    ]
    row = original_row({"id": "two", "messages": turns[:1], "conversation": turns}, "fp")
    assert row["messages"] == [{k: m[k] for k in ("role", "content")} for m in turns[:3]]
    assert row["turns"][0]["reasoning"] == "R1" and row["reasoning"] == "R2"
