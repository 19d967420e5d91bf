"""The error every configuration mistake is reported as."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""
