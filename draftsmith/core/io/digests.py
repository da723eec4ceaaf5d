"""Content digests of the workflow's intermediates, so that a damaged one is found at start.

Snakemake reruns a job whose input is newer than its outputs, and deletes those outputs before the job
runs: a corrupt `results/vocab_map.pt` with a new mtime cost `results/drafter/` before torch even said
why. So each stage that writes an intermediate seals it: a hidden sidecar beside the file
(`.vocab_map.pt.sha256`, written atomically after the file) holds its sha256, size, inode and device and
the stage that wrote it. At parse time (rules/common.smk) every sealed file is checked before any job
runs. The mtime is never trusted: Snakemake touches every output after its job, so it never matches. The
same size, inode and device are trusted (a stat: a file rewritten the usual way, by rename or copy, is a
new inode; a small file, milliseconds to hash, also needs its mtime); otherwise the file is hashed (up to a size) and a different digest stops the run naming the
file and the `--forcerun` that makes it again. A file found intact under a new inode (a copied run) is
sealed again with it, so the next start is a stat again.

A stage removes its sidecars when it starts, so a job that dies between writing a file and sealing it
leaves no stale digest behind (Snakemake reruns that incomplete job anyway).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import zipfile
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from draftsmith.core.io.atomic import write_json

SUFFIX = ".sha256"
# Files up to this size (milliseconds to hash: vocab_map.pt, data_config.json) are hashed at start whenever
# their mtime moved too, so that even an edit in place, same size and inode, is seen.
SMALL_BYTES = 4 * 2**20
# Files up to this size are hashed at start when their inode or device changed (~0.5 s); a larger one is
# left to the job that reads it (shards verify every sample), with a warning.
CHECK_MAX_BYTES = 256 * 2**20


def sidecar(path: str | os.PathLike[str]) -> Path:
    """Where the digest of `path` lives: a hidden file beside it (push and the engines skip those)."""
    path = Path(path)
    return path.with_name(f".{path.name}{SUFFIX}")


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The files of `paths`: a folder stands for the visible regular files directly in it."""
    files = []
    for path in map(Path, paths):
        if path.is_dir() and not path.is_symlink():
            files += sorted(p for p in path.iterdir() if not p.name.startswith(".") and not p.is_symlink())
        else:
            files.append(path)
    return files


def unseal(paths: Iterable[str | os.PathLike[str]]) -> None:
    for path in map(Path, paths):
        for side in path.glob(f".*{SUFFIX}") if path.is_dir() else [sidecar(path)]:
            side.unlink(missing_ok=True)


def seal(paths: Iterable[str | os.PathLike[str]], stage: str) -> None:
    """Record the digest of each file in `paths` (a folder: the files in it; missing ones are skipped)
    as written by `stage`."""
    for path in _files(paths):
        if not path.is_file() or path.is_symlink():
            continue
        write_json(sidecar(path), {"sha256": file_sha256(path), **identity(path), "stage": stage})


def identity(path: Path) -> dict[str, int]:
    """What a stat can tell of a file's bytes: its size, inode and device. The mtime is kept for the
    record only (Snakemake's touch moves it, so it decides nothing)."""
    stat = path.stat()
    return {"bytes": stat.st_size, "inode": stat.st_ino, "device": stat.st_dev, "mtime_ns": stat.st_mtime_ns}


def same_file(stat: os.stat_result, record: dict[str, Any]) -> bool:
    """Whether a stat shows the very file that was sealed: same size, inode and device (and for a small
    file, one cheap to hash, the same mtime: Snakemake's touch costs it a hash of milliseconds)."""
    sealed_as = (record["bytes"], record.get("inode"), record.get("device"))
    same = (stat.st_size, stat.st_ino, stat.st_dev) == sealed_as
    return same and (stat.st_size > SMALL_BYTES or stat.st_mtime_ns == record.get("mtime_ns"))


def seal_as(path: str | os.PathLike[str], source: str | os.PathLike[str]) -> None:
    """Seal `path`, a link or copy of the sealed `source`, with source's digest (no hash of it again)."""
    path = Path(path)
    record = _record(sidecar(source))
    if record is None:
        raise ValueError(f"{source} is not sealed")
    write_json(sidecar(path), {**record, **identity(path)})


def rule_of(stage: str) -> str:
    """The Snakemake rule of a stage command (eval-summary: rule eval_summary)."""
    return stage.replace("-", "_")


def forcerun_advice(stage: str) -> str:
    rule = rule_of(stage)
    return f"rerun with `snakemake --forcerun {rule}` (rule {rule} writes it again)"


def sealed(stage: str, *options: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator of a stage command: the files named by its keyword arguments `options` are unsealed
    when it starts and sealed when it returns (not when it fails)."""

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def run(*args: Any, **kw: Any) -> Any:
            # under torchrun only rank 0 writes the results, and only it seals them
            paths = (
                [kw[name] for name in options if kw.get(name)] if os.environ.get("RANK", "0") == "0" else []
            )
            unseal(paths)
            result = command(*args, **kw)
            seal(paths, stage)
            return result

        return run

    return wrap


def _record(side: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    keys = {"sha256": str, "bytes": int, "stage": str}  # an older seal without inode: hashed once
    ok = isinstance(record, dict) and all(isinstance(record.get(k), t) for k, t in keys.items())
    return record if ok else None


def damage(
    path: str | os.PathLike[str], max_bytes: int = CHECK_MAX_BYTES, forced: Collection[str] = ()
) -> tuple[str | None, str | None]:
    """(error, warning) for one file against its sidecar; both None when it is intact, unsealed or gone.
    A damaged file whose rule is in `forced` (`--forcerun`) is only a warning: that run makes it again."""
    path = Path(path)
    record = _record(sidecar(path))
    if record is None or not path.is_file():
        return None, None
    stat = path.stat()
    if same_file(stat, record):
        return None, None
    if stat.st_size != record["bytes"]:
        why = f"{stat.st_size:,} bytes where rule {rule_of(record['stage'])} wrote {record['bytes']:,}"
    elif stat.st_size > max_bytes:
        return (
            None,
            f"{path} was rewritten since rule {rule_of(record['stage'])} wrote it; too large to check at start",
        )
    elif file_sha256(path) != record["sha256"]:
        why = f"its sha256 differs from what rule {rule_of(record['stage'])} wrote"
    else:
        _reseal(path, record)
        return None, None
    if rule_of(record["stage"]) in forced:
        return None, f"{path}: damaged ({why}); rule {rule_of(record['stage'])} is forced to write it again"
    return f"{path}: damaged ({why}); {forcerun_advice(record['stage'])}", None


def _reseal(path: Path, record: dict[str, Any]) -> None:
    """Record the new inode of a file found intact (a copy), so that the next start only stats it."""
    with contextlib.suppress(OSError):  # a read-only results folder is checked again next time
        write_json(sidecar(path), {**record, **identity(path)})


def intact(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is sealed and still what was sealed: the same size, and the same inode or else the
    same sha256 (hashed whatever its size). An unsealed or missing file is not."""
    path = Path(path)
    record = _record(sidecar(path))
    if record is None or not path.is_file():
        return False
    stat = path.stat()
    if stat.st_size != record["bytes"]:
        return False
    return same_file(stat, record) or file_sha256(path) == record["sha256"]


def retouch(path: str | os.PathLike[str]) -> None:
    """Set an intact sealed file's mtime to now and its seal's with it (no rehash): a file reused as a
    new job's output must not look older than that job's inputs."""
    path = Path(path)
    record = _record(sidecar(path))
    if record is None:
        raise ValueError(f"{path} is not sealed")
    os.utime(path)
    write_json(sidecar(path), {**record, **identity(path)})


def damage_under(
    root: str | os.PathLike[str], max_bytes: int = CHECK_MAX_BYTES, forced: Collection[str] = ()
) -> tuple[list[str], list[str]]:
    """(errors, warnings) of every sealed file under `root` (see `damage`), named where the user sees it:
    hidden folders (extraction's stash, results/hidden/.done/) are left to the stage that keeps them,
    which checks each stashed shard before it reuses it; the shards it publishes are sealed themselves."""
    errors: list[str] = []
    warnings: list[str] = []
    root = Path(root)
    if not root.is_dir():
        return errors, warnings
    for side in sorted(root.rglob(f".*{SUFFIX}")):
        if any(part.startswith(".") for part in side.parent.relative_to(root).parts):
            continue
        path = side.with_name(side.name[1 : -len(SUFFIX)])
        error, warning = damage(path, max_bytes, forced)
        errors += [error] if error else []
        warnings += [warning] if warning else []
    return errors, warnings


# ---- unsealed intermediates: parsed at start ----------------------------------------------------------

PARSED_SUFFIXES = (".json", ".pt", ".safetensors")


def parse_error(path: Path) -> str | None:
    """Why a file cannot be what its suffix says (None when it parses), by a cheap read: JSON parsed, a
    .pt's zip archive checked (torch.save's format; no torch at start), a safetensors header parsed."""
    try:
        if path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".pt":
            if not zipfile.is_zipfile(path):
                return "not a torch file"
            with zipfile.ZipFile(path) as archive:
                if archive.testzip() is not None:
                    return "a torch file with a damaged member"
        elif path.suffix == ".safetensors":
            with open(path, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                if size <= 0 or size > path.stat().st_size - 8:
                    return "not a safetensors file"
                if not isinstance(json.loads(fh.read(size)), dict):
                    return "not a safetensors file"
    except (OSError, ValueError, RecursionError, zipfile.BadZipFile) as err:
        return f"unreadable ({type(err).__name__})"
    return None


def smallest_readable(suffix: str) -> bytes:
    """The smallest file of a kind `parse_error` accepts (JSON, a torch zip archive, a safetensors
    header; empty for any other kind): what tests and benches make a fake finished run of."""
    if suffix == ".pt":
        import io
        import zipfile

        data = io.BytesIO()
        with zipfile.ZipFile(data, "w") as archive:
            archive.writestr("archive/data.pkl", b"")
        return data.getvalue()
    return {".json": b"{}", ".safetensors": (2).to_bytes(8, "little") + b"{}"}.get(suffix, b"")


def unreadable_under(
    root: str | os.PathLike[str],
    writer: Callable[[str], str | None],
    forced: Collection[str] = (),
    max_bytes: int = CHECK_MAX_BYTES,
) -> list[str]:
    """One line per unsealed file under `root` (outside hidden folders) that a rule writes (`writer`: the
    rule of a path, None for a file no rule makes) and that does not parse: a sidecar lost in a copy
    (`cp results/*` leaves dot-files behind) or a file replaced by hand. Sealed files are `damage`'s."""
    errors = []
    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.suffix in PARSED_SUFFIXES) if root.is_dir() else []
    for path in files:
        if any(part.startswith(".") for part in path.relative_to(root).parts) or path.is_symlink():
            continue
        if not path.is_file() or _record(sidecar(path)) is not None:
            continue
        rule = writer(str(path))
        if rule is None or rule in forced:
            continue
        if path.suffix != ".safetensors" and path.stat().st_size > max_bytes:
            continue
        if why := parse_error(path):
            errors.append(f"{path}: {why}; {forcerun_advice(rule)}")
    return errors


class EveryRule(frozenset[str]):
    """The rules forced by -F/--forceall: every one."""

    def __contains__(self, rule: object) -> bool:
        return True


def forced_rules(argv: list[str]) -> frozenset[str]:
    """The rules named by -R/--forcerun in Snakemake's command line (all of them with -F/--forceall): its
    settings are made only after the Snakefile is parsed, where the start check runs."""
    rules: set[str] = set()
    taking = False
    for arg in argv[1:]:
        if arg in ("-F", "--forceall"):
            return EveryRule()
        if taking and not arg.startswith("-"):
            rules.add(arg)
            continue
        taking = arg in ("-R", "--forcerun")
        if arg.startswith("--forcerun="):
            rules.add(arg.split("=", 1)[1])
    return frozenset(rules)
