"""lmkit folders inside EleutherAI's lm-evaluation-harness: the model class `lmkit` (import this module to register it).

    import lmkit.evaluate.harness                     # registers model "lmkit" with lm_eval's registry
    lm_eval.simple_evaluate(model="lmkit", model_args={"pretrained": folder}, tasks=[...])

The requests are those of lm-eval's `TemplateLM`: loglikelihood log p(continuation | context) summed over the
continuation's tokens with is-greedy (every continuation token the argmax), rolling log-likelihood over lm-eval's
disjoint windows, and greedy generation until a stop string. Tokenization follows lm-eval's `HFLM` rule for rule
(the same context/continuation split, the prefix token for an empty context, left truncation), so the numbers are
HFLM's. What differs is how the work is batched: requests are sorted so that those sharing a context sit together,
each distinct context is read once (its KV cache, or its encoder output, is copied to every continuation) and
generation runs on lmkit's own decoding loop. Requests longer than the context lose their oldest tokens as HFLM's do,
and each kind of request says so once per call on stderr (how many, and by how much), where HFLM says nothing.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs

import lmkit
from lmkit.device import resolve_device
from lmkit.errors import ConfigError, TokenizerError
from lmkit.evaluate.harness_generate import generate_batches, render_chat
from lmkit.nn import KVCache
from lmkit.progress import progress_bar

def warn_truncated(kind: str, cuts: list[int], total: int, limit: int, out=None) -> None:
    """One line on stderr when some of `total` requests lost cuts[i] > 0 of their first tokens to the context."""
    cuts = [c for c in cuts if c > 0]
    if cuts:
        (out or sys.stderr).write(
            f"lmkit harness: warning: {len(cuts)} of {total} {kind} requests do not fit the model's {limit} positions "
            f"and lose their first tokens (up to {max(cuts)}, {sum(cuts) / len(cuts):.0f} on average), as lm-eval's "
            "HFLM cuts them; their scores suffer (fewer --num-fewshot shots, or a model with a longer context)\n")


DEFAULT_MAX_LENGTH = 2048  # HFLM's when neither config nor tokenizer names a context length
TOKENIZER_INFINITY = 1000000000000000019884624838656  # transformers' "no model_max_length"


def _context_length(folder: Path, model) -> int:
    """HFLM's max_length: config.json's n_positions / max_position_embeddings / n_ctx, else the tokenizer's
    model_max_length, else 2048. An lmkit-native folder names its context in its own config."""
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if "model_type" not in raw:
        return int(model.config.max_seq_len)
    cfg = raw.get("text_config") or raw
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        if cfg.get(key) is not None:
            return int(cfg[key])
    tok_config = folder / "tokenizer_config.json"
    if tok_config.is_file():
        value = json.loads(tok_config.read_text(encoding="utf-8")).get("model_max_length")
        if value is not None and int(value) != TOKENIZER_INFINITY:
            return int(value)
    return DEFAULT_MAX_LENGTH


@register_model("lmkit")
class LmkitLM(TemplateLM):
    """lm-eval model over an lmkit-loadable folder (decoder-only or encoder-decoder)."""

    def __init__(self, pretrained: str, batch_size: int | str = 1, max_length: int | None = None,
                 device: str | None = "cpu", dtype: str | None = None, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, max_gen_toks: int = 256, max_batch_size: int | None = None,
                 **kwargs) -> None:
        super().__init__()

        folder = Path(pretrained)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{pretrained} is not a model folder (no config.json); pass --model DIR of a folder "
                              "that lmkit.load_model reads")
        # device as lm-eval's HFLM takes it ("cuda:0", "cpu", ...), "auto" too; refused before the weights are read
        self._device = resolve_device(device or "cpu", "device=")
        model = lmkit.load_model(folder, dtype=dtype if dtype not in (None, "auto") else None, device=self._device)
        arch = model.config.architecture
        if arch not in ("decoder", "encoder-decoder"):
            raise ConfigError(f"{pretrained} holds an encoder-only model ({arch}); lm-eval scores and generates text, "
                              "which needs a decoder-only or encoder-decoder folder")
        self.model = model.eval()
        self.backend = "causal" if arch == "decoder" else "seq2seq"
        self.tokenizer = lmkit.load_tokenizer(folder)
        if self.tokenizer.eos_token_id is None and self.tokenizer.bos_token_id is None:
            raise ConfigError(f"{pretrained}'s tokenizer names neither an EOS nor a BOS token; lm-eval needs one to "
                              "read an empty context and to stop generation (set eos_token in tokenizer_config.json)")
        self.folder = folder
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_length = int(max_length) if max_length else _context_length(folder, model)
        self._max_gen_toks = int(max_gen_toks)
        if str(batch_size).startswith("auto"):
            batch_size = max_batch_size or 16  # no memory probe on CPU: the largest batch asked for
        self.batch_size = int(batch_size)
        self.pretrained = str(pretrained)
        self.chat_template_args: dict = {}

    # --- what TemplateLM asks for -------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.folder).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """HFLM's rule: special tokens as asked, else as add_bos_token says, else the tokenizer's default; a string
        that already starts with the prefix token's text gets none added."""
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None and string.startswith(self.tokenizer.decode([self.prefix_token_id])):
            special = False
        ids = self.tokenizer.encode(string, add_special_tokens=True if special is None else bool(special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # --- log-likelihoods ----------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's, with its bars (tokenizing, then scoring) drawn on a terminal only: redirected, every
        redraw would land in the file as a line."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not sys.stderr.isatty())

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log p over each string's tokens, read in lm-eval's disjoint windows of max_length (the first
        after the prefix token), each window a loglikelihood request of its own."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _split(self, context: list[int], continuation: list[int]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(shared part, own part, continuation length): the tokens read, left-truncated to max_length as HFLM
        truncates them, cut where the continuation's scoring starts. For a decoder the shared part ends with the
        token that predicts the continuation's first token; for an encoder-decoder it is the encoder's input."""
        if self.backend == "causal":
            read = (context + continuation)[-(self.max_length + 1):][:-1]
            cut = len(read) - len(continuation) + 1
            return tuple(read[:cut]), tuple(read[cut:]), len(continuation)
        return tuple(context[-self.max_length:]), tuple(continuation[-self.max_length:]), len(continuation)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum log p(continuation), is-greedy) per (key, context ids, continuation ids), batch by batch."""
        split = [self._split(ctx, cont) for _, ctx, cont in requests]
        warn_truncated("loglikelihood", [len(ctx) + len(cont) - sum(map(len, part[:2])) - (self.backend == "causal")
                                         for (_, ctx, cont), part in zip(requests, split)], len(requests),
                       self.max_length)
        for (_, ctx, cont), (shared, _, _) in zip(requests, split):
            if not ctx or not cont or not shared:
                raise ValueError("loglikelihood requests need a non-empty context and continuation")
        # longest first; requests with the same shared part next to each other, so a batch reads it once
        order = sorted(range(len(requests)), key=lambda i: (-len(split[i][0]), split[i][0], -len(split[i][1])))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        with progress_bar(not disable_tqdm, total=len(requests), desc="loglikelihood", unit="request",
                          dynamic_ncols=True) as bar:  # stderr, on a terminal only
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                conts = [requests[i][2] for i in batch]
                scored = self._score_batch([split[i] for i in batch], conts)
                for i, answer in zip(batch, scored):
                    results[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(batch))
        return results

    @torch.inference_mode()
    def _score_batch(self, parts, conts) -> list[tuple[float, bool]]:
        """One log-softmax over every scored position of the batch, then per request the sum of log p of its
        continuation's tokens and whether each was the argmax."""
        shared = list(dict.fromkeys(p[0] for p in parts))
        row_of = {s: r for r, s in enumerate(shared)}
        index = [row_of[p[0]] for p in parts]
        if self.backend == "causal":
            logits = self._causal_logits(parts, shared, index)
        else:
            logits = self._seq2seq_logits(parts, shared, index)
        scored = torch.cat([lg[-len(cont):] for lg, cont in zip(logits, conts)]).float()
        target = torch.tensor([t for cont in conts for t in cont], device=self.device)
        logprobs = F.log_softmax(scored, -1).gather(1, target[:, None])[:, 0]
        lengths = [len(c) for c in conts]
        # each request's own float32 sum, reduced as HFLM reduces it (a scatter-add would sum in another order)
        sums = torch.stack([lp.sum() for lp in logprobs.split(lengths)])
        owner = torch.repeat_interleave(torch.arange(len(conts), device=self.device),
                                        torch.tensor(lengths, device=self.device))
        misses = torch.zeros(len(conts), dtype=torch.long, device=self.device).index_add_(
            0, owner, (scored.argmax(-1) != target).long())
        return [(float(v), not bool(m)) for v, m in zip(sums.tolist(), misses.tolist())]

    def _causal_logits(self, parts, shared, index) -> list[torch.Tensor]:
        """Logit rows (own length + 1, V) scoring each continuation, by whichever layout computes the fewest token
        columns: one right-padded forward over whole rows; each distinct shared part packed with its rows' own
        tokens in one sequence (`_packed_logits`); or the distinct shared parts read once (left-padded) and each
        row's own tokens going on from a copy of its shared part's KV cache."""
        if all(not p[1] for p in parts):  # one-token continuations: the shared parts' last positions alone
            last = self._read_shared(shared, None)[0]
            return [last[r][None] for r in index]
        own = [list(dict.fromkeys(p[1] for p, r in zip(parts, index) if r == s)) for s in range(len(shared))]
        whole = len(parts) * max(len(p[0]) + len(p[1]) for p in parts)
        packed = len(shared) * max(len(s) + sum(map(len, o)) for s, o in zip(shared, own))
        reused = len(shared) * max(len(s) for s in shared) + len(parts) * max(len(p[1]) for p in parts)
        if whole <= min(packed, reused):
            rows = [list(p[0]) + list(p[1]) for p in parts]
            logits = self.model(self._pad(rows, "right")).logits
            return [logits[r, len(p[0]) - 1:len(rows[r])] for r, p in enumerate(parts)]
        if packed <= reused and self._packable():
            return self._packed_logits(parts, shared, index, own)
        cache = KVCache()
        last, mask, lengths = self._read_shared(shared, cache)
        index = torch.tensor(index, device=self.device)
        cache.reorder(index)
        own_len = max(len(p[1]) for p in parts)
        tails = self._pad([list(p[1]) for p in parts], "right")
        lengths = lengths.index_select(0, index)
        # padding columns after a short row may run past the model's positions; they are never scored
        positions = (lengths[:, None] + torch.arange(own_len, device=self.device)[None]).clamp(
            max=self.model.config.max_seq_len - 1)
        if mask is not None:
            mask = torch.cat([mask.index_select(0, index), mask.new_ones(len(parts), own_len)], dim=1)
        logits = self.model(tails, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True).logits
        return [torch.cat([last[int(index[r])][None], logits[r, :len(p[1])]]) for r, p in enumerate(parts)]

    def _packable(self) -> bool:
        """Whether a prepared (B, 1, T, T) mask and explicit positions reproduce the model's attention: positions
        that are embedded or rotated (not a relative bias over offsets) and no sliding window."""
        config = self.model.config
        return config.position in ("learned", "sinusoidal", "rope") and \
            all(config.layer_window(i) is None for i in range(config.n_layers))

    def _packed_logits(self, parts, shared, index, own) -> list[torch.Tensor]:
        """One sequence per distinct shared part s: s, then each distinct own part o_j placed at positions
        len(s) .. len(s) + len(o_j) - 1, attending to s and to the earlier tokens of o_j only (a prefix tree
        laid flat), so every token sees exactly what it sees in its own row and s is read once, in one forward."""
        rows, positions, segments, start = [], [], [], {}
        for s, (ctx, owns) in enumerate(zip(shared, own)):
            row, pos, seg = list(ctx), list(range(len(ctx))), [0] * len(ctx)
            for j, o in enumerate(owns, 1):
                start[s, o] = len(row)
                row += o
                pos += range(len(ctx), len(ctx) + len(o))
                seg += [j] * len(o)
            rows.append(row)
            positions.append(pos)
            segments.append(seg)
        width = max(map(len, rows))
        ids = self._pad(rows, "right")
        pos = self._pad(positions, "right")
        # padding columns get a segment of their own: they attend to themselves and nothing reads them
        seg = torch.full((len(rows), width), -1, dtype=torch.long)
        for r, sg in enumerate(segments):
            seg[r, :len(sg)] = torch.tensor(sg)
        seg = seg.to(self.device)
        column = torch.arange(width, device=self.device)
        causal = column[None, :, None] >= column[None, None, :]
        visible = (seg[:, None, :] == 0) & (seg[:, :, None] >= 0) | (seg[:, :, None] == seg[:, None, :])
        # the LM head only over the columns some row scores
        kept = sorted({len(ctx) - 1 for ctx in shared} | {c for (r, o), b in start.items() for c in range(b, b + len(o))})
        column_of = {c: i for i, c in enumerate(kept)}
        logits = self.model(ids, attention_mask=(causal & visible)[:, None], position_ids=pos,
                            logits_to_keep=torch.tensor(kept, device=self.device)).logits
        out = []
        for p, r in zip(parts, index):
            scored = [len(shared[r]) - 1] + list(range(start[r, p[1]], start[r, p[1]] + len(p[1])))
            out.append(logits[r, [column_of[c] for c in scored]])
        return out

    def _read_shared(self, shared, cache):
        """Read the distinct shared parts left-padded: (last-position logits (S, V), mask or None, lengths)."""
        lengths = torch.tensor([len(s) for s in shared], device=self.device)
        ids = self._pad([list(s) for s in shared], "left")
        if bool((lengths == ids.shape[1]).all()):
            out = self.model(ids, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)
            return out.logits[:, -1], None, lengths
        mask = (torch.arange(ids.shape[1], device=self.device)[None] >= (ids.shape[1] - lengths)[:, None]).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=cache is not None, logits_to_keep=1)
        return out.logits[:, -1], mask, lengths

    def _seq2seq_logits(self, parts, shared, index) -> list[torch.Tensor]:
        """Logit rows per continuation: each distinct encoder input encoded once (right-padded, as HFLM pads it); the decoder reads
        [start] + continuation[:-1] for every row."""
        ids = self._pad([list(s) for s in shared], "right")
        lengths = torch.tensor([len(s) for s in shared], device=self.device)
        mask = (torch.arange(ids.shape[1], device=self.device)[None] < lengths[:, None]).long()
        index = torch.tensor(index, device=self.device)
        memory = self.model.encode(ids, mask).index_select(0, index)
        start = self.model.decoder_start_token_id
        decoder = self._pad([[start] + list(p[1])[:-1] for p in parts], "right")
        logits = self.model(attention_mask=mask.index_select(0, index), decoder_input_ids=decoder,
                            encoder_outputs=memory).logits
        return [logits[r, :p[2]] for r, p in enumerate(parts)]

    def _pad(self, rows: list[list[int]], side: str) -> torch.Tensor:
        """Rows as one (N, longest) tensor, padded with id 0 on `side` (masked or never scored)."""
        width = max(len(r) for r in rows)
        out = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                where = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
                out[i, where] = torch.tensor(r)
        return out.to(self.device)

    # --- generation ---------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, where the task asks) continuations, cut at the first stop string; the EOS text is
        always a stop, as in HFLM."""
        cuts = []
        for context, settings in (req.args for req in requests):
            gen = normalize_gen_kwargs(dict(settings), self.max_gen_toks) if isinstance(settings, dict) else {}
            room = self.max_length - int(gen.get("max_gen_toks", self.max_gen_toks)) if self.backend == "causal" \
                else self.max_length
            cuts.append(len(self.tok_encode(context)) - room)
        warn_truncated("generate_until", cuts, len(requests), self.max_length)
        return generate_batches(self, requests, disable_tqdm=disable_tqdm)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The folder's chat template over the few-shot turns (HFLM's call: text, and the final assistant message
        left open when no generation prompt is added)."""

        return render_chat(self, chat_history, add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:

            raise TokenizerError(f"{self.folder} has no chat template; run without --apply-chat-template, or use a "
                                 "folder whose tokenizer_config.json (or chat_template.jinja) holds one")
        if isinstance(template, dict):
            name = chat_template if isinstance(chat_template, str) else "default"
            return template.get(name) or next(iter(template.values()))
        return template

    def get_model_info(self) -> dict:
        return {"model_num_parameters": self.model.num_parameters(), "model_dtype": str(self.model.dtype),
                "model_revision": None, "model_sha": ""}
