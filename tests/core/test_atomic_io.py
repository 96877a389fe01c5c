"""Atomic writes: the old file or the new one, never a part; permissions as a plain write's."""

from __future__ import annotations

import os

import pytest

from rlrecipe.core.atomic_io import atomic_open, atomic_write_bytes, atomic_write_text


def test_writes_and_replaces(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_text(path, "é first\n")
    atomic_write_text(path, "second\n")
    assert path.read_text(encoding="utf-8") == "second\n"
    atomic_write_bytes(path, b"\x00\xff")
    assert path.read_bytes() == b"\x00\xff"
    assert os.listdir(tmp_path) == ["a.json"]  # no temporary file left behind


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_open(path) as f:
        f.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["rows.jsonl"]


def test_permissions_follow_the_umask(tmp_path):
    # a temporary file made with mkstemp would carry 0600 into the target
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "env.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "env.json").stat().st_mode & 0o777 == 0o644


def test_missing_directory_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write_text(tmp_path / "no" / "such" / "dir.txt", "x")


def test_only_whole_file_modes(tmp_path):
    with pytest.raises(ValueError), atomic_open(tmp_path / "x", "a"):
        pass
