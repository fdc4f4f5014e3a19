"""Beam search gives the ids transformers' generate gives on the same weights, for every family."""
from __future__ import annotations

import pytest
import torch

import lmkit
from helpers.beams import IDS, SETTINGS, V, check_beams, peaky, source_inputs

transformers = pytest.importorskip("transformers")


def _decoder_inputs():
    torch.manual_seed(3)
    ids = torch.randint(3, V, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :5] = 0
    return dict(input_ids=ids.masked_fill(mask == 0, 1), attention_mask=mask)


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_beam_gpt2(tmp_path, setting):
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    torch.manual_seed(0)
    hf_model = peaky(transformers.GPT2LMHeadModel(cfg).eval(), 2.0)
    got, eos = check_beams(hf_model, tmp_path, _decoder_inputs(), setting)
    assert got.shape[1] > 7


@pytest.mark.parametrize("setting", SETTINGS[1:4:2], ids=IDS[1:4:2])
def test_beam_llama(tmp_path, setting):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = peaky(transformers.LlamaForCausalLM(cfg).eval(), 10.0)
    check_beams(hf_model, tmp_path, _decoder_inputs(), setting)


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_beam_t5(tmp_path, setting):
    cfg = transformers.T5Config(vocab_size=V, d_model=24, d_kv=6, d_ff=40, num_layers=3, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=6,
                                decoder_start_token_id=0, dropout_rate=0.0, initializer_factor=0.3)
    torch.manual_seed(0)
    hf_model = peaky(transformers.T5ForConditionalGeneration(cfg).eval(), 1.0)
    got, _ = check_beams(hf_model, tmp_path, source_inputs(0), setting)
    assert (got[:, 0] == 0).all()  # decoder ids begin with the decoder start token


@pytest.mark.parametrize("setting", SETTINGS[:3:2], ids=IDS[:3:2])
def test_beam_bart(tmp_path, setting):
    cfg = transformers.BartConfig(vocab_size=V, d_model=24, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40,
                                  decoder_ffn_dim=40, max_position_embeddings=64, dropout=0.0, init_std=0.3)
    torch.manual_seed(0)
    hf_model = peaky(transformers.BartForConditionalGeneration(cfg).eval(), 1.0)
    check_beams(hf_model, tmp_path, source_inputs(1), setting)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_greedy_seq2seq(tmp_path, family):
    if family == "t5":
        cfg = transformers.T5Config(vocab_size=V, d_model=24, d_kv=6, d_ff=40, num_layers=3, num_decoder_layers=2,
                                    num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=6,
                                    feed_forward_proj="gated-gelu", decoder_start_token_id=0, dropout_rate=0.0,
                                    initializer_factor=3.0)
        hf_model, pad = transformers.T5ForConditionalGeneration(cfg), 0
    else:
        cfg = transformers.BartConfig(vocab_size=V, d_model=24, encoder_layers=2, decoder_layers=2,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40,
                                      decoder_ffn_dim=40, max_position_embeddings=64, dropout=0.0, init_std=0.3)
        hf_model, pad = transformers.BartForConditionalGeneration(cfg), 1
    hf_model = peaky(hf_model.eval(), 1.0)
    check_beams(hf_model, tmp_path, source_inputs(pad), dict(num_beams=1), n_new=20)


@pytest.mark.parametrize("num_beams", [1, 3], ids=["sample", "beam-sample"])
def test_seeded_sampling_t5(tmp_path, num_beams):
    """Sampling (and beam sampling) draws the same tokens as transformers from the same seed."""
    cfg = transformers.T5Config(vocab_size=V, d_model=24, d_kv=6, d_ff=40, num_layers=3, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=6,
                                decoder_start_token_id=0, dropout_rate=0.0, initializer_factor=0.3)
    torch.manual_seed(0)
    hf_model = transformers.T5ForConditionalGeneration(cfg).eval()
    hf_model.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    kwargs = source_inputs(0)
    common = dict(max_new_tokens=8, do_sample=True, top_k=20, top_p=0.9, temperature=0.8, num_beams=num_beams,
                  eos_token_id=1, pad_token_id=0)
    torch.manual_seed(7)
    ref = hf_model.generate(**kwargs, **common)
    torch.manual_seed(7)
    got = ours.generate(kwargs["input_ids"], attention_mask=kwargs["attention_mask"], **common)
    assert got.tolist() == ref.tolist()


@pytest.mark.parametrize("num_beams", [1, 3])
def test_forced_bos_and_eos_bart(tmp_path, num_beams):
    """forced_bos_token_id / forced_eos_token_id (BART's generation defaults) force what transformers forces."""
    cfg = transformers.BartConfig(vocab_size=V, d_model=24, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40,
                                  decoder_ffn_dim=40, max_position_embeddings=64, dropout=0.0, init_std=0.3,
                                  forced_bos_token_id=0, forced_eos_token_id=2)
    torch.manual_seed(0)
    hf_model = transformers.BartForConditionalGeneration(cfg).eval()
    hf_model.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    kwargs = source_inputs(1)
    common = dict(max_new_tokens=6, num_beams=num_beams, eos_token_id=[2, 7], pad_token_id=1)
    # forced_eos_token_id comes from its generation config (transformers 5 drops forced_bos_token_id there)
    ref = hf_model.generate(**kwargs, do_sample=False, forced_bos_token_id=0, **common)
    got = ours.generate(kwargs["input_ids"], attention_mask=kwargs["attention_mask"], forced_bos_token_id=0,
                        forced_eos_token_id=2, **common)
    assert got.tolist() == ref.tolist()
    assert (got[:, 1] == 0).all() and got.shape[1] <= 7


@pytest.mark.parametrize("filters,eos", [(dict(top_k=1), 1), (dict(top_p=0.05), [1, 5]), (dict(top_k=1, top_p=0.5), None)],
                         ids=["top_k1", "top_p-two-eos", "no-eos"])
def test_beam_sampling_keeps_tokens_besides_eos(tmp_path, filters, eos):
    """With beams, transformers' top-k / top-p leave at least (number of EOS tokens) + 1 tokens (2 without EOS)."""
    cfg = transformers.T5Config(vocab_size=V, d_model=24, d_kv=6, d_ff=40, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=6,
                                decoder_start_token_id=0, dropout_rate=0.0, initializer_factor=0.3)
    torch.manual_seed(0)
    hf_model = peaky(transformers.T5ForConditionalGeneration(cfg).eval(), 3.0)
    hf_model.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    kwargs = source_inputs(0)
    common = dict(max_new_tokens=8, do_sample=True, num_beams=3, repetition_penalty=1.3, eos_token_id=eos,
                  pad_token_id=0, **filters)
    for seed in range(3):
        torch.manual_seed(seed)
        ref = hf_model.generate(**kwargs, **common)
        torch.manual_seed(seed)
        got = ours.generate(kwargs["input_ids"], attention_mask=kwargs["attention_mask"], **common)
        assert got.tolist() == ref.tolist()


@pytest.mark.parametrize("num_beams", [1, 2])
def test_decoder_prompt_counts_in_lengths_and_gets_the_start_token(tmp_path, num_beams):
    """generate(decoder_input_ids=...) as transformers: the decoder start goes in front unless a row already has it,
    max_length / min_length count the decoder prompt, and decoder_start_token_id may be one id per row."""
    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=20, num_layers=1, num_heads=2,
                                decoder_start_token_id=0, dropout_rate=0.0, initializer_factor=3.0)
    torch.manual_seed(0)
    hf_model = transformers.T5ForConditionalGeneration(cfg).eval()
    hf_model.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    src = source_inputs(0)["input_ids"][:2]
    prompt = torch.tensor([[0, 6, 7], [0, 8, 9]])
    free = hf_model.generate(src, decoder_input_ids=prompt, max_new_tokens=8, eos_token_id=None)[0, 3:].tolist()
    eos = free[4]  # min_length 7 lets row 0 end there, at its 5th new token (not held back to the 7th)
    assert eos not in free[:4]
    cases = [dict(decoder_input_ids=torch.tensor([[5, 6], [7, 8]]), max_new_tokens=4),
             dict(decoder_input_ids=prompt, max_length=6),
             dict(decoder_input_ids=prompt, min_length=7, max_new_tokens=8, eos_token_id=eos),
             dict(decoder_start_token_id=torch.tensor([4, 5]), max_new_tokens=3)]
    for case in cases:
        ref = hf_model.generate(src, num_beams=num_beams, **case)
        assert ours.generate(src, num_beams=num_beams, **case).tolist() == ref.tolist(), case
