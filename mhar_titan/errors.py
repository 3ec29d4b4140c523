"""The one base class of errors a user can fix by changing their input.

Every module that rejects a config value, a data file, a checkpoint, a launch
environment or a run folder raises a subclass of ``UserError`` (and, where callers
already expect it, of the built-in class it used to be: ``ValueError``,
``RuntimeError``, ``FileNotFoundError``). ``train.main()`` reports any ``UserError``
in one line on stderr and exits with code 2; other exceptions are bugs and keep
their traceback.

``missing_path(path, want)`` is the one wording of a path a user gave that is not there as
asked: not found, or there but a folder where a file is wanted (or the other way round).

This module imports nothing but the standard library, so every layer (config, data,
checkpoint, launch, trainer) can use it.
"""
import os


class UserError(Exception):
    """Bad input the user can fix (config, data, checkpoint, launch environment, run folder).

    The message names what is wrong and how to fix it; ``train.main()`` prints it and
    exits with code 2.
    """


class ConfigError(UserError, ValueError):
    """A configuration file or command-line override is invalid (raised by the job config's
    parser, and by the model's argument resolution, which the parser runs)."""


def missing_path(path: "str | os.PathLike", want: str = "file") -> str:
    """Why ``path`` (which is not a ``want``: "file" or "folder") cannot be used, as the start of an
    error message: "PATH is a folder, not a file" / "PATH is a file, not a folder" when it exists as
    the other kind, else "PATH not found"."""
    if os.path.isdir(path) and want == "file":
        return f"{path} is a folder, not a file"
    if os.path.exists(path) and want == "folder":
        return f"{path} is a file, not a folder"
    return f"{path} not found"
