"""The one exception the data package raises for problems a user can fix.

Every message is a single line that names the offending setting or file and says how to fix
it, so the CLI can print it without a traceback.
"""


class DataError(ValueError):
    """A data source, tokenizer or resume state that cannot be used as configured."""


class ConversationError(ValueError):
    """A conversation that cannot be rendered or trained on; the message says why, the reader adds where."""
