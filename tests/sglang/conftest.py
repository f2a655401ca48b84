"""The SGLang group (marker `sglang`): checks requests against sglang's own classes.

`make test-sglang` installs sglang and its import-time dependencies into a side folder and runs this
group with that folder and `stubs/` on PYTHONPATH; a plain `pytest` run deselects the group (see
pyproject's addopts). With REFLOW_REQUIRE_SGLANG=1 a missing sglang fails the run instead of skipping.
"""

import os

import pytest


def _sglang_error() -> str | None:
    try:
        import sglang.srt.managers.io_struct  # noqa: F401
    except Exception as e:  # any import failure means the group cannot run here
        return f"{type(e).__name__}: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    group = [item for item in items if "sglang" in item.keywords]
    if not group:
        return
    error = _sglang_error()
    if error is None:
        return
    if os.environ.get("REFLOW_REQUIRE_SGLANG") == "1":
        raise pytest.UsageError(
            f"REFLOW_REQUIRE_SGLANG=1 but sglang's request classes do not import: {error}"
        )
    for item in group:
        item.add_marker(pytest.mark.skip(reason=f"sglang not importable ({error}); run `make test-sglang`"))
