"""The one error type the CLI turns into a single line and a non-zero exit."""


class UserError(Exception):
    """Bad input or a refused operation; the message is the whole explanation."""


class Refused(UserError):
    """The checkout's state forbids the operation (conflict, half-applied, local changes)."""


class SpliceError(UserError):
    """An overlay names something the upstream module does not have (or already has)."""
