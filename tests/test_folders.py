"""Folders written whole (`reflow.folders`)."""

from __future__ import annotations

from reflow.folders import publish_dir, staging_dir


def _write(folder, text):
    (folder / "weights").write_text(text)
    return folder


def test_two_writers_of_one_folder_stage_apart(tmp_path):
    dest = tmp_path / "warmstart" / "abc"
    first, second = staging_dir(dest), staging_dir(dest)
    assert first != second and first.parent == second.parent == dest.parent
    assert first.name.startswith(".") and not list(first.iterdir())


def test_publishing_replaces_the_old_folder_and_leaves_nothing_beside_it(tmp_path):
    dest = tmp_path / "step-000003"
    publish_dir(_write(staging_dir(dest), "old"), dest)
    publish_dir(_write(staging_dir(dest), "new"), dest)
    assert (dest / "weights").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["step-000003"]


def test_publishing_over_a_file_or_a_link(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    target = _write(tmp_path / "elsewhere", "kept")
    link = tmp_path / "model"
    link.symlink_to(target)
    publish_dir(_write(staging_dir(link), "new"), link)
    assert not link.is_symlink() and (link / "weights").read_text() == "new"
    assert (target / "weights").read_text() == "kept"  # the link went, not what it pointed to
    plain = tmp_path / "out"
    plain.write_text("a file")
    publish_dir(_write(staging_dir(plain), "new"), plain)
    assert (plain / "weights").read_text() == "new"
