"""A conversation with a causal LM through its chat template: history kept within the model's context.

    session = ChatSession(model, tok, system="Be brief.", max_new_tokens=128)
    reply = session.send("What does json.dumps do?", streamer=None)   # the assistant's text, added to the history

Before each reply the conversation is rendered with add_generation_prompt; when prompt + max_new_tokens would pass
the model's positions, the oldest exchanges (a user turn and what follows it, the system prompt kept) are dropped
and `dropped` counts them. The reply decodes through the serving `Engine` (one slot, the whole prompt in one
prefill chunk, a prefix cache of one context, so that a turn reuses the keys and values of the conversation before
it), token by token to the streamer, and stops at every end token the model declares (`end_ids`). The sampling
defaults of every chat surface (this, the chat page, the API) are the folder's generation_config.json values, which
`finetune --task sft` writes as CHAT_SAMPLING.
"""
from __future__ import annotations

import torch

from lmkit.device import place
from lmkit.errors import GenerationError
from lmkit.generation.config import GenerationConfig
from lmkit.generation.engine import Engine, Request
from lmkit.generation.prefix_cache import token_bytes

# the sampling `finetune --task sft` writes into generation_config.json, so that every chat surface reads the same
CHAT_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
# generation_config.json keys that set a chat surface's sampling default when a request or flag leaves them unset
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
DEFAULT_REPLY_TOKENS = 256

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>", "<|eot|>")


def stop_ids(tok) -> list[int]:
    """EOS and the end-of-turn tokens the chat template writes (as added tokens of the tokenizer)."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    template = tok.chat_template if isinstance(tok.chat_template, str) else str((tok.chat_template or {}).get("default", ""))
    for t in END_OF_TURN:
        tid = tok.token_to_id(t)
        if t in template and tid is not None and tid in tok.added.by_id and tid not in ids:
            ids.append(tid)
    return ids


def end_ids(model, tok) -> list[int]:
    """Every id a reply stops at, as transformers and vLLM stop: generation_config.json's eos_token_id (an id or a
    list), the model config's, the tokenizer's EOS and the chat template's end-of-turn token."""
    ids: list[int] = []
    for value in (getattr(model, "generation_defaults", {}).get("eos_token_id"), model.config.eos_token_id):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    ids += [i for i in stop_ids(tok) if i not in ids]
    return ids


def chat_generation_defaults(model, tok) -> dict:
    """The generation_config.json of a chat-tuned folder: the model's own settings, the one chat sampling
    (`CHAT_SAMPLING`) and every end id (`end_ids`), so that each chat surface stops at the turn's end and samples alike."""
    defaults = {**(getattr(model, "generation_defaults", {}) or {}), **CHAT_SAMPLING}
    ends = end_ids(model, tok)
    if ends:
        defaults["eos_token_id"] = ends if len(ends) > 1 else ends[0]
    return defaults


def sampling_defaults(model) -> dict:
    """The folder's generation_config.json sampling values (SAMPLING_KEYS), as vLLM's `--generation-config auto`
    reads them; a file that says do_sample false means greedy, as transformers reads it: temperature 0."""
    defaults = getattr(model, "generation_defaults", {}) or {}
    out = {k: defaults[k] for k in SAMPLING_KEYS if defaults.get(k) is not None}
    if defaults.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def reply_room(context: int, default: int = DEFAULT_REPLY_TOKENS) -> int:
    """The default reply length within a context of `context` positions: `default`, at most half the context (the
    other half holds the conversation)."""
    return max(1, min(default, context // 2))


class ChatSession:
    def __init__(self, model, tok, system: str | None = None, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 device: str | torch.device | None = None):
        """Unset settings: max_new_tokens `reply_room(context)`, sampling the folder's `sampling_defaults`
        (else temperature 1, as generate's); the model is moved to `device` when given ("auto", "cpu", "cuda[:N]",
        "mps")."""
        if tok.chat_template is None:
            raise GenerationError("this model's tokenizer has no chat template; fine-tune it with `lmkit finetune "
                                  "--task sft --chat-template chatml`, or add a chat_template.jinja to the folder")
        if model.config.architecture != "decoder":
            raise GenerationError("lmkit chat talks to causal language models (decoder-only)")
        self.model, self.tok, self.system = place(model, device), tok, system
        self.context = model.config.max_seq_len
        folder = sampling_defaults(model)
        self.temperature = temperature if temperature is not None else folder.get("temperature", 1.0)
        self.top_p = top_p if top_p is not None else folder.get("top_p")
        self.top_k = top_k if top_k is not None else folder.get("top_k")
        self.max_new_tokens = reply_room(self.context) if max_new_tokens is None else max_new_tokens
        self.stops = end_ids(model, tok)
        self.engine: Engine | None = None  # made at the first reply, with the model as it is then
        if self.max_new_tokens >= self.context:
            raise GenerationError(f"--max-new-tokens {self.max_new_tokens} leaves no room for the conversation: the "
                                  f"model has {self.context} positions; use at most {self.context - 1} (the default, "
                                  f"{reply_room(self.context)}, leaves half of them to the conversation)")
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.dropped = 0

    def _prompt(self) -> list[int]:
        return self.tok.apply_chat_template(self.messages, add_generation_prompt=True, return_dict=False)

    def fit(self) -> list[int]:
        """Ids of the conversation with a generation prompt, the oldest exchanges dropped until the reply fits."""
        first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        alone = self.tok.apply_chat_template(self.messages[:first] + self.messages[-1:], add_generation_prompt=True,
                                             return_dict=False)
        if len(alone) + self.max_new_tokens > self.context:  # refused before any history is given up for it
            self.messages.pop()
            raise GenerationError(f"the message takes {len(alone)} of the model's {self.context} positions and the "
                                  f"reply {self.max_new_tokens} more; send a shorter one or lower --max-new-tokens")
        ids = self._prompt()
        while len(ids) + self.max_new_tokens > self.context:
            users = [i for i, m in enumerate(self.messages) if m["role"] == "user" and i >= first]
            del self.messages[first:users[1]]  # the oldest user turn and the replies after it
            self.dropped += 1
            ids = self._prompt()
        return ids

    def send(self, text: str, streamer=None, on_drop=None) -> str:
        """Add the user's message, generate the reply (streamed to `streamer`), add it to the history and return it;
        on_drop(n) is called first when n old exchanges had to go. A KeyboardInterrupt during generation keeps what
        was streamed so far as the reply, then re-raises."""
        self.messages.append({"role": "user", "content": text})
        before = self.dropped
        ids = self.fit()
        if on_drop is not None and self.dropped > before:
            on_drop(self.dropped - before)
        sampling = bool(self.temperature)
        config = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=sampling,
                                  temperature=self.temperature or 1.0, top_p=self.top_p if sampling else None,
                                  top_k=self.top_k if sampling else None, eos_token_id=self.stops or None,
                                  pad_token_id=self.stops[0] if self.stops else None)
        request, sent = Request(prompt=ids, config=config), 0
        try:
            engine = self._engine()
            engine.submit(request)  # bad settings raise here, before the streamer shows anything
            if streamer is not None:
                streamer.put(torch.tensor([ids]))
            while not request.finished:
                engine.step()
                if streamer is not None:
                    for token in request.output[sent:]:
                        streamer.put(torch.tensor([token]))
                sent = len(request.output)
            if streamer is not None:
                streamer.end()
        except BaseException:
            self.engine = None  # a step cut short (Ctrl-C) leaves the engine's state half-written: start anew
            raise
        finally:
            reply = self.tok.decode([i for i in request.output[:sent] if i not in self.stops], skip_special_tokens=True)
            self.messages.append({"role": "assistant", "content": reply})
        return reply

    def _engine(self) -> Engine:
        if self.engine is None:
            self.engine = Engine(self.model, max_batch=1, prefill_chunk=self.context,
                                 cache_memory=token_bytes(self.model) * self.context)
        return self.engine
