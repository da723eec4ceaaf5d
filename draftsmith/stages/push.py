"""Push a drafter export to the Hugging Face Hub, only after it passed its gate.

    plan_push(results, repo_id, engine)   what would be uploaded, and the gate's word on it (no network)
    push(plan, token, api=None, force)    create the repository (if new) and upload the export folder

The export folder of the engine (`results/drafter/` for vLLM, `drafter-sglang/`, `drafter-speculators/`)
is uploaded as the explicit list of its regular files the plan names, hidden files (a crashed writer's
temporaries) and links left out: one commit of one upload per file, each opened without following a
link, never patterns built from file names (a file named `*` would match them all). A drafter whose gate
blocked (`results/eval/summary.json` says `gate_passed: false`, or `results/eval/gate.json`, written only
when the gate passes, is missing) is refused unless forced: the gate exists so that a drafter that loses
to free alternatives is not deployed, and a Hub repository is a deployment. The token comes from
HF_TOKEN only and is never printed; huggingface_hub does the talking (`HfApi.create_repo`,
`HfApi.create_commit`), and tests hand in an object with the same two methods.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from draftsmith.core.config.stage_args import BAD_INPUT, FAILED, GATE, arg

ENGINE_FOLDERS = {"vllm": "drafter", "sglang": "drafter-sglang", "speculators": "drafter-speculators"}
TOKEN_ENV = "HF_TOKEN"


class PushInputError(ValueError):
    """Bad input: no such export, a malformed repository id, no token (exit 2)."""


class GateRefused(RuntimeError):
    """The drafter's gate blocked and the push was not forced (exit 3)."""


class PushFailed(RuntimeError):
    """The Hub refused or could not be reached (exit 1); the message never holds the token."""


class HubApi(Protocol):
    """The two calls of huggingface_hub.HfApi that a push makes."""

    # read-only callables, not methods: HfApi's take keyword arguments of their own, which a protocol
    # method's `**kwargs` would refuse
    @property
    def create_repo(self) -> Callable[..., Any]: ...

    @property
    def create_commit(self) -> Callable[..., Any]: ...


@dataclass
class GateStatus:
    passed: bool
    reason: str  # why the push is allowed or refused, one line
    verdict: dict[str, Any] | None = None  # summary.json's verdict, when there is one


@dataclass
class PushPlan:
    repo_id: str
    engine: str
    folder: Path
    files: list[str]  # paths relative to folder, sorted
    bytes: int
    gate: GateStatus
    private: bool = False
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> list[str]:
        lines = [
            f"push {self.folder} ({self.engine} export) to https://huggingface.co/{self.repo_id}"
            f"{' (private)' if self.private else ''}: {len(self.files)} files, {self.bytes / 1e6:.1f} MB",
            *[f"  {name}" for name in self.files],
            f"gate: {self.gate.reason}",
        ]
        return lines + [f"warning: {w}" for w in self.warnings]


def validate_repo_id(repo_id: str) -> str:
    """ORG/NAME as the Hub spells repository ids (huggingface_hub's own rules, plus the owner)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hub_validate

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise PushInputError(f"--repo-id {repo_id!r}: expected ORG/NAME (the owner, a slash, the name)")
    try:
        hub_validate(repo_id)
    except HFValidationError as err:
        raise PushInputError(f"--repo-id {repo_id!r}: {err}") from None
    return repo_id


def verdict_head(verdict: dict[str, Any]) -> str:
    """The verdict's first line as the report prints it (what to deploy, per held-out set when they
    differ). A verdict without the keys the report reads is bad input (PushInputError)."""
    from draftsmith.core.evaluation.report import format_verdict

    try:
        return format_verdict(verdict).splitlines()[0].removeprefix("VERDICT: ")
    except (KeyError, TypeError, AttributeError) as err:
        raise PushInputError(
            f"results/eval/summary.json: its verdict is not one this version reads ({type(err).__name__}: "
            f"{err}); re-run the evaluation summary (snakemake --forcerun eval_summary)"
        ) from None


def gate_status(results: Path) -> GateStatus:
    """Whether the evaluation let this drafter through: summary.json's gate_passed and gate.json both."""
    summary_path, gate_path = results / "eval" / "summary.json", results / "eval" / "gate.json"
    if not summary_path.is_file():
        return GateStatus(False, f"{summary_path} is missing: the drafter was never evaluated")
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return GateStatus(False, f"{summary_path} is not valid JSON ({err})")
    except RecursionError:
        return GateStatus(False, f"{summary_path} is not readable JSON (nested too deeply)")
    if not isinstance(summary, dict):
        return GateStatus(False, f"{summary_path} is not an evaluation summary (a {type(summary).__name__})")
    verdict = summary.get("verdict")
    said = f" (verdict: {verdict_head(verdict)})" if verdict else ""
    if summary.get("gate_passed") is not True:
        return GateStatus(False, f"the gate blocked this drafter{said}; see {summary_path}", verdict)
    if not gate_path.is_file():
        return GateStatus(
            False, f"{gate_path} is missing: the gate stage has not passed this evaluation{said}", verdict
        )
    return GateStatus(True, f"passed{said}", verdict)


def plan_push(results: str | Path, repo_id: str, engine: str = "vllm", private: bool = False) -> PushPlan:
    """What a push would upload, checked: the export folder exists and its engine's loader would read
    it (check_export), the repository id is well formed, and the gate's word. Touches no network."""
    from draftsmith.core.export.formats import check_export

    results = Path(results)
    if engine not in ENGINE_FOLDERS:
        raise PushInputError(f"--engine {engine!r}: expected one of {', '.join(ENGINE_FOLDERS)}")
    validate_repo_id(repo_id)
    folder = results / ENGINE_FOLDERS[engine]
    if not folder.is_dir():
        raise PushInputError(
            f"{folder} does not exist: no {engine} export in {results} (run the workflow's export stage)"
        )
    problems = check_export(folder, engine=engine)
    if problems:
        raise PushInputError(f"{folder} is not a loadable {engine} export: " + "; ".join(problems))
    # regular files only: a link (notes.txt -> /etc/passwd) would upload what it points to
    files = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    links = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_symlink())
    size = sum((folder / name).stat().st_size for name in files)
    plan = PushPlan(repo_id, engine, folder, files, size, gate_status(results), private)
    if links:
        plan.warnings.append(f"left out, not regular files of the export: {', '.join(links)}")
    if "README.md" not in files:
        plan.warnings.append(f"{folder} has no model card (README.md): re-run the export stage")
    verdict = plan.gate.verdict
    if plan.gate.passed and verdict and verdict.get("deploy") != "trained drafter":
        plan.warnings.append(
            f"the gate passed, but its verdict says {verdict_head(verdict)}: a check it judges was "
            "configured as a warning (evaluate.gate)"
        )
    return plan


def hf_token(environ: dict[str, str] | None = None) -> str:
    """The token from HF_TOKEN, the only place a push takes it from."""
    token = (os.environ if environ is None else environ).get(TOKEN_ENV, "").strip()
    if not token:
        raise PushInputError(
            f"{TOKEN_ENV} is not set: create a token with write access at "
            f"https://huggingface.co/settings/tokens and export {TOKEN_ENV}=... (read from the environment "
            "only, so that it appears in no command line or log)"
        )
    return token


def hub_card(plan: PushPlan) -> str | None:
    """The export's model card with the repository as the drafter to serve (its serve command names
    the Hub id, not the local folder), from the run's summary.json; None without a card or summary."""
    from draftsmith.core.export.model_card import CARD_NAME, render_card, serve_target

    summary_path = plan.folder.parent / "eval" / "summary.json"
    if CARD_NAME not in plan.files or not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    if "headline" not in summary or "provenance" not in summary:  # a summary from before the card
        return None
    folders = {e: str(plan.folder.parent / name) for e, name in ENGINE_FOLDERS.items()}
    folders[plan.engine] = plan.repo_id
    return render_card(summary, plan.engine, folders, serve_target(summary))


@contextlib.contextmanager
def staged(plan: PushPlan) -> Iterator[Path]:
    """The folder to upload: the export itself, or, when its card is re-rendered for the Hub, a
    hidden staging folder beside it of hard links to its files (copies across file systems) and the
    new card. The export folder is never changed."""
    card = hub_card(plan)
    if card is None:
        yield plan.folder
        return
    with tempfile.TemporaryDirectory(prefix=f".{plan.folder.name}.push-", dir=plan.folder.parent) as tmp:
        stage = Path(tmp)
        for name in plan.files:
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            if name == "README.md":
                (stage / name).write_text(card, encoding="utf-8")
                continue
            # a file swapped for a link since the plan stays a link here, refused by upload_operations
            try:
                os.link(plan.folder / name, stage / name, follow_symlinks=False)
            except OSError:
                shutil.copyfile(plan.folder / name, stage / name, follow_symlinks=False)
        yield stage


def upload_operations(folder: Path, names: list[str], files: contextlib.ExitStack) -> list[Any]:
    """One upload per planned file, each opened without following a link (O_NOFOLLOW) and checked to be
    a regular file inside `folder`: a file swapped for a link after the plan was made is refused, not
    followed (PushInputError). The open files are closed with `files`."""
    from huggingface_hub import CommitOperationAdd

    root = folder.resolve()
    operations = []
    for name in names:
        path = folder / name
        try:
            if not path.resolve().is_relative_to(root):  # a folder on its way swapped for a link
                raise OSError("it lies outside the export")
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            handle = files.enter_context(os.fdopen(fd, "rb"))
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError("not a regular file")
        except OSError as err:
            raise PushInputError(
                f"{path}: changed since the push was planned ({err.strerror or err}); run it again"
            ) from None
        operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=handle))
    return operations


def push(
    plan: PushPlan, api: HubApi | None = None, force: bool = False, environ: dict[str, str] | None = None
) -> str:
    """Create the repository (kept if it exists) and upload the plan's files in one commit; returns
    the commit's URL. Refuses a drafter whose gate blocked unless forced, before asking for a token."""
    if not plan.gate.passed and not force:
        raise GateRefused(f"refusing to push {plan.folder}: {plan.gate.reason} (--force pushes it anyway)")
    token = hf_token(environ)
    if api is None:
        from huggingface_hub import HfApi

        from draftsmith import __version__

        api = HfApi(library_name="draftsmith", library_version=__version__)
    verdict = plan.gate.verdict or {}
    message = f"draftsmith: EAGLE-3 drafter, {plan.engine} export"
    if verdict:
        message += f" (verdict: {verdict.get('action')}, deploy: {verdict.get('deploy')})"
    if not plan.gate.passed:
        message += " [pushed with --force: the gate blocked it]"
    try:
        api.create_repo(plan.repo_id, token=token, private=plan.private, repo_type="model", exist_ok=True)
        with staged(plan) as folder, contextlib.ExitStack() as files:
            commit = api.create_commit(
                repo_id=plan.repo_id,
                operations=upload_operations(folder, plan.files, files),
                repo_type="model",
                token=token,
                commit_message=message,
            )
    except PushInputError:
        raise
    except Exception as err:  # huggingface_hub's HTTP, validation and connection errors alike
        raise PushFailed(
            f"pushing to {plan.repo_id} failed: {type(err).__name__}: {str(err).replace(token, '***')}"
        ) from None
    return str(getattr(commit, "commit_url", None) or commit)


@dataclass
class PushPaths:
    results: str = arg("RESULTS_DIR", "", kind="dir", required=True)
    repo_id: str = arg(
        "--repo-id",
        "The Hub repository, ORG/NAME (created if it does not exist).",
        kind="text",
        required=True,
    )
    engine: str = arg(
        "--engine",
        "The serving engine whose export to push: drafter/, drafter-sglang/ or drafter-speculators/.",
        kind="text",
        choices=tuple(ENGINE_FOLDERS),
        default="vllm",
    )
    private: bool = arg("--private", "Create the repository private.", kind="flag")
    force: bool = arg("--force", "Push even though the drafter's gate blocked it.", kind="flag")
    dry_run: bool = arg(
        "--dry-run", "Print what would be uploaded and the gate's word; push nothing.", kind="flag"
    )


Paths = PushPaths
EXITS = {PushInputError: BAD_INPUT, GateRefused: GATE, PushFailed: FAILED}


def run(paths: PushPaths) -> Iterator[str]:
    """Upload a drafter export to the Hugging Face Hub, after its gate.

    \b
    draftsmith push results --repo-id my-org/smollm2-eagle3            # results/drafter/, for vLLM
    draftsmith push results --repo-id my-org/smollm2-eagle3-sglang --engine sglang

    The token is read from HF_TOKEN (never from the command line, never printed). A drafter whose gate
    blocked (results/eval/summary.json gate_passed false, or results/eval/gate.json missing) is refused
    with exit 3 unless --force. Exit 2: bad input (no such export, repository id, no token); 1: the Hub
    failed.
    """
    plan = plan_push(paths.results, paths.repo_id, paths.engine, paths.private)
    yield from plan.describe()
    if not paths.dry_run:
        yield f"pushed: {push(plan, force=paths.force)}"
