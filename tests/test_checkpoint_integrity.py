"""Checkpoint integrity: the sha256 manifest, fallback past damaged checkpoints, atomic saves, async saves.

Every run is the tiny in-process trainer of tests/test_train.py (about a second each). ``base`` is one
uninterrupted 6-step run with checkpoints at steps 2, 4, 6: each test copies it, damages or resumes
it, and compares with its losses, which a correct resume reproduces bit for bit on CPU.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
import zlib
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemWriter

ROOT = Path(__file__).resolve().parents[1]
from moekit.train import checkpoint
from moekit.train.loop import main

from tests.tiny import TINY_MODEL

TINY = [*TINY_MODEL, *"--steps 6 --checkpoint.every 2 --checkpoint.keep 3".split()]


def train(run_dir: Path, *flags: str) -> int:
    return main([*TINY, "--run-dir", str(run_dir), *flags])


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def flip_byte(path: Path) -> None:
    """Tamper without changing the size: only a digest notices."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def one_line_error(capsys, rc: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("train.py: error: checkpoint "), err
    return err[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("base") / "run"
    assert train(run) == 0
    return run


@pytest.fixture
def copy(base, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def test_manifest_holds_sha256_of_every_file_and_is_written_last(base):
    path = ckpt(base, 6)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == 2 and meta["step"] == 6
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "meta.json")
    assert sorted(meta["files"]) == on_disk and ".metadata" in on_disk
    for name, info in meta["files"].items():
        body = (path / name).read_bytes()
        assert info == {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    newest_data = max((path / n).stat().st_mtime_ns for n in on_disk)
    assert (path / "meta.json").stat().st_mtime_ns >= newest_data


def test_latest_skips_damaged_checkpoints_and_reproduces_the_run(base, copy, capsys):
    (ckpt(copy, 6) / "__0_0.distcp").write_bytes((ckpt(copy, 6) / "__0_0.distcp").read_bytes()[:500])  # truncated
    flip_byte(ckpt(copy, 4) / "__0_0.distcp")  # tampered, same size
    assert train(copy, "--resume") == 0
    captured = capsys.readouterr()
    warnings = captured.err.strip().splitlines()
    assert len(warnings) == 2, warnings
    assert f"skipped checkpoint {ckpt(copy, 6) / '__0_0.distcp'}: 500 bytes, saved with" in warnings[0]
    assert f"skipped checkpoint {ckpt(copy, 4) / '__0_0.distcp'}: sha256 mismatch" in warnings[1]
    assert all(w.endswith(f"resuming from {ckpt(copy, 2)}") for w in warnings)
    assert f"resumed from {ckpt(copy, 2)} at step 2" in captured.out
    assert losses(copy) == losses(base)  # steps 3..6 redone bitwise, no duplicate records
    for path in checkpoint.list_checkpoints(copy):  # the damaged ones were replaced by good saves
        checkpoint.read_meta(path)


@pytest.mark.parametrize("damage,expected", [
    (lambda p: flip_byte(p / "__0_0.distcp"), "__0_0.distcp: sha256 mismatch; the file changed after it was saved"),
    (lambda p: (p / "__1_0.distcp").write_bytes(b"x"), "__1_0.distcp: not in meta.json"),
    (lambda p: (p / "meta.json").unlink(), "meta.json: missing; the save did not finish"),
    (lambda p: (p / "meta.json").write_text(json.dumps({**json.loads((p / "meta.json").read_text()), "format": 99})),
     "meta.json: format 99; this moekit reads formats 1, 2"),
    (lambda p: (p / "meta.json").write_text(json.dumps({**json.loads((p / "meta.json").read_text()), "files": {}})),
     "meta.json: corrupt (its file list [] is not a DCP checkpoint's)"),
], ids=["tampered", "unlisted-file", "no-manifest", "unknown-format", "empty-manifest"])
def test_explicit_bad_checkpoint_is_one_line_error(copy, capsys, damage, expected):
    path = ckpt(copy, 4)
    damage(path)
    line = one_line_error(capsys, train(copy, "--resume", str(path)))
    assert f"{path}/{expected}" in line and "--resume alone for the newest one that verifies" in line


def test_format_1_checkpoint_still_resumes(base, copy, capsys):
    """Checkpoints from before the sha256 manifest (CRC-32, format 1) are verified with CRC-32 and load."""
    path = ckpt(copy, 2)
    meta = json.loads((path / "meta.json").read_text())
    meta["format"] = 1
    meta["files"] = {n: {"bytes": i["bytes"], "crc32": zlib.crc32((path / n).read_bytes())}
                     for n, i in meta["files"].items()}
    (path / "meta.json").write_text(json.dumps(meta))
    assert train(copy, "--resume", str(path)) == 0
    assert losses(copy) == losses(base)
    flip_byte(path / "__0_0.distcp")
    assert "__0_0.distcp: CRC-32 mismatch" in one_line_error(capsys, train(copy, "--resume", str(path)))


def test_crash_mid_save_leaves_no_complete_looking_checkpoint(base, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real_save = checkpoint.dcp.save

    def crash_at_step_4(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        if state["train"]["step"] == 4:  # files written, manifest and rename not yet: the process dies here
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.dcp, "save", crash_at_step_4)
    assert train(run) == 130
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step_000002"]
    assert (run / "checkpoints" / "step_000004.partial").is_dir()
    monkeypatch.undo()
    assert train(run, "--resume") == 0
    assert losses(run) == losses(base)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004", "step_000006"]


def test_crash_while_rotating_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """Deleting an old checkpoint is not atomic: it is renamed away first, so a crash midway leaves a
    .stale directory (cleaned by the next run), never a damaged one under a checkpoint's name."""
    run = tmp_path / "run"
    real_rmtree = shutil.rmtree

    def crash_midway(path, *args, **kwargs):
        path = Path(path)
        if path.parent.name == "checkpoints" and (path / "meta.json").exists():
            (path / "meta.json").unlink()
            raise RuntimeError("crashed while deleting")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", crash_midway)
    with pytest.raises(RuntimeError, match="crashed while deleting"):
        train(run, "--checkpoint.keep", "1")
    monkeypatch.undo()
    names = [p.name for p in checkpoint.list_checkpoints(run)]
    assert names == ["step_000004"], names
    checkpoint.read_meta(ckpt(run, 4))  # verifies
    assert train(run, "--resume", "--steps", "4") == 0
    assert not list((run / "checkpoints").glob("*.stale"))  # the next run cleaned it


def test_rotation_drops_checkpoints_of_the_abandoned_timeline(copy):
    """Resumed from step 2 past a damaged step 6: the damaged one must not crowd out the new saves."""
    flip_byte(ckpt(copy, 6) / ".metadata")
    shutil.rmtree(ckpt(copy, 4))
    assert train(copy, "--resume", str(ckpt(copy, 2)), "--steps", "4", "--checkpoint.keep", "1") == 0
    assert [p.name for p in checkpoint.list_checkpoints(copy)] == ["step_000004"]


def test_async_save_copies_the_state_before_the_next_step(base, tmp_path, monkeypatch):
    """Writes are slowed down so they happen while the next steps change the weights in place: the
    checkpoint must still hold the weights of its own step, and the last save must be sealed on return."""
    real_write = FileSystemWriter.write_data

    def slow_write(self, *args, **kwargs):
        time.sleep(0.3)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    run = tmp_path / "async"
    assert train(run, "--checkpoint.async_save", "true") == 0
    assert losses(run) == losses(base)  # async saving does not perturb training
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step_000002", "step_000004", "step_000006"]
    assert not list((run / "checkpoints").glob("*.partial"))
    for step in (2, 4, 6):
        assert checkpoint.read_meta(ckpt(run, step))["step"] == step
    assert train(run, "--resume", str(ckpt(run, 2))) == 0
    assert losses(run) == losses(base)


def test_resume_auto_starts_fresh_then_resumes(base, tmp_path, capsys):
    run = tmp_path / "auto"
    assert train(run, "--resume", "auto", "--steps", "2") == 0  # no checkpoint: a fresh run
    assert "resumed from" not in capsys.readouterr().out
    assert train(run, "--resume", "auto") == 0
    assert f"resumed from {ckpt(run, 2)} at step 2" in capsys.readouterr().out
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4, 5, 6]
    assert losses(run)[:2] == losses(base)[:2]  # steps 3.. follow a 2-step cosine schedule, so they differ
