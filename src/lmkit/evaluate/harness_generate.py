"""generate_until and chat rendering for the lm-eval model class (`lmkit.evaluate.harness`), as HFLM does them:
requests grouped by their generation settings, longest prompt first, prompts left-padded and left-truncated to
leave room for max_gen_toks, decoded by `model.generate` with lm-eval's stop rule, each continuation decoded
without special tokens and cut before the first stop."""
from __future__ import annotations

import json

import torch
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from lmkit.errors import GenerationError, TokenizerError
from lmkit.generation.prompt_lookup import MAX_DRAFT, speculates
from lmkit.generation.stopping import StopWindow
from lmkit.progress import progress_bar

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


def generate_rows(lm, ids: torch.Tensor, mask: torch.Tensor, max_new: int, until: list[str], pad: int,
                  sampling: dict | None = None) -> torch.Tensor:
    """HFLM's `generate` call through lmkit's decoding core: its stop rule (lm-eval's MultiTokenEOSCriteria, a
    `StopWindow` looking back from the prompt's width, T5's too) beside the EOS ids, so that the same tokens come
    out. A decoder reads the prompts without their padding, and greedy decoding there drafts with prompt lookup
    (`speculates`), which keeps greedy's tokens.
    Returns prompt + continuation for a decoder and decoder start + continuation for an encoder-decoder."""
    model, sampling = lm.model, sampling or {}
    if max_new < 1:  # nothing to generate (max_gen_toks 0)
        return model.prepare_generation(ids, mask)[0]
    extra = {}
    if lm.backend == "causal" and model.config.position != "xl":  # a KV-cached decoder
        extra["prefill_unpadded"] = True
    if lm.backend == "causal" and speculates(model.config) and not sampling.get("do_sample"):
        extra.update(prompt_lookup_num_tokens=MAX_DRAFT, max_matching_ngram_size=3)
    stop = StopWindow(lm.tokenizer, until, ids.shape[1]) if until else None
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=pad,
                          stopping_criteria=[stop] if stop else None, **extra, **sampling)


def generate_batches(lm, requests, disable_tqdm: bool = False) -> list[str]:
    """One string per request, in request order; a bar over the requests (stderr, on a terminal only) moves once
    per batch."""
    args = [req.args for req in requests]
    groups: dict[str, list[int]] = {}
    for i, (_, gen_kwargs) in enumerate(args):
        if not isinstance(gen_kwargs, dict):
            raise GenerationError(f"generation settings must be a dict, got {type(gen_kwargs).__name__}")
        groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
    eos_text = lm.tok_decode(lm.eot_token_id, skip_special_tokens=False)
    pad = _pad_id(lm.tokenizer)
    results: list[str | None] = [None] * len(args)
    with progress_bar(not disable_tqdm, total=len(args), desc="generate_until", unit="request",
                      dynamic_ncols=True) as bar:  # stderr, on a terminal only
        for members in groups.values():
            lengths = {i: len(lm.tok_encode(args[i][0])) for i in members}
            members = sorted(members, key=lambda i: (-lengths[i], args[i][0]))
            kwargs = normalize_gen_kwargs(args[members[0]][1], lm.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen = int(kwargs.pop("max_gen_toks"))
            do_sample = bool(kwargs.get("do_sample"))
            sampling = {k: kwargs[k] for k in SAMPLING_KEYS if do_sample and kwargs.get(k) is not None}
            sampling["do_sample"] = do_sample
            if lm.backend == "causal":
                max_ctx = lm.max_length - max_gen
                if max_ctx <= 0:
                    raise GenerationError(f"max_gen_toks ({max_gen}) must be below the model's context "
                                          f"({lm.max_length})")
            else:
                max_ctx = lm.max_length
            for start in range(0, len(members), lm.batch_size):
                batch = members[start:start + lm.batch_size]
                contexts = [args[i][0] for i in batch]
                ids, mask = _encode_prompts(lm, contexts, max_ctx)
                # HFLM asks for max_length = prompt columns + max_gen_toks; an encoder-decoder counts that on the
                # decoder's side, start token included
                new = max_gen if lm.backend == "causal" else ids.shape[1] + max_gen - 1
                out = generate_rows(lm, ids, mask, new, until, pad, sampling)
                for i, row in zip(batch, out.tolist()):
                    row = row[ids.shape[1]:] if lm.backend == "causal" else row
                    text = lm.tok_decode(row, skip_special_tokens=True)
                    results[i] = postprocess_generated_text(text, until, None)
                    lm.cache_hook.add_partial("generate_until", args[i], results[i])
                bar.update(len(batch))
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
