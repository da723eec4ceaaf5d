"""An EAGLE 3.1 drafter with Llama-3.x's `llama3` RoPE scaling, trained on a tiny Llama twin that uses
it, is accepted by real vLLM (CPU) exactly as often as by draftsmith's own speculative decoding: vLLM
builds the same rotary embedding from the export's rope_parameters, and the same layer from its EAGLE
3.1 flags (an RMSNorm per aux state before `fc`, the post-norm state fed back).

The twin scales RoPE beyond 16 positions (most frequencies divided by 8), and every prompt plus its
continuation is longer, so a drafter whose RoPE differed between training and serving would draft
differently; the control (the same weights exported with plain RoPE) shows that it does.
"""

from __future__ import annotations

import json
import shutil

import pytest
import twins
from helpers.evaluation import assert_vllm_accepts_as_offline, train_and_measure
from helpers.workflow import DEFAULT_TARGET

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def plain_rope_copy(drafter, out):
    """The same export with its RoPE replaced by plain RoPE of the same theta (the control)."""
    shutil.copytree(drafter, out)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    config["rope_scaling"] = None
    config["draftsmith"]["drafter_config"]["rope_scaling"] = None
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, target_model) -> dict:
    r = tmp_path_factory.mktemp("rope-vllm")
    target = r / "llama3-twin"
    # peaked logits (init 0.1): greedy continuations far from ties, identical in vLLM and transformers
    twins.save("llama3", target, vocab_size=49152, tokenizer_from=DEFAULT_TARGET, initializer_range=0.1)
    return train_and_measure(target, r, control_of=plain_rope_copy, train={"drafter": {"kind": "eagle3.1"}})


def test_export_carries_llama3_rope_and_eagle31_flags(run):
    assert run["export"]["draftsmith"]["drafter_config"]["kind"] == "eagle3.1"
    assert (run["export"]["fc_norm"], run["export"]["norm_output"]) == (True, True)
    rope = run["export"]["rope_parameters"]
    assert rope == twins.LLAMA3_ROPE
    assert run["export"]["rope_scaling"]["type"] == "llama3"


def test_offline_tau_equals_vllm_tau(run):
    assert_vllm_accepts_as_offline(run)
    control = run["offline"]["methods"]["untrained"]
    print(
        f"plain-RoPE control offline {control['tau']:.4f} {control['accepted_per_pos']}/{control['drafts']}"
    )


def test_plain_rope_drafts_differently(run):
    """The control: the same weights with plain RoPE accept a different number of drafts, so the
    equality above holds only because vLLM builds the llama3 rotary embedding."""
    offline = run["offline"]["methods"]
    trained, control = offline["eagle3"], offline["untrained"]
    assert (control["drafts"], control["accepted_per_pos"]) != (
        trained["drafts"],
        trained["accepted_per_pos"],
    )
