"""bench.peer (`python -m bench.peer`) and its stage modules (bench/peer/*.py): the shard converter writes SpecForge's offline
EAGLE-3 format from draftsmith's split, and the pure helpers the comparison rests on (step plan,
teacher-in-vocabulary mask, tokens per forward); the command loads every stage module."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch
from helpers.data import make_tiny_data
from helpers.training import settings
from safetensors.torch import load_file

from draftsmith.core.data.loader import Batch, StreamingData, is_validation
from draftsmith.core.data.manifest import load_manifest
from draftsmith.core.data.vocab import load_vocab_map
from draftsmith.core.model.target import load_target_head
from draftsmith.core.training.objective import ttt_step_targets

OFFLINE_KEYS = {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}


def load(name: str):
    """bench.peer's module `name` (bench/peer/<name>.py; the command: "__main__")."""
    return importlib.import_module(f"bench.peer.{name}")


@pytest.fixture(scope="module")
def peer_convert():
    return load("convert")


@pytest.fixture(scope="module")
def peer_train():
    return load("train")


@pytest.fixture(scope="module")
def peer_diff():
    return load("diff")


@pytest.fixture(scope="module")
def peer_vllm():
    return load("vllm")


def test_the_command_loads_every_stage_module() -> None:
    peer = load("__main__")
    assert peer.main.name == "main" and "--diff" in {o for p in peer.main.params for o in p.opts}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_tiny_data(tmp_path_factory.mktemp("peer-data"))


@pytest.fixture(scope="module")
def converted(peer_convert, data, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    values = settings().to_dict()
    out = tmp_path_factory.mktemp("peer-convert")
    return out, values, peer_convert.convert(data["manifest"], data["vocab"], values, out, fresh=False)


def test_every_sample_becomes_one_specforge_ckpt_in_draftsmiths_split_and_order(converted, data) -> None:
    out, values, summary = converted
    s = settings()
    stream = StreamingData.from_manifest(load_manifest(data["manifest"]), s)
    assert summary["samples"] == {"train": len(stream.train), "val": len(stream.val)}
    assert all(not is_validation(r.id, s.val_fraction) for r in stream.train)
    for split, refs in (("train", stream.train), ("val", stream.val)):
        files = sorted((out / split).glob("*.ckpt"))
        assert [f.name for f in files] == [f"data_{i:05d}.ckpt" for i in range(len(refs))]
        for i, path in enumerate(files):
            raw = torch.load(path, weights_only=True)
            ours = stream.sample(split, i)  # truncated to max_seq_len like training reads it
            T, A, H = ours.aux.shape
            assert set(raw) == OFFLINE_KEYS
            assert raw["input_ids"].dtype == torch.int64 and torch.equal(raw["input_ids"], ours.input_ids)
            assert torch.equal(raw["loss_mask"], ours.loss_mask.to(torch.int64))
            # aux layers concatenated in id order, the final state after the norm: bit for bit
            assert raw["aux_hidden_state"].shape == (1, T, A * H)
            assert raw["aux_hidden_state"].dtype == ours.aux.dtype
            for a in range(A):
                assert torch.equal(raw["aux_hidden_state"][0, :, a * H : (a + 1) * H], ours.aux[:, a])
            assert raw["hidden_state"].shape == (1, T, H) and torch.equal(raw["hidden_state"][0], ours.final)
    stream.close()


def test_vocab_mapping_target_folder_and_draft_config_are_what_specforge_reads(converted, data) -> None:
    out, _, summary = converted
    vocab = load_vocab_map(data["vocab"])
    mapping = torch.load(out / "vocab_mapping.pt", weights_only=True)
    assert torch.equal(mapping["d2t"], vocab["d2t"]) and torch.equal(mapping["t2d"], vocab["t2d"])
    # SpecForge requires an index even for one file, with the lm_head (tied here) as its own tensor
    index = json.loads((out / "target" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "lm_head.weight": "head.safetensors",
        "model.embed_tokens.weight": "head.safetensors",
    }
    tensors = load_file(str(out / "target" / "head.safetensors"))
    head = load_target_head(data["target"])
    assert torch.equal(tensors["lm_head.weight"], head.lm_head)
    assert torch.equal(tensors["model.embed_tokens.weight"], head.embed)
    assert (out / "target" / "config.json").is_file()
    cfg = json.loads((out / "draft_config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == vocab["d2t"].numel() == summary["draft_vocab_size"]
    # "output of layer k" ids: draftsmith's "input" ids minus one, the same tensors
    ids = [i - 1 for i in load_manifest(data["manifest"])["aux_layer_ids"]]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids == summary["aux_layer_ids_output"]


def test_loss_positions_all_gives_specforge_a_mask_of_ones(peer_convert, data) -> None:
    s = data["samples"][0]
    assert not s.loss_mask.all()
    assert torch.equal(
        peer_convert.specforge_sample(s, "all")["loss_mask"], torch.ones(s.num_tokens, dtype=torch.int64)
    )
    back = peer_convert.sample_from_specforge(peer_convert.specforge_sample(s), s.aux.shape[1])
    assert (
        torch.equal(back.loss_mask, s.loss_mask)
        and torch.equal(back.aux, s.aux)
        and torch.equal(back.final, s.final)
    )


def test_conversion_is_reused_until_its_inputs_change(peer_convert, converted, data) -> None:
    out, values, summary = converted
    first = out / "train" / "data_00000.ckpt"
    stamp = first.stat().st_mtime_ns
    os.utime(first, ns=(stamp - 10**9, stamp - 10**9))
    same = peer_convert.convert(data["manifest"], data["vocab"], values, out, fresh=False)
    assert same["key"] == summary["key"]
    assert first.stat().st_mtime_ns == stamp - 10**9  # not rewritten
    again = peer_convert.convert(
        data["manifest"], data["vocab"], {**values, "loss_positions": "all"}, out, fresh=False
    )
    assert again["key"] != summary["key"]
    assert int(torch.load(first, weights_only=True)["loss_mask"].min()) == 1
    # back, for the other tests
    peer_convert.convert(data["manifest"], data["vocab"], values, out, fresh=False)


def test_specforge_makes_as_many_optimizer_steps_as_draftsmith(peer_train) -> None:
    assert peer_train.specforge_plan(152, 2, 192) == {"accumulation_steps": 2, "steps": 152}
    # 30 micro-batches in steps of 8: the last partial step is dropped
    assert peer_train.specforge_plan(10, 3, 4) == {"accumulation_steps": 8, "steps": 3}
    assert peer_train.specforge_plan(5, 1, 50) == {"accumulation_steps": 1, "steps": 5}


def test_teacher_in_vocab_mask_drops_the_positions_whose_teacher_prefers_a_non_draft_token(peer_diff) -> None:
    """As SpecForge and the EAGLE-3 reference train: step j at t counts only where the target's top-1
    of f_{t+1+j} (over the whole vocabulary) is a draft token."""
    V, T = 8, 7
    top = torch.tensor([[3, 5, 3, 6, 1, 3, 5]])  # the teacher's top-1 at each f_t
    final = torch.nn.functional.one_hot(top, V).float()  # with lm_head = identity: argmax = top
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[[1, 3]] = True  # 5 and 6 are not draft tokens
    batch = Batch(top, torch.ones(1, T, dtype=torch.bool), torch.tensor([T]), torch.zeros(1, T, 3), final)
    lengths = torch.tensor([T])
    for offset in (0, 2):
        mask = peer_diff.teacher_in_vocab_mask(batch, torch.eye(V), t2d, offset)
        for j in range(3):
            valid, src, _ = ttt_step_targets(mask, lengths, j, offset)
            plain, _, _ = ttt_step_targets(batch.loss_mask, lengths, j, offset)
            assert torch.equal(valid[0], plain[0] & t2d[top[0, src]]), (offset, j)


def test_tokens_per_forward_counts_every_decode_step(peer_vllm) -> None:
    assert peer_vllm.tokens_per_forward([10, 10], [0, 0]) == 1.0
    assert peer_vllm.tokens_per_forward([10, 10], [5, 5]) == pytest.approx(2.0)  # 20 tokens in 10 forwards
    lo, hi = peer_vllm.paired_interval([10] * 6, [5] * 6, [10] * 6, [0] * 6)
    assert lo == hi == pytest.approx(1.0)


def test_specforge_checkpoint_weights_get_draftsmiths_names_without_the_embedding(peer_train) -> None:
    w = torch.zeros(2)
    state = {"draft_state_dict": {"fc.weight": w, "midlayer.mlp.up_proj.weight": w, "embed_tokens.weight": w,
                                  "d2t": w}, "global_step": 3}  # fmt: skip
    assert sorted(peer_train.specforge_weights(state)) == ["d2t", "fc.weight", "midlayer.mlp.up_proj.weight"]


def test_vllm_rows_give_every_drafter_tokens_per_forward_and_its_paired_difference_from_specforge(
    peer_vllm,
) -> None:
    def measured(accepted: list[int]) -> dict:
        s = {"num_prompts": 3, "tau": 0.0, "acceptance_per_position": [], "outputs_equal_plain": 3}
        return {"sets": {"chat": {**s, "tokens": [10, 10, 10], "accepted": accepted}}}

    rows = peer_vllm.vllm_table_rows({"specforge": measured([2, 2, 2]), "draftsmith": measured([5, 5, 5])})
    chat = rows["chat"]
    assert chat["tokens"] == 30 and chat["num_prompts"] == 3
    assert chat["drafters"]["specforge"]["tokens_per_forward"] == pytest.approx(30 / 24)
    ours = chat["drafters"]["draftsmith"]
    assert ours["tokens_per_forward"] == pytest.approx(2.0)
    assert ours["minus_specforge"] == pytest.approx(2.0 - 30 / 24)
    assert ours["interval95"] == pytest.approx([2.0 - 30 / 24] * 2)  # identical prompts: no spread
    assert "interval95" not in chat["drafters"]["specforge"]
