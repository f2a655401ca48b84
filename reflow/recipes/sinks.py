"""Where a run's records go besides metrics.jsonl and TensorBoard (`RunLog` writes both itself): the
`Sink` protocol and `log_sinks`, the sinks a run config's `log:` section asks for."""

from __future__ import annotations

from typing import Any, Protocol

from reflow.config import RunConfig


class Sink(Protocol):
    """Somewhere else a run's records go: each one as metrics.jsonl has it, then `close` once."""

    def write(self, kind: str, record: dict[str, Any]) -> None: ...

    def close(self, exit_code: int = 0) -> None: ...


def log_sinks(config: RunConfig) -> list[Sink]:
    """The sinks `config.log` asks for (none by default); a ConfigError naming the key when one cannot
    start (its package missing)."""
    if config.log.wandb is None:
        return []
    from reflow.wandb_sink import WandbSink

    run_config = config.model_dump(mode="json")
    return [WandbSink(config.log.wandb.settings(), config.run_dir, config.run_name, run_config)]
