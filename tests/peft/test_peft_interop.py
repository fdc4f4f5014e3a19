"""Adapters saved by lmkit load in the PEFT library onto the transformers model (and back), same outputs."""
import json

import pytest
import torch

import lmkit
from lmkit.peft import get_peft_model, load_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")



def hf_model(kind: str, tmp_path, seed=0):
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=71, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=71, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        model = transformers.GPT2LMHeadModel(cfg)
    model.eval().save_pretrained(tmp_path / "base")
    return model


def randomize(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


IDS = torch.randint(0, 71, (2, 11), generator=torch.Generator().manual_seed(5))
MASK = torch.tensor([[1] * 11, [0] * 3 + [1] * 8])


@pytest.mark.parametrize("kind,targets", [("llama", ["q_proj", "v_proj", "down_proj"]),
                                          ("gpt2", ["q_proj", "v_proj", "c_fc"]),
                                          ("gpt2", ["c_attn", "attn.c_proj"])])
def test_lmkit_lora_loads_in_peft(tmp_path, kind, targets):
    ref = hf_model(kind, tmp_path)
    ours = get_peft_model(lmkit.load_model(tmp_path / "base"), "lora", r=4, alpha=8, target_modules=targets)
    randomize(ours)
    ours.save_adapter(tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    with torch.no_grad():
        want = theirs(input_ids=IDS, attention_mask=MASK).logits
        got = ours(IDS, attention_mask=MASK).logits
    keep = MASK.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,targets", [("llama", ["q_proj", "k_proj", "gate_proj"]), ("gpt2", ["c_attn", "c_fc"])])
def test_peft_lora_loads_in_lmkit(tmp_path, kind, targets):
    ref = hf_model(kind, tmp_path, seed=1)
    theirs = peft.get_peft_model(ref, peft.LoraConfig(r=3, lora_alpha=5, target_modules=targets,
                                                      fan_in_fan_out=kind == "gpt2"))
    randomize(theirs)
    theirs.save_pretrained(tmp_path / "adapter")
    ours = load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "adapter")
    theirs.eval()
    with torch.no_grad():
        want = theirs(input_ids=IDS).logits
        torch.testing.assert_close(ours(IDS).logits, want, rtol=1e-4, atol=1e-4)


def test_ia3_both_ways(tmp_path):
    ref = hf_model("llama", tmp_path, seed=2)
    ours = get_peft_model(lmkit.load_model(tmp_path / "base"), "ia3")
    randomize(ours)
    assert_loads_both_ways(ours, ref, tmp_path)


def assert_loads_both_ways(ours, ref, tmp_path, ids=IDS):
    """lmkit's adapter, saved, gives PEFT over `ref` the same logits, and reloads into lmkit unchanged."""
    ours.save_adapter(tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    back = load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids).logits, rtol=1e-6, atol=1e-6)


def test_prompt_tuning_matches_peft(tmp_path):
    ref = hf_model("llama", tmp_path, seed=4)
    ours = get_peft_model(lmkit.load_model(tmp_path / "base"), "prompt", num_virtual_tokens=4)
    randomize(ours)
    ours.save_adapter(tmp_path / "prompt")
    theirs = peft.PeftModel.from_pretrained(ref, tmp_path / "prompt").eval()
    with torch.no_grad():
        want = theirs(input_ids=IDS).logits[:, 4:]   # PEFT also returns the virtual positions
        torch.testing.assert_close(ours(IDS).logits, want, rtol=1e-4, atol=1e-4)
    made_there = peft.get_peft_model(hf_model("llama", tmp_path / "again", seed=4),
                                     peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    expected = made_there.peft_config["default"]
    written = json.loads((tmp_path / "prompt" / "adapter_config.json").read_text())
    for key in ("token_dim", "num_transformer_submodules", "num_attention_heads", "num_layers"):
        assert written[key] == getattr(expected, key), key  # the fields PEFT fills in from the model


def _peft_pair(tmp_path, kind, config, seed=1):
    """(lmkit's model with the adapter, PEFT's model): PEFT makes and saves a randomized adapter, lmkit loads it."""
    theirs = peft.get_peft_model(hf_model(kind, tmp_path, seed=seed), config)
    randomize(theirs)
    theirs.save_pretrained(tmp_path / "adapter")
    theirs.eval()
    return load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "adapter"), theirs


def _peft_to_lmkit(tmp_path, kind, config, seed=1):
    ours, theirs = _peft_pair(tmp_path, kind, config, seed)
    with torch.no_grad():
        return ours(IDS).logits, theirs(input_ids=IDS).logits


@pytest.mark.parametrize("kind,config", [
    ("llama", dict(target_modules=["q_proj", "v_proj"], use_rslora=True)),
    ("gpt2", dict(target_modules=["c_attn", "c_proj"], bias="lora_only", fan_in_fan_out=True)),   # fused bias split
    ("gpt2", dict(target_modules=["c_attn"], bias="all", fan_in_fan_out=True)),
    ("llama", dict(target_modules=["q_proj", "v_proj"], rank_pattern={"q_proj|v_proj": 2},
                   alpha_pattern={r"layers\.1\.self_attn\.(q|v)_proj": 3})),   # PEFT's regex keys
])
def test_peft_lora_variants_load_in_lmkit(tmp_path, kind, config):
    got, want = _peft_to_lmkit(tmp_path, kind, peft.LoraConfig(r=4, lora_alpha=8, **config))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config,words", [
    (dict(use_dora=True), "DoRA"), (dict(lora_bias=True), "lora_bias"),
    (dict(trainable_token_indices=[3, 5]), "trainable_token_indices"),
    (dict(layer_replication=[[0, 2], [1, 2]]), "layer_replication"),
    (dict(init_lora_weights="pissa"), "pissa"),
])
def test_peft_lora_settings_lmkit_cannot_reproduce_are_refused(tmp_path, config, words):
    with pytest.raises(lmkit.errors.ConfigError, match=words):
        _peft_to_lmkit(tmp_path, "llama", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **config))


@pytest.mark.parametrize("kind,targets", [("llama", "all-linear"), ("gpt2", "all-linear"), ("gpt2", ["c_attn"])])
def test_lmkit_rslora_and_all_linear_load_in_peft(tmp_path, kind, targets):
    ref = hf_model(kind, tmp_path)
    ours = get_peft_model(lmkit.load_model(tmp_path / "base"), "lora", r=4, alpha=8, target_modules=targets,
                          use_rslora=targets != "all-linear")
    randomize(ours)
    ours.save_adapter(tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, theirs(input_ids=IDS).logits, rtol=1e-4, atol=1e-4)


def _roberta_cls(tmp_path):
    torch.manual_seed(6)
    cfg = transformers.RobertaConfig(vocab_size=71, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, max_position_embeddings=64, num_labels=3, pad_token_id=1)
    model = transformers.RobertaForSequenceClassification(cfg).eval()
    model.save_pretrained(tmp_path / "base")
    return model


@pytest.mark.parametrize("method", ["lora", "prompt"])
def test_lmkit_classifier_adapter_loads_in_peft(tmp_path, method):
    """RoBERTa's head is classifier.dense + classifier.out_proj; prompt tuning names full tensors base_model.X."""
    ref = _roberta_cls(tmp_path)
    settings = dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"]) if method == "lora" else dict(num_virtual_tokens=3)
    ours = get_peft_model(lmkit.load_model(tmp_path / "base"), method, modules_to_save=["classifier"], **settings)
    randomize(ours)
    assert_loads_both_ways(ours, ref, tmp_path, ids=IDS.clamp(min=3))


def test_peft_seq2seq_prompt_with_decoder_tokens_is_refused(tmp_path):
    torch.manual_seed(7)
    ref = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=71, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_heads=4, decoder_start_token_id=0)).eval()
    ref.save_pretrained(tmp_path / "base")
    peft.get_peft_model(ref, peft.PromptTuningConfig(num_virtual_tokens=3, task_type="SEQ_2_SEQ_LM")
                        ).save_pretrained(tmp_path / "adapter")
    with pytest.raises(lmkit.errors.ConfigError, match="num_transformer_submodules"):
        load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "adapter")


@pytest.mark.parametrize("targets", [["c_attn"], "all-linear"])
def test_gpt2_fused_c_attn_is_one_lora_as_in_peft(tmp_path, targets):
    """Targeting GPT-2's fused c_attn adapts it as one rank-r LoRA (q, k, v share A): PEFT's parameter count,
    and the adapter saves at rank r and reloads with A still shared."""
    ref = hf_model("gpt2", tmp_path, seed=4)
    ours = get_peft_model(lmkit.load_model(tmp_path / "base"), "lora", r=4, alpha=8, target_modules=targets)
    theirs = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                      fan_in_fan_out=True))
    trainable, total = theirs.get_nb_trainable_parameters()
    assert (ours.trainable_summary()["trainable"], ours.trainable_summary()["total"]) == (trainable, total)
    randomize(ours)
    ours.save_adapter(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["rank_pattern"] == {}
    back = load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "adapter", trainable=True)
    assert back.trainable_summary() == ours.trainable_summary()
    attn = back.decoder.layers[0].self_attn.sublayer
    assert attn.q_proj.lora_A is attn.k_proj.lora_A is attn.v_proj.lora_A
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, ours(IDS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("direction", ["lmkit->peft", "peft->lmkit"])
def test_tied_lm_head_in_modules_to_save_is_trained_apart_from_the_embedding(tmp_path, direction):
    """PEFT trains a copy of a tied lm_head; lmkit unties it too (it used to leave the head frozen), so the
    adapter carries the head and the input embedding stays as it was."""
    ref = hf_model("gpt2", tmp_path, seed=6)
    if direction == "lmkit->peft":
        ours = get_peft_model(lmkit.load_model(tmp_path / "base"), "lora", r=4, target_modules=["c_attn"],
                              modules_to_save=["lm_head"])
        assert ours.lm_head.weight.requires_grad and not ours.decoder.embeddings.tokens.weight.requires_grad
        theirs = peft.get_peft_model(hf_model("gpt2", tmp_path / "other", seed=6), peft.LoraConfig(
            r=4, target_modules=["c_attn"], fan_in_fan_out=True, modules_to_save=["lm_head"]))
        assert ours.trainable_summary()["trainable"] == theirs.get_nb_trainable_parameters()[0]
        randomize(ours)
        ours.save_adapter(tmp_path / "adapter")
        theirs = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    else:
        theirs = peft.get_peft_model(ref, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                          modules_to_save=["lm_head"]))
        randomize(theirs)
        theirs.save_pretrained(tmp_path / "adapter")
        theirs.eval()
        ours = load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "adapter")
    base = lmkit.load_model(tmp_path / "base")
    torch.testing.assert_close(ours.decoder.embeddings.tokens.weight, base.decoder.embeddings.tokens.weight)
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, theirs(input_ids=IDS).logits, rtol=1e-4, atol=1e-4)
    # merged, the model keeps its trained head apart: the saved folder is untied and loads in transformers as such
    merged = ours.merge_and_unload() if hasattr(ours, "merge_and_unload") else ours
    merged.save_pretrained(tmp_path / "merged")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged").eval()
    assert reloaded.lm_head.weight is not reloaded.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, theirs(input_ids=IDS).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key,value", [("velora_config", {"num_groups": 2}), ("monteclora_config", {"n_samples": 2}),
                                       ("kasa_config", {"beta": 1e-4})])
def test_peft_lora_variants_that_change_the_forward_are_refused(tmp_path, key, value):
    """PEFT 0.21's LoRA variants beyond DoRA (their own forward, or KaSA's truncated base) are refused by name."""
    ref = hf_model("llama", tmp_path)
    peft.get_peft_model(ref, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(lmkit.errors.ConfigError, match=key):
        load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "adapter")


@pytest.mark.parametrize("direction", ["lmkit->peft", "peft->lmkit"])
def test_lora_on_a_tied_lm_head_loads_both_ways_and_merges_apart_from_the_embedding(tmp_path, direction):
    """LoRA on GPT-2's tied lm_head: PEFT saves the head's base weight beside A and B (it used to be refused as a
    tensor this model does not have), lmkit used to drop the head's LoRA when saving. Merged, the update goes
    into the head alone (PEFT's in-place merge also changes the tied input embedding) and the model saves untied."""
    ref = hf_model("gpt2", tmp_path, seed=8)
    targets = ["c_attn", "lm_head"]
    if direction == "lmkit->peft":
        ours = get_peft_model(lmkit.load_model(tmp_path / "base"), "lora", r=4, target_modules=targets)
        randomize(ours)
        ours.save_adapter(tmp_path / "adapter")
        theirs = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    else:
        theirs = peft.get_peft_model(ref, peft.LoraConfig(r=4, target_modules=targets, fan_in_fan_out=True))
        randomize(theirs)
        theirs.save_pretrained(tmp_path / "adapter")
        theirs.eval()
        ours = load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        want = theirs(input_ids=IDS).logits
        torch.testing.assert_close(ours(IDS).logits, want, rtol=1e-4, atol=1e-4)
        ours.merge()                                   # in place: the head gets its own weight first
        torch.testing.assert_close(ours(IDS).logits, want, rtol=1e-4, atol=1e-4)
        ours.unmerge()
        merged = ours.merge_and_unload()
        torch.testing.assert_close(merged(IDS).logits, want, rtol=1e-4, atol=1e-4)
    base = lmkit.load_model(tmp_path / "base")
    torch.testing.assert_close(merged.decoder.embeddings.tokens.weight, base.decoder.embeddings.tokens.weight)
    merged.save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(lmkit.load_model(tmp_path / "merged")(IDS).logits, want, rtol=1e-4, atol=1e-4)


def test_lmkit_prompt_adapter_on_a_bare_or_mlm_encoder_is_applied_by_peft(tmp_path):
    """With no task type PEFT runs a prompt-tuning adapter's base model without the virtual tokens; lmkit
    now writes FEATURE_EXTRACTION for an encoder whose head is not saved, so PEFT puts them in front too."""
    torch.manual_seed(9)
    ref = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=71, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64)).eval()
    ref.save_pretrained(tmp_path / "base")
    ours = get_peft_model(lmkit.load_model(tmp_path / "base"), "prompt", num_virtual_tokens=3)
    randomize(ours)
    ours.save_adapter(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["task_type"] == "FEATURE_EXTRACTION"
    theirs = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    with torch.no_grad():
        want = theirs(input_ids=IDS, attention_mask=MASK).logits[:, 3:]   # PEFT also scores the virtual positions
        got = ours(IDS, attention_mask=MASK).logits
    torch.testing.assert_close(got[MASK.bool()], want[MASK.bool()], rtol=1e-4, atol=1e-4)


def test_peft_ia3_feedforward_by_bare_suffix_loads_in_lmkit(tmp_path):
    """PEFT marks a feed-forward IA3 layer by a bare `endswith` ("_proj" takes in o_proj), and lmkit used to
    re-match feedforward_modules by its own dotted patterns: o_proj (square) then scaled its output, not its input."""
    config = peft.IA3Config(target_modules=["o_proj", "_proj"], feedforward_modules=["_proj"])  # a subset, as PEFT asks
    got, want = _peft_to_lmkit(tmp_path, "llama", config, seed=3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["lora", "prompt"])
def test_adapter_tensors_of_another_model_are_refused_by_shape(tmp_path, method):
    """An adapter made for a model of other sizes used to fail inside torch's copy_ (or, for a fused layer, once
    some parts were replaced); it is refused naming the tensor and the shapes."""
    from safetensors.torch import load_file, save_file

    hf_model("llama", tmp_path)
    settings = dict(r=4, target_modules=["q_proj"]) if method == "lora" else dict(num_virtual_tokens=3)
    get_peft_model(lmkit.load_model(tmp_path / "base"), method, **settings).save_adapter(tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    save_file({k: torch.cat([v, v], dim=1) for k, v in load_file(path).items()}, path)   # twice the inputs / width
    with pytest.raises(lmkit.errors.CheckpointError, match=r"do not fit the layer|prompt_embeddings \(3, 64\) does not fit"):
        load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "adapter")


@pytest.mark.parametrize("kind,targets,bias", [("gpt2", ["c_attn"], "all"), ("gpt2", ["c_attn"], "lora_only"),
                                               ("llama", ["q_proj", "v_proj"], "all")])
def test_lora_bias_trains_and_saves_the_biases_as_peft_does(tmp_path, kind, targets, bias):
    """PEFT's LoRA bias="all" / "lora_only" trains every `.bias` / the adapted layers' biases and saves them. lmkit
    read such adapters but then froze the biases and saved bias="none" without them (a PEFT adapter loaded and
    saved again lost its biases); now `bias` is a setting, with PEFT's trainable count and tensor names."""
    ref = hf_model(kind, tmp_path, seed=5)
    if kind == "llama":   # biases to train
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**ref.config.to_dict(), "attention_bias": True}))
        ref.eval().save_pretrained(tmp_path / "base")
    theirs = peft.get_peft_model(ref, peft.LoraConfig(r=4, target_modules=targets, bias=bias,
                                                      fan_in_fan_out=kind == "gpt2"))
    ours = get_peft_model(lmkit.load_model(tmp_path / "base"), "lora", r=4, target_modules=targets, bias=bias)
    assert ours.trainable_summary()["trainable"] == theirs.get_nb_trainable_parameters()[0]
    randomize(theirs)
    theirs.save_pretrained(tmp_path / "theirs")
    theirs.eval()
    loaded = load_adapter(lmkit.load_model(tmp_path / "base"), tmp_path / "theirs", trainable=True)
    assert loaded.trainable_summary() == ours.trainable_summary()
    loaded.save_adapter(tmp_path / "again")                # PEFT -> lmkit -> PEFT keeps the trained biases
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text())["bias"] == bias
    back = peft.PeftModel.from_pretrained(hf_model(kind, tmp_path / "fresh", seed=5) if kind == "gpt2" else
                                          transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"),
                                          tmp_path / "again").eval()
    with torch.no_grad():
        want = theirs(input_ids=IDS).logits
        torch.testing.assert_close(loaded(IDS).logits, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(back(input_ids=IDS).logits, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(lmkit.errors.ConfigError, match="bias is 'none', 'all' or 'lora_only'"):
        get_peft_model(lmkit.load_model(tmp_path / "base"), "lora", bias="some")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_ia3_merge_and_unload_equals_peft(tmp_path, kind):
    """IA3 folds into the weights as PEFT's merge_and_unload does (diag(l) W and l b for outputs, W diag(l) for a
    feed-forward input); lmkit used to refuse merging IA3. The merged folder loads in transformers."""
    config = (peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
              if kind == "llama" else peft.IA3Config(target_modules=["c_attn", "mlp.c_proj"],
                                                     feedforward_modules=["mlp.c_proj"], fan_in_fan_out=True))
    ours, theirs = _peft_pair(tmp_path, kind, config, seed=2)
    with torch.no_grad():
        unloaded = theirs.merge_and_unload()
        want = unloaded(input_ids=IDS).logits
        merged = ours.merge_and_unload()
        assert not any(isinstance(m, lmkit.peft.IA3Linear) for m in merged.modules())
        torch.testing.assert_close(merged(IDS).logits, want, rtol=1e-4, atol=1e-4)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = type(unloaded).from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, want, rtol=1e-4, atol=1e-4)
