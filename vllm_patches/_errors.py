"""The one error type the CLI turns into a single line and a non-zero exit, and the exit
codes (the contract: ``_cli``'s docstring)."""

EXIT_OK, EXIT_REFUSED, EXIT_BAD_INPUT = 0, 1, 2


class UserError(Exception):
    """Bad input or a refused operation; the message is the whole explanation."""


class Refused(UserError):
    """The checkout's state forbids the operation (conflict, half-applied, local changes)."""


class SpliceError(UserError):
    """An overlay names something the upstream module does not have (or already has)."""
