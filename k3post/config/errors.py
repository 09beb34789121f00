"""User-facing errors: the CLI prints these without a traceback."""


class UserError(Exception):
    """A mistake in the user's input (recipe, data file, command line), explained in words."""


class RecipeError(UserError):
    """A recipe file failed to load: the message names the file, the key path and what was expected."""
