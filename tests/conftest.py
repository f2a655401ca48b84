import pytest
from fake_envs import register_test_envs

import reflow  # noqa: F401  (registers the built-in envs)

BUILTIN_ENVS = ["reflow/Calc-v0", "reflow/Guess-v0", "reflow/Math-v0", "reflow/PyCode-v0"]


@pytest.fixture(scope="session", autouse=True)
def _test_envs() -> None:
    register_test_envs()
