"""``ConfigError``: the one error type of a configuration that cannot work.

Its own module so that the leaf modules that parse parts of a config (:mod:`mtp_jax.config`,
:mod:`mtp_jax.rope`) raise the same class without importing each other;
``mtp_jax.config.ConfigError`` is the same class.
"""


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the value and the fix."""
