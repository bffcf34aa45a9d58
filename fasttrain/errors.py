"""Errors that are the user's to fix (a bad input, a busy run directory, a missing dependency): the
command line prints them as one line. Anything else is a bug or a system failure and keeps its
traceback (or every error does, with FASTTRAIN_DEBUG=1)."""


class UserError(RuntimeError):
    """A problem with what the user asked for, explained in one line."""
