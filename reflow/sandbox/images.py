"""Sandbox images: one recipe, two ways to build it, and a cache keyed by the recipe's hash.

The recipe (packages, a setup script, the sandbox user) is the single source of truth. It builds

- from a public base image with `docker build` where a registry is reachable (the Dockerfile is
  rendered from the recipe; `sandboxes/python/Dockerfile` is a checked-in copy a test keeps in sync), or
- from a `debootstrap --variant=minbase` root file system imported with `docker import`, where no
  registry is reachable (CI, air-gapped clusters). The suite and the mirror come from the machine's
  apt configuration (`/etc/apt/sources.list`, `/etc/apt/sources.list.d/`), never from this file.

Every image carries the label `reflow.recipe` with the recipe hash; a build is skipped when an image
with the same hash exists. The tool server is not baked in: it is sent when a sandbox starts, so the
image only needs Python 3 and the sandbox user.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

RECIPE_VERSION = 1
IMAGE_REPO = "reflow-sandbox-python"
DEFAULT_IMAGE = f"{IMAGE_REPO}:latest"
RECIPE_LABEL = "reflow.recipe"
SANDBOX_UID = 10001

# Run as root inside the new root file system (a chroot for debootstrap, a RUN step for the Dockerfile).
SETUP_COMMANDS = (
    "echo 'sandbox:x:{uid}:' >> /etc/group",
    "echo 'sandbox:x:{uid}:{uid}:sandbox:/work:/bin/sh' >> /etc/passwd",
    "mkdir -p /work",
    "chown {uid}:{uid} /work",
    "chmod 0755 /work",
    "rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/* /usr/share/doc/* /usr/share/man/* "
    "/usr/share/info/* /usr/share/locale/*",
    "python3 -c 'import ctypes, json, resource, selectors, signal'",
)


@dataclass(frozen=True)
class ImageRecipe:
    """What goes into a sandbox image; its hash names the build."""

    name: str = "python"
    packages: tuple[str, ...] = ("python3",)
    base_image: str = "debian:bookworm-slim"
    uid: int = SANDBOX_UID
    env: tuple[tuple[str, str], ...] = (
        ("HOME", "/work"),
        ("LANG", "C.UTF-8"),
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
    )
    repository: str = IMAGE_REPO

    @property
    def setup_commands(self) -> list[str]:
        return [c.format(uid=self.uid) for c in SETUP_COMMANDS]

    @property
    def setup_script(self) -> str:
        return "set -eu\n" + "\n".join(self.setup_commands) + "\n"

    def config_changes(self) -> list[str]:
        """Dockerfile instructions applied on top of the root file system (also by `docker import`)."""
        env = " ".join(f"{k}={v}" for k, v in self.env)
        return [f"ENV {env}", f"USER {self.uid}:{self.uid}", "WORKDIR /work", 'CMD ["sleep", "infinity"]']

    def recipe_hash(self, method: str, suite: str | None = None) -> str:
        """A short hash of everything that shapes the image (the mirror does not: same content)."""
        blob = json.dumps(
            {
                "version": RECIPE_VERSION,
                "method": method,
                "suite": suite if method == "debootstrap" else None,
                "base": self.base_image if method == "dockerfile" else None,
                "packages": self.packages,
                "setup": self.setup_script,
                "changes": self.config_changes(),
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def dockerfile(self) -> str:
        """The Dockerfile for registry-connected machines (same packages, setup and config)."""
        setup = " && \\\n    ".join(self.setup_commands)
        lines = [
            "# Rendered from reflow/sandbox/images.py (ImageRecipe); `reflow sandbox dockerfile` prints it.",
            "# Build with `reflow sandbox build --method dockerfile` (labels it with the recipe hash).",
            f"FROM {self.base_image}",
            "RUN apt-get update && \\",
            f"    apt-get install -y --no-install-recommends {' '.join(self.packages)} && \\",
            f"    {setup}",
            *self.config_changes(),
        ]
        return "\n".join(lines) + "\n"


@dataclass
class BuildResult:
    image: str
    recipe_hash: str
    method: str
    cached: bool
    seconds: float
    size_mb: float
    log: list[str] = field(default_factory=list)


class BuildError(RuntimeError):
    """The image could not be built (no engine, no registry and no debootstrap, a failing step)."""


# ---- the machine's apt configuration ---------------------------------------------------------------------


def _os_codename() -> str | None:
    try:
        with open("/etc/os-release", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VERSION_CODENAME="):
                    return line.split("=", 1)[1].strip().strip('"') or None
    except OSError:
        pass
    return None


def _apt_entries(root: str = "/etc/apt") -> list[dict[str, Any]]:
    """Every `deb` source of the machine as {"uris", "suites", "components"}, one-line and deb822 forms."""
    entries: list[dict[str, Any]] = []
    one_line = [
        os.path.join(root, "sources.list"),
        *sorted(glob.glob(os.path.join(root, "sources.list.d/*.list"))),
    ]
    for path in one_line:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            line = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
            if len(line) >= 3 and line[0] == "deb":
                entries.append({"uris": [line[1]], "suites": [line[2]], "components": line[3:]})
    for path in sorted(glob.glob(os.path.join(root, "sources.list.d/*.sources"))):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[0].isspace():
                    continue
                key, value = line.split(":", 1)
                fields[key.strip().lower()] = value.strip()
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
                entries.append(
                    {
                        "uris": fields.get("uris", "").split(),
                        "suites": fields.get("suites", "").split(),
                        "components": fields.get("components", "").split(),
                    }
                )
    return entries


def apt_mirror(root: str = "/etc/apt") -> tuple[str, str]:
    """(suite, mirror URI) for debootstrap, from the machine's apt sources: the main archive of its release."""
    codename = _os_codename()
    candidates = []
    for entry in _apt_entries(root):
        for uri in entry["uris"]:
            for suite in entry["suites"]:
                if "-" in suite or "/" in suite or not uri.startswith(("http://", "https://", "file:/")):
                    continue  # bookworm-updates, bookworm-security, flat repositories
                score = (suite == codename, "main" in entry["components"], "security" not in uri)
                candidates.append((score, suite, uri))
    if not candidates:
        raise BuildError(f"no usable `deb` source for debootstrap in {root}/sources.list(.d)")
    candidates.sort(key=lambda c: c[0], reverse=True)
    _, suite, uri = candidates[0]
    return suite, uri


# ---- building ------------------------------------------------------------------------------------------


def docker_client(timeout: int = 120) -> Any:
    """A Docker SDK client from the environment (DOCKER_HOST etc.); BuildError when the engine is absent."""
    try:
        import docker
    except ImportError as e:  # pragma: no cover - the sandbox extra is not installed
        raise BuildError("the Docker SDK is not installed: pip install 'reflow-rl[sandbox]'") from e
    try:
        client = docker.from_env(timeout=timeout, max_pool_size=64)
        client.ping()
    except Exception as e:
        raise BuildError(f"no Docker engine reachable: {e}") from e
    return client


def find_image(client: Any, recipe_hash: str) -> Any | None:
    """The image labelled with `recipe_hash`, or None."""
    images = client.images.list(filters={"label": f"{RECIPE_LABEL}={recipe_hash}"})
    return images[0] if images else None


def _tag_latest(image: Any, recipe: ImageRecipe, recipe_hash: str) -> str:
    image.tag(recipe.repository, tag=recipe_hash)
    image.tag(recipe.repository, tag="latest")
    return f"{recipe.repository}:{recipe_hash}"


def _registry_reachable(client: Any, base_image: str, log: list[str]) -> bool:
    """Pull the base image; False (quickly, in practice) where no registry can be reached."""
    try:
        client.images.get(base_image)
        return True
    except Exception:
        pass
    try:
        client.images.pull(base_image)
        return True
    except Exception as e:
        log.append(f"cannot pull {base_image}: {str(e).splitlines()[0][:200]}")
        return False


def _build_dockerfile(client: Any, recipe: ImageRecipe, recipe_hash: str, log: list[str]) -> Any:
    dockerfile = recipe.dockerfile() + f'LABEL {RECIPE_LABEL}="{recipe_hash}"\n'
    try:
        image, output = client.images.build(
            fileobj=io.BytesIO(dockerfile.encode()), rm=True, forcerm=True, pull=False
        )
    except Exception as e:
        raise BuildError(f"docker build failed: {e}") from e
    log.extend(chunk["stream"].rstrip() for chunk in output if chunk.get("stream", "").strip())
    return image


def _run(cmd: list[str], log: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.append("$ " + " ".join(cmd))
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise BuildError(f"{cmd[0]} failed (exit {proc.returncode}):\n" + "\n".join(tail))


def _build_debootstrap(
    client: Any, recipe: ImageRecipe, recipe_hash: str, suite: str, mirror: str, log: list[str]
) -> Any:
    if shutil.which("debootstrap") is None:
        raise BuildError("debootstrap is not installed (apt-get install -y debootstrap)")
    if os.geteuid() != 0:
        raise BuildError("a debootstrap build needs root (it creates device nodes and runs chroot)")
    tmp = tempfile.mkdtemp(prefix="reflow-rootfs-")
    root = os.path.join(tmp, "root")
    try:
        include = ",".join(recipe.packages)
        _run(["debootstrap", "--variant=minbase", f"--include={include}", suite, root, mirror], log)
        with open(os.path.join(root, "tmp/reflow-setup.sh"), "w", encoding="utf-8") as f:
            f.write(recipe.setup_script)
        _run(["chroot", root, "/bin/sh", "/tmp/reflow-setup.sh"], log)
        os.unlink(os.path.join(root, "tmp/reflow-setup.sh"))
        tar = subprocess.Popen(
            ["tar", "--numeric-owner", "-C", root, "-c", "."], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert tar.stdout is not None
        changes = [*recipe.config_changes(), f'LABEL {RECIPE_LABEL}="{recipe_hash}"']
        try:
            out = client.api.import_image_from_stream(
                tar.stdout, repository=recipe.repository, tag=recipe_hash, changes=changes
            )
        finally:
            tar.stdout.close()
            tar.wait()
        if tar.returncode != 0:
            raise BuildError(f"tar of the root file system failed: {tar.stderr.read().decode()[-500:]}")
        log.append(str(out).strip()[:300])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    image = find_image(client, recipe_hash)
    if image is None:
        raise BuildError(f"docker import produced no image labelled {recipe_hash}: {log[-1]}")
    return image


def build_image(
    method: str = "auto",
    *,
    recipe: ImageRecipe | None = None,
    suite: str | None = None,
    mirror: str | None = None,
    force: bool = False,
    client: Any = None,
) -> BuildResult:
    """Build the sandbox image (or find it cached) and tag it `<repository>:latest`.

    Args:
        method: "dockerfile" (needs a registry), "debootstrap" (needs root and an apt mirror), or "auto":
            the cached image of either method, else dockerfile where the base image can be pulled,
            else debootstrap.
        suite, mirror: override what debootstrap reads from the apt configuration.
        force: build even when an image with the recipe hash exists.
    """
    if method not in ("auto", "dockerfile", "debootstrap"):
        raise ValueError(f"unknown build method {method!r}")
    recipe = recipe or ImageRecipe()
    client = client or docker_client(timeout=600)
    start = time.monotonic()
    log: list[str] = []

    def deboot_params() -> tuple[str, str]:
        found_suite, found_mirror = (None, None) if suite and mirror else apt_mirror()
        return suite or found_suite, mirror or found_mirror  # type: ignore[return-value]

    order = ["dockerfile", "debootstrap"] if method == "auto" else [method]
    if not force:
        for m in order:
            try:
                s = deboot_params()[0] if m == "debootstrap" else None
            except BuildError:
                continue
            h = recipe.recipe_hash(m, s)
            image = find_image(client, h)
            if image is not None:
                name = _tag_latest(image, recipe, h)
                return BuildResult(name, h, m, True, time.monotonic() - start, image.attrs["Size"] / 1e6)
    if method == "auto":
        method = "dockerfile" if _registry_reachable(client, recipe.base_image, log) else "debootstrap"
    elif method == "dockerfile" and not _registry_reachable(client, recipe.base_image, log):
        raise BuildError(f"cannot pull {recipe.base_image}; use --method debootstrap. " + " ".join(log))
    if method == "dockerfile":
        h = recipe.recipe_hash("dockerfile")
        image = _build_dockerfile(client, recipe, h, log)
    else:
        s, m = deboot_params()
        h = recipe.recipe_hash("debootstrap", s)
        log.append(f"debootstrap suite {s} from {m}")
        image = _build_debootstrap(client, recipe, h, s, m, log)
    image.reload()
    name = _tag_latest(image, recipe, h)
    return BuildResult(name, h, method, False, time.monotonic() - start, image.attrs["Size"] / 1e6, log)
