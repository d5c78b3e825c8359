"""The one error type the planner raises for bad input.

It subclasses shardwise's `ConfigError` so a CLI that already maps configuration errors to a
one-line message and exit status 2 handles planner errors the same way.
"""
from shardwise.config import ConfigError


class PlanError(ConfigError):
    """Unknown preset or GPU, unreadable model config, or a layout that cannot exist."""
