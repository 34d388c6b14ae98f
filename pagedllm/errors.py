"""Errors a user can cause. Entry points turn them into one clear line (CLI: exit 2) or HTTP 400."""


class InputError(ValueError):
    """Bad input from the user: the message names the field and the limit."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
