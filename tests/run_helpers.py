"""Overrides for the short `agent-train` runs the integration tests make: a tiny model without a warm
start and small groups, so that a step takes seconds on a CPU. Tests add the env and their own keys."""

TINY_MODEL = [
    "model=tiny",
    "model_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, "
    "num_key_value_heads: 1, head_dim: 16}",
    "warmstart.enabled=false",
]
SMALL_ROLLOUT = [
    "rollout.group_size=4",
    "rollout.groups_per_step=2",
    "rollout.max_new_tokens=8",
    "rollout.stop=[e, a, o]",  # an untrained model's replies end early, at varied lengths
    "rollout.max_batch_size=16",
]
PARITY_ENV = ["env.plugins=[fake_envs:register_test_envs]", "env.id=test/Parity-v0"]
"""The parity env: reward spread without a warm start."""
