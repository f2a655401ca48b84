"""ReFlow's built-in environments (installed as `reflow_envs`), one folder each.

Each registers itself through the `reflow.envs` entry-point group, the same way a user's package does,
and imports nothing of `reflow` but the public env API.
"""
