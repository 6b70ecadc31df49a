"""Signed manifests: with the job key, a snapshot whoever can write the directory forged is refused.

Real files, tiny tensors; the key comes from the rendezvous' environment variables, as in a job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import AsyncSnapshotWriter, SnapshotCorruptError, SnapshotKeyError, SnapshotStore
from checkpoints.cli import main
from checkpoints.signing import KEY_ENV, KEY_FILE_ENV
from ckpt_testutil import REPO_ROOT, assert_equal_state, child_env, cli_rows

KEY = "job-key-0123456789abcdef"  # what ELASTIC_RDZV_HMAC_KEY holds (>= 16 bytes)
OTHER = b"another-job-key-fedcba9876543210"
UNSIGNED = "MANIFEST.json: not signed with the job key (written without it, or forged)"
MISMATCH = "MANIFEST.json: signature does not match the job key"


@pytest.fixture(autouse=True)
def no_key_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)


def _state(step: int, fill: float | None = None) -> dict[str, Any]:
    return {"model": {"w": torch.full((256,), float(step if fill is None else fill))}, "step": step}


def _dir(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}"


def _manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((_dir(root, step) / "MANIFEST.json").read_bytes())


def _write_manifest(path: Path, body: dict[str, Any]) -> None:
    """Write ``body`` with a correct self-checksum, keeping whatever ``hmac`` it carries."""
    body = {k: v for k, v in body.items() if k != "manifest_sha256"}
    body["manifest_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (path / "MANIFEST.json").write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def _swap_model(root: Path, step: int, fill: float) -> None:
    """The attack: replace a file with another model's and recompute its hash in the manifest
    (the signature, which the attacker cannot compute, is kept as it was)."""
    d = _dir(root, step)
    SnapshotStore(root / "elsewhere", key=None).save(step, _state(step, fill), world_size=2)
    model = next(d.glob("000-*.pt")).name
    shutil.copyfile(root / "elsewhere" / d.name / model, d / model)
    shutil.rmtree(root / "elsewhere")
    body = _manifest(root, step)
    data = (d / model).read_bytes()
    for f in body["files"]:
        if f["file"] == model:
            f["size"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    _write_manifest(d, body)


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_signed_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    store = SnapshotStore(tmp_path, keep=5)
    assert store.signed
    store.save(100, _state(100), world_size=2)
    signature = _manifest(tmp_path, 100)["hmac"]
    assert len(signature) == 64 and int(signature, 16) >= 0
    assert store.check(100) == [] and store.verify(100, full=False) == []
    info, state = store.load_latest()
    assert info.step == 100
    assert_equal_state(state, _state(100))
    # A key file (what --rdzv-conf hmac_key_file= becomes for the workers) gives the same key.
    key_file = tmp_path.parent / f"{tmp_path.name}.key"
    key_file.write_text(KEY + "\n")
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    assert SnapshotStore(tmp_path, keep=5).check(100) == []


def test_a_forged_snapshot_is_invalid_skipped_with_one_line_and_never_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    store = SnapshotStore(tmp_path, keep=1)
    for step in (100, 200):
        store.save(step, _state(step), world_size=2, housekeeping=False)
    _swap_model(tmp_path, 200, fill=-1.0)  # files replaced, hashes recomputed, old signature kept
    SnapshotStore(tmp_path, key=None).save(300, _state(300, -1.0), world_size=2)  # no signature
    SnapshotStore(tmp_path, key=OTHER).save(400, _state(400, -1.0), world_size=2)  # another key
    before = _dirs(tmp_path)

    # Without the key every one of them is "valid": the hashes match.
    assert all(SnapshotStore(tmp_path, key=None).check(s) == [] for s in (100, 200, 300, 400))
    # With it, quick and full checks refuse them alike, each with one line.
    for full in (False, True):
        assert store.verify(400, full=full) == [MISMATCH]
        assert store.verify(300, full=full) == [UNSIGNED]
        assert store.verify(200, full=full) == [MISMATCH]
        assert store.verify(100, full=full) == []
    unsigned = UNSIGNED.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(SnapshotCorruptError, match="^snapshot .*step-000000000300: " + unsigned + "$"):
        store.load(300)
    assert [i.step for i in store.list()] == [100]

    caplog.set_level(logging.WARNING, logger="checkpoints.store")
    info, state = store.load_latest()
    assert info.step == 100 and torch.equal(state["model"]["w"], torch.full((256,), 100.0))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "3 snapshot(s)" in lines[0] and "not signed with the job key" in lines[0]
    assert "resuming from step 100, the newest signed one" in lines[0]
    assert "python -m checkpoints sign" in lines[0] and "\n" not in lines[0]

    assert store.prune(1) == [] and store.prune(1, trust_own=True) == []
    store.housekeep()
    assert _dirs(tmp_path) == before

    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = cli_rows(out)
    assert f"INVALID: {MISMATCH}" in rows["400"] and f"INVALID: {UNSIGNED}" in rows["300"]
    assert f"INVALID: {MISMATCH}" in rows["200"] and "OK (newest valid)" in rows["100"]
    assert "a restart resumes from step 100" in out
    assert f"signatures: checked with the job key from {KEY_ENV}: 3 signed, 1 unsigned; 3 refused" in out
    assert main(["verify", str(tmp_path)]) == 1
    assert main(["prune", "--keep", "1", str(tmp_path)]) == 0
    assert _dirs(tmp_path) == before


def test_all_unsigned_starts_from_scratch_and_sign_adopts_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job that just turned its key on: resume refuses its old snapshots with one line, nothing
    is deleted (not even when a step is written again), and ``sign`` is the way back."""
    old = SnapshotStore(tmp_path, keep=3)  # no key in the environment
    for step in (100, 200):
        old.save(step, _state(step), world_size=2)
    monkeypatch.setenv(KEY_ENV, KEY)
    store = SnapshotStore(tmp_path, keep=1)
    caplog.set_level(logging.WARNING, logger="checkpoints.store")
    assert store.load_latest() is None
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"2 snapshot(s) in {tmp_path} are not signed with the job key")
    assert "starting from scratch" in line and f"python -m checkpoints sign {tmp_path}" in line
    assert store.prune() == [] and _dirs(tmp_path) == ["step-000000000100", "step-000000000200"]

    # The restarted job writes steps of its own; the refused ones are newer than it, so kept...
    store.save(50, _state(50), world_size=2)
    assert _dirs(tmp_path) == ["step-000000000050", "step-000000000100", "step-000000000200"]
    # ...and one whose step it writes again is set aside, never deleted.
    store.save(100, _state(100, 7.0), world_size=2)
    aside = [n for n in _dirs(tmp_path) if n.startswith(".unsigned-step-000000000100-")]
    assert len(aside) == 1 and store.check(100) == []
    store.prune()
    assert aside[0] in _dirs(tmp_path) and "step-000000000200" in _dirs(tmp_path)
    assert main(["ls", str(tmp_path)]) == 0
    assert "set aside: .unsigned-step-000000000100-" in capsys.readouterr().out

    assert main(["sign", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 200: signed" in out and "step 100: already signed with this key" in out
    assert store.check(200) == []
    info, state = store.load_latest()
    assert info.step == 200
    assert_equal_state(state, _state(200))


def test_retention_never_removes_a_snapshot_refused_for_its_signature(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Older than every kept one, yet kept: it may be the job's own (or a stray key's writer
    must not wipe the job's snapshots); only valid signed ones are pruned."""
    SnapshotStore(tmp_path, key=None).save(100, _state(100), world_size=2)
    SnapshotStore(tmp_path, key=OTHER).save(200, _state(200), world_size=2)
    monkeypatch.setenv(KEY_ENV, KEY)
    store = SnapshotStore(tmp_path, keep=1)
    for step in (300, 400, 500):
        store.save(step, _state(step), world_size=2)
    names = _dirs(tmp_path)
    assert [n for n in names if n.startswith("step-")] == [
        "step-000000000100", "step-000000000200", "step-000000000500"
    ]
    assert any(n.startswith(".spare-step-000000000400-") for n in names)
    assert store.prune(1) == [] and main(["prune", "--keep", "1", str(tmp_path)]) == 0
    assert [n for n in _dirs(tmp_path) if n.startswith("step-")] == [
        "step-000000000100", "step-000000000200", "step-000000000500"
    ]
    assert "a restart resumes from step 500" in capsys.readouterr().out


def test_a_signed_manifest_moved_to_another_step_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    store = SnapshotStore(tmp_path, keep=5)
    store.save(100, _state(100), world_size=2)
    shutil.copytree(_dir(tmp_path, 100), _dir(tmp_path, 300))
    assert store.verify(300, full=False) == [
        "MANIFEST.json: records step 100 but the directory is step-000000000300"
    ]
    body = _manifest(tmp_path, 100)  # the replay: the step rewritten to fit, the signature kept
    body["step"] = 300
    _write_manifest(_dir(tmp_path, 300), body)
    assert SnapshotStore(tmp_path, key=None).check(300) == []  # the checksums all agree
    assert store.verify(300, full=False) == [MISMATCH] and store.check(300) == [MISMATCH]
    info, _ = store.load_latest()
    assert info.step == 100


def test_without_a_key_signed_and_unsigned_snapshots_both_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    SnapshotStore(tmp_path, key=KEY.encode()).save(100, _state(100), world_size=2)
    SnapshotStore(tmp_path).save(200, _state(200), world_size=2)  # no key in the environment
    store = SnapshotStore(tmp_path)
    assert not store.signed
    assert "hmac" in _manifest(tmp_path, 100) and "hmac" not in _manifest(tmp_path, 200)
    for step in (100, 200):
        assert store.check(step) == []
        assert_equal_state(store.load(step), _state(step))
    info, _ = store.load_latest()
    assert info.step == 200
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "signatures: NOT checked (no job key; set ELASTIC_RDZV_HMAC_KEY_FILE or pass --key-file): 1 signed, 1 unsigned" in out


@pytest.mark.slow  # starts processes
def test_cli_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "snaps"
    key_file = tmp_path / "job.key"
    key_file.write_text(KEY + "\n")
    SnapshotStore(root, key=KEY.encode()).save(100, _state(100), world_size=2)
    SnapshotStore(root, key=None).save(200, _state(200), world_size=2)

    assert main(["verify", "--key-file", str(key_file), str(root)]) == 1
    out = capsys.readouterr().out
    assert f"INVALID: {UNSIGNED}" in cli_rows(out)["200"] and "a restart resumes from step 100" in out
    assert f"signatures: checked with the job key from key file {key_file}: 1 signed, 1 unsigned" in out
    assert main(["verify", str(root)]) == 0  # no key: nothing to check signatures against
    capsys.readouterr()

    assert main(["ls", "--key-file", str(tmp_path / "missing.key"), str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.key" in err and "does not exist" in err
    (tmp_path / "short.key").write_text("short")
    assert main(["ls", "--key-file", str(tmp_path / "short.key"), str(root)]) == 2
    assert "use at least 16" in capsys.readouterr().err
    assert main(["sign", str(root)]) == 2
    assert "no job key to sign with" in capsys.readouterr().err

    # The real command line, as someone on call runs it: sign, then everything verifies.
    r = subprocess.run(
        [sys.executable, "-m", "checkpoints", "sign", "--key-file", str(key_file), str(root)],
        cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "step 200: signed" in r.stdout and "step 100: already signed" in r.stdout
    assert main(["verify", "--key-file", str(key_file), str(root)]) == 0
    assert "2 signed, 0 unsigned" in capsys.readouterr().out


def test_a_bad_key_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "too-short")
    with pytest.raises(SnapshotKeyError, match="^ELASTIC_RDZV_HMAC_KEY has 9 bytes; use at least 16"):
        SnapshotStore(tmp_path)
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "nope.key"))  # the file wins over the value
    with pytest.raises(SnapshotKeyError, match="does not exist"):
        SnapshotStore(tmp_path)
    with pytest.raises(SnapshotKeyError, match="has 3 bytes"):
        SnapshotStore(tmp_path, key=b"abc")


@pytest.mark.slow  # starts processes
def test_the_background_writer_signs_with_its_stores_key(tmp_path: Path) -> None:
    """In both modes; the writer process is told the store's key (here not in its environment)."""
    store = SnapshotStore(tmp_path, keep=5, key=KEY.encode())
    with AsyncSnapshotWriter(store, mode="thread") as writer:
        assert writer.submit(100, _state(100), world_size=2)
    with AsyncSnapshotWriter(store, mode="process") as writer:
        assert writer.wait_writer_process()
        assert writer.submit(200, _state(200), world_size=2)
        writer.flush()
        assert writer.writer_pid not in (None, os.getpid())
    for step in (100, 200):
        assert store.check(step) == [] and "hmac" in _manifest(tmp_path, step)


def test_workers_get_the_key_file_the_agent_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.node.launch import _with_network
    from agent.node.settings import AgentSettings

    monkeypatch.chdir(tmp_path)
    settings = AgentSettings(node_name="n0", metrics_port=0, metrics_addr="127.0.0.1", lease_ttl=5,
                             hang_timeout=None, snapshot_dir=None, work_dir=tmp_path, store_host="127.0.0.1")
    got = _with_network(settings, "127.0.0.1:2379", "127.0.0.1", "1", {"hmac_key_file": "job.key"})
    assert got.worker_env[KEY_FILE_ENV] == str(tmp_path / "job.key")
    assert KEY_FILE_ENV not in _with_network(settings, "127.0.0.1:2379", "127.0.0.1", "1", {}).worker_env
    monkeypatch.setenv(KEY_FILE_ENV, "/already/set.key")  # inherited by the workers as it is
    assert KEY_FILE_ENV not in _with_network(settings, "127.0.0.1:2379", "127.0.0.1", "1",
                                             {"hmac_key_file": "job.key"}).worker_env
