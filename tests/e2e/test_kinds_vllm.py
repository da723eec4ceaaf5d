"""EAGLE 3.1 and P-EAGLE drafters, trained on a tiny Llama twin, served by real vLLM (CPU): lossless,
and accepted exactly as often as by draftsmith's own speculative decoding, position by position (vLLM
reads fc_norm / norm_output, and drafts a P-EAGLE export in one parallel pass)."""

from __future__ import annotations

import pytest
import twins
from helpers import DEFAULT_TARGET, assert_vllm_accepts_as_offline, train_and_measure

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("kind", ["eagle3.1", "peagle"])
def test_vllm_serves_kind_as_offline(tmp_path, target_model, kind):
    target = tmp_path / "llama-twin"
    # peaked logits (init 0.1): greedy continuations far from ties, identical in vLLM and transformers
    twins.save("llama3", target, vocab_size=49152, tokenizer_from=DEFAULT_TARGET, initializer_range=0.1)
    run = train_and_measure(target, tmp_path, train={"drafter": {"kind": kind}})
    export = run["export"]
    assert export["draftsmith"]["drafter_config"]["kind"] == kind
    if kind == "peagle":
        assert export["mask_token_id"] == 49151
    else:
        assert (export["fc_norm"], export["norm_output"]) == (True, True)
    assert_vllm_accepts_as_offline(run)
