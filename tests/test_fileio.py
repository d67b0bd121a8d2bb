"""hf_evon.fileio's rules for what a directory lists under a name."""

from __future__ import annotations

import os

import pytest

from hf_evon.fileio import Listed, file_on_the_way, leads_to_directory, listed_directory, reachable_kind


@pytest.mark.parametrize("kind", ["file", "directory", "link to a directory", "missing", "dangling link", "loop"])
def test_reachable_kind_refuses_a_link_to_nothing_and_leads_to_directory_counts_a_link_to_one(tmp_path, kind):
    """hf_evon.fileio's one rule for a link that reaches nothing (reachable_kind) and for "a directory or a
    link to one" (leads_to_directory), which local_directory, the trainer's resume checks and the CLI's
    --output and Hub-cache checks share: a link to nothing or a loop of links raises ``unreachable(why)``,
    ``why`` naming its target; anything else comes back as listed, and a link to a directory counts as a
    directory (listed_directory counts the entry itself only)."""
    path = tmp_path / "entry"
    (tmp_path / "elsewhere").mkdir()
    if kind == "file":
        path.write_text("kept")
    elif kind == "directory":
        path.mkdir()
    elif kind != "missing":
        path.symlink_to({"loop": path, "dangling link": tmp_path / "moved-away"}.get(kind, tmp_path / "elsewhere"))
    if kind in ("dangling link", "loop"):
        with pytest.raises(LookupError) as err:
            reachable_kind(str(path), LookupError)
        if kind == "loop":
            target, why = path, "leads into a loop of links (ELOOP)"
        else:
            target, why = tmp_path / "moved-away", "does not exist"
        assert str(err.value) == f"a link to {str(target)!r}, which {why}"
        return
    listed = reachable_kind(str(path), AssertionError)  # AssertionError(why) where it refuses
    assert listed is {"file": Listed.FILE, "missing": None}.get(kind, Listed.NOT_REGULAR)
    assert leads_to_directory(str(path), listed) is (kind in ("directory", "link to a directory"))
    assert listed_directory(str(path)) is (kind == "directory")


def test_file_on_the_way_names_the_nearest_existing_entry_that_is_no_directory(tmp_path) -> None:
    """The examples' check before a run: the file an ``os.makedirs(path)`` would fail on, or None."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    assert file_on_the_way(str(tmp_path / "dir" / "new" / "deeper")) is None  # made as it goes
    assert file_on_the_way(str(tmp_path / "dir")) is None
    assert file_on_the_way(str(tmp_path / "file")) == str(tmp_path / "file")
    assert file_on_the_way(str(tmp_path / "file" / "new" / "deeper") + os.sep) == str(tmp_path / "file")
    assert file_on_the_way("") is None
