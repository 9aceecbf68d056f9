"""User-facing errors.

A `UserError` is a mistake in what the user handed us (a path, a flag, a file). The CLI prints it as one
message and exits non-zero; it never becomes a traceback. Everything else is a bug and keeps its trace.
"""


class UserError(Exception):
    """Bad input, described in words that name the file or field and what was expected."""


def fail_if(problems: list[str], what: str) -> None:
    """Raise one error listing every problem, so a user fixes them all in one go."""
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise UserError(f"{what}:\n{lines}")
