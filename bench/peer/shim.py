"""SpecForge 0.2.0 on a CPU, for bench.peer: runs in SpecForge's own side environment (its venv), never
in draftsmith's, and changes nothing on disk: every CPU workaround is applied here, in this process, at
run time (shared/research/peer-trainers.md lists them):

1. `TORCH_COMPILE_DISABLE=1` (set before torch is imported): SpecForge wraps its RMSNorm, RoPE and loss
   helpers in `torch.compile`; on this CPU that is minutes of compilation for nothing measured here.
2. A stand-in `triton` module, seen only while `specforge.core.loss` is imported: that module imports
   Triton at the top for its fused GPU soft cross-entropy kernel. The stand-in's `jit` returns the
   function undecorated and `language.constexpr` exists for the kernels' annotations; it is removed from
   `sys.modules` right after, so nothing else ever sees a Triton. During that one import `torch.compile`
   is a pass-through (what it amounts to under (1)), since torch's compiler stack would inspect the
   stand-in.
3. `LogSoftmaxLoss` (that Triton kernel's autograd function) is replaced by `TorchSoftCE`: the same
   maths in plain torch — per row, -sum_v p_v * log_softmax(logits)_v, zero where the position mask is 0,
   summed and divided by the number of rows B*T (the kernel's `.mean()` over rows).
4. Config values, written by bench.peer: `training.attention_backend: sdpa` (flex attention has no CPU
   backward), `training.fsdp_sharding: NO_SHARD`, `data.dataloader_num_workers: 0`.

    python -P bench/peer/shim.py train --config run.yaml [dotted.override=value ...]
    python -P bench/peer/shim.py diff --config run.yaml --inputs diff_in.pt --out diff_out.pt
    python -P bench/peer/shim.py check          # the stand-ins apply and SpecForge's modules import

`diff` is bench.peer's differential check, SpecForge's side: it builds the drafter exactly as
`specforge train` would from the same config (its own initialisation, vocab map, frozen embedding and
target head), in float32, and runs SpecForge's own EAGLE-3 step (`Eagle3TrainStrategy.forward_loss`) on
the samples it is given, once per TTT depth 1..n, saving the initial weights, the per-step losses and
the gradient of every depth's weighted loss.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # (1): before torch is imported anywhere

import argparse  # noqa: E402
import importlib.machinery  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402


class TorchSoftCE:
    """Stand-in for SpecForge's Triton `LogSoftmaxLoss.apply(logits, target_p, position_mask)`:
    logits, target_p [B, T, V], position_mask [B, T, 1] -> the scalar mean over the B*T rows of the masked
    soft cross-entropy, differentiable by autograd."""

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)
        per_row = -(target_p.float() * logp).sum(-1)  # [B, T]
        mask = position_mask.reshape(per_row.shape).to(per_row.dtype)
        return (per_row * mask).sum() / per_row.numel()


def _triton_stand_in() -> dict[str, types.ModuleType]:
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    language.__spec__ = importlib.machinery.ModuleSpec("triton.language", None)
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    triton.language = language
    language.constexpr = int  # only read in the kernels' signatures
    return {"triton": triton, "triton.language": language}


def _no_compile(fn=None, **_kwargs):
    """torch.compile with compilation disabled: the function itself (as a bare or called decorator)."""
    return fn if fn is not None else (lambda f: f)


def apply_cpu_shims() -> None:
    """(2) + (3). Idempotent; call before anything imports SpecForge's EAGLE-3 model."""
    import specforge  # noqa: F401  (the package itself imports nothing heavy)

    if "specforge.core.loss" not in sys.modules:
        # That module's `@torch.compile` decorators would import torch's compiler stack, which inspects any
        # Triton in sys.modules; compilation is off (1), so they return the function as it is meanwhile.
        stand_ins = _triton_stand_in()
        hidden = {name: sys.modules.get(name) for name in stand_ins}
        sys.modules.update(stand_ins)
        compile_ = torch.compile
        torch.compile = _no_compile
        try:
            import specforge.core.loss  # noqa: F401
        finally:
            torch.compile = compile_
            for name, previous in hidden.items():
                if previous is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = previous
    sys.modules["specforge.core.loss"].LogSoftmaxLoss = TorchSoftCE
    model = sys.modules.get("specforge.algorithms.eagle3.model")
    if model is not None:  # imported already: rebind the name it took
        model.LogSoftmaxLoss = TorchSoftCE


def cmd_check(_args: argparse.Namespace) -> int:
    apply_cpu_shims()
    import specforge.algorithms.eagle3.model as m

    assert m.LogSoftmaxLoss is TorchSoftCE
    assert "triton" not in sys.modules
    print(f"ok: torch {torch.__version__}, SpecForge's EAGLE-3 model imports with the CPU stand-ins")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    apply_cpu_shims()
    from specforge.cli import main

    return int(main(["train", "--config", args.config, *args.overrides]) or 0)


def build_step(config_path: str, overrides: list[str]):
    """SpecForge's own assembly of the EAGLE-3 training step from a run config -> (strategy, bundle)."""
    apply_cpu_shims()
    from specforge.application import resolve_run
    from specforge.config import load_config
    from specforge.training.assembly import build_model_bundle

    resolved = resolve_run(load_config(config_path, overrides))
    algorithm = resolved.algorithm
    bundle = build_model_bundle(resolved.config, algorithm=algorithm)
    step = algorithm.providers.step
    strategy = step.build(bundle.model, target_head=bundle.target_head, **step.options(resolved.config))
    return strategy, bundle, resolved.config


def cmd_diff(args: argparse.Namespace) -> int:
    """One batch of samples (bench.peer's `diff_in.pt`), SpecForge's step at every TTT depth."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.contracts import TrainBatch

    torch.manual_seed(args.seed)
    strategy, bundle, cfg = build_step(args.config, ["model.torch_dtype=float32", *args.overrides])
    # SpecForge keeps its target head in bf16 (TargetHead.from_pretrained): reload it in float32
    if args.teacher_dtype == "float32":
        head = bundle.target_head.to(torch.float32)
        head.load_weights(model_path=cfg.model.target_model_path, lm_head_key=cfg.model.lm_head_key)
    model = strategy.eagle3_model  # OnlineEagle3Model
    inputs = torch.load(args.inputs, map_location="cpu", weights_only=True)
    draft = bundle.draft_model
    if inputs.get("weights") is not None:  # start from the given weights instead of SpecForge's own
        missing, unexpected = draft.load_state_dict(inputs["weights"], strict=False)
        if unexpected or [k for k in missing if "embed" not in k]:
            raise SystemExit(f"weights: missing {missing}, unexpected {unexpected}")
    initial = {k: v.detach().clone() for k, v in draft.state_dict().items() if "embed" not in k}
    params = {n: p for n, p in draft.named_parameters() if p.requires_grad}
    ttt = model.length
    out = {"initial": initial, "ttt_steps": ttt, "samples": []}
    for raw in inputs["samples"]:
        sample = normalize_offline_sample(raw, cfg.data.max_length)
        batch = TrainBatch(
            sample_ids=["diff"], strategy="eagle3", tensors=sample, metadata={"target_repr": "hidden_state"}
        )
        per_depth = []
        for depth in range(1, ttt + 1):
            model.length = depth
            draft.zero_grad(set_to_none=True)
            result = strategy.forward_loss(batch)
            result.loss.backward()
            per_depth.append(
                {
                    "loss": float(result.loss.detach()),
                    "plosses": [float(p) for p in result.metrics["plosses"]],
                    "acc_corrects": [int(c) for c in result.metrics["acc_corrects"]],
                    "acc_denoms": [float(d) for d in result.metrics["acc_denoms"]],
                    "grads": {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None},
                }
            )
        model.length = ttt
        out["samples"].append(per_depth)
    torch.save(out, args.out)
    print(f"wrote {args.out}: {len(out['samples'])} samples x {ttt} TTT depths")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/peer/shim.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="apply the stand-ins and import SpecForge's EAGLE-3 model")
    train = sub.add_parser("train", help="`specforge train` with the CPU stand-ins")
    train.add_argument("--config", required=True)
    train.add_argument("overrides", nargs="*", help="dotted overrides, as `specforge train` takes them")
    diff = sub.add_parser("diff", help="SpecForge's side of bench.peer --diff")
    diff.add_argument("--config", required=True)
    diff.add_argument("--inputs", required=True, help="samples (+ optional initial weights) from bench.peer")
    diff.add_argument("--out", required=True)
    diff.add_argument("--seed", type=int, default=0)
    diff.add_argument(
        "--teacher-dtype",
        choices=("bfloat16", "float32"),
        default="float32",
        help="SpecForge's target head runs in bf16; float32 isolates the maths from that rounding",
    )
    diff.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    return {"check": cmd_check, "train": cmd_train, "diff": cmd_diff}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
