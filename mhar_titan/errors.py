"""The one base class of errors a user can fix by changing their input.

Every module that rejects a config value, a data file, a checkpoint, a launch
environment or a run folder raises a subclass of ``UserError`` (and, where callers
already expect it, of the built-in class it used to be: ``ValueError``,
``RuntimeError``, ``FileNotFoundError``). ``train.main()`` reports any ``UserError``
in one line on stderr and exits with code 2; other exceptions are bugs and keep
their traceback.

This module imports nothing, so every layer (config, data, checkpoint, launch,
trainer) can use it.
"""


class UserError(Exception):
    """Bad input the user can fix (config, data, checkpoint, launch environment, run folder).

    The message names what is wrong and how to fix it; ``train.main()`` prints it and
    exits with code 2.
    """


class ConfigError(UserError, ValueError):
    """A configuration file or command-line override is invalid (raised by the job config's
    parser, and by the model's argument resolution, which the parser runs)."""
