"""Sandbox images: the recipe hash, the checked-in Dockerfile, the apt sources debootstrap reads, the
build cache on a real engine, and the `reflow sandbox` commands."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from reflow.sandbox.images import DEFAULT_IMAGE, RECIPE_LABEL, ImageRecipe, apt_mirror, build_image

ROOT = Path(__file__).resolve().parents[1]
REFLOW = str(Path(sys.executable).parent / "reflow")


def test_the_checked_in_dockerfile_is_the_rendered_recipe():
    assert (ROOT / "sandboxes/python/Dockerfile").read_text() == ImageRecipe().dockerfile()
    out = subprocess.run([REFLOW, "sandbox", "dockerfile"], capture_output=True, text=True, check=True)
    assert out.stdout == ImageRecipe().dockerfile()


def test_the_recipe_hash_follows_what_shapes_the_image():
    recipe = ImageRecipe()
    h = recipe.recipe_hash("debootstrap", "bookworm")
    assert h == ImageRecipe().recipe_hash("debootstrap", "bookworm") and len(h) == 16
    assert h != recipe.recipe_hash("debootstrap", "trixie")
    assert h != recipe.recipe_hash("dockerfile")
    assert h != replace(recipe, packages=("python3", "git")).recipe_hash("debootstrap", "bookworm")
    assert h != replace(recipe, uid=20000).recipe_hash("debootstrap", "bookworm")


def test_apt_sources_give_the_release_archive_in_both_formats(tmp_path, monkeypatch):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# a comment\ndeb [arch=amd64] http://mirror.example/debian-security bookworm-security main\n"
        "deb-src http://mirror.example/debian bookworm main\n"
    )
    (tmp_path / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\nComponents: main\n"
    )
    (tmp_path / "sources.list.d/vendor.list").write_text("deb https://vendor.example/apt stable main\n")
    monkeypatch.setattr("reflow.sandbox.images._os_codename", lambda: "bookworm")
    assert apt_mirror(str(tmp_path)) == ("bookworm", "http://mirror.example/debian")


def test_this_machines_apt_sources_name_a_mirror():
    suite, mirror = apt_mirror()
    assert suite and mirror.startswith(("http://", "https://", "file:/"))


@pytest.mark.docker
def test_a_second_build_is_skipped_by_the_recipe_hash():
    result = build_image("auto")  # CI built the image already: this must hit the cache
    assert result.cached
    out = subprocess.run([REFLOW, "sandbox", "build"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "cached" in out.stdout, out.stdout + out.stderr
    import docker

    image = docker.from_env().images.get(DEFAULT_IMAGE)
    assert image.labels[RECIPE_LABEL] == result.recipe_hash
    assert image.attrs["Config"]["User"] == "10001:10001"


def test_sandbox_check_reports_every_backend():
    out = subprocess.run([REFLOW, "sandbox", "check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for kind in ("docker", "process", "subprocess"):
        assert kind in out.stdout
    assert "best available:" in out.stdout


def test_the_sandbox_package_imports_neither_docker_nor_heavy_modules():
    code = (
        "import sys, reflow.sandbox, reflow.sandbox.cli; "
        "print([m for m in sys.modules if m.split('.')[0] in ('docker', 'torch', 'transformers', 'ray')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
