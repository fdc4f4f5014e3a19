"""User-facing errors: each message says what went wrong and what to do about it.

The CLI prints the message of an `LmkitError` as one line and exits with status 2;
anything else is a bug and raises normally.
"""


class LmkitError(Exception):
    """Base class of every error a user can cause and fix."""


class ConfigError(LmkitError):
    """A model config (preset, config.json, flags) that lmkit cannot build."""


class CorpusError(LmkitError):
    """A corpus that is missing, empty, unreadable or not UTF-8."""


class TokenizerError(LmkitError):
    """A tokenizer file or component that lmkit cannot read, or misuse of a tokenizer."""


class CheckpointError(LmkitError):
    """A model folder or checkpoint that is missing, truncated, damaged or mismatched."""


class GenerationError(LmkitError, ValueError):
    """Generation arguments that cannot work (prompt longer than the context, bad sampling values); a ValueError,
    the kind transformers' generate raises for the same arguments."""


class SequenceTooLongError(GenerationError):
    """A sequence longer than the model's positions, in any forward pass (training, fine-tuning, eval, generation)."""


class TrainingError(LmkitError):
    """A training run that cannot go on (NaN loss, nothing to resume from)."""


class RewardError(TrainingError):
    """A reward function that raised, or returned the wrong number of rewards or a value that is not a number."""


class MetricError(LmkitError):
    """Inputs or options a metric cannot score (BLEU, ROUGE): mismatched lists, unknown tokenizers or smoothing."""


def user_message(exc: BaseException) -> str | None:
    """The one line a user error gets (an LmkitError, or an OSError naming a path); None for a bug."""
    if isinstance(exc, LmkitError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:
        return (f"cannot use {exc.filename}: {exc.strerror or exc}; check the path, its permissions and the free "
                "disk space")
    return None
