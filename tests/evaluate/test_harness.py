"""lm-evaluation-harness parity: lmkit's `lmkit` model against lm-eval's own HFLM on the same folders (random GPT-2,
random LLaMA with grouped-query attention, a briefly trained GPT-2, a random T5), through lmkit's offline tasks:
every request's log-likelihood within 1e-4 and is-greedy equal, every generation and every metric equal."""
from __future__ import annotations

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from helpers.hf_folders import byte_level_bpe, spm_bpe, unigram  # noqa: E402

from lmkit.evaluate import harness_run  # noqa: E402
from lmkit.evaluate.harness import LmkitLM  # noqa: E402
from lmkit.evaluate.harness_tasks import lmkit_tasks  # noqa: E402

TASKS = ["pydoc_mc", "numbers_5shot", "addition_cot_d2", "addition_direct_d3", "addition_cot_zeroshot_d2",
         "pydocs_perplexity"]
LIMIT = 3
GEN = {"max_gen_toks": 20}


def _save(model, tok, out) -> str:
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def gpt2_folder(out, n_positions=256):
    T = transformers
    torch.manual_seed(0)
    tok = T.GPT2TokenizerFast(tokenizer_object=byte_level_bpe(["<|endoftext|>"]), bos_token="<|endoftext|>",
                              eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=len(tok), n_positions=n_positions, n_embd=32, n_layer=2,
                                           n_head=2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    return model, tok


def test_exemplar_texts_are_the_shots_lm_eval_writes():
    """The training texts are the tasks' own few-shot layout as lm-eval renders a shot (its fewshot_config's
    doc_to_text, target delimiter, doc_to_target and the delimiter between shots), exemplar by exemplar:
    addition_cot_d2's (whose shots show the worked steps), then numbers'."""
    from lm_eval.tasks import get_task_dict

    names = ["addition_cot_d2", "numbers"]
    tasks = get_task_dict(names, harness_run.task_manager(names))
    expected = []
    for name in names:
        task, shot = tasks[name], tasks[name].fewshot_cfg
        for doc in task.fewshot_docs():
            expected.append(task.doc_to_text(doc, shot.doc_to_text) + shot.target_delimiter
                            + task.doc_to_target(doc, shot.doc_to_target) + shot.fewshot_delimiter)
    assert lmkit_tasks.exemplar_texts() == expected


def test_zero_shot_cot_prompts_have_the_trigger_and_no_exemplars():
    """Kojima et al.'s zero-shot chain of thought: the question, then "Let's think step by step." opening the
    answer, no exemplar; the answer is read by the same filters as the few-shot CoT task."""
    from lm_eval.tasks import get_task_dict

    names = ["addition_cot_zeroshot_d2", "addition_cot_d2"]
    tasks = get_task_dict(names, harness_run.task_manager(names))
    zero, few = tasks["addition_cot_zeroshot_d2"], tasks["addition_cot_d2"]
    assert zero.config.num_fewshot == 0 and few.config.num_fewshot == 3
    doc = zero.test_docs()[0]
    prompt = zero.fewshot_context(doc, num_fewshot=0)
    assert prompt == f"Question: {doc['question']}\nAnswer: Let's think step by step."
    assert "The answer is" not in prompt and [f["name"] for f in zero.config.filter_list] == \
        [f["name"] for f in few.config.filter_list]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    T = transformers
    out = {}
    model, tok = gpt2_folder(None)
    out["gpt2"] = _save(model, tok, tmp_path_factory.mktemp("gpt2"))
    torch.manual_seed(0)
    ltok = T.LlamaTokenizerFast(tokenizer_object=spm_bpe(), bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                add_bos_token=True)
    llama = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=len(ltok), bos_token_id=1, eos_token_id=2, hidden_size=32,
                                             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=256))
    out["llama"] = _save(llama, ltok, tmp_path_factory.mktemp("llama"))
    # a GPT-2 trained for a few steps on the tasks' own exemplars: greedy continuations that match, generations
    # that stop at a newline and answers that the regexes find
    model, tok = gpt2_folder(None)
    ids = [tok.encode(t) for t in lmkit_tasks.exemplar_texts(n_numbers=60)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(80):
        rows = [ids[i] for i in torch.randint(len(ids), (8,), generator=gen).tolist()]
        width = max(map(len, rows))
        batch = torch.full((len(rows), width), -100)
        for i, r in enumerate(rows):
            batch[i, :len(r)] = torch.tensor(r)
        loss = model(batch.clamp(min=0), labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out["trained"] = _save(model, tok, tmp_path_factory.mktemp("trained"))
    torch.manual_seed(0)
    ttok = T.T5TokenizerFast(tokenizer_object=unigram(["<pad>", "</s>", "<unk>"]), eos_token="</s>",
                             unk_token="<unk>", pad_token="<pad>", extra_ids=10)
    t5 = T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=len(ttok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    out["t5"] = _save(t5, ttok, tmp_path_factory.mktemp("t5"))
    return out


def evaluate(lm, tasks=TASKS, **kw):
    return harness_run.run("", tasks, limit=LIMIT, gen_kwargs=GEN, log_samples=True, lm=lm, **kw)


def assert_same_results(ours, ref):
    assert ours["results"].keys() == ref["results"].keys()
    for task, samples in ref["samples"].items():
        mine = {(s["doc_id"], s["filter"]): s for s in ours["samples"][task]}
        assert len(mine) == len(samples) > 0
        for s in samples:
            m = mine[s["doc_id"], s["filter"]]
            for a, b in zip(m["resps"], s["resps"], strict=True):
                a, b = a[0], b[0]
                if isinstance(b, str):  # a generation
                    assert a == b, (task, s["doc_id"])
                elif isinstance(b, (tuple, list)):  # (log-likelihood, is-greedy)
                    assert abs(a[0] - b[0]) < 1e-4 and bool(a[1]) == bool(b[1]), (task, s["doc_id"], a, b)
                else:  # a document's rolling log-likelihood: a sum over windows of float32 sums (1e-4 per window)
                    assert abs(a - b) < 1e-4 * max(1.0, abs(b) / 100), (task, s["doc_id"], a, b)
            assert m["filtered_resps"] == s["filtered_resps"] or task.startswith(("pydoc_mc", "pydocs_"))
    for task, metrics in ref["results"].items():
        for key, value in metrics.items():
            if "stderr" in key or key == "alias":
                continue
            if key.startswith(("word_perplexity", "byte_perplexity", "bits_per_byte")):
                # sums of float32 log-likelihoods: equal as far as the requests' own float32 sums are
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-6), (task, key)
            else:
                assert ours["results"][task][key] == value, (task, key)


@pytest.mark.parametrize("which", ["gpt2", "llama", "trained", "t5"])
def test_every_request_and_metric_equals_hflm(folders, which):
    from lm_eval.models.huggingface import HFLM

    tasks = TASKS if which != "t5" else [t for t in TASKS if t != "pydocs_perplexity"]
    ref = evaluate(HFLM(pretrained=folders[which], batch_size=4, device="cpu"), tasks)
    ours = evaluate(LmkitLM(pretrained=folders[which], batch_size=4), tasks)
    assert_same_results(ours, ref)
    if which == "trained":  # its greedy continuations are real: requests read from its training text
        from lm_eval.api.instance import Instance

        # one cut per text: HFLM's one-token-continuation cache (logits_cache) mixes up requests that share
        # context + continuation but are cut at different points, and lmkit's does not
        texts = lmkit_tasks.exemplar_texts(n_numbers=60)[:36]
        reqs = [Instance("loglikelihood", {}, (t[:cut], t[cut:]), i) for i, t in enumerate(texts)
                for cut in [(len(t) // 3, len(t) // 2, len(t) - 4, len(t) - 2)[i % 4]]]
        mine = LmkitLM(pretrained=folders[which], batch_size=4).loglikelihood(reqs)
        theirs = HFLM(pretrained=folders[which], batch_size=4, device="cpu").loglikelihood(reqs)
        assert all(abs(a[0] - b[0]) < 1e-4 and a[1] == b[1] for a, b in zip(mine, theirs))
        assert 0 < sum(a[1] for a in mine) < len(mine)


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    model, tok = gpt2_folder(None)
    tok.chat_template = CHATML
    return _save(model, tok, tmp_path_factory.mktemp("chat"))


def test_chat_template_prompts_equal_hflm(chat_folder):
    """Few-shot exemplars as alternating user/assistant turns through the folder's template, a system turn too."""
    from lm_eval.models.huggingface import HFLM

    tasks = ["pydoc_mc", "numbers_1shot", "addition_cot_d1"]
    kw = dict(apply_chat_template=True, fewshot_as_multiturn=True)
    ref = evaluate(HFLM(pretrained=chat_folder, batch_size=4, device="cpu"), tasks, **kw)
    ours = evaluate(LmkitLM(pretrained=chat_folder, batch_size=4), tasks, **kw)
    prompt = ours["samples"]["addition_cot_d1"][0]["arguments"][0][0]
    assert prompt.count("<|im_start|>user") == 4 and prompt.endswith("<|im_start|>assistant\n")
    assert [s["arguments"] for s in ours["samples"]["numbers_1shot"]] == \
        [s["arguments"] for s in ref["samples"]["numbers_1shot"]]
    assert_same_results(ours, ref)


def test_a_folder_without_a_chat_template_is_refused_in_one_line(folders):
    from lmkit.errors import LmkitError

    with pytest.raises(LmkitError, match="no chat template"):
        evaluate(LmkitLM(pretrained=folders["gpt2"]), ["numbers"], apply_chat_template=True)


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_continuations_packed_after_a_shared_context_score_as_alone(folders, which, monkeypatch):
    """Several continuations of one context (different lengths, a repeated one, one-token ones) read in one packed
    sequence give each request the log-likelihood and is-greedy it gets alone in a batch of one."""
    from lm_eval.api.instance import Instance

    texts = lmkit_tasks.exemplar_texts(n_numbers=60)[:6]
    conts = [" 12", " The answer is 42.", " 12", "\n", " (10+5)+(20+7) = 30+12", "é"]
    reqs = [Instance("loglikelihood", {}, (t[:len(t) // 2], c), i)
            for i, (t, c) in enumerate((t, c) for t in texts for c in conts)]
    alone = LmkitLM(pretrained=folders[which], batch_size=1).loglikelihood(reqs)
    packed = []
    lm = LmkitLM(pretrained=folders[which], batch_size=6)
    original = lm._packed_logits
    monkeypatch.setattr(lm, "_packed_logits", lambda *a: packed.append(1) or original(*a))
    batched = lm.loglikelihood(reqs)
    assert packed
    for a, b in zip(batched, alone, strict=True):
        assert abs(a[0] - b[0]) < 1e-4 and a[1] == b[1]


def test_requests_past_the_context_are_cut_as_hflm_cuts_them_and_said_once(folders, capsys):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    texts = lmkit_tasks.exemplar_texts(n_numbers=60)[:6]
    reqs = [Instance("loglikelihood", {}, (t * 3, " 12"), i) for i, t in enumerate(texts)]
    reqs.append(Instance("loglikelihood", {}, ("short", " 12"), len(reqs)))
    ours = LmkitLM(pretrained=folders["gpt2"], batch_size=4, max_length=32)
    mine = ours.loglikelihood(reqs)
    theirs = HFLM(pretrained=folders["gpt2"], batch_size=4, device="cpu", max_length=32).loglikelihood(reqs)
    assert all(abs(a[0] - b[0]) < 1e-4 and a[1] == b[1] for a, b in zip(mine, theirs))  # HFLM's numbers still
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmkit harness")]
    read = [len(ours.tok_encode(t * 3)) + len(ours.tok_encode(" 12")) - 33 for t in texts]
    assert lines == [f"lmkit harness: warning: 6 of 7 loglikelihood requests do not fit the model's 32 positions and "
                     f"lose their first tokens (up to {max(read)}, {sum(read) / 6:.0f} on average), as lm-eval's HFLM "
                     "cuts them; their scores suffer (fewer --num-fewshot shots, or a model with a longer context)"]
    gen = [Instance("generate_until", {}, (texts[0] * 3, {"until": ["\n"], "max_gen_toks": 8}), 0)]
    ours.generate_until(gen)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmkit harness")]
    assert len(lines) == 1 and "1 of 1 generate_until requests" in lines[0]
    assert f"up to {len(ours.tok_encode(texts[0] * 3)) - 24}," in lines[0]
