"""The one exception type for problems the user can fix (bad file, bad option, missing package).

Raise `UserError` with one clear sentence: what was wrong, which file or option, what to do.
The command-line entry points catch it and print the sentence without a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, files or environment, explained in one sentence."""
