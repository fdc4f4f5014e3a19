"""`lmkit finetune`: fine-tune a pretrained encoder for text classification (CSV or JSONL: text, text_pair, label),
or, with --task clm, a causal LM on text (--train: a corpus name or text files), or, with --task sft, a causal LM
on instruction data (JSONL rows: messages, prompt/completion or text), with --task dpo / reward on preference
pairs (JSONL rows: prompt, chosen, rejected), with --task grpo a causal LM by reinforcement learning on --prompts
scored by --reward, or, with --task token / qa, an encoder for NER-style tagging (JSONL rows: tokens, tags; or
pydocs-ner) or extractive QA (SQuAD format; or pydocs-qa); --peft picks a PEFT method."""
from __future__ import annotations

import argparse
import json

from lmkit.cli.helptext import add_command
from lmkit.cli.common import add_device_argument, device_of
from lmkit.cli.finetune_align import add_alignment_arguments, check_flags, refuse
from lmkit.cli.finetune_grpo import GRPO_ONLY, NOT_FOR_GRPO, SHARED_WITH_DPO, add_grpo_arguments, run_grpo
from lmkit.errors import ConfigError

CLASSIFY_ONLY = (("--eval", "eval"), ("--epochs", "epochs"), ("--pooling", "pooling"))
CLM_ONLY = (("--max-steps", "max_steps"), ("--regularize", "regularize"), ("--forgetting-corpus", "forgetting_corpus"),
            ("--rope-scaling", "rope_scaling"), ("--rope-factor", "rope_factor"), ("--longlora", "longlora"),
            ("--s2-group", "s2_group"))
CLM_ONLY_NOT_SFT = CLM_ONLY[1:]
SFT_ONLY = (("--packing", "packing"), ("--chat-template", "chat_template"), ("--train-on-all", "train_on_all"),
            ("--micro-batch-size", "micro_batch_size"))
FIELDS = ("model", "train", "out", "eval", "epochs", "lr", "batch_size", "max_length", "pooling", "val_fraction",
          "seed", "warmup_ratio", "weight_decay")


def register(subparsers) -> None:
    p = add_command(subparsers, "finetune", help="fine-tune a model: classification, causal LM text (--task clm), "
                    "instructions (--task sft), RL with rewards (--task grpo); --peft METHOD", description=__doc__,
                    example_lines=(
                        "lmkit finetune --task sft --model runs/demo --train pydocs-instruct --out runs/demo/sft "
                        "--chat-template chatml --packing",
                        "lmkit finetune --task grpo --model runs/cot --prompts addition-cot --reward exact-answer "
                        "--out runs/cot-grpo",
                        "lmkit finetune --task dpo --model runs/demo/sft --train pairs.jsonl --out runs/demo/dpo --beta 0.1",
                        "lmkit finetune --task reward --model runs/demo/sft --train pairs.jsonl --eval held.jsonl "
                        "--out runs/demo/rm",
                        "lmkit finetune --task clm --model runs/demo --train notes/ --out runs/notes --peft lora",
                        "lmkit finetune --model bert-folder --train reviews.csv --out runs/reviews --epochs 2"))
    p.add_argument("--model", required=True, metavar="DIR", help="pretrained folder (config.json, weights, tokenizer.json): an encoder to classify, a causal LM for "
                   "--task clm and sft")
    p.add_argument("--train", metavar="FILE", help="training data: .csv with a header, or .jsonl (--task clm: a corpus name or text files; --task sft: "
                   ".jsonl rows or pydocs-instruct; --task dpo and reward: preference rows or pydocs-preference; "
                   "default: none, which only --task grpo accepts: it takes --prompts)")
    p.add_argument("--eval", metavar="FILE", help="evaluation data (default: classification holds out --val-fraction of --train; sft: none)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the best checkpoint and metrics.jsonl go")
    p.add_argument("--epochs", type=int, metavar="N", help="passes over the training data (default 3 to classify, 1 for --task sft; --task clm counts --max-steps)")
    p.add_argument("--lr", type=float, metavar="X", help="peak learning rate (default 3e-5 to classify; with --peft, --task clm or sft "
                   "the method's own default, 1e-3 in full; --task grpo: 1e-6, TRL's)")
    p.add_argument("--batch-size", type=int, metavar="N", help="examples per step (default 16; --task dpo and reward: "
                   "8 pairs, TRL's; --task grpo: completions, a multiple of --num-generations)")
    p.add_argument("--max-length", "--seq-len", type=int, metavar="N", help="tokens per example, cut beyond (default: what "
                   "fits the model's positions after any prompt-tuning virtual tokens, at most 128; --task clm: at most "
                   "256, or the extended window with --rope-scaling; --task sft: at most 1024)")
    p.add_argument("--pooling", choices=["cls", "mean"],
                   help="classification: what the head reads (default cls); a mean-pooled folder is lmkit's: transformers' "
                   "...ForSequenceClassification pools [CLS] and gives other logits")
    p.add_argument("--val-fraction", type=float, metavar="F",
                   help="held out when --eval is not given (default 0.1; --task clm: 0.05 of the documents)")
    p.add_argument("--warmup-ratio", type=float, metavar="F", help="share of steps warming up (default 0.1; --task clm: "
                   "0.1, at most 20 steps; --task grpo: 0)")
    p.add_argument("--weight-decay", type=float, metavar="X", help="AdamW weight decay (default 0.01; --task clm and grpo: 0)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument("--task", choices=["classify", "clm", "sft", "dpo", "reward", "grpo", "token", "qa"],
                   default="classify",
                   help="classify (the default); clm: next-token fine-tuning of a causal LM on the text of --train; sft: "
                   "supervised fine-tuning on instruction rows, loss on completions / assistant turns as TRL's "
                   "SFTTrainer; dpo: direct preference optimization on preference pairs, as TRL's DPOTrainer; reward: "
                   "a Bradley-Terry reward model (a scalar head), as TRL's RewardTrainer; grpo: reinforcement learning "
                   "on --prompts with --reward, as TRL's GRPOTrainer; token: NER-style tagging of an encoder, JSONL rows "
                   "{tokens, tags} or pydocs-ner, entity-level precision/recall/F1 as seqeval computes them; qa: "
                   "extractive QA of an encoder, SQuAD-format JSONL or pydocs-qa, exact match and F1 as the SQuAD v1.1 "
                   "script computes them")
    qa = p.add_argument_group("--task qa")
    qa.add_argument("--doc-stride", type=int, metavar="N", help="pieces two windows of a long context share "
                    "(default 32)")
    qa.add_argument("--max-answer-length", type=int, metavar="N", help="longest answer predicted, in pieces "
                    "(default 30)")
    sft = p.add_argument_group("--task sft")
    sft.add_argument("--packing", action="store_true", help="pack examples into --max-length rows (best-fit "
                     "decreasing; no attention across examples; default: one example a row)")
    sft.add_argument("--chat-template", metavar="chatml|FILE", help="chatml (adds <|im_start|>/<|im_end|>) or a "
                     ".jinja file, for a model without a chat template (default: the folder's own)")
    sft.add_argument("--train-on-all", action="store_true", help="loss on every token, prompts and user turns too (default: "
                     "completions and assistant turns only)")
    sft.add_argument("--micro-batch-size", type=int, metavar="N", help="examples per forward pass (default: "
                     "--batch-size); the loss stays a mean over all trained tokens of the step")
    p.add_argument("--max-steps", type=int, metavar="N", help="optimizer steps (--task clm: default 200; --task sft: default "
                   "--epochs passes, a number here overrides them; --task grpo: one pass over the prompts)")
    clm = p.add_argument_group("--task clm")
    clm.add_argument("--regularize", metavar="l2sp:LAMBDA|ewc:LAMBDA",
                     help="pull the weights toward the starting ones against forgetting: L2-SP (lambda/2 |w - w0|^2) "
                          "or EWC (Fisher-weighted, estimated on --forgetting-corpus or pydocs) (default: none)")
    clm.add_argument("--forgetting-corpus", metavar="NAME|PATH",
                     help="also score this corpus's validation split before and after, to measure forgetting "
                          "(default: none)")
    long = p.add_argument_group("longer context (--task clm, RoPE models)")
    long.add_argument("--rope-scaling", choices=["linear", "dynamic", "yarn"], help="extend the RoPE window before "
                      "training at --seq-len: linear (position interpolation), dynamic (NTK-aware) or yarn, written into "
                      "config.json as transformers' rope_scaling (default: none)")
    long.add_argument("--rope-factor", type=float, metavar="F", help="how many times the window grows, at least 1 "
                      "(default: --seq-len / the model's positions)")
    long.add_argument("--longlora", action="store_true", default=None, help="LongLoRA: train with shifted sparse "
                      "attention (S2-Attn) and, with --peft lora, the embeddings and norms in full; the saved model "
                      "attends in full (default: off)")
    long.add_argument("--s2-group", type=int, metavar="N", help="S2-Attn group size, even, dividing --seq-len "
                      "(default: a quarter of --seq-len)")
    add_alignment_arguments(p)
    add_grpo_arguments(p)
    add_run_arguments(p)
    add_peft_arguments(p)
    p.set_defaults(func=run)


def add_run_arguments(parser) -> None:
    """The flags of the one training loop that every fine-tuning job shares (also `lmkit distill`'s)."""
    g = parser.add_argument_group("training run")
    g.add_argument("--precision", choices=["fp32", "bf16"], help="bf16: autocast matrix products to bfloat16 "
                   "(default: bf16 where the CPU multiplies bf16 natively and faster than fp32, else fp32)")
    g.add_argument("--lr-schedule", choices=["linear", "cosine", "constant"],
                   help="after the linear warm-up (default: cosine; classification: linear)")
    g.add_argument("--save-every", type=int, metavar="N", help="write a resumable checkpoint into --out/checkpoint "
                   "every N steps (default: none)")
    g.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint, with "
                   "the losses it would have had")
    add_device_argument(parser)


def run_settings(args: argparse.Namespace) -> dict:
    """The loop's settings from the parsed run flags (as the jobs' configs name them)."""
    settings = dict(precision=args.precision, save_every=args.save_every, resume=args.resume,
                    device=str(device_of(args)))
    if args.lr_schedule is not None:
        settings["lr_schedule"] = args.lr_schedule
    return settings


def on_every_rank(body, device=None):
    """(body(), 0) in one process or on every rank under torchrun; (None, status) on the ranks other than 0,
    which print nothing."""
    from lmkit.train import distributed

    ctx = distributed.setup(device)  # torchrun: one process per rank (cuda: each its own GPU), rank 0 prints and writes
    result, status = distributed.run_ranks(ctx, body)
    return (result, status) if ctx.is_main else (None, status)


def add_peft_arguments(parser) -> None:
    """The --peft flags of `lmkit finetune` (argparse), shared by its classification and causal-LM paths."""
    from lmkit.peft.model import METHODS

    g = parser.add_argument_group("parameter-efficient fine-tuning")
    g.add_argument("--peft", choices=("full",) + METHODS, default="full",
                   help="train everything (full, the default) or only a PEFT method's parameters")
    g.add_argument("--lora-r", type=int, default=8, metavar="R", help="LoRA / QLoRA rank (default 8)")
    g.add_argument("--lora-alpha", type=float, default=16.0, metavar="X",
                   help="LoRA scale alpha (update = alpha/r B A; default 16)")
    g.add_argument("--lora-dropout", type=float, default=0.0, metavar="X",
                   help="dropout on the LoRA branch's input (default 0)")
    g.add_argument("--target-modules", nargs="+", metavar="NAME",
                   help="layers LoRA/IA3 adapt, by name (q_proj v_proj, or the HF names; 're:REGEX' for a pattern; default: "
                        "q_proj v_proj for LoRA, k_proj v_proj down_proj for IA3)")
    g.add_argument("--qlora-bits", type=int, choices=(4, 8), default=4, help="QLoRA base weights: 4 (NF4, the default) or 8 bits")
    g.add_argument("--qlora-double-quant", action="store_true",
                   help="QLoRA: also quantize the NF4 block scales (8 bits, blocks of 256: about 0.37 bits a "
                        "parameter saved; default off)")
    g.add_argument("--virtual-tokens", type=int, default=16, metavar="N", help="prefix / prompt length (default 16)")
    g.add_argument("--bottleneck", type=int, default=16, metavar="N", help="adapter bottleneck width (default 16)")


def peft_settings(args) -> tuple[str, dict]:
    """(method, settings for peft_for_task) from the parsed --peft flags."""
    settings = dict(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, bits=args.qlora_bits,
                    double_quant=args.qlora_double_quant, num_virtual_tokens=args.virtual_tokens, bottleneck=args.bottleneck)
    if args.target_modules:
        settings["target_modules"] = list(args.target_modules)
    return args.peft, settings


def run(args: argparse.Namespace) -> int:
    from lmkit.finetune import FinetuneConfig, finetune
    from lmkit.finetune.common import default_lr

    method, settings = peft_settings(args)
    if args.task in ("grpo", "sft"):
        given = [f for f, name in CLM_ONLY_NOT_SFT if getattr(args, name) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} applies to --task clm only; drop it")
    if args.task == "grpo":
        refuse(args, NOT_FOR_GRPO, "grpo")
        return run_grpo(args, run_settings(args))
    given = [f for f, name in GRPO_ONLY if getattr(args, name) is not None
             and not (args.task in ("dpo", "reward") and name in SHARED_WITH_DPO)]
    if given:
        raise ConfigError(f"{', '.join(given)} applies to --task grpo only; drop it")
    if args.train is None:
        raise ConfigError(f"--task {args.task} needs --train FILE")
    check_flags(args)
    if args.task in ("dpo", "reward"):
        from lmkit.cli import finetune_align

        return finetune_align.run(args, method, settings, run_settings(args), on_every_rank)
    args.batch_size = args.batch_size or 16
    if args.task == "sft":
        return run_sft(args, method, settings)
    given = [f for f, name in SFT_ONLY if getattr(args, name) not in (None, False)]
    if given:
        raise ConfigError(f"{', '.join(given)} applies to --task sft only; drop it")
    unused = CLASSIFY_ONLY if args.task == "clm" else CLM_ONLY
    given = [flag for flag, name in unused if getattr(args, name) is not None]
    if given:
        other = "classify" if args.task == "clm" else "clm"
        raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --task {other} only; "
                          f"drop {'it' if len(given) == 1 else 'them'} (--task clm trains --max-steps steps and holds "
                          f"out --val-fraction of --train's documents; classification trains --epochs passes)")
    if args.lr is None and (method != "full" or args.task == "clm"):
        args.lr = default_lr(method, args.task)
    if args.task == "clm":
        return run_clm(args, method, settings)
    if args.task in ("token", "qa"):
        return run_token(args, method, settings)
    config = FinetuneConfig(**{f: getattr(args, f) for f in FIELDS if getattr(args, f) is not None}, peft=method,
                            peft_settings=settings, **run_settings(args))
    best, status = on_every_rank(lambda: finetune(config), device_of(args))
    if best is None:
        return status
    print(f"lmkit finetune: best epoch {best['epoch']}: accuracy {best['accuracy']:.4f}, macro-F1 {best['macro_f1']:.4f}; "
          f"saved to {args.out}")
    print(json.dumps(best))
    return 0


def run_token(args: argparse.Namespace, method: str, settings: dict) -> int:
    """--task token and --task qa: an encoder's tagging or extractive QA, as classification's epochs."""
    from lmkit.finetune import FinetuneConfig
    from lmkit.finetune.qa import finetune_qa
    from lmkit.finetune.token_classification import finetune_token

    if args.pooling is not None:
        raise ConfigError(f"--pooling applies to classification; --task {args.task} reads every position")
    if args.task == "token" and (args.doc_stride is not None or args.max_answer_length is not None):
        raise ConfigError("--doc-stride and --max-answer-length apply to --task qa only; drop them")
    fields = {f: getattr(args, f) for f in FIELDS if getattr(args, f) is not None}
    config = FinetuneConfig(**fields, peft=method, peft_settings=settings, **run_settings(args))
    qa = {k: v for k, v in (("stride", args.doc_stride), ("max_answer_length", args.max_answer_length)) if v is not None}
    job = (lambda: finetune_token(config)) if args.task == "token" else (lambda: finetune_qa(config, **qa))
    best, status = on_every_rank(job, device_of(args))
    if best is None:
        return status
    scores = (f"entity precision {best['precision']:.4f}, recall {best['recall']:.4f}, F1 {best['f1']:.4f}"
              if args.task == "token" else f"exact match {best['exact_match']:.2f}, F1 {best['f1']:.2f}")
    print(f"lmkit finetune --task {args.task}: best epoch {best['epoch']}: {scores}; saved to {args.out}")
    print(json.dumps(best))
    return 0


def run_clm(args: argparse.Namespace, method: str, settings: dict) -> int:
    from lmkit.finetune.clm import finetune_causal_lm_folder

    given = {k: getattr(args, k) for k in ("val_fraction", "warmup_ratio", "weight_decay", "regularize",
                                           "forgetting_corpus") if getattr(args, k) is not None}
    r, status = on_every_rank(lambda: finetune_causal_lm_folder(
        args.model, args.out, method, [args.train], 200 if args.max_steps is None else args.max_steps, args.batch_size,
        args.max_length, args.lr, args.seed, **given, **run_settings(args), **settings, rope_scaling=args.rope_scaling,
        rope_factor=args.rope_factor, longlora=bool(args.longlora), s2_group=args.s2_group), device_of(args))
    if r is None:
        return status
    b, a = r["before"], r["after"]
    print(f"lmkit finetune --task clm --peft {method}: {r['trainable']:,} of {r['total']:,} parameters trained "
          f"({r['percent']:.2f}%) in {r['seconds']:.0f} s; validation loss {b['loss']:.4f} -> {a['loss']:.4f}, "
          f"next-token accuracy {b['accuracy']:.4f} -> {a['accuracy']:.4f}; saved to {args.out}")
    if "forgetting" in r:
        f = r["forgetting"]
        print(f"forgetting on {f['corpus']}: validation loss {f['before']['loss']:.4f} -> {f['after']['loss']:.4f}")
    return 0


def run_sft(args: argparse.Namespace, method: str, settings: dict) -> int:
    from lmkit.finetune.sft import SFTConfig, sft

    for flag, name in (("--pooling", "pooling"), ("--val-fraction", "val_fraction")):
        if getattr(args, name) is not None:
            raise ConfigError(f"{flag} does not apply to --task sft; give held-out rows with --eval FILE")
    for flag, name in (("--rope-scaling", "rope_scaling"), ("--rope-factor", "rope_factor"), ("--longlora", "longlora"),
                       ("--s2-group", "s2_group")):
        if getattr(args, name) is not None:
            raise ConfigError(f"{flag} applies to --task clm only; extend the window there, then run sft on the result")
    fields = dict(model=args.model, train=args.train, out=args.out, eval=args.eval, max_length=args.max_length,
                  packing=args.packing, train_on_all=args.train_on_all, chat_template=args.chat_template,
                  epochs=args.epochs or 1, max_steps=args.max_steps, batch_size=args.batch_size,
                  micro_batch_size=args.micro_batch_size, lr=args.lr, seed=args.seed, peft=method,
                  peft_settings=settings if method != "full" else {}, **run_settings(args))
    for key, name in (("warmup_ratio", "warmup_ratio"), ("weight_decay", "weight_decay")):
        if getattr(args, name) is not None:
            fields[key] = getattr(args, name)
    log = lambda line: print(f"lmkit finetune --task sft: {line}", flush=True)  # noqa: E731
    r, status = on_every_rank(lambda: sft(SFTConfig(**fields), log=log), device_of(args))
    if r is None:
        return status
    held = (f"; held-out loss {r['eval_loss_before']:.4f} -> {r['eval_loss_after']:.4f}"
            if r["eval_loss_after"] is not None else "")
    rows = (f"packed into {r['packed_rows']} rows ({r['untrained']} without a trained token within --max-length "
            f"{r['max_length']}, kept as TRL keeps them)" if "packed_rows" in r else
            f"{r['dropped']} dropped: no trained token within --max-length {r['max_length']}")
    print(f"lmkit finetune --task sft: {r['examples']} examples from {r['rows']} rows, {rows}; "
          f"{r['steps']} steps, loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}{held}; saved to {args.out}")
    return 0
