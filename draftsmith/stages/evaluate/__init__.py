"""The evaluation stage (`draftsmith evaluate`, `draftsmith evaluate-vllm`): a drafter on held-out
prompts, offline and in real vLLM, with baselines.

    stage.py        the settings, both measurements and their JSON
    vllm_runner.py  one vLLM run in a child process (`python -m draftsmith.stages.evaluate.vllm_runner`)
"""

from draftsmith.stages.evaluate.stage import (
    EAGLE_METHODS,
    NGRAM_DEFAULT,
    SUFFIX_DEFAULT,
    EvaluateSettings,
    NotLossless,
    VllmUnavailable,
    checked_drafters,
    counts_summary,
    encode_prompts,
    evaluate_offline,
    evaluate_vllm,
    read_eval_prompts,
    vllm_engine,
    vllm_prompt_counts,
)

__all__ = [
    "EAGLE_METHODS",
    "NGRAM_DEFAULT",
    "SUFFIX_DEFAULT",
    "EvaluateSettings",
    "NotLossless",
    "VllmUnavailable",
    "checked_drafters",
    "counts_summary",
    "encode_prompts",
    "evaluate_offline",
    "evaluate_vllm",
    "read_eval_prompts",
    "vllm_engine",
    "vllm_prompt_counts",
]
