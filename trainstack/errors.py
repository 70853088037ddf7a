"""User-facing errors: one line naming the file and the field, never a traceback."""

from __future__ import annotations


class TrainstackError(Exception):
    """A mistake in the user's input or environment. The CLI prints str(error) and exits 2."""

    exit_code = 2


class RecipeError(TrainstackError):
    def __init__(self, source: str, field: str | None, message: str):
        self.source, self.field, self.message = source, field, message
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {message}")
