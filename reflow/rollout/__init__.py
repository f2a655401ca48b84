"""Rollout: episodes of an env played by an engine, kept token-in-token-out for training."""
