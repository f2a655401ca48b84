"""Wire models of the env server, its error type, and the one session state-transition table.

Observations, step results, messages and tool schemas travel as the JSON form of the dataclasses in
`reflow.env.core`. A step sends the *parsed* assistant turn (tool calls included): the tool-call syntax
belongs to the model's chat template, so the client parses (`reflow.env.parse_assistant`) and the server
does not re-parse `raw_text`, which travels only for the record. The server still checks every call
against its own tools (unknown names and bad arguments become error messages to the model), and a
`parse_error` the client set is answered as such.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reflow.env import AssistantTurn, ToolCall

ErrorKind = Literal["agent", "env", "infra"]
"""Whose fault an error is: the caller's request (agent), the environment (env), or the server and
what it runs on (infra: capacity, sandboxes, timeouts, shutdown)."""

SessionState = Literal["creating", "ready", "stepping", "done", "failed", "closed"]

# The only moves a session can make; `check_transition` enforces them and nothing else changes state.
# done: the episode ended (any status, timeouts included) and its env was released; failed: the env
# could not be reset; closed: deleted, reaped or shut down (final).
TRANSITIONS: dict[str, frozenset[str]] = {
    "creating": frozenset({"ready", "failed", "closed"}),
    "ready": frozenset({"stepping", "closed"}),
    "stepping": frozenset({"ready", "done", "closed"}),
    "done": frozenset({"closed"}),
    "failed": frozenset({"closed"}),
    "closed": frozenset(),
}
LIVE_STATES = frozenset({"creating", "ready", "stepping"})
"""States that hold an env (and count against max_sessions)."""


class InvalidTransition(RuntimeError):
    """A session was asked to move where the table does not allow (a bug in the server)."""


def check_transition(current: str, new: str) -> str:
    """Return `new` if a session in `current` may move there, else raise InvalidTransition."""
    if new not in TRANSITIONS.get(current, frozenset()):
        raise InvalidTransition(f"session cannot go from {current!r} to {new!r}")
    return new


class ApiError(Exception):
    """An error answered as `{error_kind, code, message}` with an HTTP status (and optional headers)."""

    def __init__(
        self, status: int, kind: ErrorKind, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.message = status, kind, code, message
        self.headers = headers or {}

    def body(self) -> dict[str, str]:
        return {"error_kind": self.kind, "code": self.code, "message": self.message}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_TOOL_CALLS = 64
"""Tool calls in one turn, over every protocol (each is run, and answered with a message)."""
MIN_DEADLINE_S = 1.0
"""The shortest session deadline a client may ask for: less and the session is over before it plays."""
JSON_SAFE_INT = 2**53 - 1
"""The largest integer every JSON parser reads exactly (I-JSON, RFC 7493); past it 2**63 - 1 arrives as
a float that rounds to 2**63."""


class _Request(_Model):
    """A request body: strict types, so that what the OpenAPI document says is all that is accepted
    (pydantic's default would read `false` as 0 and `"5"` as 5 where an integer is asked for)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _json_integer(value: Any) -> Any:
    """A `mode="before"` validator of integer fields: JSON Schema's integer (what the document declares)
    is a number without a fractional part, so 3.0 is one; true and "3" are not (strict mode refuses them)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


class ErrorBody(_Model):
    error_kind: ErrorKind
    code: str = Field(description="a short machine-readable name, e.g. session_not_found")
    message: str


class WireToolCall(_Request):
    name: str | None = Field(None, max_length=256)
    arguments: dict[str, Any] = Field(default_factory=dict)
    raw: str = ""
    id: str = Field("call_0", max_length=128)
    parse_error: str | None = None


class WireTurn(_Request):
    """`reflow.env.AssistantTurn` on the wire."""

    content: str = ""
    tool_calls: list[WireToolCall] = Field(default_factory=list, max_length=MAX_TOOL_CALLS)
    reasoning: str | None = None
    finish_reason: str = Field("stop", max_length=32)
    raw_text: str | None = None

    def to_turn(self) -> AssistantTurn:
        calls = [ToolCall(c.name, c.arguments, c.raw, c.id, c.parse_error) for c in self.tool_calls]
        return AssistantTurn(self.content, calls, self.reasoning, self.finish_reason, self.raw_text)


class CreateSession(_Request):
    env_id: str = Field(max_length=200, description="a served env id (GET /v1/envs)")
    task: dict[str, Any] | None = Field(None, description="an explicit task; else the env picks by seed")
    seed: int | None = Field(
        None, ge=-JSON_SAFE_INT, le=JSON_SAFE_INT, description="chooses the task when none is given"
    )
    deadline_s: float | None = Field(
        None, ge=MIN_DEADLINE_S, le=86400, description="wall-clock budget from now, sandbox start included"
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="constructor kwargs, only those the server allows clients"
    )

    _seed = field_validator("seed", mode="before")(_json_integer)


class ObservationBody(_Model):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    info: dict[str, Any]


class StepResultBody(_Model):
    messages: list[dict[str, Any]]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class SessionBody(_Model):
    session_id: str
    env_id: str
    state: SessionState
    turns: int = Field(description="steps taken: the turn_index the next step must carry")
    deadline_left_s: float
    idle_s: float
    status: str | None = Field(None, description="the episode status once the episode has ended")
    extended_s: float = Field(0.0, description="seconds the deadline moved for the client's pauses (extend)")
    idle_timeout_s: float = Field(description="a session with no request for this long is closed")


class SessionCreated(SessionBody):
    observation: ObservationBody


class StepRequest(_Request):
    turn_index: int = Field(ge=0, le=1_000_000, description="0 for the first step; a retry repeats it")
    turn: WireTurn

    _turn_index = field_validator("turn_index", mode="before")(_json_integer)


class ExtendRequest(_Request):
    seconds: float = Field(
        ge=0,
        le=86400,
        description="seconds the client's episode waited without using the env (its generation paused "
        "while the trainer ran): the deadline moves this much later; 0 only marks the session active",
    )


class StepResponse(_Model):
    session_id: str
    turn_index: int
    state: SessionState
    replayed: bool = Field(description="true when this answers a retry from the stored result")
    result: StepResultBody


class Deleted(_Model):
    session_id: str
    state: Literal["closed"]
    reason: str


class EnvInfo(_Model):
    env_id: str
    tools: list[dict[str, Any]]
    max_turns: int | None
    deadline_s: float | None


class EnvList(_Model):
    envs: list[EnvInfo]


class Capacity(_Model):
    max_sessions: int
    live_sessions: int
    available: int
    states: dict[str, int]
    steps_in_flight: int
    idle_envs: int = Field(description="envs kept for reuse, holding no session")
    draining: bool


class Health(_Model):
    status: Literal["ok", "draining"]
    uptime_s: float
