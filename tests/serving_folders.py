"""Tiny decoder folders with a byte-level BPE tokenizer (and a chat template) for the serving tests."""
import json

import torch

import lmkit

TEXTS = ["hello world, this is a small test of the serving engine", "def f(x):\n    return x + 1",
         "The quick brown fox jumps over the lazy dog.", "naïve café — 東京 🙂", "stop here STOP there"] * 8

# a ChatML template (as Qwen2 folders ship it), read by the tokenizer's apply_chat_template
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def make_folder(path, family: str = "gpt2", seed: int = 0, chat: bool = True, n_positions: int = 256, width: int = 32,
                fim: bool = False, sliding_window: int = 6):
    """A random tiny `family` ("gpt2", "llama", or "mistral": llama's shape sliding over `sliding_window` positions)
    folder whose vocabulary is the tokenizer's (with `fim`, StarCoder's fill-in-the-middle sentinels in it)."""
    import transformers

    sentinels = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"] if fim else []
    tok = lmkit.train_tokenizer(TEXTS, kind="bpe", vocab_size=300,
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *sentinels])
    vocab = tok.vocab_size
    eos = tok.token_to_id("<|endoftext|>")
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=2, n_head=4, n_positions=n_positions,
                                      bos_token_id=eos, eos_token_id=eos)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        shape = dict(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n_positions,
                     bos_token_id=eos, eos_token_id=eos)
        if family == "mistral":
            model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=sliding_window, **shape))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": n_positions}
    if chat:
        config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def make_seq2seq_folder(path, family: str = "t5", seed: int = 0, width: int = 32):
    """A random tiny `family` ("t5": v1.1, gated, untied; or "bart") encoder-decoder folder whose vocabulary is the
    tokenizer's, EOS its <|endoftext|>."""
    import transformers

    tok = lmkit.train_tokenizer(TEXTS, kind="bpe", vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"])
    eos, pad = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<pad>")
    torch.manual_seed(seed)
    if family == "t5":
        cfg = transformers.T5Config(vocab_size=tok.vocab_size, d_model=width, d_kv=8, d_ff=2 * width, num_layers=2,
                                    num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                                    tie_word_embeddings=False, decoder_start_token_id=pad, pad_token_id=pad,
                                    eos_token_id=eos, dropout_rate=0.0)
        model = transformers.T5ForConditionalGeneration(cfg)
    else:
        cfg = transformers.BartConfig(vocab_size=tok.vocab_size, d_model=width, encoder_layers=2, decoder_layers=2,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * width,
                                      decoder_ffn_dim=2 * width, max_position_embeddings=128, dropout=0.0,
                                      bos_token_id=eos, eos_token_id=eos, pad_token_id=pad,
                                      decoder_start_token_id=eos, forced_eos_token_id=None)
        model = transformers.BartForConditionalGeneration(cfg)
    with torch.no_grad():  # larger weights than the default init, so that outputs differ between sources
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": 128}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_process_config(app, port: int):
    """uvicorn's Config for a server inside the test process. log_config=None: uvicorn's own logging setup runs
    logging.config.dictConfig, which closes every live handler; absl's handler (rouge-score and lm-eval import
    absl) then closes the stream it was made with, which can be pytest's capture file, breaking every later test
    of the worker."""
    import uvicorn

    return uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None)


class RunningServer:
    """`lmkit serve`'s app under uvicorn in a thread of the test, on a free loopback port, ready when entered."""

    def __init__(self, folder, **options):
        from lmkit.serve import build_app

        options.setdefault("model_name", "m")  # the name the tests' requests give
        self.app = build_app(folder, **options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def state(self):
        return self.app.state.server

    def __enter__(self):
        import threading
        import time

        import httpx
        import uvicorn

        self.server = uvicorn.Server(in_process_config(self.app, self.port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the server did not become healthy")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def make_scripted_folder(path, messages: list[dict], reply: str, end: str = "<|endoftext|>", after: str = ""):
    """A GPT-2 folder whose greedy reply to `messages` (through the chat template) is `reply`, the token `end`, then
    `after` and EOS: blocks that add nothing, and an untied head that reads the answer off one-hot position
    embeddings."""
    import transformers

    make_folder(path, "gpt2", n_positions=128, width=64)
    tok = lmkit.load_tokenizer(path)
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    target = tok.encode(reply, add_special_tokens=False) + [tok.token_to_id(end)]
    if after:
        target += tok.encode(after, add_special_tokens=False) + [tok.token_to_id("<|endoftext|>")]
    cfg = transformers.GPT2Config.from_pretrained(path)
    cfg.tie_word_embeddings = False
    model = transformers.GPT2LMHeadModel(cfg)
    width = cfg.n_embd
    assert len(target) <= width, "the reply must fit in n_embd distinct positions"
    with torch.no_grad():
        for block in model.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        model.transformer.wte.weight.mul_(0.01)
        model.transformer.wpe.weight.zero_()
        for p in range(cfg.n_positions):
            model.transformer.wpe.weight[p, p % width] = 5.0
        model.lm_head.weight.zero_()
        for i, token in enumerate(target):
            model.lm_head.weight[token, (len(prompt) - 1 + i) % width] += 10.0
    model.save_pretrained(path)
    return path


def generate_ids(local, ids: list[int], seed: int | None = None, **settings) -> list[int]:
    """The new ids of `generate` on (model, tokenizer) `local` alone, after torch.manual_seed(seed) when given."""
    model, _ = local
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(torch.tensor([ids]), **settings)[0, len(ids):].tolist()


def reply_text(local, ids: list[int]) -> str:
    """The text of new ids as the server returns it (the end token left out)."""
    model, tok = local
    return tok.decode([i for i in ids if i != model.config.eos_token_id])
