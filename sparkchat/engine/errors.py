"""Errors the engine raises for bad input. Each carries one line a user can read."""


class SparkchatError(Exception):
    """Base class: str(error) is a complete one-line message for the user."""


class ModelError(SparkchatError):
    """A model directory, config or weight file that cannot be used."""


class ContextOverflowError(SparkchatError):
    """A prompt (plus what the conversation already holds) longer than the context."""


class TemplateError(SparkchatError):
    """A chat template that fails to render."""


class DownloadError(SparkchatError):
    """A model download or local model cache operation that failed (network, auth, disk, corrupt file)."""
