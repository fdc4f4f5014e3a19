"""generate_until and chat rendering for the lm-eval model class (`lmkit.evaluate.harness`), as HFLM does them:
requests grouped by their generation settings, longest prompt first, prompts left-padded and left-truncated to
leave room for max_gen_toks, each continuation decoded without special tokens and cut before the first stop."""
from __future__ import annotations

import json

import torch
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from lmkit.errors import GenerationError, TokenizerError
from lmkit.generation.prompt_lookup import Speculation, accepted, speculates
from lmkit.nn import KVCache

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _encode_prompts(lm, contexts: list[str], left_truncate_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask; special tokens as HFLM's tok_batch_encode adds them (none when the first
    prompt already begins with the BOS text, for a decoder)."""
    tok = lm.tokenizer
    special = True
    if lm.backend == "causal":
        bos = tok.decode([tok.bos_token_id]) if tok.bos_token_id is not None else None
        if bos and contexts[0].startswith(bos):
            special = False
        elif lm.add_bos_token is not None:
            special = bool(lm.add_bos_token)
    rows = [tok.encode(c, add_special_tokens=special)[-left_truncate_len:] for c in contexts]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids.to(lm.device), mask.to(lm.device)


def _pad_id(tok) -> int:
    """HFLM's configure_pad_token: the pad token, else unk, else eos."""
    for tid in (tok.pad_token_id, tok.unk_token_id, tok.eos_token_id):
        if tid is not None:
            return tid
    return 0


def _eos_ids(model) -> list[int]:
    """The ids generation stops a row at: the folder's generation config's, else the model config's."""
    value = getattr(model, "generation_defaults", {}).get("eos_token_id", model.config.eos_token_id)
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def prefill_unpadded(model, state, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token logits (B, V) after left-padded prompts, with the KV cache `state` then decodes from, computed
    without the padding: the prompts of each length are read together, unpadded, and their keys and values are
    placed right-aligned in one cache whose padding columns the mask hides. Every real token sees what it sees
    in the padded forward (the same keys, at the same positions), and no column is spent on padding."""
    lengths = mask.sum(-1)
    width = ids.shape[1]
    if bool((lengths == width).all()):
        return model._generation_logits(state, ids)
    logits = None
    cache = state.cache
    for length in sorted(set(lengths.tolist())):
        rows = (lengths == length).nonzero()[:, 0]
        part = KVCache()
        out = model(ids[rows, width - length:], past_key_values=part, use_cache=True, logits_to_keep=1).logits[:, -1]
        if logits is None:
            logits = out.new_empty(ids.shape[0], out.shape[-1])
        logits[rows] = out
        for layer in part.keys:
            if layer not in cache.keys:  # room for the decoding steps too, so the buffers need not grow
                k, v = part.keys[layer], part.values[layer]
                cache.keys[layer] = k.new_zeros(ids.shape[0], k.shape[1], 2 * width, k.shape[3])
                cache.values[layer] = v.new_zeros(ids.shape[0], v.shape[1], 2 * width, v.shape[3])
                cache.lengths[layer] = width
            cache.keys[layer][rows, :, width - length:width] = part.keys[layer][:, :, :length]
            cache.values[layer][rows, :, width - length:width] = part.values[layer][:, :, :length]
    # what GenerationMixin._generation_logits keeps after a padded prompt: the mask, and each row's last position
    state.attention_mask = mask
    state.extra["padded"] = True
    state.extra["position"] = (lengths - 1)[:, None]
    return logits


def _stopped(tok, row: list[int], start: int, looks: dict[int, list[str]]) -> bool:
    """Whether a stop string shows in the text of the row's last n columns (none before `start`), for each
    look-back n: one decode per n, however many stops share it."""
    for n, group in looks.items():
        text = tok.decode(row[max(start, len(row) - n):])
        if any(s in text for s in group):
            return True
    return False


class _Rows:
    """Each row's new tokens under HFLM's rules, one step at a time: after EOS a row pads; a row is done once a
    stop string shows in the decoded text of its last len(stop ids) + 2 columns (none before the prompt's end);
    the batch ends at the first step where every row has finished, or every row is done, or at max_new."""

    def __init__(self, tok, start: torch.Tensor, width: int, eos: set[int], looks: dict[int, list[str]], pad: int,
                 max_new: int):
        self.tok, self.eos, self.looks, self.pad, self.max_new = tok, eos, looks, pad, max_new
        self.width = width  # HFLM looks back from this column of the output: the prompt's width (T5's too)
        self.out = start.tolist()  # each row's output columns (prompt, or decoder start), to look back over
        self.new: list[list[int]] = [[] for _ in self.out]
        self.finished_at: list[int | None] = [None] * len(self.out)
        self.done_at: list[int | None] = [None] * len(self.out)
        self.checked = -1  # steps whose end test has run
        self.end: int | None = None  # the batch's last step, once known

    def push(self, r: int, token: int) -> None:
        step = len(self.new[r])
        if self.finished_at[r] is not None:
            token = self.pad
        self.new[r].append(token)
        if self.finished_at[r] is None and token in self.eos:
            self.finished_at[r] = step
        if self.looks and self.done_at[r] is None:
            row = self.out[r]
            row.append(token)
            if _stopped(self.tok, row, self.width, self.looks):
                self.done_at[r] = step

    def settle(self) -> bool:
        """Runs the end test over the steps every row has reached; whether the batch's end is known."""
        for step in range(self.checked + 1, min(len(n) for n in self.new)):
            self.checked = step
            if all(f is not None and f <= step for f in self.finished_at) or step == self.max_new - 1 or \
                    (self.looks and all(d is not None and d <= step for d in self.done_at)):
                self.end = step
                break
        return self.end is not None

    def columns(self) -> torch.Tensor:
        return torch.tensor([n[:self.end + 1] for n in self.new], dtype=torch.long)


@torch.inference_mode()
def greedy_until(lm, ids: torch.Tensor, mask: torch.Tensor, max_new: int, until: list[str], pad: int) -> torch.Tensor:
    """Greedy decoding with HFLM's stopping rule (`_Rows`), so that the same tokens come out. Returns prompt +
    continuation for a decoder and decoder start + continuation for an encoder-decoder, as generate does.
    A decoder decodes with prompt-lookup speculation (`speculates`), which keeps greedy's tokens."""
    model, tok = lm.model, lm.tokenizer
    looks: dict[int, list[str]] = {}  # columns looked back over -> the stop strings looked for in them
    for s in until:
        looks.setdefault(len(tok.encode(s, add_special_tokens=False)) + 2, []).append(s)
    sequences, state = model._generation_start(ids, mask)
    if max_new < 1:  # nothing to generate (max_gen_toks 0)
        return sequences
    rows = _Rows(tok, sequences, ids.shape[1], set(_eos_ids(model)), looks, pad, max_new)
    if lm.backend == "causal" and speculates(model.config):
        logits = prefill_unpadded(model, state, ids, mask)
        _speculate(model, state, rows, ids, logits.argmax(-1).tolist())
    else:
        tokens = sequences
        while not rows.settle():
            if lm.backend == "causal" and tokens is sequences:
                logits = prefill_unpadded(model, state, ids, mask)
            else:
                logits = model._generation_logits(state, tokens)
            nxt = logits.argmax(-1).tolist()
            for r, t in enumerate(nxt):
                rows.push(r, t)
            tokens = torch.tensor([[n[-1]] for n in rows.new], dtype=torch.long, device=ids.device)
    return torch.cat([sequences, rows.columns().to(sequences.device)], dim=1)


def _speculate(model, state, rows: _Rows, ids: torch.Tensor, first: list[int]) -> None:
    """Greedy steps after the prompt with prompt-lookup drafts (`Speculation`), until the batch's end is known."""
    spec = Speculation(model, state, ids, first, rows.pad)
    for r, t in enumerate(first):
        rows.push(r, t)
    while not rows.settle():
        # rows past max_new or finished need nothing more from the model: finished ones pad, the others wait
        wanted = [rows.finished_at[r] is None and len(n) < rows.max_new for r, n in enumerate(rows.new)]
        choices = spec.step(wanted, [rows.max_new - len(n) for n in rows.new]).argmax(-1).tolist()
        kept = [c[:accepted(d, c)] if w else [] for d, c, w in zip(spec.drafts, choices, wanted)]
        spec.keep(kept)
        for r, tokens in enumerate(kept):
            for t in tokens:
                rows.push(r, t)
        longest = max(len(n) for n in rows.new)
        for r in range(len(rows.new)):  # finished rows pad without the model
            while rows.finished_at[r] is not None and len(rows.new[r]) < longest:
                rows.push(r, rows.pad)


def generate_batches(lm, requests) -> list[str]:
    """One string per request, in request order."""
    args = [req.args for req in requests]
    groups: dict[str, list[int]] = {}
    for i, (_, gen_kwargs) in enumerate(args):
        if not isinstance(gen_kwargs, dict):
            raise GenerationError(f"generation settings must be a dict, got {type(gen_kwargs).__name__}")
        groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
    eos_text = lm.tok_decode(lm.eot_token_id, skip_special_tokens=False)
    pad = _pad_id(lm.tokenizer)
    results: list[str | None] = [None] * len(args)
    for members in groups.values():
        lengths = {i: len(lm.tok_encode(args[i][0])) for i in members}
        members = sorted(members, key=lambda i: (-lengths[i], args[i][0]))
        kwargs = normalize_gen_kwargs(args[members[0]][1], lm.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_gen = int(kwargs.pop("max_gen_toks"))
        do_sample = bool(kwargs.get("do_sample"))
        sampling = {k: kwargs[k] for k in SAMPLING_KEYS if do_sample and kwargs.get(k) is not None}
        if lm.backend == "causal":
            max_ctx = lm.max_length - max_gen
            if max_ctx <= 0:
                raise GenerationError(f"max_gen_toks ({max_gen}) must be below the model's context ({lm.max_length})")
        else:
            max_ctx = lm.max_length
        for start in range(0, len(members), lm.batch_size):
            batch = members[start:start + lm.batch_size]
            contexts = [args[i][0] for i in batch]
            ids, mask = _encode_prompts(lm, contexts, max_ctx)
            # HFLM asks for max_length = prompt columns + max_gen_toks; an encoder-decoder counts that on the
            # decoder's side, start token included
            new = max_gen if lm.backend == "causal" else ids.shape[1] + max_gen - 1
            if do_sample:
                out = lm.model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=True, pad_token_id=pad,
                                        stop_strings=until, tokenizer=lm.tokenizer, **sampling)
            else:
                out = greedy_until(lm, ids, mask, new, until, pad)
            for i, row in zip(batch, out.tolist()):
                row = row[ids.shape[1]:] if lm.backend == "causal" else row
                text = lm.tok_decode(row, skip_special_tokens=True)
                results[i] = postprocess_generated_text(text, until, None)
                lm.cache_hook.add_partial("generate_until", args[i], results[i])
    return results


def render_chat(lm, chat_history: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The folder's chat template as text; a template that refuses the system role is retried without it, as
    HFLM retries."""
    import jinja2

    apply = getattr(lm.tokenizer, "apply_chat_template", None)
    if apply is None or getattr(lm.tokenizer, "chat_template", None) is None:
        raise TokenizerError(f"{lm.folder} has no chat template; run without --apply-chat-template, or use a folder "
                             "whose tokenizer_config.json (or chat_template.jinja) holds one")
    options = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                   continue_final_message=not add_generation_prompt, **lm.chat_template_args)
    try:
        return apply(chat_history, **options)
    except jinja2.exceptions.TemplateError:
        return apply([m for m in chat_history if m["role"] != "system"], **options)
