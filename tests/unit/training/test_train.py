"""EAGLE-3 training on a tiny random Llama target: offsets, the TTT objective, the loop, resume."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.data import TINY_AUX_IDS, TINY_DRAFT_VOCAB, TINY_HIDDEN, TINY_LAYERS, TINY_VOCAB, make_tiny_data
from helpers.model import fp_tolerance
from helpers.training import build, checkpoints_of, cli_train, objective, rows, run, run_folder, settings
from safetensors.torch import load_file

from draftsmith.core.data.loader import collate
from draftsmith.core.data.shards import iter_samples, verify_shard, write_shard
from draftsmith.core.export.formats import check_export, load_drafter
from draftsmith.core.model.drafter import TTTKV, build_drafter
from draftsmith.core.model.target import file_sha256, load_target_head
from draftsmith.core.training.checkpoints import list_checkpoints, step_of
from draftsmith.core.training.objective import (
    EVAL_MASK_OFFSET,
    Objective,
    real_positions,
    ttt_loss,
    ttt_step_counts,
    ttt_step_targets,
)
from draftsmith.core.training.optimizers import lr_factor, make_optimizer
from draftsmith.stages.train import TrainSettings, train


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_tiny_data(tmp_path_factory.mktemp("train-data"))


# ---------------------------------------------------------------------------------------------- offsets


def test_step_targets_hand_example() -> None:
    # sample 0: 6 tokens, prompt x0 x1, assistant x2..x5 except x3; sample 1: 4 tokens, assistant x1..x3
    loss_mask = torch.tensor([[0, 0, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    lengths = torch.tensor([6, 4])
    expected_valid = {
        # step 0, position t predicts x_{t+2}
        0: [[1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]],
        # step 1: x_{t+3}
        1: [[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]],
        # step 2: x_{t+4}
        2: [[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
    }
    for step, valid_rows in expected_valid.items():
        valid, src, tgt = ttt_step_targets(loss_mask, lengths, step, EVAL_MASK_OFFSET)
        assert valid.tolist() == [[bool(v) for v in r] for r in valid_rows], step
        # input token / teacher state t+1+j, predicted token t+2+j, clamped to T-1 (never valid there)
        assert src.tolist() == [min(t + 1 + step, 5) for t in range(6)]
        assert tgt.tolist() == [min(t + 2 + step, 5) for t in range(6)]


def test_lr_schedule() -> None:
    assert lr_factor(0, 4, 20) == pytest.approx(0.25)
    assert lr_factor(3, 4, 20) == pytest.approx(1.0)
    assert lr_factor(4, 4, 20) == pytest.approx(1.0)
    assert lr_factor(20, 4, 20) == pytest.approx(0.1)
    assert lr_factor(12, 4, 20) == pytest.approx(0.55)


def test_settings_from_dict_names_bad_keys() -> None:
    good = settings().to_dict()
    assert TrainSettings.from_dict(good) == settings()
    with pytest.raises(ValueError, match="unknown train settings: bogus"):
        TrainSettings.from_dict({**good, "bogus": 1})
    assert TrainSettings.from_dict({k: v for k, v in good.items() if k != "lr"}).lr == TrainSettings().lr
    with pytest.raises(ValueError, match="train.ttt_steps: 0 is less than the minimum of 1"):
        TrainSettings.from_dict({**good, "ttt_steps": 0})


# -------------------------------------------------------------------------------------------- objective


def test_validation_view_keeps_steps_weights_precision_and_drops_training_options() -> None:
    options = {"noise_std": 0.05, "mask_offset": 0, "loss_norm": "sample", "loss_positions": "all"}
    views = {"ttt_prefix": "lagged", "ttt_positions": "fixed"}
    trained = Objective.from_settings(
        settings(ttt_steps=4, ttt_decay=0.5, precision="bf16", **options, **views)
    )
    assert trained.step_weights == (1.0, 0.5, 0.25, 0.125) and trained.precision == "bf16"
    view = trained.for_validation()
    assert (view.ttt_steps, view.step_weights, view.precision) == (4, trained.step_weights, "bf16")
    assert (view.noise_std, view.mask_offset, view.loss_norm, view.loss_positions) == (
        0,
        2,
        "position",
        "assistant",
    )
    assert (view.ttt_prefix, view.ttt_positions) == ("accepted", "advance")
    assert view.for_validation() == view


def reference_loss(
    drafter, embed, teacher_weight, batch, steps: int, decay: float, lagged=False, advance=True
) -> torch.Tensor:
    """EAGLE cnets.py's formulation: full-length forward per step, inputs/teacher/mask shifted left by
    one per step (zero padded), position ids + j (advance=False: SpecForge's fixed ids; lagged: its
    step-0 keys hidden from t-j+1 on)."""
    B, T = batch.input_ids.shape

    def shift(x: torch.Tensor) -> torch.Tensor:  # x[:, t] <- x[:, t+1], zero at the end
        return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)

    inputs = shift(batch.input_ids)  # position t reads x_{t+1}
    teacher = shift(torch.softmax(batch.final.float() @ teacher_weight.T, -1))  # f_{t+1}
    mask = shift(shift(batch.loss_mask.float()))  # x_{t+2} is an assistant token (0 past the end)
    hidden = drafter.fuse(batch.aux.float())
    kv, pos, total = TTTKV(prefix_lag=lagged), torch.arange(T).expand(B, T), 0.0
    for j in range(steps):
        logits, hidden = drafter(F.embedding(inputs, embed), hidden, pos + (j if advance else 0), kv)
        ce = -(teacher * torch.log_softmax(logits, -1)).sum(-1)
        total = total + decay**j * (ce * mask).sum() / mask.sum()
        inputs, teacher, mask = shift(inputs), shift(teacher), shift(mask)
    return total


def test_ttt_loss_matches_reference_formulation(data: dict) -> None:
    drafter, embed, teacher = build(data)
    batch = collate(data["samples"][:4])
    loss, stats = ttt_loss(drafter, embed, teacher, batch, objective())
    ref = reference_loss(drafter, embed, teacher, batch, 3, 0.8)
    # fp32, two formulations: 3 TTT steps of fc -> decoder layer -> lm_head (6 matmuls), longest sum 3H
    tol = fp_tolerance(torch.float32, 3 * 6, 3 * TINY_HIDDEN, scale=ref.abs())
    torch.testing.assert_close(loss, ref, **tol)
    assert stats.count[0] >= stats.count[1] >= stats.count[2] > 0
    # greedy traces: the target's argmax reproduces the next token wherever it lies in the draft vocab
    assert stats.teacher_acc() > 0.9
    # agreement with the teacher's top-1, counted by hand at step 0 (t predicts t+2 from f_{t+1})
    valid, src, _ = ttt_step_targets(batch.loss_mask, batch.lengths, 0, EVAL_MASK_OFFSET)
    b, t = valid.nonzero(as_tuple=True)
    with torch.no_grad():
        hidden = drafter.midlayer(
            F.embedding(batch.input_ids[:, src], embed),
            drafter.fuse(batch.aux.float()),
            torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids),
            TTTKV(),
        )
        drafted = drafter.lm_head(drafter.norm(hidden[b, t])).argmax(-1)
    wanted = (batch.final[b, src[t]].float() @ teacher.T).argmax(-1)
    assert stats.agree[0] == int((drafted == wanted).sum())
    assert stats.agreement()[0] == stats.agree[0] / stats.count[0]


@pytest.mark.parametrize(
    ("prefix", "positions"), [("lagged", "advance"), ("accepted", "fixed"), ("lagged", "fixed")]
)
def test_specforge_ttt_views_change_only_later_steps(data: dict, prefix: str, positions: str) -> None:
    """SpecForge's TTT view (step j sees step-0 keys <= t-j, position t) leaves step 0 as it is and
    changes every later step's loss; it matches the cnets-style formulation with that view."""
    drafter, embed, teacher = build(data)
    attn = drafter.midlayer.self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        torch.nn.init.normal_(proj.weight, std=0.5)  # attention dominates: positions and masks show
    batch = collate(data["samples"][:4])
    kw = {"ttt_prefix": prefix, "ttt_positions": positions}
    one, _ = ttt_loss(drafter, embed, teacher, batch, objective(1, **kw))
    torch.testing.assert_close(one, ttt_loss(drafter, embed, teacher, batch, objective(1))[0])
    loss, view = ttt_loss(drafter, embed, teacher, batch, objective(**kw))
    _, default = ttt_loss(drafter, embed, teacher, batch, objective())
    assert view.loss_sum[0] == pytest.approx(default.loss_sum[0], rel=1e-6)
    # fp32, two formulations: 3 TTT steps of fc -> decoder layer -> lm_head (6 matmuls), longest sum 3H
    rtol = fp_tolerance(torch.float32, 3 * 6, 3 * TINY_HIDDEN)["rtol"]
    assert all(
        abs(a - b) > rtol * abs(b) for a, b in zip(view.loss_sum[1:], default.loss_sum[1:], strict=True)
    )
    ref = reference_loss(drafter, embed, teacher, batch, 3, 0.8, lagged=prefix == "lagged",
                         advance=positions == "advance")  # fmt: skip
    torch.testing.assert_close(loss, ref, rtol=rtol, atol=rtol * float(ref.abs()))


def test_bf16_autocast_loss_is_close_to_fp32(data: dict) -> None:
    drafter, embed, teacher = build(data)
    batch = collate(data["samples"][:4])
    fp32, _ = ttt_loss(drafter, embed, teacher, batch, objective(precision="fp32"))
    bf16, _ = ttt_loss(drafter, embed, teacher, batch, objective(precision="bf16"))
    assert bf16.dtype == torch.float32  # the loss itself is computed in fp32
    # autocast rounds each matmul's inputs to bf16 (sums stay fp32); the loss averages those roundings
    # over every token and step, so it stays within about one bf16 rounding of the fp32 loss
    torch.testing.assert_close(bf16, fp32, **fp_tolerance(torch.bfloat16, 1, scale=0))
    assert float(bf16.detach()) != float(fp32.detach())  # autocast did change the matmuls


def test_ttt_steps_reduce_loss(data: dict) -> None:
    torch.set_num_threads(1)
    drafter, embed, teacher = build(data)
    batch = collate(data["samples"][:4])
    opt = make_optimizer(drafter, settings(lr=1e-3))
    losses = []
    for _ in range(6):
        loss, _ = ttt_loss(drafter, embed, teacher, batch, objective())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    # the embedding stays frozen and outside the drafter
    assert not any(p.data_ptr() == embed.data_ptr() for p in drafter.parameters())
    assert "embed_tokens.weight" not in drafter.state_dict()


# ---------------------------------------------------------------------------------------------- the loop


def test_train_writes_export_metrics_checkpoint(data: dict, tmp_path: Path) -> None:
    summary = run(data, tmp_path, settings(max_steps=3))
    assert summary["steps"] == 3 and summary["stopped_early"] and summary["resumed_from_step"] is None
    assert len(summary["train_acc"]) == 3

    out = tmp_path / "drafter"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert check_export(out, target_num_layers=TINY_LAYERS, target_vocab_size=TINY_VOCAB) == []
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == TINY_AUX_IDS
    assert config["draftsmith"]["training"]["summary"]["steps"] == 3
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 3
    model, _ = load_drafter(out)
    assert model.cfg.draft_vocab_size == TINY_DRAFT_VOCAB and model.cfg.target_hidden_size == TINY_HIDDEN

    train_rows = [r for r in rows(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    first = train_rows[0]
    assert set(first) >= {"step", "epoch", "lr", "loss", "acc", "step_loss", "positions", "tokens_per_s"}
    assert len(first["acc"]) == 3 and first["epoch"] == 1
    assert first["lr"] == pytest.approx(3e-3 * 0.5)  # warm-up step 1 of 2

    ckpts = sorted(p.name for p in run_folder(tmp_path).iterdir())
    assert ckpts == ["resume_key.json", "step-3"]
    step3 = run_folder(tmp_path) / "step-3"
    for name in (
        "model.safetensors",
        "optimizer.pt",
        "trainer.pt",
        "state.json",
        "metrics.jsonl",
        "COMPLETE",
    ):
        assert (step3 / name).is_file(), name
    state = json.loads((step3 / "state.json").read_text())
    assert state["step"] == 3 and state["epoch"] == 0 and state["batch_in_epoch"] == 3


def test_training_learns(data: dict, tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="draftsmith.stages.train"):
        summary = run(data, tmp_path, settings(epochs=4, noise_std=0.0, lr=5e-3), progress=True)
    # progress goes through logging: the first step, then at most every PROGRESS_EVERY_S, every validation
    lines = [r.getMessage() for r in caplog.records if r.name == "draftsmith.stages.train"]
    assert any(line.startswith("epoch 1 step 1/") and " train loss " in line for line in lines), lines
    assert sum(" val loss " in line for line in lines) == 4, lines
    val = [r for r in rows(tmp_path) if r["kind"] == "val"]
    assert len(val) == 4 and summary["val_samples"] > 0
    assert val[-1]["loss"] < val[0]["loss"]
    assert summary["train_acc"][0] > 0.3, summary
    # keeps the newest two complete checkpoints
    names = list_checkpoints(run_folder(tmp_path))
    assert [p.name for p in names] == [f"step-{sum(summary['steps_per_epoch'][:k])}" for k in (3, 4)]


@pytest.mark.parametrize("stop", ["epoch_end", "mid_epoch"])
def test_resume_gives_identical_weights(data: dict, tmp_path: Path, stop: str, caplog) -> None:
    s = settings()
    full = run(data, tmp_path / "full", s)
    assert full["steps"] == sum(full["steps_per_epoch"]) and not full["stopped_early"]
    k = full["steps_per_epoch"][0] if stop == "epoch_end" else 2

    first = run(data, tmp_path / "resumed", replace(s, max_steps=k))  # "interrupted" after k steps
    assert first["steps"] == k
    with caplog.at_level(logging.INFO, logger="draftsmith.stages.train"):
        second = run(data, tmp_path / "resumed", s)
    assert second["resumed_from_step"] == k and second["steps"] == full["steps"]
    assert any(f"resumed from step {k}" in r.getMessage() for r in caplog.records)

    a = load_file(str(run_folder(tmp_path / "full") / f"step-{full['steps']}" / "model.safetensors"))
    b = load_file(str(run_folder(tmp_path / "resumed") / f"step-{full['steps']}" / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ea = load_file(str(tmp_path / "full" / "drafter" / "model.safetensors"))
    eb = load_file(str(tmp_path / "resumed" / "drafter" / "model.safetensors"))
    assert all(torch.equal(ea[n], eb[n]) for n in ea)

    def losses(root: Path) -> list:
        return [(r["kind"], r["step"], r["loss"]) for r in rows(root) if r["kind"] in ("train", "val")]

    assert losses(tmp_path / "full") == losses(tmp_path / "resumed")
    assert full["val_acc"] == second["val_acc"]


def test_partial_or_foreign_checkpoints_are_not_resumed(data: dict, tmp_path: Path, caplog) -> None:
    legacy = tmp_path / "checkpoints" / "step-99"
    legacy.mkdir(parents=True)
    (legacy / "state.json").write_text("{}")  # an older layout's step folder, and partial
    summary = run(data, tmp_path, settings(max_steps=2))
    assert summary["resumed_from_step"] is None and summary["steps"] == 2
    assert not legacy.exists()

    with caplog.at_level(logging.WARNING, logger="draftsmith.core.training.checkpoints"):
        summary = run(data, tmp_path, settings(max_steps=1, lr=1e-3))  # other settings: start fresh
    assert summary["resumed_from_step"] is None and summary["steps"] == 1
    assert any("not resuming" in r.getMessage() and "lr" in r.getMessage() for r in caplog.records)
    assert [p.name for p in list_checkpoints(run_folder(tmp_path))] == ["step-1"]

    # max_steps and threads may change between runs: resume and go on
    summary = run(data, tmp_path, settings(max_steps=2, lr=1e-3, threads=2))
    assert summary["resumed_from_step"] == 1 and summary["steps"] == 2


def test_finished_run_trains_afresh(data: dict, tmp_path: Path, caplog) -> None:
    """A rerun of a finished run (snakemake --forcerun train) trains again instead of resuming its last
    checkpoint and re-exporting it; --fresh discards the checkpoints of an unfinished one."""
    s = settings(max_steps=2)
    first = run(data, tmp_path, s)
    with caplog.at_level(logging.INFO, logger="draftsmith.core.training.checkpoints"):
        again = run(data, tmp_path, s)
    assert again["resumed_from_step"] is None and again["trained_tokens"] == first["trained_tokens"] > 0
    assert any("trains afresh" in r.getMessage() for r in caplog.records)
    assert [r["step"] for r in rows(tmp_path) if r["kind"] == "train"] == [1, 2]

    run(data, tmp_path, settings(max_steps=1, epochs=3))  # another run, stopped early
    fresh = train(
        data["manifest"], data["vocab"], tmp_path / "drafter", tmp_path / "checkpoints",
        tmp_path / "metrics.jsonl", settings(max_steps=2, epochs=3), progress=False, fresh=True,
    )  # fmt: skip
    assert fresh["resumed_from_step"] is None and fresh["steps"] == 2


def changed_copy(data: dict, root: Path) -> Path:
    """The same shards (names, sample counts, token counts) with every aux state changed -> manifest."""
    manifest = json.loads(data["manifest"].read_text())
    for shard in manifest["shards"]:
        src = data["root"] / shard["path"]
        samples = [replace(s, aux=(s.aux.float() + 0.5).to(s.aux.dtype)) for s in iter_samples(str(src))]
        meta = {"aux_layer_ids": TINY_AUX_IDS, "layer_convention": "input", "dtype": "bfloat16"}
        path = root / shard["path"]
        write_shard(path, samples, meta, codec="none", level=1, storage_dtype="bfloat16")
        shard.update(bytes=path.stat().st_size, sha256=file_sha256(path), content_sha256=verify_shard(path))
    out = root / "data_config.json"
    out.write_text(json.dumps(manifest))
    return out


def test_changed_data_content_trains_afresh(data: dict, tmp_path: Path, caplog) -> None:
    """Re-extracted shards with the same names and counts but other tensors: no resume."""
    first = run(data, tmp_path, settings(max_steps=1, epochs=3))
    assert first["steps"] == 1
    other = changed_copy(data, tmp_path / "other")
    with caplog.at_level(logging.WARNING, logger="draftsmith.core.training.checkpoints"):
        second = train(
            other, data["vocab"], tmp_path / "drafter", tmp_path / "checkpoints", tmp_path / "metrics.jsonl",
            settings(max_steps=2, epochs=3), progress=False,
        )  # fmt: skip
    assert second["resumed_from_step"] is None and second["steps"] == 2
    assert any("data.shards" in r.getMessage() for r in caplog.records)
    assert [r["kind"] for r in rows(tmp_path)].count("resume") == 0


# ------------------------------------------------------------------------------------------ the loader


def test_target_head_read_directly_equals_model(data: dict, tmp_path: Path) -> None:
    """embed/lm_head/norm read from the safetensors (no model built) equal the loaded model's, for a
    tied and an untied target."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    untied = tmp_path / "untied"
    cfg = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(untied)
    for folder in (data["target"], untied):
        head = load_target_head(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert torch.equal(head.embed, model.get_input_embeddings().weight)
        assert torch.equal(head.lm_head, model.get_output_embeddings().weight)
        assert torch.equal(head.norm, model.model.norm.weight)
        assert head.config.hidden_size == TINY_HIDDEN


# ------------------------------------------------------------------------------------------- real kill


def test_killed_run_resumes_to_identical_weights(data: dict, tmp_path: Path) -> None:
    """SIGKILL a real `draftsmith train` process once a mid-run checkpoint exists, rerun the same
    command: the final weights equal an uninterrupted run's bit for bit (CPU, 1 thread)."""
    import signal
    import subprocess
    import time

    s = settings(epochs=6, checkpoint_every=4, noise_std=0.05)
    full = run(data, tmp_path / "full", s)
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cli_train(data["manifest"], data["vocab"], killed, s),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not checkpoints_of(killed):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0].decode(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill:\n{out[-3000:]}"
    assert not (killed / "drafter").exists()
    done = checkpoints_of(killed)
    assert done and step_of(done[-1]) < full["steps"], [p.name for p in done]
    (killed / "metrics.jsonl").unlink()  # Snakemake deletes a failed job's declared outputs

    rerun = subprocess.run(
        cli_train(data["manifest"], data["vocab"], killed, s), env=env, capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    summary = json.loads((killed / "drafter" / "train_summary.json").read_text())
    assert summary["resumed_from_step"] is not None and summary["steps"] == full["steps"]
    a = load_file(str(tmp_path / "full" / "drafter" / "model.safetensors"))
    b = load_file(str(killed / "drafter" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    a = load_file(str(run_folder(tmp_path / "full") / f"step-{full['steps']}" / "model.safetensors"))
    b = load_file(str(run_folder(killed) / f"step-{full['steps']}" / "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)  # fp32 master weights, not only the bf16 export

    def losses(root: Path) -> list:
        return [(r["kind"], r["step"], r["loss"]) for r in rows(root) if r["kind"] in ("train", "val")]

    assert losses(killed) == losses(tmp_path / "full")
    assert [r["kind"] for r in rows(killed)].count("resume") == 1


# ------------------------------------------------------------------------ objective options (ablated)


def test_mask_offset_hand_example() -> None:
    # the hand example above; offset 0 trains where x_{t+j} is an assistant token (SpecForge)
    loss_mask = torch.tensor([[0, 0, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    lengths = torch.tensor([6, 4])
    expected = {
        (0, 0): [[0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]],  # t+2 < len and mask[t]
        (1, 0): [[0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]],  # t+3 < len and mask[t+1]
        (0, 1): [[0, 1, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0]],  # t+2 < len and mask[t+1]
    }
    for (step, offset), valid_rows in expected.items():
        valid, _, tgt = ttt_step_targets(loss_mask, lengths, step, mask_offset=offset)
        assert valid.tolist() == [[bool(v) for v in r] for r in valid_rows], (step, offset)
        assert tgt.tolist() == [min(t + 2 + step, 5) for t in range(6)]  # predicted tokens do not move
    assert ttt_step_targets(loss_mask, lengths, 1, 2)[0].equal(
        ttt_step_targets(loss_mask, lengths, 1, EVAL_MASK_OFFSET)[0]
    )


def test_sample_normalisation_matches_per_sample_reference(data: dict) -> None:
    """loss_norm="sample": the mean over samples of each sample's (sum over valid positions / length),
    i.e. each sample alone with a position mean rescaled by its share of valid positions."""
    drafter, embed, teacher = build(data)
    samples = data["samples"][:4]
    loss, _ = ttt_loss(drafter, embed, teacher, collate(samples), objective(loss_norm="sample"))
    expected = 0.0
    for s in samples:  # each sample alone: its cross-entropy sums per step, over its length
        _, stats = ttt_loss(drafter, embed, teacher, collate([s]), objective())
        expected += sum(0.8**j * stats.loss_sum[j] for j in range(3)) / s.num_tokens
    torch.testing.assert_close(loss, torch.tensor(expected / len(samples)), rtol=1e-5, atol=1e-6)
    # a position mean weighs long answers more than the per-sample mean does: the two differ
    position, _ = ttt_loss(drafter, embed, teacher, collate(samples), objective())
    assert not torch.allclose(position, loss)


@pytest.mark.parametrize("loss_norm", ["position", "sample"])
@pytest.mark.parametrize("offset", [0, 2])
def test_split_batch_with_global_counts_adds_up(data: dict, loss_norm: str, offset: int) -> None:
    """Data parallel: two slices of a batch, each divided by the whole batch's counts, sum to the
    whole batch's loss, for every normalisation and mask offset."""
    drafter, embed, teacher = build(data)
    samples = data["samples"][:6]
    whole = collate(samples)
    kw = {"mask_offset": offset, "loss_norm": loss_norm}
    counts = ttt_step_counts(whole.loss_mask, whole.lengths, 3, offset, loss_norm)
    full, _ = ttt_loss(drafter, embed, teacher, whole, objective(**kw))
    parts = [
        ttt_loss(drafter, embed, teacher, collate(half), objective(**kw), step_counts=counts)[0]
        for half in (samples[:2], samples[2:])
    ]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-6)


def test_head_init_target_or_random(data: dict) -> None:
    from draftsmith.core.data.vocab import load_vocab_map

    head = load_target_head(data["target"])
    vocab = load_vocab_map(data["vocab"])
    rows_of_draft = head.lm_head[torch.arange(TINY_DRAFT_VOCAB) + vocab["d2t"]]
    args = (head, vocab["d2t"], vocab["t2d"], len(TINY_AUX_IDS))
    copied, _, teacher = build_drafter(*args, settings(head_init="target", layer_init="normal"), "cpu")
    assert torch.equal(copied.lm_head.weight.detach(), rows_of_draft) and torch.equal(teacher, rows_of_draft)
    assert torch.equal(copied.norm.weight.detach(), head.norm)
    fresh, _, teacher = build_drafter(*args, settings(head_init="random", layer_init="normal"), "cpu")
    assert torch.equal(teacher, rows_of_draft)  # the teacher is the target's either way
    assert torch.equal(fresh.norm.weight.detach(), torch.ones(TINY_HIDDEN))
    w = fresh.lm_head.weight.detach()
    assert not torch.equal(w, rows_of_draft) and abs(float(w.std()) - 0.02) < 0.002
    assert torch.equal(fresh.fc.weight, copied.fc.weight)  # the same seed draws the same rest
    with pytest.raises(ValueError, match="head_init"):  # refused before any drafter is built
        settings(head_init="zeros")


def test_layer_init_normal_or_fan_in(data: dict) -> None:
    from draftsmith.core.data.vocab import load_vocab_map

    head = load_target_head(data["target"])
    vocab = load_vocab_map(data["vocab"])
    args = (head, vocab["d2t"], vocab["t2d"], len(TINY_AUX_IDS))
    normal, _, _ = build_drafter(*args, settings(layer_init="normal"), "cpu")
    fan_in, _, _ = build_drafter(*args, settings(layer_init="fan_in"), "cpu")
    again, _, _ = build_drafter(*args, settings(layer_init="fan_in"), "cpu")
    for name, module in fan_in.named_modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight.detach()
            bound = 1 / math.sqrt(w.shape[1])  # torch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.9 * bound, name
            assert torch.equal(w, again.get_submodule(name).weight), name  # a function of the seed
    assert abs(float(normal.fc.weight.std()) - 0.02) < 0.002
    with pytest.raises(ValueError, match="layer_init"):  # refused before any drafter is built
        settings(layer_init="xavier")


def test_objective_settings_validated_and_reach_the_optimizer(data: dict) -> None:
    for bad in (
        {"loss_norm": "token"},
        {"mask_offset": 3},
        {"adam_beta2": 1.0},
        {"head_init": "x"},
        {"layer_init": "x"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            settings(**bad)
    drafter, _, _ = build(data)
    opt = make_optimizer(drafter, settings(adam_beta2=0.999))
    assert all(g["betas"] == (0.9, 0.999) for g in opt.param_groups)


def test_objective_options_train_end_to_end(data: dict, tmp_path: Path) -> None:
    """The loop passes the options through: a run with every non-default option trains, and its
    validation accuracy is scored on the default positions (comparable across options)."""
    s = settings(
        epochs=2, head_init="target", loss_norm="sample", mask_offset=0, adam_beta2=0.999,
        layer_init="fan_in", loss_positions="all",
    )  # fmt: skip
    summary = run(data, tmp_path, s)
    assert summary["steps"] > 0 and summary["val_acc"] is not None
    assert len(summary["val_agreement"]) == len(summary["val_acc"])
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())["draftsmith"]["training"]
    assert saved["settings"]["loss_norm"] == "sample" and saved["settings"]["mask_offset"] == 0
    assert saved["settings"]["loss_positions"] == "all" and saved["settings"]["layer_init"] == "fan_in"


def test_real_positions_hand_example(data: dict) -> None:
    assert real_positions(torch.tensor([3, 1]), 4).tolist() == [
        [True, True, True, False],
        [True, False, False, False],
    ]
    # prompts as well as answers: every step trains more positions than on answers alone
    batch = collate(data["samples"][:4])
    everywhere = ttt_step_counts(
        real_positions(batch.lengths, batch.loss_mask.shape[1]),
        batch.lengths,
        3,
        EVAL_MASK_OFFSET,
        "position",
    )
    answers = ttt_step_counts(batch.loss_mask, batch.lengths, 3, EVAL_MASK_OFFSET, "position")
    assert all(e > a for e, a in zip(everywhere, answers, strict=True)), (everywhere, answers)
    assert everywhere == [int((batch.lengths - 2 - j).clamp(min=0).sum()) for j in range(3)]


# ---------------------------------------------------------------------------------- levers (ablated)


def test_per_step_weights_replace_the_decay(data: dict) -> None:
    drafter, embed, teacher = build(data)
    batch = collate(data["samples"][:4])
    weights = (1.0, 0.3, 2.0)
    assert Objective.from_settings(settings(ttt_step_weights=list(weights))).step_weights == weights
    loss, stats = ttt_loss(drafter, embed, teacher, batch, objective(step_weights=weights))
    expected = sum(w * s / n for w, s, n in zip(weights, stats.loss_sum, stats.count, strict=True))
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="train.ttt_step_weights: 2 weights for ttt_steps 3"):
        settings(ttt_step_weights=[1.0, 0.5])


def test_draft_mass_is_the_targets_probability_of_the_draft_vocabulary(data: dict) -> None:
    from draftsmith.core.data.vocab import load_vocab_map
    from draftsmith.core.training.objective import draft_mass

    head = load_target_head(data["target"])
    _, _, teacher = build(data)
    final = collate(data["samples"][:3]).final.float()
    full = torch.softmax(final @ head.lm_head.T, -1)  # [B, T, V]
    draft_ids = torch.arange(TINY_DRAFT_VOCAB) + load_vocab_map(data["vocab"])["d2t"]
    expected = full[..., draft_ids].sum(-1)
    mass = draft_mass(final, teacher, head.lm_head, rows=7)  # several chunks
    torch.testing.assert_close(mass, expected, rtol=1e-5, atol=1e-6)
    assert 0 < float(mass.min()) <= float(mass.max()) < 1


def reference_lk(
    drafter, embed, teacher, batch, mass: torch.Tensor, kind: str, scale=1.0, decay=1.0
) -> torch.Tensor:
    """The LK losses written out per step over the valid positions (3 steps, weights 0.8**j)."""
    B, T = batch.input_ids.shape
    kv, hidden, total = TTTKV(), drafter.fuse(batch.aux.float()), 0.0
    for j in range(3):
        valid, src, _ = ttt_step_targets(batch.loss_mask, batch.lengths, j, EVAL_MASK_OFFSET)
        positions = torch.arange(T).expand(B, T) + j
        hidden = drafter.midlayer(F.embedding(batch.input_ids[:, src], embed), hidden, positions, kv)
        b, t = valid.nonzero(as_tuple=True)
        q = torch.softmax(drafter.lm_head(drafter.norm(hidden[b, t])), -1)
        p = torch.softmax(batch.final[b, src[t]].float() @ teacher.T, -1)
        alpha = torch.minimum(p * mass[b, src[t], None], q).sum(-1)
        if kind == "alpha":
            step = (-alpha.log()).mean()
        else:
            weight = scale * torch.exp(-decay * alpha.detach().mean())
            step = weight * (-(p * q.log()).sum(-1)).mean() + (1 - weight) * (1 - alpha.mean())
        total = total + 0.8**j * step
    return total


@pytest.mark.parametrize(
    ("kind", "scale", "decay"), [("alpha", 1.0, 1.0), ("lambda", 1.0, 1.0), ("lambda", 0.7, 3.0)]
)
def test_lk_losses_match_their_formulas(data: dict, kind: str, scale: float, decay: float) -> None:
    from draftsmith.core.training.objective import draft_mass

    drafter, embed, teacher = build(data)
    batch = collate(data["samples"][:4])
    mass = draft_mass(batch.final, teacher, load_target_head(data["target"]).lm_head)
    view = objective(lk_loss=kind, lk_kl_scale=scale, lk_kl_decay=decay)
    loss, stats = ttt_loss(drafter, embed, teacher, batch, view, draft_mass=mass)
    expected = reference_lk(drafter, embed, teacher, batch, mass, kind, scale, decay)
    # fp32, two formulations: 3 TTT steps of fc -> decoder layer -> lm_head (6 matmuls), longest sum 3H
    torch.testing.assert_close(
        loss, expected, **fp_tolerance(torch.float32, 3 * 6, 3 * TINY_HIDDEN, scale=1.0)
    )
    _, plain = ttt_loss(drafter, embed, teacher, batch, objective())
    assert stats.loss_sum == plain.loss_sum  # the stats keep the cross-entropy
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


def test_lk_lambda_split_batch_with_global_sums_adds_up(data: dict) -> None:
    """Data parallel: with the whole batch's counts and acceptance sums (what all_sum gives each rank),
    two slices' LK-lambda losses add up to the whole batch's."""
    drafter, embed, teacher = build(data)
    samples = data["samples"][:6]
    whole, view = collate(samples), objective(lk_loss="lambda")
    sums: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        sums.append(t.clone())
        return t

    full, _ = ttt_loss(drafter, embed, teacher, whole, view, all_sum=record)
    counts = view.step_counts(whole)
    parts = []
    for half in (samples[:2], samples[2:]):
        steps = iter(sums)
        parts.append(
            ttt_loss(
                drafter, embed, teacher, collate(half), view, counts, all_sum=lambda t, s=steps: next(s)
            )[0]
        )
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-6)


def test_muon_trains_the_weight_matrices_and_adamw_the_rest(data: dict) -> None:
    from draftsmith.core.training.optimizers import Chain

    drafter, _, _ = build(data)
    optimizer = make_optimizer(drafter, settings(optimizer="muon", lr=1e-3, muon_lr_scale=10.0))
    assert isinstance(optimizer, Chain)
    adamw, muon = optimizer.parts
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    names = {id(p): n for n, p in drafter.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert in_muon == {
        "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    }  # fmt: skip
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_adamw == set(names.values()) - in_muon and "lm_head.weight" in in_adamw
    assert muon.param_groups[0]["lr"] == pytest.approx(1e-2) and optimizer.param_groups[0]["lr"] == 1e-3


def test_a_checkpoint_of_muon_and_adamw_counts_both_states(data: dict) -> None:
    """The disk-full message's figure (checkpoint_bytes) reads the Chain's state as an optimizer's."""
    from draftsmith.core.training.checkpoints import checkpoint_bytes

    drafter, _, _ = build(data)
    optimizer = make_optimizer(drafter, settings(optimizer="muon"))
    weights = checkpoint_bytes(drafter, optimizer)
    sum(p.sum() for p in drafter.parameters()).backward()
    optimizer.step()
    states = [
        v for part in optimizer.parts for s in part.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    assert len(optimizer.state) == sum(len(part.state) for part in optimizer.parts) > 0
    assert checkpoint_bytes(drafter, optimizer) == weights + sum(t.numel() * t.element_size() for t in states)


@pytest.mark.parametrize("shape", [(48, 96), (96, 48)])
def test_muon_in_fp32_steps_as_torchs_bf16_muon(shape: tuple[int, int]) -> None:
    """A run training in fp32 orthogonalises in fp32 (`Muon.fp32_newton_schulz`), torch's Muon in bf16:
    two steps (momentum included) move the weights alike, to bf16's precision. Tolerance: bf16 keeps 8
    mantissa bits (2^-8 = 0.4%) and 5 Newton-Schulz iterations of 3 products each compound it."""
    from draftsmith.core.training.optimizers import Muon

    torch.manual_seed(0)
    start = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(2)]
    moved = []
    for fp32 in (False, True):
        param = torch.nn.Parameter(start.clone())
        optimizer = Muon([param], lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        optimizer.fp32_newton_schulz = fp32
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        moved.append(param.detach() - start)
    bf16, fp32 = moved
    assert 0 < (bf16 - fp32).norm() / fp32.norm() < 0.05  # 0 would mean fp32 never ran
    reference = torch.nn.Parameter(start.clone())  # the bf16 path is torch's own step
    torch_muon = torch.optim.Muon([reference], lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for grad in grads:
        reference.grad = grad.clone()
        torch_muon.step()
    assert torch.equal(reference.detach() - start, bf16)


def test_muon_orthogonalises_in_fp32_where_the_run_trains_in_fp32(data: dict) -> None:
    drafter, _, _ = build(data)
    for precision, fp32 in (("fp32", True), ("bf16", False)):
        muon = make_optimizer(drafter, settings(optimizer="muon", precision=precision)).parts[1]
        assert muon.fp32_newton_schulz is fp32


def test_muon_run_resumes_to_identical_weights(data: dict, tmp_path: Path) -> None:
    """Both optimizers' states and both schedules go into the checkpoint: a resumed Muon run ends where
    an uninterrupted one does, bit for bit, and trains."""
    s = settings(optimizer="muon", epochs=2)
    full = run(data, tmp_path / "full", s)
    run(data, tmp_path / "resumed", replace(s, max_steps=3))
    second = run(data, tmp_path / "resumed", s)
    assert second["resumed_from_step"] == 3
    a = load_file(str(run_folder(tmp_path / "full") / f"step-{full['steps']}" / "model.safetensors"))
    b = load_file(str(run_folder(tmp_path / "resumed") / f"step-{full['steps']}" / "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    train_rows = [r for r in rows(tmp_path / "full") if r["kind"] == "train"]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]


def _one_step(data: dict, parts: list, **over) -> list[torch.Tensor]:
    """The drafter's weights after one optimizer step on `parts` (a batch's micro-batches)."""
    from draftsmith.core.training.distributed import Dist
    from draftsmith.core.training.objective import DraftingLoss
    from draftsmith.core.training.optimizers import make_scheduler
    from draftsmith.stages.train import train_step

    s = settings(noise_std=0.0, precision="fp32", **over)
    drafter, embed, teacher = build(data)
    optimizer = make_optimizer(drafter, s)
    scheduler = make_scheduler(optimizer, s, 10)
    obj = Objective.from_settings(s)
    train_step(DraftingLoss(drafter, embed, teacher), parts, obj, optimizer, scheduler, s, Dist(), 0)
    return [p.detach().clone() for p in drafter.parameters()]


def test_micro_batches_accumulate_to_the_single_batch_step(data: dict) -> None:
    """One optimizer step over a batch's micro-batches (gradients accumulated, each loss divided by the
    whole batch's counts) gives the weights of the same step over the batch in one pass."""
    from draftsmith.core.data.loader import micro_batches

    samples = data["samples"][:6]
    lengths = [s.num_tokens for s in samples]
    parts = micro_batches(list(range(6)), lengths, 2 * max(lengths))
    assert len(parts) == 3 and sorted(i for p in parts for i in p) == list(range(6))
    whole = _one_step(data, [collate(samples)])
    split = _one_step(data, [collate([samples[i] for i in p]) for p in parts])
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(
            a, b, **fp_tolerance(torch.float32, 3 * 6, 3 * TINY_HIDDEN, scale=a.abs().max())
        )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_checkpointing_per_ttt_step_changes_no_gradient(data: dict, precision: str) -> None:
    """checkpoint_ttt recomputes each TTT step in the backward pass: the same loss, stats and gradients."""
    batch = collate(data["samples"][:4])
    results = []
    for checkpointed in (False, True):
        drafter, embed, teacher = build(data)
        loss, stats = ttt_loss(
            drafter, embed, teacher, batch, objective(precision=precision, checkpoint_ttt=checkpointed)
        )
        loss.backward()
        results.append((loss.detach(), stats, [p.grad.clone() for p in drafter.parameters()]))
    (loss0, stats0, grads0), (loss1, stats1, grads1) = results
    assert stats0 == stats1
    torch.testing.assert_close(loss0, loss1, rtol=0, atol=0)
    for a, b in zip(grads0, grads1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))


def test_soft_cross_entropy_gradient_is_log_softmaxs() -> None:
    """The soft cross-entropy that saves logits and p (not fp32 log-probabilities) has autograd's
    gradient of -(p * log_softmax(logits)).sum(-1), exactly (fp32 and bf16 logits)."""
    from draftsmith.core.training.objective import soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 40, generator=g), -1)
    weights = torch.rand(5, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(5, 40, generator=g).to(dtype).requires_grad_()
        (soft_cross_entropy(logits, p) * weights).sum().backward()
        mine = logits.grad.clone()
        logits.grad = None
        (-(p * torch.log_softmax(logits.float(), -1)).sum(-1) * weights).sum().backward()
        torch.testing.assert_close(mine, logits.grad, rtol=0, atol=0)  # bit for bit: CPU runs train as before


def host_reads(monkeypatch, fn) -> int:
    """Calls of `fn` that read a device tensor's values on the host (a sync on a GPU): .tolist(), .item(),
    bool/int/float of a tensor (aten._local_scalar_dense) and nonzero (its size depends on the values)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = 0

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal count
            if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero):
                count += 1
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted(self):
        nonlocal count
        count += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    with Reads():
        fn()
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return count


@pytest.mark.parametrize("checkpoint_ttt", [False, True])
def test_host_syncs_stay_out_of_the_ttt_loop(data: dict, monkeypatch, checkpoint_ttt: bool) -> None:
    """A forward reads the device from the host the same few times at 1, 3 or 7 TTT steps (before and
    after the loop, none per step): a GPU never waits for the host inside the loop."""
    drafter, embed, teacher = build(data)
    batch = collate(data["samples"][:4])
    reads = {
        steps: host_reads(
            monkeypatch,
            lambda steps=steps: ttt_loss(
                drafter, embed, teacher, batch, objective(steps, checkpoint_ttt=checkpoint_ttt)
            ),
        )
        for steps in (1, 3, 7)
    }
    assert reads[1] == reads[3] == reads[7] <= 3, reads


# ------------------------------------------------------------------------------------- bad input, full disk


def _invoke_train(data: dict, root: Path, vocab: Path | None = None, **over):
    from click.testing import CliRunner

    from draftsmith.cli import main

    args = cli_train(data["manifest"], vocab or data["vocab"], root, settings(**over))[3:]
    return CliRunner().invoke(main, args)


def test_a_junk_vocab_map_is_one_line_exit_2(data: dict, tmp_path: Path) -> None:
    junk = tmp_path / "vocab_map.pt"
    junk.write_bytes(b"junk")
    result = _invoke_train(data, tmp_path, vocab=junk)
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"error: {junk}: not a vocabulary map (") and "--forcerun vocab" in line


def test_a_full_disk_at_a_checkpoint_is_one_line_naming_the_folder_and_the_bytes(
    data: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import draftsmith.core.training.checkpoints as checkpoints

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints, "save_file", full)
    result = _invoke_train(data, tmp_path, epochs=1, checkpoint_every=1)
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert "Traceback" not in result.output
    assert (
        line.startswith(f"error: {tmp_path / 'checkpoints'}")
        and "the disk is full writing checkpoint" in line
    )
    assert re.search(r"a checkpoint needs about [\d.,]+ [KMG]?B \([\d,]+ bytes\)", line), line
