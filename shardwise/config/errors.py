"""The one error type of configuration: the CLI turns it into exit status 2 and one line."""


class ConfigError(ValueError):
    """An invalid configuration, detected before any rank starts."""
