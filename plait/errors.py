"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""


class PlaitError(Exception):
    """Bad input: the message names the offending value and what would work."""

    exit_code = 2


class ConfigError(PlaitError, ValueError):
    """A config, model, cluster, plan or data file that is missing, malformed or inconsistent."""


class NoFeasiblePlan(PlaitError):
    """No plan fits: the message says by how much the best candidate misses and what would fit."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what a command wants to add to the CLI's one line (e.g. where the last checkpoint is)."""
