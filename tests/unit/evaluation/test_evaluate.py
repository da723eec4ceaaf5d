"""The evaluation stages end to end on a tiny pipeline (random Llama target with a chat tokenizer,
extracted shards, a briefly trained drafter): the untrained baseline, the offline measurement, the
summary with plots, and the gate through the CLI. The vLLM measurement runs for real in the workflow
test (tests/e2e/test_workflow.py, tiny config); here only its bookkeeping and its missing-extra message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from draftsmith.cli import EXIT_GATE, main
from draftsmith.core.config.stage_settings import EvaluateSettings
from draftsmith.stages.evaluate.stage import (
    NotLossless,
    VllmUnavailable,
    counts_summary,
    evaluate_offline,
    evaluate_vllm,
    histogram_positions,
    offline_device,
    outputs_agree,
    vllm_engine,
    vllm_eval_dtype,
    vllm_method_summary,
    vllm_prompt_counts,
)

AUX = [1, 2, 3]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!:\n")
VOCAB = 3 + len(CHARS)
PNG = b"\x89PNG\r\n\x1a\n"


def save_tiny_target(path: Path) -> None:
    """A 4-layer random Llama with a character-level chat tokenizer, saved as an HF folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)  # fmt: skip
    LlamaForCausalLM(cfg).float().eval().save_pretrained(path)
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def extract_tiny_data(root: Path, target_dir: Path) -> tuple[Path, Path]:
    """Greedy traces of the target on chat prompts -> one shard, data_config.json, vocab_map.pt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.core.data.chat import render_prompt, template_fingerprint
    from draftsmith.core.data.shards import Sample, verify_shard, write_shard
    from draftsmith.core.data.vocab import save_vocab_map
    from draftsmith.core.evaluation.speculate import greedy_decode
    from draftsmith.core.model.layers import capture_aux, stack_aux
    from draftsmith.core.model.target import file_sha256
    from draftsmith.stages.vocab import build_vocab_map

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    samples = []
    for i in range(12):
        prompt = render_prompt(tok, [{"role": "user", "content": f"tell me {i} things about {chr(97 + i)}"}])
        answer = greedy_decode(model, torch.tensor([prompt]), 24, eos_ids=None)
        ids = torch.tensor(prompt + answer)
        with torch.no_grad(), capture_aux(model, AUX) as captured:
            final = model.model(ids[None]).last_hidden_state[0]
            aux = stack_aux(captured, AUX)[0]
        mask = torch.arange(len(ids)) >= len(prompt)
        samples.append(Sample(f"s{i}", ids, mask, aux.to(torch.bfloat16), final.to(torch.bfloat16)))
    shard = root / "hidden" / "shard-0.safetensors"
    write_shard(
        shard,
        samples,
        {"aux_layer_ids": AUX, "layer_convention": "input", "dtype": "bfloat16"},
        codec="none",
        level=1,
        storage_dtype="bfloat16",
    )
    manifest = {
        "version": 1,
        "target": str(target_dir),
        "hidden_size": 32,
        "num_layers": 4,
        "vocab_size": VOCAB,
        "aux_layer_ids": AUX,
        "layer_convention": "input",
        "num_aux": len(AUX),
        "chat_template_fingerprint": template_fingerprint(tok),
        "teacher_agreement": 1.0,
        "min_teacher_agreement": 0.9,
        "shards": [
            {
                "path": "hidden/shard-0.safetensors",
                "num_samples": len(samples),
                "num_tokens": sum(s.num_tokens for s in samples),
                "bytes": shard.stat().st_size,
                "sha256": file_sha256(shard),
                "content_sha256": verify_shard(shard),  # what training checks the shard against
                "teacher_agreement": 1.0,
            }
        ],
    }
    manifest_path = root / "data_config.json"
    manifest_path.write_text(json.dumps(manifest))
    masked = torch.cat([s.input_ids[s.loss_mask] for s in samples])
    vocab_path = root / "vocab_map.pt"
    save_vocab_map(vocab_path, build_vocab_map(masked, VOCAB, 32))
    return manifest_path, vocab_path


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """target/, data_config.json, vocab_map.pt, a drafter trained for a few steps, metrics.jsonl,
    held-out prompts."""
    from draftsmith.core.config.config import settings_defaults
    from draftsmith.stages.train import TrainSettings, train

    root = tmp_path_factory.mktemp("eval")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls
    target = root / "target"
    save_tiny_target(target)
    manifest, vocab = extract_tiny_data(root, target)
    values = {**settings_defaults("train"), "epochs": 2, "max_steps": 6, "batch_tokens": 512, "warmup_steps": 1,
              "ttt_steps": 2, "val_fraction": 0.2, "lr": 3e-3}  # fmt: skip
    settings = TrainSettings.from_dict(values)
    metrics = root / "train" / "metrics.jsonl"
    train(
        manifest,
        vocab,
        root / "drafter",
        root / "train" / "ckpt",
        metrics,
        settings,
        device="cpu",
        progress=False,
    )
    prompts = root / "heldout.jsonl"
    rows = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}: why?"}]} for i in range(3)
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    yield {"root": root, "target": target, "data": manifest, "vocab": vocab, "drafter": root / "drafter",
           "metrics": metrics, "prompts": prompts}  # fmt: skip
    torch.set_num_threads(before)


def cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def untrained(pipeline) -> Path:
    out = pipeline["root"] / "untrained"
    cli(
        "untrained-drafter",
        "--manifest",
        pipeline["data"],
        "--vocab",
        pipeline["vocab"],
        "--out",
        out,
        "--seed",
        0,
    )
    return out


def test_untrained_drafter_is_trainings_starting_point(pipeline, untrained):
    from safetensors.torch import load_file

    from draftsmith.core.export.formats import check_export
    from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter

    assert check_export(untrained, target_num_layers=4, target_vocab_size=VOCAB) == []
    config = json.loads((untrained / "config.json").read_text())
    assert config["draftsmith"]["training"]["summary"]["steps"] == 0
    weights, trained = (
        load_file(untrained / "model.safetensors"),
        load_file(pipeline["drafter"] / "model.safetensors"),
    )
    torch.manual_seed(0)  # train.seed: the same draws as train()'s initialisation
    fresh = Eagle3Drafter(DrafterConfig(**config["draftsmith"]["drafter_config"]))
    fresh.init_linears(config["draftsmith"]["training"]["settings"]["layer_init"])
    torch.testing.assert_close(
        weights["fc.weight"].float(), fresh.fc.weight.detach().to(torch.bfloat16).float()
    )
    assert not torch.equal(weights["fc.weight"], trained["fc.weight"])  # training moved it
    torch.testing.assert_close(weights["d2t"], trained["d2t"])  # same vocabulary map
    # train.head_init random (the default): lm_head and norm are the drafter's own initial draw too
    torch.testing.assert_close(
        weights["lm_head.weight"].float(), fresh.lm_head.weight.detach().to(torch.bfloat16).float()
    )


@pytest.fixture(scope="module")
def offline(pipeline, untrained) -> Path:
    out = pipeline["root"] / "eval" / "offline.json"
    cli("evaluate", "--target", pipeline["target"], "--drafter", pipeline["drafter"], "--untrained", untrained,
        "--prompts", pipeline["prompts"], "--out", out, "--num-prompts", 2, "--max-new-tokens", 20,
        "--num-draft-tokens", 3, "--threads", 1)  # fmt: skip
    return out


def test_offline_measures_every_method_losslessly(offline):
    data = json.loads(offline.read_text())
    assert list(data["methods"]) == ["eagle3", "untrained", "ngram", "suffix", "hybrid"]
    assert data["num_prompts"] == 2 and data["prompt_ids"] == ["p0", "p1"]
    assert len(data["plain"]["outputs"]) == 2 and data["plain"]["tokens"] == sum(
        map(len, data["plain"]["outputs"])
    )
    for name, m in data["methods"].items():
        assert m["lossless"] is True and m["mismatches"] == [], name
        assert m["tokens"] == data["plain"]["tokens"]
        assert len(m["accepted_per_step"]) == len(m["drafted_per_step"]) == m["verify_steps"]
        assert m["drafts"] == sum(1 for d in m["drafted_per_step"] if d > 0)
        assert m["tau"] == pytest.approx(1 + m["accepted_tokens"] / m["drafts"] if m["drafts"] else 1.0)
        assert len(m["acceptance_rate_per_position"]) == 3 and m["speedup"] > 0
    assert (
        data["methods"]["eagle3"]["aux_layer_ids"] == AUX and data["methods"]["ngram"]["settings"]["max"] == 4
    )
    assert all(
        data["methods"][n]["drafts"] == data["methods"][n]["verify_steps"] for n in ("eagle3", "untrained")
    )
    # per-prompt counts (the bootstrap's unit) add up to the totals
    for name, m in data["methods"].items():
        rows = m["per_prompt"]
        assert [r["id"] for r in rows] == ["p0", "p1"], name
        assert sum(r["accepted"] for r in rows) == m["accepted_tokens"]
        assert sum(r["drafts"] for r in rows) == m["drafts"]
        assert [sum(col) for col in zip(*(r["accepted_per_pos"] for r in rows), strict=True)] == m[
            "accepted_per_pos"
        ]


def offline_settings(**values) -> EvaluateSettings:
    """Settings of an offline measurement on one thread, without suffix decoding and the hybrid."""
    return EvaluateSettings(**{"suffix": False, "hybrid": False, "threads": 1, **values})


def test_offline_fails_hard_when_not_lossless(pipeline, untrained, monkeypatch, tmp_path):
    import draftsmith.stages.evaluate.stage as ev

    real = ev.speculative_decode

    def corrupt(*args, **kw):
        res = real(*args, **kw)
        if len(res.tokens) > 4:
            res.tokens[4] = (res.tokens[4] + 1) % VOCAB
        return res

    monkeypatch.setattr(ev, "speculative_decode", corrupt)
    out = tmp_path / "offline.json"
    with pytest.raises(NotLossless, match=r"on prompt 'p0' differs at generated position 4"):
        evaluate_offline(pipeline["target"], {"eagle3": pipeline["drafter"]}, pipeline["prompts"], out,
                         offline_settings(num_prompts=1, max_new_tokens=10, num_draft_tokens=2, ngram=False))  # fmt: skip
    assert json.loads(out.read_text())["methods"]["eagle3"]["lossless"] is False  # written first


def test_offline_sampling_is_seeded(pipeline, tmp_path):
    runs = []
    for n in range(2):
        out = tmp_path / f"s{n}.json"
        evaluate_offline(pipeline["target"], {"eagle3": pipeline["drafter"]}, pipeline["prompts"], out,
                         offline_settings(num_prompts=1, max_new_tokens=12, num_draft_tokens=2, temperature=0.9, seed=3))  # fmt: skip
        runs.append(json.loads(out.read_text()))
    assert runs[0]["plain"]["outputs"] == runs[1]["plain"]["outputs"]
    assert (
        runs[0]["methods"]["eagle3"]["accepted_per_step"] == runs[1]["methods"]["eagle3"]["accepted_per_step"]
    )
    assert runs[0]["methods"]["eagle3"]["lossless"] is None and "distribution" in runs[0]["lossless_check"]


def vllm_result(offline_method: dict, plain_tokens: int, seconds: float, outputs: list) -> dict:
    """A run_vllm_speculative result with the counters vLLM would report for these acceptance counts."""
    k = len(offline_method["accepted_per_pos"])
    return {
        "spec_decode": {
            "drafts": offline_method["drafts"],
            "draft_tokens": offline_method["draft_tokens"],
            "accepted_tokens": offline_method["accepted_tokens"],
            "accepted_per_pos": offline_method["accepted_per_pos"][:k],
        },
        "generated_tokens": plain_tokens,
        "seconds": seconds,
        "load_seconds": 20.0,
        "outputs": outputs,
    }


def test_vllm_bookkeeping():
    r = {"spec_decode": {"drafts": 40, "draft_tokens": 120, "accepted_tokens": 30, "accepted_per_pos": [18, 8, 4]},
         "generated_tokens": 100, "seconds": 2.0, "load_seconds": 25.0, "outputs": []}  # fmt: skip
    r["outputs"] = [[0] * 50, [0] * 50]
    m = vllm_method_summary(r, plain_tps=100.0, num_draft_tokens=3)
    assert m["tau"] == pytest.approx(1.75) and m["acceptance_rate_per_position"] == pytest.approx(
        [0.45, 0.2, 0.1]
    )
    assert m["forwards"] == 70 and m["tokens_per_forward"] == pytest.approx(100 / 70)
    assert m["draft_acceptance_rate"] == pytest.approx(0.25) and m["speedup"] == pytest.approx(0.5)
    plain = vllm_method_summary(
        {"spec_decode": None, "generated_tokens": 10, "seconds": 1.0, "outputs": [[0] * 10]}, 10.0, 3
    )
    assert plain["tau"] == 1.0 and plain["drafts"] == 0
    assert outputs_agree([[1, 2], [3]], [[1, 2], [4]]) == 1


VLLM = EvaluateSettings(num_prompts=1, max_new_tokens=4, num_draft_tokens=2)


def test_vllm_sets_and_outputs_must_match(pipeline, tmp_path):
    with pytest.raises(ValueError, match="differ"):
        evaluate_vllm(
            pipeline["target"], {}, {"a": pipeline["prompts"]}, {"b": tmp_path / "v.json"}, VLLM, None
        )


def test_vllm_per_request_histograms_to_prompt_counts():
    # histogram[j]: verify steps that accepted j of 3 drafts
    assert histogram_positions([5, 3, 2, 1]) == [6, 3, 1]
    result = {"per_request_histograms": [[5, 3, 2, 1], [4, 0, 0, 0]], "outputs": [[1] * 20, [2] * 5]}
    rows = vllm_prompt_counts(["a", "b"], result)
    assert rows == [
        {"id": "a", "tokens": 20, "forwards": 10, "accepted": 3 + 4 + 3, "drafts": 11,
         "accepted_per_pos": [6, 3, 1]},
        {"id": "b", "tokens": 5, "forwards": 5, "accepted": 0, "drafts": 4, "accepted_per_pos": [0, 0, 0]},
    ]  # fmt: skip
    assert vllm_prompt_counts(["a", "b"], {"per_request_histograms": None, "outputs": []}) is None
    # the counters of one held-out set of a batch: every forward counted, tau over drafting steps only
    assert counts_summary(rows[1:], 3) == {
        "forwards": 5,
        "tokens_per_forward": 1.0,
        "draft_share": 0.8,
        "drafts": 4,
        "accepted_tokens": 0,
        "accepted_per_pos": [0, 0, 0],
        "tau": 1.0,
        "acceptance_rate_per_position": [0.0, 0.0, 0.0],
    }
    both = counts_summary(rows, 3)
    assert both["tau"] == pytest.approx(1 + 10 / 15) and both["tokens_per_forward"] == pytest.approx(25 / 15)


def test_vllm_missing_says_how_to_skip(pipeline, monkeypatch, tmp_path):
    import draftsmith.stages.evaluate.stage as ev

    monkeypatch.setattr(ev, "vllm_available", lambda: False)
    with pytest.raises(VllmUnavailable, match=r"evaluate\.vllm: false"):
        evaluate_vllm(
            pipeline["target"], {}, {"s": pipeline["prompts"]}, {"s": tmp_path / "v.json"}, VLLM, None
        )


def fake_vllm(offline: dict) -> dict:
    """vllm.json as vLLM would write it for the same acceptance counts (the real one runs in the workflow
    test)."""
    outputs, plain_tokens = offline["plain"]["outputs"], offline["plain"]["tokens"]
    methods = {
        name: {"kind": name if name in ("ngram", "suffix") else "eagle3", "drafter": None,
               **vllm_method_summary(vllm_result(m, plain_tokens, 2.0, outputs), plain_tokens / 1.0, 3),
               "per_prompt": m["per_prompt"], "outputs_equal_plain": len(outputs)}
        for name, m in offline["methods"].items() if name != "untrained"
    }  # fmt: skip
    return {"num_prompts": offline["num_prompts"], "prompt_ids": offline["prompt_ids"], "device": "cpu",
            "num_draft_tokens": offline["num_draft_tokens"], "context_tokens": 100.0,
            "plain": {"tokens": plain_tokens, "seconds": 1.0, "tokens_per_s": plain_tokens, "outputs": outputs},
            "methods": methods}  # fmt: skip


def test_summary_report_and_gate(pipeline, offline, untrained, tmp_path):
    hand = tmp_path / "hand-offline.json"
    handwritten = Path(__file__).parents[3] / "draftsmith" / "data" / "heldout_handwritten.jsonl"
    cli("evaluate", "--target", pipeline["target"], "--drafter", pipeline["drafter"], "--untrained", untrained,
        "--prompts", handwritten, "--out", hand, "--num-prompts", 2, "--max-new-tokens", 12,
        "--num-draft-tokens", 3, "--threads", 1)  # fmt: skip
    vllm_path = tmp_path / "vllm.json"
    vllm_path.write_text(json.dumps(fake_vllm(json.loads(offline.read_text()))))
    out = tmp_path / "eval"
    common = ["--offline", f"heldout={offline}", "--offline", f"handwritten={hand}", "--vllm", f"heldout={vllm_path}",
              "--manifest", pipeline["data"], "--drafter", pipeline["drafter"], "--target", pipeline["target"],
              "--metrics", pipeline["metrics"], "--out", out]  # fmt: skip
    relaxed = ["--check", "beats_free=warn", "--check", "beats_untrained=warn", "--max-acc-gap", 1.0]
    # the pre-flight's lines lead the page where its preflight.json exists
    preflight = tmp_path / "preflight.json"
    preflight.write_text(
        json.dumps({"sets": {"heldout": {"line": "heldout: serve suffix (k = 3) at 1.19x"}}})
    )
    printed = cli("eval-summary", *common, *relaxed, "--preflight-json", preflight)
    assert printed.startswith("VERDICT: ")
    for name in ("training.png", "acceptance.png", "per_forward.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gate_passed"], summary["checks"]
    assert list(summary["heldout_sets"]) == ["heldout", "handwritten"]
    assert summary["heldout_sets"]["handwritten"]["prompts"] == str(handwritten)
    head = summary["headline"]
    assert head["heldout"]["measured_by"] == "vLLM" and head["handwritten"]["measured_by"] == "offline"
    trained = [r for r in summary["rows"] if r.get("key") == "eagle3"]
    assert {(r["heldout"], r["measured_by"]) for r in trained} == {("heldout", "offline"), ("heldout", "vLLM"),
                                                                   ("handwritten", "offline")}  # fmt: skip
    by = {(r["heldout"], r["measured_by"]): r for r in trained}
    assert by["heldout", "vLLM"]["tokens_per_forward"] == pytest.approx(
        by["heldout", "offline"]["tokens_per_forward"]
    )
    for r in trained:
        lo, hi = r["tau_interval"]
        assert lo <= r["tau"] <= hi and len(r["acceptance_intervals"]) == 3
        lo, hi = r["tokens_per_forward_interval"]
        assert lo <= r["tokens_per_forward"] <= hi
    # the judged measurement is projected to the serving point (the schema's: an H100 at 1, 8, 32)
    served = by["heldout", "vLLM"]
    assert len(served["projected_speedup"]) == 3 and 1 <= served["k"] <= 3
    assert by["heldout", "offline"]["projected_speedup"] is None
    assert (
        summary["projection"]["concurrency"] == [1, 8, 32]
        and "H100-80GB" in summary["projection"]["points"][0]
    )
    assert "projected speedup" in summary["projection"]["formula"]
    # per set the serving policy over the grid 1, 2, 4, ..., 32 and the drafter against its break-even
    for name, heldout in summary["heldout_sets"].items():
        assert heldout["policy"]["grid"] == [1, 2, 4, 8, 16, 32], name
        room = heldout["acceptance_vs_break_even"]
        assert len(room["position_acceptance"]) == 3 and room["ceiling"] > 0, name
    names = [c["name"] for c in summary["checks"]]
    assert {
        "beats_free (heldout)",
        "beats_untrained (handwritten)",
        "speedup",
        "tau_gap (eagle3, heldout)",
    } <= set(names)
    speed = next(c for c in summary["checks"] if c["name"] == "speedup")
    assert speed["status"] == "skip"  # the evaluation's engines are no fair measurement: not judged
    html = (out / "summary.html").read_text()
    assert "<table>" in html and "Gate: PASSED" in html
    assert html.index("heldout: serve suffix (k = 3) at 1.19x") < html.index("Decision per held-out set")
    assert summary["preflight"]["lines"] == ["heldout: serve suffix (k = 3) at 1.19x"]
    assert (
        html.index("Decision per held-out set") < html.index("Verdict") < html.index("<table class='wide'>")
    )
    assert html.count("data:image/png;base64,") == 3  # the plots, inside the page
    assert (
        (out / "summary.tsv")
        .read_text()
        .splitlines()[0]
        .startswith("held-out set\tmethod\tmeasured by\tprompts")
    )
    assert " ± " in (out / "summary.tsv").read_text()
    printed = cli("gate", out / "summary.json", "--out", out / "gate.json")
    assert printed.startswith("VERDICT: ") and "trained drafter" in printed and "gate passed" in printed
    assert json.loads((out / "gate.json").read_text())["passed"]

    # n-gram lookup yields far more per target forward in vLLM: blocking by default, the gate fails
    # naming it first
    strong = json.loads(vllm_path.read_text())
    ngram = strong["methods"]["ngram"]
    ngram["tau"] = 4.0
    ngram["per_prompt"] = [{**r, "forwards": max(r["tokens"] // 4, 1)} for r in ngram["per_prompt"]]
    (tmp_path / "vllm-ngram.json").write_text(json.dumps(strong))
    args = [f"heldout={tmp_path / 'vllm-ngram.json'}" if a == f"heldout={vllm_path}" else a for a in common]
    cli("eval-summary", *args, "--check", "beats_untrained=warn", "--max-acc-gap", 1.0)
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["gate_passed"] and "Gate: FAILED" in (out / "summary.html").read_text()
    assert summary["verdict"]["per_set"][0]["deploy"] == "n-gram lookup"
    printed = cli("gate", out / "summary.json", "--out", tmp_path / "never.json", code=EXIT_GATE)
    diagnosis = printed[printed.index("\ncheck ") + 1 :].splitlines()
    assert diagnosis[1].startswith("beats_free (heldout)") and "FAIL" in diagnosis[1]
    # on the hand-written prompts the tiny drafter's passes cost more than the free methods save: it fails too
    assert "the acceptance gate failed on 2 check(s): beats_free (heldout)" in printed
    assert "beats_free (handwritten)" in printed
    assert not (tmp_path / "never.json").exists()

    # vLLM sees a different drafter than the one measured offline: an integration failure
    broken = json.loads(vllm_path.read_text())
    broken["methods"]["eagle3"].update(
        tau=1.0, drafts=500, accepted_tokens=0, acceptance_rate_per_position=[0.0] * 3
    )
    broken_off = json.loads(offline.read_text())
    broken_off["methods"]["eagle3"]["tau"] = 1.6  # as if the offline drafter were accepted often
    broken_off["methods"]["eagle3"]["accepted_per_step"] = [1, 0, 2, 0, 1] * 100
    (tmp_path / "off2.json").write_text(json.dumps(broken_off))
    (tmp_path / "vllm2.json").write_text(json.dumps(broken))
    swap = {
        f"heldout={offline}": f"heldout={tmp_path / 'off2.json'}",
        f"heldout={vllm_path}": f"heldout={tmp_path / 'vllm2.json'}",
    }
    cli("eval-summary", *[swap.get(a, a) for a in common], *relaxed)
    printed = cli("gate", out / "summary.json", code=EXIT_GATE)
    assert "tau_gap (eagle3, heldout)" in printed.split("failed on 1 check(s): ")[1]
    assert printed.startswith("VERDICT: DEPLOY ") and "; next: CONTRACT BROKEN\n" in printed

    # bad usage: a held-out set named twice, an unknown gate mode
    cli("eval-summary", *common, "--offline", f"heldout={offline}", code=2)
    cli("eval-summary", *common, "--check", "speedup=sometimes", code=2)


# ------------------------------------------------------------------------ the device it runs on


def test_vllm_evaluates_in_the_targets_dtype_on_gpus_and_float32_on_a_cpu():
    assert vllm_eval_dtype("bfloat16", gpus=8) == "bfloat16"
    assert vllm_eval_dtype("float32", gpus=1) == "float32"
    assert vllm_eval_dtype("bfloat16", gpus=0) == "float32"  # tokens equal the offline decoder's
    assert vllm_eval_dtype("auto", gpus=0) == "float32"


def test_offline_decoding_runs_on_the_jobs_gpu(monkeypatch):
    assert offline_device(0) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--gpus 1, but torch sees no CUDA device"):
        offline_device(1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert offline_device(1) == "cuda"


def evaluate_vllm_call(monkeypatch, tmp_path, *options: str) -> dict:
    """How `draftsmith evaluate-vllm ... OPTIONS` runs vLLM (vllm_engine of the settings it passes to
    evaluate_vllm, recorded, not run)."""
    import draftsmith.stages.evaluate as ev

    calls = []
    monkeypatch.setattr(ev, "evaluate_vllm", lambda *a, **kw: calls.append(vllm_engine(a[4])))
    monkeypatch.setattr(ev, "checked_drafters", lambda drafter, untrained, target: {"eagle3": drafter})
    monkeypatch.setattr(ev, "export_draft_positions_warning", lambda *a: None)
    (tmp_path / "p.jsonl").touch()
    args = ["evaluate-vllm", "--target", str(tmp_path), "--drafter", str(tmp_path), "--prompts",
            f"s={tmp_path / 'p.jsonl'}", "--out", f"s={tmp_path / 'v.json'}", *options]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return calls[0]


def test_vllm_evaluation_on_a_cpu_is_eager_float32_in_one_process(monkeypatch, tmp_path):
    kw = evaluate_vllm_call(monkeypatch, tmp_path, "--gpus", "0", "--dtype", "auto")
    assert (kw["dtype"], kw["enforce_eager"], kw["tensor_parallel_size"]) == ("float32", True, 1)
    assert kw["gpu_memory_utilization"] is None and kw["timeout_s"] == 900


def test_vllm_evaluation_on_gpus_compiles_unless_told_otherwise(monkeypatch, tmp_path):
    kw = evaluate_vllm_call(
        monkeypatch, tmp_path, "--gpus", "2", "--dtype", "bfloat16", "--vllm-timeout-s", "60"
    )
    assert (kw["dtype"], kw["enforce_eager"], kw["tensor_parallel_size"]) == ("bfloat16", False, 2)
    assert (kw["gpu_memory_utilization"], kw["timeout_s"]) == (0.9, 60)
    assert evaluate_vllm_call(monkeypatch, tmp_path, "--gpus", "2", "--vllm-eager")["enforce_eager"] is True


def test_a_vllm_run_past_its_time_limit_fails_in_one_line(monkeypatch, tmp_path):
    import draftsmith.stages.evaluate as ev
    import draftsmith.stages.evaluate.vllm_runner as spec

    monkeypatch.setattr(spec, "run_with_timeout", lambda cmd, env, log, timeout: None)
    with pytest.raises(spec.VllmTimeout) as err:
        spec.run_vllm_subprocess("t", None, None, [[1]], 4, 3, "float32", seed=0, temperature=0.0, gpu_memory_utilization=None, timeout=60, log_path=tmp_path / "plain.log",
                                 run_name="plain")  # fmt: skip
    assert str(err.value) == (
        "vLLM run 'plain' did not finish within 60 s, engine load included (raise "
        f"resources.evaluate.vllm_timeout_s for a target that loads slowly); its log: {tmp_path / 'plain.log'}"
    )
    monkeypatch.setattr(
        "draftsmith.stages.evaluate.evaluate_vllm", lambda *a, **kw: (_ for _ in ()).throw(err.value)
    )
    monkeypatch.setattr(ev, "checked_drafters", lambda drafter, untrained, target: {"eagle3": drafter})
    monkeypatch.setattr(ev, "export_draft_positions_warning", lambda *a: None)
    (tmp_path / "p.jsonl").touch()
    args = ["evaluate-vllm", "--target", str(tmp_path), "--drafter", str(tmp_path), "--prompts",
            f"s={tmp_path / 'p.jsonl'}", "--out", f"s={tmp_path / 'v.json'}"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"error: the vLLM measurement failed: {err.value}"]


def test_an_offline_evaluation_is_kept_by_what_it_measured_and_reused(tmp_path, monkeypatch):
    """A rerun of the same measurement (a deleted manifest rebuilt to the same bytes re-plans it) decodes
    nothing: the kept result is written as the output. Another setting or drafter measures again; where
    it runs (threads) does not."""
    import draftsmith.stages.evaluate as ev
    from draftsmith.core.config.stage_settings import OfflineEvaluateSettings
    from draftsmith.core.io.atomic import write_json

    target, drafter = tmp_path / "target", tmp_path / "drafter"
    for folder in (target, drafter):
        folder.mkdir()
        (folder / "config.json").write_text('{"a": 1}')
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    decoded = []

    def evaluate_offline(target, drafters, prompts, out, settings):
        decoded.append(settings.max_new_tokens)
        result = {"decoded": len(decoded)}
        write_json(out, result)
        return result

    monkeypatch.setattr(ev, "evaluate_offline", evaluate_offline)
    monkeypatch.setattr(ev, "_drafters", lambda paths, settings: {"eagle3": str(drafter)})

    def run(out: str, **settings) -> dict:
        paths = ev.EvaluatePaths(
            str(target), str(drafter), None, str(prompts), str(tmp_path / out), str(tmp_path / "runs")
        )
        ev.run(paths, OfflineEvaluateSettings.from_dict(settings))
        return json.loads((tmp_path / out).read_text())

    assert run("a.json") == {"decoded": 1}
    assert run("b.json", threads=1) == {"decoded": 1} and len(decoded) == 1  # kept: nothing decoded
    assert run("c.json", max_new_tokens=7) == {"decoded": 2}
    (drafter / "config.json").write_text('{"a": 2}')
    assert run("d.json") == {"decoded": 3}
