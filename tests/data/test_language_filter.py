"""`lmkit data clean --languages`: lingua's identification drops documents in other languages (and text it cannot
place), the report says which language each removed document was, and bad codes or a missing lingua are one line."""
import json
import subprocess
import sys

import pytest

from lmkit.cli import main
from lmkit.data.clean import CleanConfig, clean_corpus
from lmkit.data.corpus import Corpus, Document
from lmkit.errors import ConfigError

pytest.importorskip("lingua")
from lmkit.data.language import detect_language, parse_languages  # noqa: E402

TEXTS = {
    "en": "The standard library provides modules for reading files, parsing arguments and talking to the network.",
    "de": "Die Standardbibliothek enthält Module zum Lesen von Dateien, zum Verarbeiten von Argumenten und für Netzwerke.",
    "fr": "La bibliothèque standard fournit des modules pour lire des fichiers et analyser les arguments de la ligne.",
    "es": "La biblioteca estándar ofrece módulos para leer archivos, procesar argumentos y comunicarse por la red.",
    "ru": "Стандартная библиотека содержит модули для чтения файлов, разбора аргументов и работы с сетью.",
    "ja": "標準ライブラリには、ファイルの読み込みや引数の解析、ネットワーク通信のためのモジュールが含まれています。",
}


@pytest.mark.parametrize("code", sorted(TEXTS))
def test_detect_language(code):
    assert detect_language(TEXTS[code]) == code


def test_clean_keeps_the_languages_asked_for_and_reports_the_others():
    docs = [Document(f"{code}-{i}", f"{text} ({i})") for i in range(3) for code, text in TEXTS.items()]
    kept, report = clean_corpus(Corpus("mixed", docs), CleanConfig(languages=("en", "fr"), near_threshold=None,
                                                                   boilerplate_min_docs=0))
    assert sorted({d.id.split("-")[0] for d in kept.documents}) == ["en", "fr"]
    assert report["removed"]["other_language"] == 12
    removed = report["removed_documents"]["other_language"]
    assert {r["language"] for r in removed} == {"de", "es", "ru", "ja"}


def test_parse_languages():
    assert parse_languages("EN, de,en") == ("en", "de") and parse_languages(None) is None
    with pytest.raises(ConfigError, match="xx is not an ISO 639-1 code"):
        parse_languages("en,xx")


def test_cli_languages_flag(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": code, "text": text}) + "\n" for code, text in TEXTS.items()))
    assert main(["data", "clean", "--corpus", str(src), "--out", str(tmp_path / "out.jsonl"), "--languages", "en"]) == 0
    assert [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == ["en"]
    assert "5 other language" in capsys.readouterr().out
    assert main(["data", "clean", "--corpus", str(src), "--out", str(tmp_path / "o2.jsonl"), "--languages", "e"]) == 2


def test_a_missing_lingua_is_one_line_naming_the_extra(tmp_path):
    code = ("import sys; sys.modules['lingua'] = None\n"
            "from lmkit.cli import main\n"
            f"sys.exit(main(['data', 'clean', '--corpus', 'pydocs', '--out', {str(tmp_path / 'o.jsonl')!r}, "
            "'--languages', 'en']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2 and "pip install 'lmkit[data]'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
