"""The `specjax` command: convert, generate, serve, bench, plan, profile, demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from specjax.multihost import add_job_arguments, join_job
from specjax.serve.args import draft_shape  # argparse only: no server package is imported

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
    import jax

    from specjax import NgramDrafter, generate, load, stream

    _check_chat_options(args)
    _check_draft_options(args)
    join_job(args)
    target = load(args.model, dtype=DTYPES[args.dtype], attn_impl=args.attn_impl, mesh=_mesh(args))
    drafter = None
    if args.drafter == "ngram":
        drafter = NgramDrafter()
    elif args.drafter:
        from specjax.loading.drafter import load_drafter

        drafter = load_drafter(args.drafter, target)
    prompts = _chat_prompts(target, args) if args.chat else _cli_prompts(target, args.prompt)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              min_p=args.min_p, seed=args.seed, drafter=drafter, num_draft_tokens=args.num_draft_tokens, tree=args.tree,
              eos_token_id=args.eos, max_len=args.max_len, scheduler=args.scheduler, stop=args.stop or None,
              stop_token_ids=args.stop_token_ids or None, repetition_penalty=args.repetition_penalty,
              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
              min_tokens=args.min_tokens, logprobs=args.logprobs, top_logprobs=args.top_logprobs)
    # every process of a multi-process job decodes the same; process 0 prints
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    if args.stream:
        for chunk in stream(target, prompts, **kw):
            if args.json:
                say(json.dumps(dataclasses.asdict(chunk)), flush=True)
                continue
            text = chunk.text if chunk.text is not None else " ".join(map(str, chunk.token_ids))
            if len(prompts) == 1:
                say(text, end="", flush=True)
            else:
                say(f"[{chunk.index}] {text!r}", flush=True)
            if chunk.finish_reason is not None:
                say(f"\n--- {chunk.index}: finished ({chunk.finish_reason})", flush=True)
        return 0
    out = generate(target, prompts, **kw)
    stats = {k: v for k, v in out.stats.items() if not isinstance(v, list)}
    if args.json:  # one JSON object on stdout: every row's output, and the stats
        rows = [{"text": None if out.texts is None else out.texts[i], "token_ids": toks,
                 "finish_reason": out.finish_reasons[i], "stop_reason": out.stop_reasons[i],
                 **({"logprobs": out.logprobs[i]} if out.logprobs is not None else {}),
                 **({"top_logprobs": out.top_logprobs[i]} if out.top_logprobs is not None else {})}
                for i, toks in enumerate(out.tokens)]
        say(json.dumps({"outputs": rows, "stats": stats}, default=str))
        return 0
    for i, toks in enumerate(out.tokens):
        say(f"--- {i}: {out.texts[i] if out.texts else ' '.join(map(str, toks))}")
        if out.logprobs is not None:
            say(f"    logprobs: {', '.join(f'{x:.3f}' for x in out.logprobs[i])}")
    # the statistics go to stderr: stdout holds the text alone
    say(json.dumps({**stats, "finish_reasons": out.finish_reasons}, indent=1, default=str), file=sys.stderr)
    return 0


def _check_draft_options(args) -> None:
    """--num-draft-tokens, --tree and --scheduler shape speculative decoding: without --drafter they are refused."""
    given = [flag for flag, value in (("--num-draft-tokens", args.num_draft_tokens), ("--tree", args.tree),
                                      ("--scheduler", args.scheduler)) if value is not None]
    if given and not args.drafter:
        raise ValueError(f"{' and '.join(given)} shape(s) a speculative draft, but no drafter was given: add "
                         "--drafter DIR (any drafter family's directory, or 'ngram'), or drop "
                         f"{' and '.join(given)}")


def _mesh(args):
    """The mesh --mesh D,M or --tensor-parallel N ask for, over the job's devices (every process's), or None."""
    from specjax.models.sharding import device_mesh, tensor_parallel_mesh

    if args.mesh is not None and args.tensor_parallel is not None:
        raise ValueError("pass --mesh D,M or --tensor-parallel N, not both (--tensor-parallel N is --mesh 1,N)")
    if args.mesh is not None:
        return device_mesh(*args.mesh)
    return None if args.tensor_parallel is None else tensor_parallel_mesh(args.tensor_parallel)


def _mesh_shape(text: str) -> tuple[int, int]:
    """--mesh: 'D,M', the data-parallel and tensor-parallel sizes."""
    try:
        data, model = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected D,M (data-parallel replicas, tensor-parallel devices) like 2,4, "
                                         f"got {text!r}") from None
    return data, model


def _cli_prompts(target, prompts: list[str]) -> list:
    """Text prompts, or space-separated token ids for a checkpoint without a tokenizer."""
    if target.tokenizer is not None:
        return prompts
    try:
        return [[int(t) for t in p.split()] for p in prompts]
    except ValueError:
        raise ValueError(f"{target.path} has no tokenizer (no tokenizer.json), so --prompt must be space-separated "
                         f"token ids like '7 30 12', got {prompts[0]!r}") from None


def _chat_prompts(target, args) -> list[list[int]]:
    """--chat: each --prompt a user message (after the --system message, when given), rendered to ids by the
    checkpoint's chat template with --chat-template-kwargs."""
    from specjax.chat import render_prompts

    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    chats = [system + [{"role": "user", "content": p}] for p in args.prompt]
    return render_prompts(target, chats, args.chat_template_kwargs)


def _check_chat_options(args) -> None:
    """--system and --chat-template-kwargs shape a chat: without --chat they would be ignored, so they are refused."""
    given = [flag for flag, value in (("--system", args.system), ("--chat-template-kwargs", args.chat_template_kwargs))
             if value is not None]
    if given and not args.chat:
        raise ValueError(f"{' and '.join(given)} only apply to a chat: add --chat (each --prompt is then a user "
                         "message rendered with the checkpoint's chat template)")


def _json_object(text: str) -> dict:
    """--chat-template-kwargs: a JSON object of template variables."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"enable_thinking\": false}}', got {text!r}")
    return value


def _eos_ids(text: str) -> list[int]:
    """--eos: comma-separated token ids (empty: never stop on EOS)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 2,32000, got {text!r}") from None


def _serve(args) -> int:
    from specjax.serve.main import main  # FastAPI and uvicorn (the serve extra), only when serving

    return main(args)


def _bench_serve(args) -> int:
    from specjax.bench.serving.main import main  # httpx (the serve extra), only when benchmarking a server

    return main(args)


def _plan(args) -> int:
    """`specjax plan`; with --memory --compiled the memory plan beside the compiler's figure (specjax/aot/memory.py)."""
    from specjax.planning.advisor import memory_cases, plan_main

    if not args.compiled:
        return plan_main(args)
    if not args.memory:
        raise ValueError("--compiled checks the memory plan against the compiler: add --memory")
    from specjax.aot.memory import compiled_memory_main

    return compiled_memory_main(args, memory_cases(args))


def _demo(args) -> int:
    from specjax.demo import EMBEDDED, run_demo

    run_demo(args.target or EMBEDDED / "target", args.draft or EMBEDDED / "draft", max_new_tokens=args.max_new_tokens,
             num_draft_tokens=args.num_draft_tokens, dtype=DTYPES[args.dtype], methods_like=args.methods)
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
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-len", type=int, default=None, help="a limit on prompt + output (sets the cache length)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; default: the checkpoint's generation_config.json (greedy without do_sample)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeat for more); not in the output")
    p.add_argument("--stop-token-ids", type=_eos_ids, default=None, help="stop token ids beyond EOS, comma-separated")
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--logprobs", action="store_true", help="each generated token's log-probability")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                   help="also the N most likely tokens at each position (at most 20)")
    p.add_argument("--json", action="store_true",
                   help="print the outputs (text, token ids, finish reasons, logprobs) and stats as JSON on stdout "
                        "(with --stream: one JSON object a chunk)")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="the target's dtype (default: the checkpoint's)")
    p.add_argument("--eos", type=_eos_ids, default=None,
                   help="EOS token ids, comma-separated, instead of the checkpoint's ('' never stops on EOS)")
    p.add_argument("--drafter", default=None,
                   help="a drafter directory of any family (draft model, EAGLE-3, MTP, DFlash, DSpark), or 'ngram'")
    p.add_argument("--num-draft-tokens", type=draft_shape, default=None,
                   help="chain length K (default 4), 'auto' (the planner picks a chain or off) or 'off'")
    p.add_argument("--tree", default=None,
                   help="draft tree instead of a chain, e.g. kary:3,2,1 or dynamic:top_k=8,depth=5,total_tokens=60; "
                        "'auto' (the planner picks a tree, a chain or off)")
    p.add_argument("--scheduler", choices=["confidence", "prefix"], default=None,
                   help="verify only the prefix of each chain that pays off (drafters with confidences, e.g. DSpark)")
    p.add_argument("--attn-impl", choices=["auto", "xla", "pallas"], default="auto")
    p.add_argument("--chat", action="store_true",
                   help="each --prompt is a user message, rendered with the checkpoint's chat template (Instruct models)")
    p.add_argument("--system", default=None, help="with --chat: a system message before each user message")
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None,
                   help='with --chat: template variables as a JSON object, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="split the target (and drafter) over the job's first N devices")
    p.add_argument("--mesh", type=_mesh_shape, default=None, metavar="D,M",
                   help="a (data, model) mesh: D data-parallel replicas of an M-device tensor-parallel model")
    add_job_arguments(p)
    p.set_defaults(fn=_generate)

    p = sub.add_parser("demo", help="the embedded tiny target and draft model, plain vs speculative")
    p.add_argument("--target", default=None, help="default: checkpoints/tiny/target")
    p.add_argument("--draft", default=None, help="default: checkpoints/tiny/draft")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="target dtype (default: the checkpoint's, fp32); in bf16/fp16 the match rate is reported")
    p.add_argument("--methods", default=None, help="only the methods whose name contains this, e.g. EAGLE-3")
    p.set_defaults(fn=_demo)

    from specjax.planning.advisor import add_plan_arguments, add_profile_arguments, profile_main

    p = sub.add_parser("plan", help="best draft shape per concurrency (tree, chain K or off), predicted speedup")
    add_plan_arguments(p)
    p.set_defaults(fn=_plan)
    p = sub.add_parser("profile", help="time verify rounds and drafting on this device; write a profile JSON")
    add_profile_arguments(p)
    p.set_defaults(fn=profile_main)

    from specjax.serve.args import add_arguments as add_serve_args

    p = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics) "
                                     "on the engine")
    add_serve_args(p)
    p.set_defaults(fn=_serve)

    from specjax.aot.compile import add_arguments as add_compile
    from specjax.aot.compile import main as compile_main

    p = sub.add_parser("compile", help="compile the production graphs for an H100 or H200 (deviceless without one): "
                                       "compile seconds, the compiler's memory figures, kernels and collectives")
    add_compile(p)
    p.set_defaults(fn=compile_main)

    from specjax.bench.ar import add_arguments as add_ar
    from specjax.bench.ar import main as bench_ar
    from specjax.bench.spec import add_arguments as add_spec
    from specjax.bench.spec import main as bench_spec

    bench = sub.add_parser("bench", help="benchmarks (same as scripts/bench.py)").add_subparsers(dest="mode",
                                                                                             required=True)
    from specjax.bench.serving.args import add_arguments as add_serve

    for mode, add, fn, text in (("ar", add_ar, bench_ar, "plain decoding vs transformers"),
                                ("spec", add_spec, bench_spec, "speculative decoding vs plain, replay sweep"),
                                ("serve", add_serve, _bench_serve, "load an OpenAI-compatible server (vLLM's flags "
                                                                  "and metrics)")):
        p = bench.add_parser(mode, help=text)
        add(p)
        p.set_defaults(fn=fn)
    return parser


USER_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError)


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
