"""Hugging Face Hub ids: how a setting names a Hub repository, where a target from the Hub is
materialised, and downloads through huggingface_hub's own cache with errors of one line.

`huggingface_hub` is imported only when a Hub id is used. It reads the token from `HF_TOKEN` (or the
login `hf auth login` stored); draftsmith never passes, logs or writes it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name as the Hub spells repository ids: letters, digits, '-', '_', '.', at most 96 each
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
# Where the workflow materialises a target given by Hub id (`resources/hub/<owner>--<name>[@revision]`).
HUB_TARGETS = "resources/hub"


class HubError(RuntimeError):
    """A Hub repository could not be had; the message names the id, the cache and what to do."""


def is_hub_id(value: str | os.PathLike[str]) -> bool:
    """Whether a setting names a Hub repository (`owner/name`) rather than a local path: spelled as a
    Hub id, not an existing file or folder (a local folder of that name wins), and its owner part no
    local folder (local_parent)."""
    text = str(value)
    spelled = bool(HUB_ID.fullmatch(text)) and ".." not in text and "--" not in text
    return spelled and not Path(text).exists() and local_parent(text) is None


def local_parent(value: str) -> str | None:
    """The folder of the working folder that `owner/name` would lie in, when it exists: then `value`
    is a mistyped or missing local path (`models/llama` beside a `models/`), not a Hub id.

    This cannot refuse a Hub id the workflow or huggingface_hub put there: neither ever makes a folder
    named after a Hub owner in the working folder (Hub targets are materialised into
    resources/hub/<owner>--<name>, the Hub cache keeps models--<owner>--<name> elsewhere). Only a folder
    the user made with an owner's name (`meta-llama/`) does, and the message names it. Paths that start
    with ./ or / are never spelt like Hub ids (HUB_ID), so they are local paths already."""
    if not HUB_ID.fullmatch(value):
        return None
    owner = value.split("/", 1)[0]
    return owner if Path(owner).is_dir() else None


def hub_target_dir(repo_id: str, revision: str | None = None) -> str:
    """The folder the workflow materialises Hub target `repo_id` (at `revision`) into."""
    name = repo_id.replace("/", "--")
    if revision:
        name += "@" + revision.replace("/", "--")
    return f"{HUB_TARGETS}/{name}"


def hub_cache() -> str:
    """The Hub cache huggingface_hub reads and fills (HF_HUB_CACHE, or HF_HOME/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    """Whether HF_HUB_OFFLINE forbids huggingface_hub to download (read as huggingface_hub reads it)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def is_cached(repo_id: str, repo_type: str = "model", revision: str | None = None) -> bool:
    """Whether the Hub cache holds a snapshot of `repo_id` (at `revision`: a branch, tag or commit it
    knows), without the network."""
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(hub_cache()) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshots = folder / "snapshots"
    if revision:
        return (folder / "refs" / revision).is_file() or (snapshots / revision).is_dir()
    return snapshots.is_dir() and any(snapshots.iterdir())


def cached_file(repo_id: str, filename: str, revision: str | None = None) -> Path | None:
    """`filename` of a Hub model from the local cache, without the network; None when not cached."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename, revision=revision)
    return Path(found) if isinstance(found, str) else None


def _described(repo_id: str, revision: str | None) -> str:
    return repo_id + (f" (revision {revision})" if revision else "")


def snapshot(
    repo_id: str,
    revision: str | None = None,
    repo_type: str = "model",
    ignore_patterns: list[str] | None = None,
) -> Path:
    """The folder of a Hub repository's files in the Hub cache, downloaded there when missing (offline,
    with `HF_HUB_OFFLINE=1`, from the cache only). Raises HubError with one line."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{'dataset' if repo_type == 'dataset' else 'model'} {_described(repo_id, revision)}"
    cache = constants.HF_HUB_CACHE
    try:
        folder = snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, ignore_patterns=ignore_patterns
        )
    except GatedRepoError:
        raise HubError(
            f"Hugging Face {what} is gated: accept its terms on huggingface.co and set HF_TOKEN to a token "
            "of that account"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"Hugging Face {what}: no such revision on the Hub") from None
    except RepositoryNotFoundError:
        raise HubError(
            f"Hugging Face {what}: no such repository on the Hub, or a private one (set HF_TOKEN to a token "
            "that can read it)"
        ) from None
    except HfHubHTTPError as err:
        raise HubError(f"Hugging Face {what}: the Hub refused ({_cause(err)})") from None
    except IncompleteSnapshotError:
        raise HubError(
            f"Hugging Face {what}: its copy in the cache {cache} is incomplete and cannot be completed here "
            "(offline or the Hub unreachable)"
        ) from None
    except LocalEntryNotFoundError as err:
        why = (
            "HF_HUB_OFFLINE=1 forbids downloading it"
            if constants.HF_HUB_OFFLINE
            else f"the Hub cannot be reached ({_cause(err)})"
        )
        raise HubError(f"Hugging Face {what} is not in the cache {cache} and {why}") from None
    except HFValidationError as err:
        raise HubError(f"{repo_id!r} is not a Hugging Face repository id: {err}") from None
    except OSError as err:  # a full disk or an unwritable cache while downloading
        raise HubError(f"Hugging Face {what}: download into {cache} failed: {err}") from None
    return Path(folder)


def _cause(err: BaseException) -> str:
    """The root error's class and first line (the connection error behind huggingface_hub's wrapper)."""
    while err.__cause__ is not None:
        err = err.__cause__
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


# The shipped configs' Hub targets, as their config.json files ship in this checkout: the memory plan of
# a first run reads them before any download (tests/data/target-configs, beside the workflow).
SHIPPED_TARGET_CONFIGS = {
    "moonshotai/Kimi-K2.5": "kimi-k2.5",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
}
SHIPPED_CONFIGS_DIR = Path(__file__).resolve().parents[3] / "tests" / "data" / "target-configs"
# What the plan needs of a Hub target: kilobytes, fetched at start (the weights' bytes from the index).
PLAN_FILES = ("config.json", "model.safetensors.index.json")


def plan_folder(repo_id: str, revision: str | None = None) -> Path | None:
    """A folder with the Hub target's config.json (and its safetensors index, where the Hub has one) for
    the memory plan at start, before the weights are downloaded: the Hub cache's copy, else the one
    shipped for a shipped config's target, else fetched from the Hub (config.json and the index only;
    with HF_HUB_OFFLINE=1 never). None when none can be had (the target job then plans after its
    download)."""
    found = cached_file(repo_id, "config.json", revision)
    if found is not None:
        return found.parent
    shipped = SHIPPED_TARGET_CONFIGS.get(repo_id)
    if shipped and not revision and (SHIPPED_CONFIGS_DIR / shipped / "config.json").is_file():
        return SHIPPED_CONFIGS_DIR / shipped
    if offline():
        return None
    from huggingface_hub import hf_hub_download

    folder = None
    for name in PLAN_FILES:
        try:
            folder = Path(hf_hub_download(repo_id, name, revision=revision, etag_timeout=10)).parent
        except Exception:  # noqa: BLE001 - gated, missing, unreachable: the plan waits for the download
            if name == "config.json":
                return None
    return folder
