"""transformers' T5 (v1.0 relu, v1.1 gated-gelu, tied and untied) and BART models of odd sizes."""
import pytest

transformers = pytest.importorskip("transformers")


def _t5(vocab, d_model, d_kv, heads, d_ff, layers, decoder_layers, gated, tied):
    cfg = transformers.T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=layers,
                                num_decoder_layers=decoder_layers, num_heads=heads, relative_attention_num_buckets=8,
                                relative_attention_max_distance=11, feed_forward_proj="gated-gelu" if gated else "relu",
                                tie_word_embeddings=tied, decoder_start_token_id=0, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


def _bart(vocab, d_model, heads, ffn, layers, decoder_layers, scale):
    cfg = transformers.BartConfig(vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=decoder_layers,
                                  encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                                  decoder_ffn_dim=ffn, max_position_embeddings=40, scale_embedding=scale, dropout=0.0,
                                  init_std=0.3)
    return transformers.BartForConditionalGeneration(cfg)


# (name, builder, how much the output layer is scaled so that the distributions are peaked but not one-hot)
# (transformers 5's T5 sizes the decoder's cache by the encoder's layers: no more decoder layers than encoder ones)
MODELS = [("t5-v1.0", lambda: _t5(67, 22, 5, 3, 29, 3, 2, False, True), 1.0),
          ("t5-v1.1", lambda: _t5(59, 26, 7, 2, 35, 2, 1, True, False), 0.25),
          ("t5-gated-tied", lambda: _t5(53, 18, 3, 5, 23, 3, 1, True, True), 0.5),
          ("bart", lambda: _bart(61, 28, 4, 37, 2, 3, False), 1.0),
          ("bart-scaled", lambda: _bart(71, 15, 3, 19, 1, 2, True), 1.5)]
