"""draftsmith push: what is uploaded, the gate's refusal, the token's one source, and the Hub's errors,
without the Hub: huggingface_hub's real HfApi talks to a local HTTP endpoint that answers its calls
(create the repository, pre-upload, commit) and records them."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.evaluation import tiny_summary
from helpers.model import EXPORT_AUX_IDS, make_drafter
from huggingface_hub import HfApi

from draftsmith.cli import main
from draftsmith.core.export.formats import save_drafter
from draftsmith.core.io.atomic import write_json
from draftsmith.stages.push import GateRefused, PushFailed, PushInputError, plan_push, push

TOKEN = "hf_test_Secret0123456789"


class LocalHub:
    """A stand-in for the Hub's HTTP API on 127.0.0.1: records every request; answers create_repo,
    the model card's metadata check, preupload (every file "regular": uploaded inline, base64, in the
    commit; the Hub would send large files through LFS, which this does not reproduce) and commit.
    `fail_with` makes every request answer that status."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.fail_with: int | None = None
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                )
                base = f"http://127.0.0.1:{hub.port}"
                if hub.fail_with:
                    return self._reply(
                        hub.fail_with, {"error": f"refused, token {self.headers.get('Authorization')}"}
                    )
                if self.path == "/api/validate-yaml":  # huggingface_hub checks a README's metadata first
                    return self._reply(200, {"errors": [], "warnings": []})
                if self.path == "/api/repos/create":
                    name = json.loads(body)
                    return self._reply(200, {"url": f"{base}/{name['organization']}/{name['name']}"})
                if "/preupload/" in self.path:
                    files = json.loads(body)["files"]
                    return self._reply(
                        200,
                        {
                            "files": [
                                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                for f in files
                            ]
                        },
                    )
                if "/commit/" in self.path:
                    repo = self.path.split("/api/models/")[1].split("/commit/")[0]
                    return self._reply(
                        200, {"commitUrl": f"{base}/{repo}/commit/0123abc", "commitOid": "0123abc"}
                    )
                self._reply(404, {"error": "unknown route"})

            def _reply(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def api(self) -> HfApi:
        return HfApi(endpoint=f"http://127.0.0.1:{self.port}")

    def committed(self) -> tuple[dict, dict[str, bytes]]:
        """(the commit's header, {path: bytes uploaded}) of the one commit made."""
        (commit,) = [r for r in self.requests if "/commit/" in r["path"]]
        lines = [json.loads(line) for line in commit["body"].decode().splitlines()]
        files = {
            x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"
        }
        return lines[0]["value"], files


@pytest.fixture
def hub() -> Iterator[LocalHub]:
    server = LocalHub()
    yield server
    server.server.shutdown()


def _results(tmp_path: Path, gate_passed: bool = True, gate_json: bool = True) -> Path:
    """A results folder as the workflow leaves it: the vLLM export (with a card), a temporary file a
    crashed writer left beside it, and the evaluation's summary (and gate.json when the gate passed)."""
    results = tmp_path / "results"
    drafter = results / "drafter"
    save_drafter(make_drafter(), drafter, EXPORT_AUX_IDS, "targets/tiny")
    (drafter / "README.md").write_text("---\nlibrary_name: vllm\n---\n# card\n")
    (drafter / ".model.safetensors.tmp123").write_bytes(b"partial")
    verdict = {"action": "deploy drafter" if gate_passed else "train longer", "deploy": "trained drafter"}
    if not gate_passed:
        verdict["deploy"] = "n-gram lookup"
    write_json(results / "eval" / "summary.json", {"gate_passed": gate_passed, "verdict": verdict})
    if gate_json:
        write_json(results / "eval" / "gate.json", {"verdict": verdict})
    return results


def test_push_uploads_exactly_the_export_folder_with_the_token_from_hf_token(tmp_path, hub):
    results = _results(tmp_path)
    plan = plan_push(results, "my-org/smollm2-eagle3", private=True)
    assert plan.files == ["README.md", "config.json", "model.safetensors"] and plan.gate.passed
    url = push(plan, api=hub.api(), environ={"HF_TOKEN": TOKEN})
    assert url == f"http://127.0.0.1:{hub.port}/my-org/smollm2-eagle3/commit/0123abc"
    create = hub.requests[0]
    assert create["path"] == "/api/repos/create"
    assert json.loads(create["body"]) == {
        "name": "smollm2-eagle3",
        "organization": "my-org",
        "visibility": "private",
        "type": "model",
    }
    assert {r["auth"] for r in hub.requests} == {f"Bearer {TOKEN}"}
    header, files = hub.committed()
    assert "verdict: deploy drafter" in header["summary"]
    drafter = results / "drafter"
    assert files == {
        name: (drafter / name).read_bytes() for name in plan.files
    }  # byte for byte, no temp file


def test_push_refuses_a_drafter_whose_gate_blocked_unless_forced(tmp_path, hub):
    for gate_passed, gate_json, said in (
        (False, False, "the gate blocked this drafter (verdict: DEPLOY n-gram lookup; next: TRAIN LONGER)"),
        (True, False, "gate.json is missing: the gate stage has not passed this evaluation"),
    ):
        results = _results(tmp_path / str(gate_passed), gate_passed, gate_json)
        plan = plan_push(results, "my-org/drafter")
        with pytest.raises(
            GateRefused, match="refusing to push .*drafter: .*--force pushes it anyway"
        ) as err:
            push(plan, api=hub.api(), environ={})  # refused before a token is even asked for
        assert said in str(err.value)
        assert hub.requests == []
    url = push(plan, api=hub.api(), environ={"HF_TOKEN": TOKEN}, force=True)
    assert url.endswith("/my-org/drafter/commit/0123abc")
    assert "pushed with --force: the gate blocked it" in hub.committed()[0]["summary"]


def test_push_without_hf_token_says_where_to_get_one(tmp_path, hub):
    plan = plan_push(_results(tmp_path), "my-org/drafter")
    for environ in ({}, {"HF_TOKEN": "  "}):
        with pytest.raises(PushInputError, match="HF_TOKEN is not set: create a token with write access"):
            push(plan, api=hub.api(), environ=environ)
    assert hub.requests == []


def test_a_hub_error_fails_without_showing_the_token(tmp_path, hub):
    hub.fail_with = 401
    plan = plan_push(_results(tmp_path), "my-org/drafter")
    with pytest.raises(PushFailed, match="pushing to my-org/drafter failed: ") as err:
        push(plan, api=hub.api(), environ={"HF_TOKEN": TOKEN})
    assert TOKEN not in str(err.value) and err.value.__cause__ is None and err.value.__suppress_context__


@pytest.mark.parametrize(
    ("repo_id", "message"),
    [
        ("drafter", "expected ORG/NAME"),
        ("a/b/c", "expected ORG/NAME"),
        ("my-org/bad name", "--repo-id 'my-org/bad name': "),
    ],
)
def test_bad_repository_ids_are_refused_before_anything_runs(tmp_path, repo_id, message):
    with pytest.raises(PushInputError, match=message):
        plan_push(_results(tmp_path), repo_id)


def test_push_checks_the_export_it_would_upload(tmp_path):
    results = _results(tmp_path)
    with pytest.raises(PushInputError, match="drafter-sglang does not exist: no sglang export"):
        plan_push(results, "my-org/drafter", engine="sglang")
    (results / "drafter" / "model.safetensors").unlink()
    with pytest.raises(PushInputError, match="is not a loadable vllm export: .*model.safetensors is missing"):
        plan_push(results, "my-org/drafter")


def test_push_cli_exit_codes_and_messages(tmp_path, monkeypatch):
    """2 bad input, 3 the gate refused (and says so), 0 a dry run listing what would go; the token
    never reaches the output."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    runner = CliRunner()
    results = _results(tmp_path / "blocked", gate_passed=False, gate_json=False)
    refused = runner.invoke(main, ["push", str(results), "--repo-id", "my-org/drafter"])
    assert refused.exit_code == 3
    assert "refusing to push" in refused.output and "the gate blocked this drafter" in refused.output
    dry = runner.invoke(main, ["push", str(results), "--repo-id", "my-org/drafter", "--dry-run"])
    assert dry.exit_code == 0 and "  model.safetensors" in dry.output and ".tmp" not in dry.output
    assert "gate: the gate blocked this drafter" in dry.output
    bad = runner.invoke(main, ["push", str(results), "--repo-id", "drafter"])
    assert bad.exit_code == 2 and "expected ORG/NAME" in bad.output
    monkeypatch.delenv("HF_TOKEN")
    forced = runner.invoke(main, ["push", str(results), "--repo-id", "my-org/drafter", "--force"])
    assert forced.exit_code == 2 and "HF_TOKEN is not set" in forced.output
    for result in (refused, dry, bad, forced):
        assert TOKEN not in result.output


def test_a_passed_gate_with_a_losing_verdict_is_pushed_with_a_warning(tmp_path):
    """The default config gates beats_ngram as a warning: the gate passes while the verdict says deploy
    n-gram lookup. push lets it through, and says so."""
    results = _results(tmp_path)
    write_json(
        results / "eval" / "summary.json",
        {"gate_passed": True, "verdict": {"action": "train longer", "deploy": "n-gram lookup"}},
    )
    plan = plan_push(results, "my-org/drafter")
    assert plan.gate.passed
    assert any("its verdict says DEPLOY n-gram lookup; next: TRAIN LONGER" in w for w in plan.warnings)


def test_the_pushed_card_names_the_repository_as_the_drafter_to_serve(tmp_path, hub):
    """With the run's summary beside it, the card is rendered again for the Hub: its vLLM command names
    the repository; the local export folder keeps its own card, and every other file goes as it is."""
    from draftsmith.stages.export.card import write_cards

    results = _results(tmp_path)
    summary = {**tiny_summary(), "gate_passed": True}
    write_json(results / "eval" / "summary.json", summary)
    write_cards(results / "eval" / "summary.json", {"vllm": results / "drafter"}, "targets/tiny")
    local_card = (results / "drafter" / "README.md").read_text()
    plan = plan_push(results, "my-org/smollm2-eagle3")
    push(plan, api=hub.api(), environ={"HF_TOKEN": TOKEN})
    _, files = hub.committed()
    card = files["README.md"].decode()
    assert '"model": "my-org/smollm2-eagle3"' in card and '"model": "my-org/smollm2-eagle3"' not in local_card
    assert card.split("## Serve")[0] == local_card.split("## Serve")[0]  # the same figures
    assert (results / "drafter" / "README.md").read_text() == local_card
    assert {k: v for k, v in files.items() if k != "README.md"} == {
        name: (results / "drafter" / name).read_bytes() for name in ("config.json", "model.safetensors")
    }
    assert sorted(p.name for p in results.iterdir()) == ["drafter", "eval"]  # the staging folder is gone


def test_a_link_inside_the_export_is_not_uploaded(tmp_path, hub):
    """Regular files only: notes.txt -> a file outside the export would upload what it points to."""
    results = _results(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the Hub")
    (results / "drafter" / "notes.txt").symlink_to(secret)
    (results / "drafter" / "more").symlink_to(tmp_path, target_is_directory=True)
    plan = plan_push(results, "my-org/drafter")
    assert plan.files == ["README.md", "config.json", "model.safetensors"]
    assert any("left out, not regular files of the export: more, notes.txt" in w for w in plan.warnings)
    push(plan, api=hub.api(), environ={"HF_TOKEN": TOKEN})
    assert set(hub.committed()[1]) == set(plan.files)


@pytest.mark.parametrize("verdict", [{"deploy": "trained drafter"}, "deploy", [1]])
def test_a_summary_whose_verdict_lacks_its_keys_is_one_line_exit_2(tmp_path, verdict):
    results = _results(tmp_path)
    write_json(results / "eval" / "summary.json", {"gate_passed": True, "verdict": verdict})
    dry = CliRunner().invoke(main, ["push", str(results), "--repo-id", "my-org/drafter", "--dry-run"])
    assert dry.exit_code == 2 and "Traceback" not in dry.output, dry.output
    assert "summary.json: its verdict is not one this version reads" in dry.output


class RecordingApi:
    """A stand-in for HfApi: records each commit's uploads (path in the repository -> bytes)."""

    def __init__(self):
        self.uploads: dict[str, bytes] = {}

    def create_repo(self, repo_id, **kwargs):
        return repo_id

    def create_commit(self, repo_id, operations, **kwargs):
        for op in operations:
            self.uploads[op.path_in_repo] = op.path_or_fileobj.read()
        return "commit-url"


def test_push_uploads_the_planned_regular_files_by_name_never_by_pattern(tmp_path):
    """No card (the export itself is uploaded), a regular file named `*` and a link to a secret: the
    commit holds exactly the planned files, `*` as itself; the link's target never leaves."""
    results = _results(tmp_path)
    drafter = results / "drafter"
    (drafter / "README.md").unlink()
    (drafter / "*").write_text("a file named star")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the Hub")
    (drafter / "notes.txt").symlink_to(secret)
    plan = plan_push(results, "my-org/drafter")
    assert plan.files == ["*", "config.json", "model.safetensors"]
    api = RecordingApi()
    assert push(plan, api=api, environ={"HF_TOKEN": TOKEN}) == "commit-url"
    assert api.uploads == {name: (drafter / name).read_bytes() for name in plan.files}
    assert b"not for the Hub" not in api.uploads.values()
    # a planned file swapped for a link before the upload: refused, not followed
    (drafter / "config.json").unlink()
    (drafter / "config.json").symlink_to(secret)
    api = RecordingApi()
    with pytest.raises(PushInputError, match=r"config\.json: changed since the push was planned"):
        push(plan, api=api, environ={"HF_TOKEN": TOKEN})
    assert api.uploads == {}
