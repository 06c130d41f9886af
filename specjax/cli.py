"""The `specjax` command: convert, generate, bench, plan, profile, demo."""

from __future__ import annotations

import argparse
import json
import sys

DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", None: None}  # CLI spelling -> dtype name


def _convert(args) -> int:
    from specjax.loading.target import convert

    dtype = DTYPES[args.dtype]
    dst = convert(args.src, args.dst, dtype=dtype, overwrite=args.overwrite)
    print(f"wrote {dst}")
    return 0


def _export(args) -> int:
    from specjax.convert.export import export

    dst = export(args.src, args.dst, dtype=DTYPES[args.dtype], overwrite=args.overwrite, target=args.target)
    print(f"wrote {dst}")
    return 0


def _generate(args) -> int:
    from specjax import generate, load

    target = load(args.model, attn_impl=args.attn_impl)
    drafter = None
    if args.drafter:
        from specjax.loading.drafter import load_drafter

        drafter = load_drafter(args.drafter, target)
    prompts = args.prompt if target.tokenizer is not None else [[int(t) for t in p.split()] for p in args.prompt]
    out = generate(target, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, drafter=drafter,
                   num_draft_tokens=args.num_draft_tokens, tree=args.tree)
    for i, toks in enumerate(out.tokens):
        print(f"--- {i}: {out.texts[i] if out.texts else ' '.join(map(str, toks))}")
    print(json.dumps({k: v for k, v in out.stats.items() if not isinstance(v, list)}, indent=1))
    return 0


def _demo(args) -> int:
    from specjax.demo import EMBEDDED, run_demo

    run_demo(args.target or EMBEDDED / "target", args.draft or EMBEDDED / "draft", max_new_tokens=args.max_new_tokens,
             num_draft_tokens=args.num_draft_tokens,
             dtype=DTYPES[args.dtype])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="Hugging Face model dir -> specjax orbax checkpoint")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None, help="default: the checkpoint's")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=_convert)

    p = sub.add_parser("export", help="specjax checkpoint (with its MTP layers), MTP-only dir + --target, "
                                      "EAGLE-3 training run, DFlash or DSpark head -> Hugging Face / SafeAILab / "
                                      "z-lab / DeepSpec dir")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None, help="default: the source's")
    p.add_argument("--target", default=None,
                   help="for an MTP-only src: the target it was made for (written together, MTP layers included); "
                        "for a DSpark head stored without its embed/lm_head copies: the target they come from "
                        "(default: the head's own reference)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=_export)

    p = sub.add_parser("generate", help="continue prompts (text, or space-separated ids without a tokenizer)")
    p.add_argument("model")
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", default=None, help="a draft-model checkpoint dir")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="chain length (default 4)")
    p.add_argument("--tree", default=None,
                   help="draft tree instead of a chain, e.g. kary:3,2,1 or dynamic:top_k=8,depth=5,total_tokens=60")
    p.add_argument("--attn-impl", choices=["auto", "xla", "pallas"], default="auto")
    p.set_defaults(fn=_generate)

    p = sub.add_parser("demo", help="the embedded tiny target and draft model, plain vs speculative")
    p.add_argument("--target", default=None, help="default: checkpoints/tiny/target")
    p.add_argument("--draft", default=None, help="default: checkpoints/tiny/draft")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="target dtype (default: the checkpoint's, fp32); in bf16/fp16 the match rate is reported")
    p.set_defaults(fn=_demo)

    from specjax.planning.advisor import add_plan_arguments, add_profile_arguments, plan_main, profile_main

    p = sub.add_parser("plan", help="best draft shape per concurrency (tree, chain K or off), predicted speedup")
    add_plan_arguments(p)
    p.set_defaults(fn=plan_main)
    p = sub.add_parser("profile", help="time verify rounds and drafting on this device; write a profile JSON")
    add_profile_arguments(p)
    p.set_defaults(fn=profile_main)

    from specjax.bench.ar import add_arguments as add_ar
    from specjax.bench.ar import main as bench_ar
    from specjax.bench.spec import add_arguments as add_spec
    from specjax.bench.spec import main as bench_spec

    bench = sub.add_parser("bench", help="benchmarks (same as scripts/bench.py)").add_subparsers(dest="mode",
                                                                                             required=True)
    for mode, add, fn, text in (("ar", add_ar, bench_ar, "plain decoding vs transformers"),
                                ("spec", add_spec, bench_spec, "speculative decoding vs plain, replay sweep")):
        p = bench.add_parser(mode, help=text)
        add(p)
        p.set_defaults(fn=fn)
    return parser


USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a user error (bad path, bad file, bad option) is one line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as err:
        print(f"specjax {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2


def one_line(err: BaseException) -> str:
    """The error's message with any line breaks folded into spaces (some libraries' messages span lines)."""
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
