"""User-facing errors.

Every problem a user can cause (bad config, bad data, bad file) raises a subclass of
:class:`LightningPutmError` whose message says what is wrong and how to fix it. The scripts
catch it, print the message and exit with a non-zero code (a traceback only with ``debug=true``).
"""


class LightningPutmError(ValueError):
    """Base class of errors caused by the user's input, not by a bug."""


class ConfigError(LightningPutmError):
    """An unknown key, a value of the wrong type or out of range."""


class DataError(LightningPutmError):
    """Data that cannot serve the request: missing root, too few images or classes."""


class FeatureError(LightningPutmError):
    """A feature file or tensor that is malformed, unsafe or unfit for a method."""
