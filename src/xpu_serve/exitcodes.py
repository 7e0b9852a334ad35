"""Documented process exit codes of the `xpu-serve` command (README, "Exit codes").

systemd units (`xpu-serve unit`) list USAGE, GAVE_UP_AT_ONCE and LOCKED in
`RestartPreventExitStatus=`: restarting the unit fixes neither a configuration error nor a lock
held by another supervisor, so systemd must not restart it either.
"""

OK = 0
"""Success; `up` stopped on SIGTERM/SIGINT after a clean shutdown; `check` found nothing."""
FAILURE = 1
"""A runtime failure that is not the input's fault; `check --strict` found warnings."""
USAGE = 2
"""Bad input: unreadable or invalid config, bad arguments, unreadable file, bad fault spec."""
GAVE_UP = 3
"""`up` gave up after a crash loop (too many failures inside the window)."""
GAVE_UP_AT_ONCE = 4
"""`up` gave up at once: a failure that a restart cannot fix (config error, port owned by another program)."""
LOCKED = 5
"""Another supervisor already holds the runtime directory's lock."""
NO_VERDICT = 6
"""`diagnose` ran but found nothing that supports a verdict (`cause: unknown`); the report is printed as usual."""
