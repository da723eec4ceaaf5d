"""The real workflow through Snakemake on the real default target, with the tiny configuration."""

import json
import os
import re
import shutil
import subprocess

import pytest
from helpers.workflow import REPO, cli_env, snakemake

pytestmark = pytest.mark.slow
# The jobs downstream of a new drafter: both evaluations, the summary, the gate, the engine exports.
AFTER_TRAINING = {"evaluate_offline", "evaluate_vllm", "eval_summary", "gate", "export", "all"}


def planned_jobs(output: str) -> dict[str, int]:
    """Job counts from the 'Job stats' table of a dry run."""
    jobs, inside = {}, False
    for line in output.splitlines():
        if line.startswith("job ") and "count" in line:
            inside = True
            continue
        if inside:
            m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
            if m and m.group(1) != "total":
                jobs[m.group(1)] = int(m.group(2))
            elif line.startswith("total"):
                break
    return jobs


def test_every_target_exists_and_is_sound(tiny_run):
    """The shared tiny run (tests/conftest.py tiny_run): spaces and shell metacharacters in every path."""
    workdir, results = tiny_run.workdir, tiny_run.results
    assert not list(workdir.rglob("INJ*"))  # no rule's command let the shell split or run a path
    for rel in [
        "prompts/train.jsonl",
        "prompts/heldout.jsonl",
        "traces.jsonl",
        "tokens.safetensors",
        "hidden/shard-0.safetensors",
        "hidden/shard-1.safetensors",
        "data_config.json",
        "vocab_map.pt",
        "drafter/config.json",
        "drafter/model.safetensors",
        "train/metrics.jsonl",
        "eval/summary.json",
        "eval/acceptance.png",
    ]:
        assert (results / rel).is_file(), rel
    manifest = json.loads((results / "data_config.json").read_text())
    assert manifest["aux_layer_ids"] == [2, 15, 27] and manifest["layer_convention"] == "input"
    assert manifest["teacher_agreement"] > 0.9
    summary = json.loads((results / "eval" / "summary.json").read_text())
    assert summary["figure"] == "tokens per target forward"
    head = summary["headline"]["heldout"]
    assert head["measured_by"] == "vLLM" and {"eagle3", "ngram", "suffix"} <= set(head["methods"])
    # the untrained baseline: measured offline only (a random drafter accepts next to nothing)
    untrained = [r for r in summary["rows"] if r["key"] == "untrained"]
    assert untrained and {r["measured_by"] for r in untrained} == {"offline"}, untrained
    # every method projected to the serving point (the schema's: an H100 at concurrency 1, 8, 32), each at
    # its best draft length, re-measured in vLLM there where shorter than evaluate.num_draft_tokens
    vllm = json.loads((results / "eval" / "heldout" / "vllm.json").read_text())
    for key in ("eagle3", "ngram", "suffix"):
        m = head["methods"][key]
        assert 1 <= m["k"] <= 3 and len(m["projected_speedup"]) == 3, key
        row = next(r for r in summary["rows"] if r["key"] == key and r["measured_by"] == "vLLM")
        if m["k"] < 3 and str(m["k"]) not in vllm["methods"][key].get("at_k", {}):
            # not measured again: its estimate there could not change what is deployed
            assert not row["serving"]["measured_at_k"], key
        elif m["k"] < 3:
            at_k = vllm["methods"][key]["at_k"][str(m["k"])]
            assert at_k["outputs_equal_plain"] == vllm["num_prompts"], key  # lossless at k too
            assert row["serving"]["measured_at_k"] and row["serving"]["tokens_per_forward"] == pytest.approx(
                at_k["tokens_per_forward"]
            ), key
    choice = summary["verdict"]["per_set"][0]
    assert (
        choice["method"] in ("eagle3", "ngram", "suffix", "plain") and len(choice["projected_speedup"]) == 3
    )
    assert choice["runner_up"] is not None
    for row in summary["rows"]:  # tau = 1 + mean accepted length = 1 + sum of per-position acceptance
        if row["tau"] is not None and row["acceptance_per_position"]:
            assert row["tau"] == pytest.approx(1 + sum(row["acceptance_per_position"]), abs=1e-6), row
        # every forward counted: tokens / forwards, and forwards never exceed tokens
        assert row["tokens_per_forward"] == pytest.approx(row["tokens"] / row["forwards"]), row
    by = {(r["key"], r["measured_by"]): r for r in summary["rows"] if r["heldout"] == "heldout"}
    assert (
        by["eagle3", "offline"]["tokens_per_forward"] >= 1.0 and by[None, "vLLM"]["tokens_per_forward"] == 1.0
    )
    assert summary["verdict"]["per_set"][0]["heldout"] == "heldout"
    assert (results / "eval" / "gate.json").is_file()
    for engine in ("sglang", "speculators"):  # one export per engine, each checked by `draftsmith export`
        assert (results / f"drafter-{engine}" / "model.safetensors").is_file(), engine
    # a model card in every export, from this run's summary.json: its headline figures and its verdict
    for folder in ("drafter", "drafter-sglang", "drafter-speculators"):
        card = (results / folder / "README.md").read_text()
        assert card.startswith("---\n") and "library_name:" in card and "- eagle3" in card, folder
        for name, head in summary["headline"].items():
            for m in head["methods"].values():
                lo, hi = m["tokens_per_forward_interval"]
                assert f"{m['tokens_per_forward']:.3f} [{lo:.3f}, {hi:.3f}]" in card, (folder, name)
        assert "## Verdict" in card and summary["verdict"]["per_set"][0]["action"] in card
        assert "## Speed at the serving point (H100-80GB)" in card, folder
        val = summary["learning"]["val_acc"]  # None when the tiny split held out no sample
        said = (
            "validation accuracy per TTT step (top-1 = the next token): "
            + " / ".join(f"{a:.3f}" for a in val)
            if val
            else "validation accuracy per TTT step: not measured"
        )
        assert said in card, folder
    rules = (
        "generate",
        "extract",
        "train",
        "evaluate_offline/heldout",
        "evaluate_vllm",
        "gate",
        "export",
    )
    for rule in rules:
        assert (workdir / "benchmarks" / f"{rule}.tsv").is_file(), rule
        assert (workdir / "logs" / f"{rule}.log").is_file(), rule


def test_nothing_to_do_after_a_run(tiny_run):
    out = tiny_run.snakemake("-n").stdout
    assert "Nothing to be done" in out, out[-2000:]


def test_train_settings_rerun_only_train_and_evaluate(tiny_run):
    out = tiny_run.snakemake("-n", extra=("train={lr: 0.001}",)).stdout
    assert set(planned_jobs(out)) == {"train", *AFTER_TRAINING}, out[-3000:]


def test_vocab_size_reruns_vocab_train_evaluate_but_no_extraction(tiny_run):
    out = tiny_run.snakemake("-n", extra=("vocab={size: 1024}",)).stdout
    # the pre-flight costs the planned drafter by its draft vocabulary: it reruns, from its kept runs
    expected = {"vocab", "train", "untrained_drafter", "preflight", *AFTER_TRAINING}
    assert set(planned_jobs(out)) == expected, out[-3000:]


def test_operational_knobs_rerun_nothing(tiny_run):
    ops = "resources={generate: {concurrency: 3, timeout_s: 60}, train: {checkpoint_every: 1, threads: 1}}"
    out = tiny_run.snakemake("-n", extra=(ops,)).stdout
    assert "Nothing to be done" in out, out[-2000:]


def test_forcerun_redoes_one_output(tiny_run):
    out = tiny_run.snakemake("results/vocab_map.pt", "-n", "--forcerun", "vocab").stdout
    assert planned_jobs(out) == {"vocab": 1}, out[-3000:]


def test_single_target_regenerates_just_that_file(tiny_run, tmp_path):
    run = tiny_run.copy(tmp_path / "run")  # a copy: the shared run stays finished for the other tests
    vocab = run.results / "vocab_map.pt"
    vocab.unlink()
    out = run.snakemake("results/vocab_map.pt", "-n").stdout
    assert planned_jobs(out) == {"vocab": 1}, out[-3000:]
    run.snakemake("results/vocab_map.pt")
    assert vocab.is_file()


def test_a_broken_prompt_file_stops_the_rerun_before_any_result_is_deleted(tiny_run):
    """The prompt file gains a bad line after a good run: `snakemake` (not a dry run) stops at start
    naming file and line, and every result of the good run is still there, unchanged."""
    workdir = tiny_run.workdir
    prompts = workdir / "my prompts.jsonl"
    good, stamp = prompts.read_text(), prompts.stat()
    before = {p: p.stat().st_mtime_ns for p in tiny_run.results.rglob("*") if p.is_file()}
    line = good.count("\n") + 1
    prompts.write_text(good + '{"messages": [{"role": "user", "content": "unterminated}]}\n')
    try:
        proc = tiny_run.snakemake(check=False)
        assert proc.returncode != 0
        out = proc.stdout + proc.stderr
        assert f"prompts.path: {prompts}:{line}: invalid JSON" in out, out[-3000:]
        assert "Traceback" not in out
        after = {p: p.stat().st_mtime_ns for p in tiny_run.results.rglob("*") if p.is_file()}
        assert after == before
    finally:  # the shared run as it was, bytes and timestamps: other tests read it after this one
        prompts.write_text(good)
        os.utime(prompts, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))


def test_a_preflight_that_blocks_stops_the_run_before_generation_in_one_line(tiny_run, tmp_path):
    """evaluate.preflight: block, and a drafter that cannot pay wherever it serves (planned larger than
    its target, so each of its passes costs more than the target's step): the run stops after the
    pre-flight, before anything is generated, with one line naming what to serve. The pre-flight reuses
    the shared run's kept vLLM runs (the same prompts and settings): no engine starts."""
    run = tiny_run.copy(tmp_path / "run")
    for path in run.results.iterdir():  # a fresh run, but for the kept engine runs
        if path.name != "eval":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in (run.results / "eval").iterdir():
        if path.name != ".runs":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    extra = ("evaluate={preflight: block}", "train={drafter: {intermediate_size: 400000}}")
    proc = run.snakemake(extra=extra, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    ran = re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):", out, re.M)
    assert "preflight" in ran and "generate" not in ran, ran
    assert not (run.results / "traces.jsonl").exists()
    log = (run.workdir / "logs" / "preflight.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pre-flight: no drafter can beat the best choice" in errors[0], log[-3000:]
    assert "Traceback" not in log and "vllm: 0 engine runs measured" in log, log[-3000:]


def test_bad_config_names_the_key(tmp_path, target_model):
    proc = snakemake(tmp_path, "-n", "--config", "train={lrr: 1}", check=False)
    assert proc.returncode != 0
    assert "train: Additional properties are not allowed ('lrr' was unexpected)" in proc.stdout + proc.stderr


def test_kill_during_generation_resumes(tmp_path, target_model):
    """A killed generate job leaves complete lines in traces.jsonl.partial; the rerun only adds the rest."""
    shutil.copy(REPO / "draftsmith" / "data" / "prompts.jsonl", tmp_path / "p.jsonl")
    env = cli_env()
    args = ["draftsmith", "generate", "--target", str(target_model), "--prompts", str(tmp_path / "p.jsonl")]
    args += ["--out", str(tmp_path / "traces.jsonl"), "--summary", str(tmp_path / "s.json")]
    args += ["--max-new-tokens", "8", "--batch-size", "4"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    partial = tmp_path / "traces.jsonl.partial"
    import time

    deadline = time.time() + 300
    while time.time() < deadline and (not partial.exists() or partial.read_text().count("\n") < 8):
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert not (tmp_path / "traces.jsonl").exists()
    done_before = partial.read_text().count("\n")
    assert done_before >= 8
    rerun = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    assert f"{done_before} already done" in rerun.stderr  # logged, as a rule's log receives it
    rows = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in rows]
    expected = sum(1 for line in (tmp_path / "p.jsonl").read_text().splitlines() if line.strip())
    assert len(ids) == len(set(ids)) == expected
    assert not partial.exists()
