"""Wrappers that every env made by `reflow.make` gets, and opt-in ones (`MalformedCallPenalty`, which a
run adds with `env.malformed_call_penalty`), one per file (as in Gymnasium)."""

from reflow.env.wrappers.contain_errors import ContainErrors
from reflow.env.wrappers.episode_deadline import EpisodeDeadline
from reflow.env.wrappers.malformed_call_penalty import MalformedCallPenalty
from reflow.env.wrappers.order_enforcing import OrderEnforcing
from reflow.env.wrappers.turn_limit import TurnLimit

__all__ = ["ContainErrors", "EpisodeDeadline", "MalformedCallPenalty", "OrderEnforcing", "TurnLimit"]
