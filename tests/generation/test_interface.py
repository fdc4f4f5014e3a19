"""The models' public decoding interface (generation/interface.py): every decoding loop reaches the model through
it, so a model that changes its logits hooks changes what greedy decoding, sampling, beam search, prompt lookup and
the harness produce."""
from types import SimpleNamespace

import torch

from lmkit import CausalLM, get_preset
from lmkit.evaluate import harness_generate
from lmkit.generation import DecodingInterface


class Banned(CausalLM):
    """A model whose next-token logits never allow token `banned`, by its two logits hooks alone (one step, and
    prompt lookup's check of drafted tokens)."""

    banned = 0

    def generation_logits(self, state, tokens):
        logits = super().generation_logits(state, tokens).clone()
        logits[:, self.banned] = -float("inf")
        return logits

    def draft_logits(self, state, fed, used):
        logits = super().draft_logits(state, fed, used).clone()
        logits[..., self.banned] = -float("inf")
        return logits


@torch.inference_mode()
def test_every_loop_calls_the_models_generation_logits():
    torch.manual_seed(0)
    config = get_preset("llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=30, max_seq_len=96)
    plain = CausalLM(config).eval()
    prompts = torch.tensor([[0, 0, 5, 6, 7, 5, 6, 7], [4, 9, 4, 9, 4, 9, 4, 9]])
    mask = (torch.arange(8) >= torch.tensor([[2], [0]])).long()
    runs = [dict(), dict(do_sample=True, top_k=0), dict(num_beams=3), dict(prompt_lookup_num_tokens=4)]
    free = [plain.generate(prompts, attention_mask=mask, max_new_tokens=16, eos_token_id=[], **r) for r in runs]
    # the token the plain model chooses most, which the hooked one must then never choose
    new = torch.cat([f[:, 8:].reshape(-1) for f in free])
    Banned.banned = int(new.bincount().argmax())
    banned = Banned(config).eval()
    banned.load_state_dict(plain.state_dict())
    assert isinstance(banned, DecodingInterface)
    for run, before in zip(runs, free):
        torch.manual_seed(0)
        after = banned.generate(prompts, attention_mask=mask, max_new_tokens=16, eos_token_id=[], **run)
        assert Banned.banned not in after[:, 8:].reshape(-1).tolist(), run
    assert any(Banned.banned in f[:, 8:].reshape(-1).tolist() for f in free)
    tok = SimpleNamespace(encode=lambda s, add_special_tokens=False: [1] * len(s), decode=lambda ids: "")
    banned.generation_defaults = {"eos_token_id": []}
    lm = SimpleNamespace(model=banned, tokenizer=tok, backend="causal")
    out = harness_generate.generate_rows(lm, prompts, mask, 16, ["\n"], pad=0)
    assert Banned.banned not in out[:, 8:].reshape(-1).tolist()
