"""Errors of the island engine that end a run with one clear line."""


class TrainingError(RuntimeError):
    """The island cannot continue; the message says why and what to do."""
