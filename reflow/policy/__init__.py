"""The scheduling policies: plain objects and functions, counters in, decisions out.

- `elastic`: how many device slots roll out and how many train (`ElasticPolicy`), and how many train
  slots lend their engine to rollout while their trainer waits (`lending`: its arithmetic).
- `tail`: what to do with a batch's episodes still running (`TailPolicy`: over-provision, carry
  over, migrate, free an engine, set a concurrency limit).
- `dual_cycle`: which groups may start (`AdmissionControl`) and how much of a batch replay may fill
  (`ReplayShare`).
- `task_selection`: which training task seeds a round samples (`LearnabilityFilter`).
- `eval_schedule`: when a loop takes a held-out evaluation point (`EvalSchedule`).
- `actuator`: the `Actuator` protocol through which a decision is applied.

Each policy module owns `observe` (the driver's raw counters in, the policy's observation out) where
its observation needs arithmetic, and `decide`. Nothing here imports Ray, a clock, threads,
processes, sockets or files (`tests/test_layout.py` checks the folder): the two drivers bring those.
The Ray runtime (`reflow.runtime`) and the cluster simulator (`reflow.sim`) feed the same
observations to the same objects and apply the decisions through their own `Actuator`, so a change
to a policy changes both. This package sits below `reflow.config`, which builds its sections from
the policies' config dataclasses.
"""
