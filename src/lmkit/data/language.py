"""Language identification for `lmkit data clean --languages en,...`, with lingua (`lingua-language-detector`).

lingua ships its character n-gram models (1- to 5-grams of 75 languages) inside its wheel, compiled into its
native library: nothing is downloaded or unpickled. A document's language is read from its first
`SAMPLE_CHARS` characters by lingua's low-accuracy mode (tri-grams only: a tenth of the memory, and as accurate
as the full models on texts of paragraph length); a document lingua cannot place (numbers, symbols) counts as
"unknown" and is dropped like another language.
"""
from __future__ import annotations

from functools import lru_cache

from lmkit.errors import ConfigError

SAMPLE_CHARS = 2000


def _lingua():
    try:
        import lingua
    except ImportError:
        raise ConfigError("language identification needs lingua, which is not installed; install lmkit's data extra: "
                          "pip install 'lmkit[data]'") from None
    return lingua


def parse_languages(spec: str | None) -> tuple[str, ...] | None:
    """'en,fr' -> ("en", "fr"): ISO 639-1 codes lingua knows; None keeps every language."""
    if spec is None:
        return None
    codes = tuple(dict.fromkeys(c.strip().lower() for c in str(spec).split(",") if c.strip()))
    if not codes:
        raise ConfigError("--languages takes ISO 639-1 codes separated by commas, e.g. en,de")
    known = {lang.iso_code_639_1.name.lower() for lang in _lingua().Language.all()}
    unknown = [c for c in codes if c not in known]
    if unknown:
        raise ConfigError(f"--languages: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not an ISO 639-1 "
                          f"code lingua detects; it knows {', '.join(sorted(known))}")
    return codes


@lru_cache(maxsize=1)
def _detector():
    lingua = _lingua()
    return lingua.LanguageDetectorBuilder.from_all_languages().with_low_accuracy_mode().build()


def detect_language(text: str) -> str:
    """The ISO 639-1 code of the text's language, or "unknown"."""
    found = _detector().detect_language_of(text[:SAMPLE_CHARS])
    return "unknown" if found is None else found.iso_code_639_1.name.lower()
