"""mBART: folders transformers wrote (v4- and v5-style config.json) load with transformers' logits, losses from labels
alone (the language code wrapped to the front) and generate ids; the folders lmkit writes load back there."""
from __future__ import annotations

import json

import pytest
import torch

import lmkit
from lmkit.errors import ConfigError
from lmkit.models.seq2seq import Seq2SeqLM
from helpers.beams import check_beams, peaky, source_inputs
from test_seq2seq_hub import perturbed

transformers = pytest.importorskip("transformers")

V = 97
WORDS = [f"w{i}" for i in range(V - 6)]  # the tokenizer's words after <s> <pad> </s> <unk> en_XX ro_RO


def _mbart(tied: bool = True, **kw):
    cfg = transformers.MBartConfig(vocab_size=V, d_model=24, encoder_layers=2, decoder_layers=1,
                                   encoder_attention_heads=3, decoder_attention_heads=3, encoder_ffn_dim=40,
                                   decoder_ffn_dim=40, max_position_embeddings=64, scale_embedding=True, dropout=0.0,
                                   init_std=0.3, tie_word_embeddings=tied, **kw)
    return perturbed(transformers.MBartForConditionalGeneration, cfg)


def as_v4(folder) -> None:
    """A transformers 4.x era folder: torch_dtype, no decoder_start_token_id, BART's legacy layout keys (which
    transformers' mBART ignores), generation keys in config.json and no generation_config.json."""
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("dtype")
    raw.pop("decoder_start_token_id")
    raw.update(torch_dtype="float32", transformers_version="4.44.0", add_bias_logits=False, add_final_layer_norm=True,
               normalize_before=True, normalize_embedding=True, static_position_embeddings=False, output_past=True,
               num_hidden_layers=2, num_beams=3, max_length=9)
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "generation_config.json").unlink()


def _batch():
    torch.manual_seed(1)
    src = torch.randint(6, V, (3, 11))
    mask = torch.ones_like(src)
    mask[1, 7:] = 0  # padded source rows
    mask[2, 4:] = 0
    src = src.masked_fill(mask == 0, 1)
    dec = torch.randint(6, V, (3, 9))
    dec[:, 0] = 5
    dec_mask = torch.ones_like(dec)
    dec_mask[2, 6:] = 0
    labels = torch.randint(6, V, (3, 9))
    labels[0, 7:] = torch.tensor([2, 4])  # </s> en_XX: the language code ends the target
    labels[1, 4:] = torch.tensor([2, 5, -100, -100, -100])
    labels[2, 5:] = torch.tensor([2, 4, 1, 1])  # pad labels (not ignored) read as padding by the shift
    return src, mask, dec, dec_mask, labels


def _check_logits(ours, ref) -> None:
    src, mask, dec, dec_mask, labels = _batch()
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
        got = ours(src, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        keep = mask.bool()
        torch.testing.assert_close(got.encoder_last_hidden_state[keep], want.encoder_last_hidden_state[keep],
                                   atol=1e-4, rtol=1e-4)
        want, got = ref(input_ids=src, attention_mask=mask, labels=labels), ours(src, attention_mask=mask, labels=labels)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("style,tied", [("v5", True), ("v5", False), ("v4", True)], ids=["v5", "v5-untied", "v4"])
def test_mbart_logits_loss_and_round_trip(tmp_path, style, tied):
    hf = _mbart(tied)
    hf.save_pretrained(tmp_path / "hf")
    if style == "v4":
        as_v4(tmp_path / "hf")
    ref = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()  # as transformers reads the folder
    ours = lmkit.load_model(tmp_path / "hf")
    assert isinstance(ours, Seq2SeqLM) and ours.config.family == "mbart"
    assert (ours.lm_head.weight is ours.get_input_embeddings().weight) == tied
    _check_logits(ours, hf)
    _check_logits(ours, ref)
    ours.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "mbart"
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is transformers.MBartForConditionalGeneration
    _check_logits(ours, back)
    _check_logits(lmkit.load_model(tmp_path / "ours"), hf)


def test_mbart_v4_folder_generation_defaults(tmp_path):
    """A v4-era folder's num_beams / max_length in config.json, and the decoder start from bos_token_id (its
    decoder_start_token_id unset), give the ids transformers gives."""
    hf = peaky(_mbart(), 2.0)
    hf.save_pretrained(tmp_path)
    as_v4(tmp_path)
    ref = transformers.MBartForConditionalGeneration.from_pretrained(tmp_path).eval()
    src, mask = _batch()[:2]
    want = ref.generate(src, attention_mask=mask)
    got = lmkit.load_model(tmp_path).generate(src, attention_mask=mask)
    assert got.tolist() == want.tolist()
    assert (got[:, 0] == 0).all() and got.shape[1] <= 9


@pytest.mark.parametrize("setting", [
    dict(num_beams=1),
    dict(num_beams=3, length_penalty=0.5, early_stopping=True, repetition_penalty=1.5, num_return_sequences=2),
    dict(num_beams=2, length_penalty=2.0, forced_bos_token_id=5, decoder_start_token_id=2, no_repeat_ngram_size=2),
    dict(num_beams=1, forced_bos_token_id=4, decoder_start_token_id=[2, 5, 2], repetition_penalty=1.5),
], ids=["greedy", "beams-lp0.5-return2", "beams-forced-lang", "greedy-start-per-row"])
def test_mbart_generate_matches_transformers(tmp_path, setting):
    """Batched, padded sources: greedy and beam ids equal transformers' with its start rules (bos_token_id when
    decoder_start_token_id is unset), forced language codes, several EOS ids and length penalties."""
    hf = peaky(_mbart(), 2.0)
    got, eos = check_beams(hf, tmp_path, source_inputs(1), setting)
    start = setting.get("decoder_start_token_id", 0)  # unset: bos_token_id (0), as transformers starts
    assert got[:, 0].tolist() == (start if isinstance(start, list) else [start] * got.shape[0])
    if "forced_bos_token_id" in setting:
        assert (got[:, 1] == setting["forced_bos_token_id"]).all()
    assert torch.isin(got[:, 1:], torch.tensor(eos)).any()  # some hypothesis ended at one of the EOS ids


def test_shift_wraps_the_language_code_as_transformers():
    from transformers.models.mbart.modeling_mbart import shift_tokens_right

    from lmkit.objectives import shift_right_wrapped

    labels = _batch()[4]
    assert shift_right_wrapped(labels, 1).tolist() == shift_tokens_right(labels, 1).tolist()
    assert shift_right_wrapped(labels, 1)[:, 0].tolist() == [4, 5, 4]


def test_mbart_causal_lm_folder_and_bart_layout_are_refused(tmp_path):
    """A decoder-only MBartForCausalLM folder, and a post-norm (BART) model saved as mBART, are one clear error."""
    from lmkit.config import get_preset
    from lmkit.models import build_model

    transformers.MBartForCausalLM(_mbart().config).save_pretrained(tmp_path / "causal")
    with pytest.raises(ConfigError, match="MBartForCausalLM is a mBART class lmkit does not load"):
        lmkit.load_model(tmp_path / "causal")
    bart = build_model(get_preset("bart", vocab_size=V, d_model=24, n_layers=1, n_heads=3, d_ff=40, max_seq_len=16,
                                  family="mbart"))
    with pytest.raises(ConfigError, match="does not fit the mBART format .*norm_placement=pre"):
        bart.save_pretrained(tmp_path / "out")


# --- the command line on an mBART folder ---------------------------------------------------------

def _word_tokenizer(template: str):
    """A tokenizer.json (built with `tokenizers`) of <s> <pad> </s> <unk> en_XX ro_RO and WORDS whose template adds
    the source language code and </s>, as mBART's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<s>", "<pad>", "</s>", "<unk>", "en_XX", "ro_RO"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + WORDS)}, unk_token="<unk>"))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("</s>", 2), ("en_XX", 4)])
    return tok


@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory):
    """An mBART folder whose tokenizer appends `</s> en_XX` to a source and whose generation starts from ro_RO
    (decoder_start_token_id, as in mbart-large-en-ro)."""
    folder = tmp_path_factory.mktemp("mbart-cli")
    tok = _word_tokenizer("$A </s> en_XX")
    tok.save(str(folder / "tokenizer.json"))
    hf = peaky(_mbart(decoder_start_token_id=5), 2.0)
    hf.save_pretrained(folder)
    return folder, hf, tok


def test_cli_generate_on_an_mbart_folder(cli_folder, capsys):
    from lmkit.cli import main

    folder, hf, tok = cli_folder
    prompt = "w3 w17 w40 w8"
    assert main(["generate", "--model", str(folder), "--prompt", prompt, "--max-new-tokens", "8", "--num-beams", "2"]) == 0
    ids = torch.tensor([tok.encode(prompt).ids])
    assert ids[0, -2:].tolist() == [2, 4]
    want = hf.generate(ids, max_new_tokens=8, num_beams=2)
    assert want[0, 0] == 5
    assert capsys.readouterr().out == tok.decode(want[0].tolist(), skip_special_tokens=True) + "\n"


PAIRS = [("w1 w2 w3", "w2 w3 w4"), ("w10 w11", "w11 w12 w13 w14"), ("w5 w6 w7 w8 w9", "w6")]


def _eval_lines(folder, tmp_path, capsys) -> dict[str, float]:
    """The loss and BLEU that `lmkit eval --pairs` prints for PAIRS."""
    from lmkit.cli import main

    (tmp_path / "pairs.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS))
    assert main(["eval", "--model", str(folder), "--pairs", str(tmp_path / "pairs.tsv")]) == 0
    lines = capsys.readouterr().out.splitlines()
    return {name: float(next(l for l in lines if l.startswith(name)).split()[1]) for name in ("loss", "BLEU")}


def _hf_batch(tokenizer_class, tok):
    """Sources and labels as transformers' mBART tokenizer makes them from this tokenizer.json (en_XX -> ro_RO)."""
    hf_tok = tokenizer_class(tokenizer_object=tok, src_lang="en_XX", tgt_lang="ro_RO", pad_token="<pad>")
    batch = hf_tok([s for s, _ in PAIRS], text_target=[t for _, t in PAIRS], padding=True, return_tensors="pt")
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == 1, -100)
    return batch


def test_cli_eval_on_an_mbart_folder(cli_folder, tmp_path, capsys):
    """`lmkit eval --pairs`: the reference loss equals transformers' on MBartTokenizerFast's labels (`X </s> ro_RO`,
    shifted with the language code wrapped to the front: the decoder starts where generation does) and BLEU of the
    greedy outputs equals that of transformers' outputs."""
    from lmkit.evaluate.seq2seq import score_translations

    folder, hf, tok = cli_folder
    lines = _eval_lines(folder, tmp_path, capsys)
    batch = _hf_batch(transformers.MBartTokenizerFast, tok)
    assert batch["labels"][0, :5].tolist() == [8, 9, 10, 2, 5]
    with torch.no_grad():
        loss = hf(**batch).loss
        gen = hf.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=32)
    hyps = [tok.decode(row.tolist(), skip_special_tokens=True).strip() for row in gen]
    assert lines["loss"] == pytest.approx(float(loss), abs=1e-4)
    assert lines["BLEU"] == pytest.approx(score_translations(hyps, [t for _, t in PAIRS])["bleu"], abs=0.006)


def test_cli_eval_on_an_mbart50_folder_saved_by_lmkit(tmp_path, capsys):
    """mBART-50's convention, in a folder lmkit wrote: the decoder starts from </s> and forced_bos_token_id is the
    target code, so the labels are `ro_RO X </s>` (MBart50TokenizerFast); the loss is transformers' on those."""
    tok = _word_tokenizer("en_XX $A </s>")
    hf = peaky(_mbart(decoder_start_token_id=2), 2.0)
    hf.generation_config.forced_bos_token_id = 5
    hf.save_pretrained(tmp_path / "hf")
    lmkit.load_model(tmp_path / "hf").save_pretrained(tmp_path / "m")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    lines = _eval_lines(tmp_path / "m", tmp_path, capsys)
    batch = _hf_batch(transformers.MBart50TokenizerFast, tok)
    assert batch["labels"][0, :5].tolist() == [5, 8, 9, 10, 2]
    with torch.no_grad():
        loss = transformers.MBartForConditionalGeneration.from_pretrained(tmp_path / "m")(**batch).loss
    assert lines["loss"] == pytest.approx(float(loss), abs=1e-4)


def test_pair_training_labels_mbart_targets_as_evaluation_does(tmp_path):
    """fit_pairs on an mBART-style model (decoder starts from ro_RO): training and its validation label each target
    `X </s> ro_RO` as `lmkit eval` and MBartTokenizerFast do (they labeled it `X </s>`, so the decoder learned to
    start from </s> while generation starts from the code): the run's val_loss is the reference loss of the folder
    it wrote, and transformers' loss on its tokenizer's labels."""
    from lmkit.evaluate.seq2seq import encode_pairs, reference_loss
    from lmkit.train.translation import fit_pairs

    tok = _word_tokenizer("$A </s> en_XX")
    tok.save(str(tmp_path / "tokenizer.json"))
    result = fit_pairs(PAIRS, PAIRS, lmkit.load_tokenizer(tmp_path), tmp_path / "run", preset="bart", steps=3, batch_size=3,
                       eval_every=3, warmup_steps=1, family="mbart", norm_placement="pre", final_norm=True,
                       decoder_start_from_labels=True, decoder_start_token_id=5, d_model=24, n_layers=1, n_heads=2,
                       d_ff=32, max_seq_len=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = lmkit.load_model(tmp_path / "run")
    ours = lmkit.load_tokenizer(tmp_path / "run")
    assert encode_pairs(model, ours, PAIRS[:1]) == ([[7, 8, 9, 2, 4]], [[8, 9, 10, 2, 5]])  # w1 = id 7
    assert result["val_loss"] == pytest.approx(reference_loss(model, ours, PAIRS)[0], abs=1e-5)
    batch = _hf_batch(transformers.MBartTokenizerFast, tok)
    with torch.no_grad():
        hf_loss = transformers.MBartForConditionalGeneration.from_pretrained(tmp_path / "run")(**batch).loss
    assert result["val_loss"] == pytest.approx(float(hf_loss), abs=1e-5)
