"""`lmkit serve` on T5 and BART folders: served through the engine, the openai SDK's completions (greedy over a
list of prompts of different lengths, seeded, streamed, with logprobs) equal `generate` on each source alone."""
import pytest
import torch

import lmkit

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")
from serving_folders import RunningServer, make_seq2seq_folder  # noqa: E402


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_encoder_decoder_folder_is_served_by_the_engine(tmp_path, family, mode):
    folder = make_seq2seq_folder(tmp_path / family, family)
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    eos = model.config.eos_token_id

    def generated(source, seed=None, **settings):
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(torch.tensor([tok.encode(source)]), return_dict_in_generate=True, output_logits=True,
                             **settings)
        ids = out.sequences[0, 1:].tolist()  # after the decoder start token
        ids = ids[:ids.index(eos) + 1] if eos in ids else ids
        logprobs = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, ids)]
        return tok.decode([t for t in ids if t != eos]), logprobs

    prompts = ["hello world, this is a small test", "def f(x):", "The quick brown fox jumps over the lazy dog."]
    with RunningServer(folder, max_concurrency=2, prefill_chunk=8, engine_process=mode == "process") as server:
        from lmkit.generation.engine import Engine

        assert mode == "process" or (isinstance(server.state.engine, Engine)
                                     and server.state.engine.seq2seq is not None)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        greedy = client.completions.create(model="m", prompt=prompts, max_tokens=10, temperature=0, logprobs=0)
        seeded = client.completions.create(model="m", prompt=prompts[2], max_tokens=10, temperature=0.9, seed=3)
        stream = client.completions.create(model="m", prompt=prompts[1], max_tokens=10, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        with pytest.raises(openai.BadRequestError, match="source"):
            client.completions.create(model="m", prompt=prompts[0], max_tokens=3, echo=True, logprobs=0)
    for choice in greedy.choices:
        text, logprobs = generated(prompts[choice.index], max_new_tokens=10)
        assert choice.text == text
        assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert len({c.text for c in greedy.choices}) > 1  # the sources really steer the decoder
    text, _ = generated(prompts[2], seed=3, max_new_tokens=10, do_sample=True, temperature=0.9, top_k=0)
    assert seeded.choices[0].text == text
    assert streamed == greedy.choices[1].text
