"""The cluster simulator: the project's own scheduling policies run against calibrated costs
in simulated time, at cluster sizes this machine cannot reach.

`config` (scenario YAML), `costs` (the cost model), `store` (the replay store's query surface in memory),
`simulation` (the event loop and the rollout side), `training` (the `SimTrainer` the simulation holds: train
steps, syncs, resumes; the sync loop's rounds), `oversample` (slime's over-provisioned rounds with an
abort at the target: APRIL), `engines` (simulated inference engines and their
requests), `policies` (the seam to the runtime's policy objects, and the simulator's `Actuator`),
`metrics` (the run-metric names), `validate` and `fit` (published targets), `measured` and `from_run`
(a finished run's costs in, its figures predicted), `predict` and `plan` (comparisons, sweeps, the
planner), `cli` (`reflow simulate`). Imports no Ray, torch or engine code: it runs anywhere the core
installs.
"""
