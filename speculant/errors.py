"""The one exception type users see: a one-line message that says what is wrong and what to do."""


class SpeculantError(ValueError):
    """Bad input or an unusable model. The CLI prints its message on one line and exits with 2."""
