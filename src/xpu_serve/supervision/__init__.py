"""The supervisor's collaborators, one job each (the state loop itself is `xpu_serve.supervisor`):

- `eventlog`: the supervisor's own events (stderr + RUNTIME/events.jsonl);
- `context`: `Incarnation`, what one launch's watchers, capture and bundle writer see;
- `engine`: launch, process-tree discovery and ownership proof, ordered stop and sweep,
  shared-memory clean-up, port and host checks, the previous run's orphans, PID-1 reaping;
- `exits`: process exits (pidfd) and the exit window that decides when a burst fails;
- `watch`: the other built-in detectors behind the `Watcher` protocol (readiness and /health,
  fatal lines, the start-up timeout and stall) and the line routing from the log pump;
- `capture`: settle, flush, analyse, bundle, before anything is killed;
- `statefile`: RUNTIME/state.json, its heartbeat and the lock check;
- `backoff`: the wait between incarnations (restart policy, a wedged device's hold).
"""
