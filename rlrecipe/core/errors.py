"""User-facing errors: one readable line naming the file, field or line; exit code 2."""


class UserError(Exception):
    """A mistake the user can fix (bad recipe, bad data row, missing file, no network)."""

    exit_code = 2
