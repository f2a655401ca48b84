"""The ReFlow environment API: async message-level envs, tools, tool-call parsing, registration.

This package knows no tokens, models, engines, replay or training.
"""

from reflow.env.core import (
    EPISODE_STATUSES,
    AssistantTurn,
    Env,
    EnvError,
    EpisodeStatus,
    InfraError,
    Message,
    Observation,
    ResetNeeded,
    StepResult,
    Task,
    Wrapper,
    task_hash,
)
from reflow.env.parsers import format_hermes_call, get_parser, parse_assistant, register_parser
from reflow.env.play import EpisodeResult, play_episode, scripted_policy
from reflow.env.registration import discover, env_ids, make, register
from reflow.env.tasks import load_tasks, write_tasks
from reflow.env.tool_env import ToolEnv
from reflow.env.tools import SchemaTool, Tool, ToolCall, ToolError, ToolResult

__all__ = [
    "EPISODE_STATUSES",
    "AssistantTurn",
    "Env",
    "EnvError",
    "EpisodeResult",
    "EpisodeStatus",
    "InfraError",
    "Message",
    "Observation",
    "ResetNeeded",
    "SchemaTool",
    "StepResult",
    "Task",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "ToolResult",
    "Wrapper",
    "discover",
    "env_ids",
    "format_hermes_call",
    "get_parser",
    "load_tasks",
    "make",
    "parse_assistant",
    "play_episode",
    "register",
    "register_parser",
    "scripted_policy",
    "task_hash",
    "write_tasks",
]
