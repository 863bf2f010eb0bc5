"""Errors raised for bad user input. Every one is a ValueError, so callers can catch one type."""


class DartreeError(ValueError):
    """A bad argument or checkpoint; the message says what was wrong and what is expected."""


class CheckpointError(DartreeError):
    """A checkpoint directory is missing, incomplete, corrupt or does not fit the target."""


def require(condition: bool, message: str, error: type[DartreeError] = DartreeError) -> None:
    if not condition:
        raise error(message)
