"""Word embeddings: word2vec (skip-gram, CBOW; negative sampling, hierarchical softmax) and word vectors."""
from lmkit.embed.train import TrainReport, Word2Vec, Word2VecConfig
from lmkit.embed.vectors import WordVectors
from lmkit.embed.vocab import Vocabulary, sentences_of, tokenize

__all__ = ["TrainReport", "Word2Vec", "Word2VecConfig", "WordVectors", "Vocabulary", "sentences_of", "tokenize"]
