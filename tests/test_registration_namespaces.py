"""Id namespaces: `<namespace>/<name>` made from one registered env, with the name as a constructor kwarg
(`openenv/<name>` is the built-in one; tests/test_interop_openenv.py plays it on a real OpenEnv server)."""

import pytest

import reflow
from reflow.env import register, registration
from reflow.env.registration import register_namespace, spec_kwargs


@pytest.fixture
def greetings(monkeypatch):
    """`hello/<greeting>`: test/Echo-v0 (registered by conftest) greeting with the name."""
    monkeypatch.setattr(registration, "_namespaces", dict(registration._namespaces))
    register_namespace("hello", "test/Echo-v0", "greeting")
    return "hello"


async def test_a_namespace_id_makes_its_env_with_the_name(greetings):
    env = reflow.make("hello/bonjour", max_turns=2)
    obs = await env.reset(seed=0)
    assert obs.messages == [{"role": "user", "content": "bonjour"}]
    assert env.unwrapped.spec_id == "hello/bonjour" and env.unwrapped.greeting == "bonjour"
    assert spec_kwargs("hello/bonjour")["env_kwargs"]["greeting"] == "bonjour"
    assert "hello/bonjour" not in reflow.env.env_ids()  # a namespace is open-ended: nothing is listed
    await env.close()


def test_a_registered_id_wins_over_its_namespace(greetings):
    register("hello/Real-v0", entry_point="fake_envs:EchoEnv", kwargs={"greeting": "registered"})
    try:
        assert reflow.make("hello/Real-v0").unwrapped.greeting == "registered"
    finally:
        import gymnasium

        del gymnasium.registry["hello/Real-v0"]


def test_a_namespace_name_and_a_kwarg_that_disagree_are_refused(greetings):
    assert reflow.make("hello/salut", greeting="salut").unwrapped.greeting == "salut"
    with pytest.raises(ValueError, match="already sets greeting='salut'"):
        reflow.make("hello/salut", greeting="ciao")
    with pytest.raises(KeyError, match="non-empty name"):
        reflow.make("hello/ padded")
    with pytest.raises(KeyError, match=r"or hello/<name>"):  # unknown ids name the namespaces too
        reflow.make("nowhere/x")
    with pytest.raises(ValueError, match="one id segment"):
        register_namespace("a/b", "test/Echo-v0", "greeting")


def test_the_openenv_namespace_is_the_openenv_adapter():
    settings = spec_kwargs("openenv/echo")
    assert settings["env_entry_point"] == spec_kwargs("reflow/OpenEnv-v0")["env_entry_point"]
    assert settings["env_kwargs"]["name"] == "echo" and settings["max_turns"] == 32
