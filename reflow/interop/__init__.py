"""Adapters to the env ecosystems users already have: OpenEnv servers and verifiers environments.

- `reflow.interop.openenv_client.OpenEnvEnv`: an unmodified OpenEnv server, played over its `/ws`
  session protocol as a ReFlow env (registered as `reflow/OpenEnv-v0`).
- `reflow.interop.verifiers_env.VerifiersEnv`: a verifiers (classic API, 0.3.x) environment run in its
  own process and venv, stepped by our episode runner (registered as `reflow/Verifiers-v0`).

The other direction, our envs served to OpenEnv clients, is `reflow.server.openenv_ws`. Nothing here
imports openenv or verifiers: the two speak to them over the wire, since neither co-installs with the
other (or, for verifiers, with our stack).
"""
