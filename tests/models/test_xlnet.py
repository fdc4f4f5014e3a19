"""XLNet against transformers: the same numbers from the same folders, every input XLNet takes, its heads, its
memory over several segments, saving both ways and generate in both memory modes."""
from __future__ import annotations

import json

import pytest
import torch

import lmkit
from lmkit.errors import ConfigError

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
# odd shapes: heads of 5 and 7 features, vocabularies and FFNs of no round size
CONFIGS = {
    "bi": dict(vocab_size=53, d_model=20, n_layer=3, n_head=4, d_inner=29, mem_len=None),
    "bi-clamp": dict(vocab_size=41, d_model=28, n_layer=2, n_head=4, d_inner=17, clamp_len=3, mem_len=6,
                     ff_activation="relu"),
    "bi-reuse": dict(vocab_size=47, d_model=14, n_layer=2, n_head=2, d_inner=23, mem_len=9, reuse_len=4,
                     ff_activation="gelu_new"),
    "uni": dict(vocab_size=43, d_model=18, n_layer=2, n_head=6, d_inner=19, attn_type="uni", mem_len=5),
    "uni-same": dict(vocab_size=43, d_model=14, n_layer=3, n_head=2, d_inner=19, attn_type="uni", mem_len=4,
                     same_length=True, clamp_len=2),
}


def _hf(kind: str, cls=None, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.XLNetConfig(dropout=0.0, pad_token_id=0, **{**CONFIGS[kind], **overrides})
    model = (cls or transformers.XLNetLMHeadModel)(config).eval()
    with torch.no_grad():  # random (not zero) linear biases and layer-norm gains, so that every tensor counts
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    ref = _hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder)
    return request.param, ref, lmkit.load_model(folder)


def _inputs(vocab: int, B: int = 3, T: int = 11, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    types = torch.randint(0, 3, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, :4] = 0  # left padding
    mask[-1, -3:] = 0  # right padding
    perm = (torch.rand(B, T, T, generator=g) > 0.6).float()
    targets = torch.zeros(B, 4, T)
    for b in range(B):
        for m, t in enumerate(torch.randperm(T, generator=g)[:4].tolist()):
            targets[b, m, t] = 1.0
    return ids, types, mask, perm, targets


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < ATOL


def _same_mems(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        _close(a, b)


@torch.no_grad()
def test_every_input_over_three_segments_equals_transformers(pair):
    kind, ref, ours = pair
    ids, types, mask, perm, targets = _inputs(ref.config.vocab_size)
    # transformers' "uni" attention adds a per-row mask in place into its (T, K, 1, 1) causal mask and fails;
    # uni is compared without padding and perm_mask, the rest with everything
    masks = dict(attention_mask=mask, perm_mask=perm) if ref.config.attn_type == "bi" else {}
    mems_ref = mems_ours = None
    for segment in range(3):
        seg_ids = (ids + segment) % ref.config.vocab_size
        kw = dict(token_type_ids=types, target_mapping=targets if segment != 1 else None, **masks)
        r = ref(seg_ids, mems=mems_ref, use_mems=True, **kw)
        o = ours(seg_ids, mems=mems_ours, use_mems=True, **kw)
        _close(o.logits, r.logits)
        _same_mems(o.mems, r.mems)
        mems_ref, mems_ours = r.mems, o.mems
    labels = torch.randint(0, ref.config.vocab_size, targets.shape[:2])
    labels[0, 1] = -100
    r = ref(ids, token_type_ids=types, target_mapping=targets, labels=labels, **masks)
    o = ours(ids, token_type_ids=types, target_mapping=targets, labels=labels, **masks)
    assert abs(o.loss.item() - r.loss.item()) < ATOL
    embeds = ref.transformer.word_embedding(ids).detach()
    _close(ours(inputs_embeds=embeds, token_type_ids=types).logits, ref(inputs_embeds=embeds, token_type_ids=types).logits)
    kept = 3 * (ref.config.reuse_len or ids.shape[1])  # each call adds its first reuse_len positions
    assert mems_ours[0].shape[0] == min(kept, ref.config.mem_len or kept)


@torch.no_grad()
def test_input_mask_and_defaults(pair):
    kind, ref, ours = pair
    ids, types, mask, perm, targets = _inputs(ref.config.vocab_size, B=2, T=6, seed=3)
    if ref.config.attn_type == "bi":
        _close(ours(ids, input_mask=1 - mask).logits, ref(ids, input_mask=1 - mask).logits)
    r, o = ref(ids), ours(ids)  # eval mode: mems returned by default (use_mems_eval)
    _close(o.logits, r.logits)
    _same_mems(o.mems, r.mems)
    assert ours(ids, use_mems=False).mems is None
    ours.train()
    try:
        assert ours(ids).mems is None  # use_mems_train is false
    finally:
        ours.eval()


@torch.no_grad()
def test_bare_model_and_odd_lengths(tmp_path):
    ref = _hf("bi-clamp", transformers.XLNetModel)
    ref.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    for T in (1, 2, 13):
        ids, types, mask, perm, targets = _inputs(ref.config.vocab_size, B=2, T=T, seed=T)
        r = ref(ids, token_type_ids=types, perm_mask=perm, target_mapping=targets[:, :, :T][:, :min(T, 4)])
        o = ours(ids, token_type_ids=types, perm_mask=perm, target_mapping=targets[:, :, :T][:, :min(T, 4)])
        _close(o.last_hidden_state, r.last_hidden_state)
        _same_mems(o.mems, r.mems)
    ours.save_pretrained(tmp_path / "again")
    assert not any(k.startswith("transformer.") for k in _names(tmp_path / "again"))
    back = transformers.XLNetModel.from_pretrained(tmp_path / "again").eval()
    ids = _inputs(ref.config.vocab_size)[0]
    _close(back(ids).last_hidden_state, ref(ids).last_hidden_state)


def _names(folder) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


HEADS = [
    (transformers.XLNetForSequenceClassification, dict(num_labels=3)),
    (transformers.XLNetForSequenceClassification, dict(num_labels=1, summary_type="mean", summary_activation="linear")),
    (transformers.XLNetForSequenceClassification, dict(num_labels=4, summary_type="first",
                                                       summary_first_dropout=0.2)),
    (transformers.XLNetForSequenceClassification, dict(num_labels=2, summary_type="cls_index",
                                                       summary_use_proj=False)),
    (transformers.XLNetForTokenClassification, dict(num_labels=5)),
    (transformers.XLNetForMultipleChoice, dict()),
    (transformers.XLNetForQuestionAnsweringSimple, dict()),
]


@pytest.mark.parametrize("cls,settings", HEADS, ids=lambda x: getattr(x, "__name__", None) or str(sorted(x)))
@torch.no_grad()
def test_heads_equal_transformers_and_save_back(tmp_path, cls, settings):
    ref = _hf("bi", cls, summary_last_dropout=0.0, **settings)
    ref.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    ids, types, mask, perm, targets = _inputs(ref.config.vocab_size)
    kw = dict(token_type_ids=types, attention_mask=mask)
    if cls is transformers.XLNetForMultipleChoice:
        kw = {k: torch.stack([v, v.flip(0)]) for k, v in kw.items()}  # 2 questions of 3 choices
        ids, labels = torch.stack([ids, ids.flip(0)]), torch.tensor([2, 0])
        extra = dict(labels=labels)
    elif cls is transformers.XLNetForQuestionAnsweringSimple:
        extra = dict(start_positions=torch.tensor([1, 4, 20]), end_positions=torch.tensor([3, 9, 2]))
    elif cls is transformers.XLNetForTokenClassification:
        labels = torch.randint(0, 5, ids.shape)
        labels[0, :4] = -100
        extra = dict(labels=labels)
    elif ref.config.num_labels == 1:
        extra = dict(labels=torch.randn(3))
    else:
        extra = dict(labels=torch.randint(0, ref.config.num_labels, (3,)))
    r, o = ref(ids, **kw, **extra), ours(ids, **kw, **extra)
    if cls is transformers.XLNetForQuestionAnsweringSimple:
        _close(o.start_logits, r.start_logits)
        _close(o.end_logits, r.end_logits)
    else:
        _close(o.logits, r.logits)
    assert abs(o.loss.item() - r.loss.item()) < ATOL
    ours.save_pretrained(tmp_path / "again")
    back = cls.from_pretrained(tmp_path / "again").eval()
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == [cls.__name__]
    b = back(ids, **kw, **extra)
    assert abs(b.loss.item() - r.loss.item()) < ATOL


@torch.no_grad()
def test_transformers_4_config_loads(tmp_path):
    ref = _hf("uni", mem_len=3)
    ref.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["n_token"] = raw.pop("vocab_size")  # transformers 4's older spelling, with use_cache for use_mems_eval
    raw.pop("use_mems_eval", None)
    raw.pop("dtype", None)
    raw.update(transformers_version="4.30.0", torch_dtype="float32", use_cache=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = lmkit.load_model(tmp_path)
    assert ours.config.vocab_size == ref.config.vocab_size and ours.config.architecture == "decoder"
    ids = _inputs(ref.config.vocab_size)[0]
    _close(ours(ids).logits, ref(ids).logits)
    ours.save_pretrained(tmp_path / "again")
    back = transformers.XLNetLMHeadModel.from_pretrained(tmp_path / "again").eval()
    assert back.config.mem_len == 3 and back.config.attn_type == "uni"
    _close(back(ids).logits, ref(ids).logits)


def test_lmkit_built_xlnet_saves_for_transformers(tmp_path):
    config = lmkit.ModelConfig(family="xlnet", architecture="encoder", position="xl", norm_placement="post",
                               final_norm=False, attention_bias=False, vocab_size=31, d_model=12, n_layers=2,
                               n_heads=4, d_ff=20, mem_len=5, pad_token_id=0, extra={"head": "lm"})
    from lmkit.models import build_model

    ours = build_model(config).eval()
    ours.save_pretrained(tmp_path)
    ref = transformers.XLNetLMHeadModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 31, (2, 7))
    with torch.no_grad():
        _close(ours(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("change,word", [(dict(bi_data=True), "bi_data"),
                                         (dict(architectures=["XLNetForQuestionAnswering"]), "XLNetForQuestionAnswering"),
                                         (dict(attn_type="tri"), "attn_type"),
                                         (dict(summary_type="attn"), "summary_type"),
                                         (dict(summary_proj_to_labels=True), "summary_proj_to_labels")])
def test_options_lmkit_does_not_reproduce_are_refused_by_name(tmp_path, change, word):
    _hf("bi").save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=word):
        lmkit.load_model(tmp_path)


@pytest.mark.parametrize("kind", ["bi", "uni-same", "bi-reuse"])
@pytest.mark.parametrize("use_mems", [True, False])
@pytest.mark.parametrize("beams", [1, 3])
def test_generate_equals_transformers(tmp_path, kind, use_mems, beams):
    ref = _hf(kind, seed=7)
    ref.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    # transformers' "uni" XLNet fails on a batch of more than one row with a perm_mask (which generate passes)
    rows = 1 if ref.config.attn_type == "uni" else 2
    if rows * beams > 1 and ref.config.attn_type == "uni":
        pytest.skip("transformers' uni XLNet cannot generate a batch of more than one row (beams included)")
    ids = torch.randint(1, ref.config.vocab_size, (rows, 5), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=9, do_sample=False, num_beams=beams, use_mems=use_mems, eos_token_id=None,
                    pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(ids, **settings)
    got = ours.generate(ids, **settings)
    assert torch.equal(got, want)


def test_uni_generates_a_batch_as_each_row_alone(tmp_path):
    """transformers cannot run this case (above); each row of a batch decodes as it does alone."""
    ref = _hf("uni-same", seed=7)
    ref.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    ids = torch.randint(1, ref.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(5))
    for use_mems in (True, False):
        batch = ours.generate(ids, max_new_tokens=6, use_mems=use_mems, eos_token_id=None, pad_token_id=0)
        for row in range(3):
            alone = ours.generate(ids[row:row + 1], max_new_tokens=6, use_mems=use_mems, eos_token_id=None,
                                  pad_token_id=0)
            assert torch.equal(batch[row:row + 1], alone)
            with torch.no_grad():
                assert torch.equal(alone, ref.generate(ids[row:row + 1], max_new_tokens=6, use_mems=use_mems,
                                                       eos_token_id=None, pad_token_id=0))


def test_classifier_from_a_pretrained_xlnet_keeps_its_body_and_saves_for_transformers(tmp_path):
    from lmkit.finetune.classify import classifier_from_pretrained, reads_last_position

    ref = _hf("bi-clamp")
    ref.save_pretrained(tmp_path / "lm")
    model = classifier_from_pretrained(tmp_path / "lm", 3, id2label={"0": "a", "1": "b", "2": "c"}).eval()
    assert model.head == "sequence" and reads_last_position(model)
    ids = _inputs(ref.config.vocab_size)[0]
    with torch.no_grad():
        _close(model(ids).last_hidden_state, ref.transformer(ids).last_hidden_state)
    model.save_pretrained(tmp_path / "cls")
    back = transformers.XLNetForSequenceClassification.from_pretrained(tmp_path / "cls").eval()
    assert back.config.id2label == {0: "a", 1: "b", 2: "c"}
    with torch.no_grad():
        _close(back(ids).logits, model(ids).logits)
    mean = classifier_from_pretrained(tmp_path / "lm", 2, pooling="mean")
    assert not reads_last_position(mean) and mean.sequence_summary.kind == "mean"


@pytest.mark.parametrize("cls", [transformers.XLNetForTokenClassification, transformers.XLNetForQuestionAnsweringSimple])
@torch.no_grad()
def test_uni_xlnet_heads_load(tmp_path, cls):
    """A causal ("uni") XLNet's heads load too (their tensor names are those of decoder task heads lmkit refuses)."""
    ref = _hf("uni-same", cls, num_labels=4 if cls is transformers.XLNetForTokenClassification else 2)
    ref.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    ids = _inputs(ref.config.vocab_size)[0]
    r, o = ref(ids), ours(ids)
    _close(o.start_logits if o.start_logits is not None else o.logits,
           r.start_logits if hasattr(r, "start_logits") else r.logits)
