"""The Weights & Biases sink of a training run (`log.wandb:` in the run config; the `wandb` extra): its
settings (`WandbConfig`, which `reflow.config` reads as that section) and `WandbSink`, a W&B run fed the
records `RunLog.write` puts in metrics.jsonl, under the same keys and values.

Each record but the summary is one `run.log` call, its keys prefixed with its kind (`step/reward_mean`,
`eval/success_rate`, `warmstart/sft_steps`): the kinds have keys in common. A kind whose records carry a
`step` is plotted against it (`define_metric`). The summary record goes to the run's summary, its keys
as they are. `wandb` is imported only when a run asks for the sink; this module needs the standard
library alone, so the config can read its settings anywhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from reflow.errors import ConfigError

RUN_ID_FILE = "wandb-run-id"
"""In the run folder: the W&B run's id, so that a resumed training run goes on in the same W&B run."""
INSTALL_HINT = "pip install 'reflow-rl[wandb]'"


@dataclasses.dataclass
class WandbConfig:
    project: str = "reflow"
    """the W&B project"""
    entity: str | None = None
    """the W&B team or user (None: your default entity)"""
    mode: Literal["online", "offline", "disabled"] | None = None
    """None: W&B's own choice ($WANDB_MODE, else online); offline writes the run under <run>/wandb, for
    `wandb sync` later"""
    name: str | None = None
    """the W&B run's display name (None: the run's run_name)"""
    group: str | None = None
    """a W&B group to put the run in (e.g. the runs of one benchmark)"""
    tags: list[str] = dataclasses.field(default_factory=list)
    """W&B tags of the run"""

    def __post_init__(self) -> None:
        if not self.project.strip():
            raise ValueError("project must not be empty")


def import_wandb() -> Any:
    """The `wandb` module; a ConfigError naming the key when it is not installed."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            f"log.wandb is set but the wandb package is not installed ({INSTALL_HINT})"
        ) from None
    return wandb


class WandbSink:
    """One W&B run for a training run's records; `close` finishes it."""

    def __init__(
        self,
        config: WandbConfig,
        run_dir: str | Path,
        run_name: str,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        wandb = import_wandb()
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else None  # None: W&B picks one
        try:
            self.run = wandb.init(
                project=config.project,
                entity=config.entity,
                mode=config.mode,
                name=config.name or run_name,
                group=config.group,
                tags=list(config.tags),
                dir=str(run_dir),
                id=run_id,
                resume="allow",
                config=run_config,
            )
        except wandb.errors.Error as e:  # no login, a bad entity: W&B's own words, and the key
            raise ConfigError(
                f"log.wandb: W&B could not start the run: {e} (or log to files: log.wandb.mode=offline)"
            ) from None
        id_file.write_text(self.run.id + "\n")
        self._axes: set[str] = set()

    def write(self, kind: str, record: dict[str, Any]) -> None:
        """One metrics.jsonl record (its JSON values: `RunLog.write` passes them as written)."""
        if kind == "summary":
            self.run.summary.update(record)
            return
        if "step" in record and kind not in self._axes:
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
            self._axes.add(kind)
        self.run.log({f"{kind}/{key}": value for key, value in record.items()})

    def close(self, exit_code: int = 0) -> None:
        """Finish the run (a non-zero `exit_code` marks it failed in W&B)."""
        self.run.finish(exit_code=exit_code)
