"""What speculation would gain where decoding is memory-bound.

On a GPU serving small batches, a forward costs about the bytes of weights it reads, so a verify step of
k+1 tokens costs about one plain step, and k draft steps cost k drafter forwards. The projected speedup
of a method is then its tokens per target forward divided by the relative cost of one speculative step:

    projected speedup = tokens per target forward / (1 + k x drafter bytes per draft step / target bytes per forward)

with 0 drafter bytes for n-gram lookup. Both sides are counted in parameters read (the same serving
dtype cancels): the target's weights, its lm_head once and its embedding not at all (a forward reads a
few rows), MoE experts scaled by the share a token routes to; the drafter's fc, layer, norm and lm_head
over the draft vocabulary. KV-cache reads and kernel overheads are left out, so it is a ceiling, printed
beside the speed measured here, never in its place: on a CPU a verify step of k+1 tokens costs about k+1
plain steps, and speculation on a small target is slower whatever the figure.
"""

from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open

PROJECTION_FORMULA = (
    "projected speedup = tokens per target forward / (1 + k x drafter bytes per draft step / target bytes "
    "per forward), n-gram lookup 0 drafter bytes; memory-bound decoding, KV cache left out"
)
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def tensor_sizes(folder: str | Path) -> dict[str, int]:
    """name -> element count of every tensor in the folder's safetensors files (headers only)."""
    sizes: dict[str, int] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sizes[name] = math.prod(f.get_slice(name).get_shape())
    if not sizes:
        raise ValueError(f"{folder}: no safetensors weights to count")
    return sizes


def active_expert_share(config: dict) -> float:
    """The share of routed experts one token reads (1.0 for a dense model)."""
    per_token = config.get("num_experts_per_tok")
    total = next((config[k] for k in EXPERT_COUNT_KEYS if config.get(k)), None)
    return per_token / total if per_token and total else 1.0


def target_parameters_per_forward(target_path: str | Path) -> float:
    """Parameters one decode forward of the target reads (see the module doc)."""
    from draftsmith.target import text_config_dict

    share = active_expert_share(text_config_dict(target_path))
    sizes = tensor_sizes(target_path)
    tied = not any("lm_head" in name for name in sizes)
    total = 0.0
    for name, n in sizes.items():
        if "embed_tokens" in name and not tied:
            continue  # a forward reads only its tokens' rows; the lm_head is counted instead
        routed = ".experts." in name and "shared_experts" not in name
        total += n * share if routed else n
    return total


def drafter_parameters_per_step(export_dir: str | Path) -> float:
    """Parameters one draft step of an export reads: everything but the vocabulary maps and the target's
    embedding that speculators' format carries."""
    skip = ("d2t", "t2d", "embed_tokens.weight")
    return float(sum(n for name, n in tensor_sizes(export_dir).items() if name not in skip))


def memory_bound_speedup(tokens_per_forward: float, num_draft_tokens: int, cost_ratio: float) -> float:
    """PROJECTION_FORMULA; cost_ratio = drafter parameters per draft step / target's per forward."""
    return tokens_per_forward / (1.0 + num_draft_tokens * cost_ratio)


def cost_ratio(export_dir: str | Path, target_path: str | Path) -> float:
    return drafter_parameters_per_step(export_dir) / target_parameters_per_forward(target_path)


def describe_ratio(export_dir: str | Path, target_path: str | Path) -> dict[str, float]:
    """The projection's inputs, for the summary: both parameter counts and their ratio."""
    drafter, target = drafter_parameters_per_step(export_dir), target_parameters_per_forward(target_path)
    return {
        "drafter_parameters_per_step": drafter,
        "target_parameters_per_forward": target,
        "ratio": drafter / target,
    }
