"""The errors of the peer network that end an island's start with one clear line (the trainer's command line
prints the message, never a traceback)."""


class PeerNetworkError(RuntimeError):
    """The island could not join or start the peer network; the message says what to check."""


class PortTakenError(PeerNetworkError):
    """The port to listen on is in use (by another process, or a daemon of ours not yet gone)."""


class RunKeyError(PeerNetworkError):
    """The island cannot take part in the run with the run key it was given (none, or the wrong one)."""
