"""`SchemaTool`: a tool that runs on the other side of an adapter (an OpenEnv server, a verifiers env),
known here only by its JSON Schema; names and required or extra argument keys are checked here."""

from __future__ import annotations

from typing import Any

from reflow.env import Tool, ToolError


class SchemaTool(Tool):
    """A remote tool: `parameters` is its JSON Schema; calling it here is a bug (the adapter runs it)."""

    def __init__(self, name: str, description: str, parameters: dict[str, Any]) -> None:
        super().__init__(name, description, _runs_remotely, None)  # type: ignore[arg-type]
        self.parameters = parameters

    @property
    def schema(self) -> dict[str, Any]:  # type: ignore[override]
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        props = self.parameters.get("properties")
        problems = [f"{k}: Field required" for k in self.parameters.get("required", []) if k not in arguments]
        if isinstance(props, dict) and self.parameters.get("additionalProperties") is False:
            problems += [f"{k}: Extra inputs are not permitted" for k in arguments if k not in props]
        if problems:
            raise ToolError(f"bad arguments for {self.name}: {'; '.join(problems)}")
        return dict(arguments)


def _runs_remotely(**kwargs: Any) -> Any:
    raise RuntimeError("a remote tool runs on the other side of its adapter, through the adapter's step")
