"""The one exception type that means "the user gave us bad input"."""


class SurgeryError(Exception):
    """A problem with the user's input: reported as one line on stderr, exit code 2."""
