"""User-facing errors: one readable line naming the file, field or line; exit code 2."""


class UserError(Exception):
    """A mistake the user can fix (bad recipe, bad data row, missing file, no network)."""

    exit_code = 2


class ResumableStop(UserError):
    """The run stopped for a cause outside the recipe (a lost node, a cut collective): `--resume`
    continues it, so a cluster job runs it again by itself instead of waiting for a person."""

    exit_code = 75  # EX_TEMPFAIL: try again
