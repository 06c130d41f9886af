"""`specjax demo`: the embedded tiny target and its drafters continuing code prompts.

Runs plain greedy decoding, then each available drafter on the same prompts, checks that
every speculative output equals the plain one token for token (fp32: a difference raises;
bf16/fp16: near-ties may flip, so the match rate and first divergence are reported), and prints
a table of tau, speedup, tokens/s and agreement. Before it, two continuations sampled through
the speculative loop (lossless: the target's own distribution, a fixed seed), the tokens each
round accepted highlighted: a 4M-parameter model's greedy text falls into loops, its sampled
text reads as code (scripts/demo_quality.py measures both on held-out prompts). Then the embedded
hybrid (checkpoints/tiny/hybrid: a Qwen3.5-style target of Gated DeltaNet and gated attention layers
with the MTP layer it carries) gets the same check and table.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from specjax.bench.agreement import EXACT_DTYPES, check_agreement
from specjax.drafters import NgramDrafter
from specjax.generate import GenerateOutput, generate
from specjax.loading.drafter import load_drafter
from specjax.loading.embedded import EMBEDDED_DIR
from specjax.loading.target import load
from specjax.models.target import Target

EMBEDDED = EMBEDDED_DIR
PROMPTS = [
    "def fibonacci(n):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "import os\n\n\ndef read_lines(path):\n    ",
]
ROUND_STYLES = ("black on green3", "black on dark_sea_green2")
# How the shown continuations are decoded (scripts/demo_quality.py: held-out prompts, this setting against greedy).
SHOW_SAMPLING = {"temperature": 0.8, "top_p": 0.95, "seed": 0}
SHOWN_ROWS = 2


def highlighted(target: Target, out: GenerateOutput, row: int) -> Text:
    """The row's text; tokens that were accepted drafts get a background, alternating per round.

    The last token a round emits is the target's own (bonus) token and stays plain.
    """
    tokens, rounds = out.tokens[row], out.token_rounds[row]
    text = Text()
    for i, (tok, rnd) in enumerate(zip(tokens, rounds)):
        is_bonus = i + 1 == len(tokens) or rounds[i + 1] != rnd
        text.append(target.decode([tok]), style="" if is_bonus else ROUND_STYLES[rnd % 2])
    return text


def trained_heads(root: Path, target: Target, num_draft_tokens: int) -> dict[str, dict]:
    """Rows for the drafter heads trained for this target that sit beside it (checkpoints/tiny/eagle3, mtp, dflash,
    dspark)."""
    methods = {}
    if (root / "eagle3").is_dir():
        eagle = load_drafter(root / "eagle3", target)
        methods[f"EAGLE-3, chain of {num_draft_tokens}"] = dict(drafter=eagle, num_draft_tokens=num_draft_tokens)
        methods["EAGLE-3, dynamic tree top_k=3,depth=3,16 nodes"] = dict(
            drafter=eagle, tree="dynamic:top_k=3,depth=3,total_tokens=16")
    if (root / "mtp").is_dir():
        methods["MTP, chain of 3"] = dict(drafter=load_drafter(root / "mtp", target), num_draft_tokens=3)
    if (root / "dflash").is_dir():
        dflash = load_drafter(root / "dflash", target)
        k = dflash.cfg.block_size - 1
        methods[f"DFlash, block of {k} drafts"] = dict(drafter=dflash, num_draft_tokens=k)
    if (root / "dspark").is_dir():
        dspark = load_drafter(root / "dspark", target)
        k = dspark.cfg.block_size
        methods[f"DSpark, block of {k} drafts"] = dict(drafter=dspark, num_draft_tokens=k)
        methods[f"DSpark, block of {k}, confidence scheduler"] = dict(drafter=dspark, num_draft_tokens=k,
                                                                      scheduler="confidence")
    return methods


def run_demo(target_dir: Path = EMBEDDED / "target", draft_dir: Path = EMBEDDED / "draft", max_new_tokens: int = 48,
             num_draft_tokens: int = 4, console: Console | None = None, dtype: str | None = None,
             methods_like: str | None = None) -> list[dict]:
    """Run the demo and return its table rows; dtype overrides the target's stored dtype (e.g. "bfloat16");
    methods_like keeps only the methods whose name contains it (e.g. "EAGLE-3"), plain decoding always."""
    console = console or Console()
    if not (Path(target_dir) / "config.json").is_file():
        raise FileNotFoundError(f"no embedded model at {target_dir}; run from a full clone of specjax")
    target = load(target_dir, dtype=dtype)
    draft = load_drafter(draft_dir, target)
    methods = {
        f"draft model, chain of {num_draft_tokens}": dict(drafter=draft, num_draft_tokens=num_draft_tokens),
        "draft model, tree kary:3,2,1": dict(drafter=draft, tree="kary:3,2,1"),
        f"n-gram, chain of {num_draft_tokens}": dict(drafter=NgramDrafter(), num_draft_tokens=num_draft_tokens),
    }
    methods |= trained_heads(Path(target_dir).parent, target, num_draft_tokens)
    if methods_like is not None:
        methods = {name: kw for name, kw in methods.items() if methods_like in name}
        if not methods:
            raise ValueError(f"no demo method's name contains {methods_like!r}")
    console.print(f"[bold]specjax demo[/bold]: target {target.cfg.num_params() / 1e6:.1f}M params, draft "
                  f"{draft.cfg.num_params() / 1e6:.2f}M params, {target.cfg.dtype}, {max_new_tokens} new "
                  f"tokens per prompt")
    generate(target, PROMPTS, max_new_tokens=max_new_tokens)  # compile
    plain = generate(target, PROMPTS, max_new_tokens=max_new_tokens)
    rows = [plain_row(plain)]
    show_name, show_kwargs = next(iter(methods.items()))
    shown = generate(target, PROMPTS[:SHOWN_ROWS], max_new_tokens=max_new_tokens, **show_kwargs, **SHOW_SAMPLING)
    console.rule(f"{show_name}, sampled (temperature {SHOW_SAMPLING['temperature']}, top_p "
                 f"{SHOW_SAMPLING['top_p']}, seed {SHOW_SAMPLING['seed']}): tau {shown.stats['acceptance_length']:.2f}")
    for row, prompt in enumerate(PROMPTS[:SHOWN_ROWS]):
        console.print(Text(prompt, style="bold") + highlighted(target, shown, row))
        console.print()
    rows += method_rows(target, plain, methods, max_new_tokens)
    console.print(results_table(rows, str(target.cfg.dtype)))
    console.print("Highlighted: drafted tokens the target accepted (one shade per round); plain: the target's own "
                  "token ending each round. The table is greedy decoding, every method checked against plain "
                  "decoding on all prompts. Speedups are this machine's; on a CPU verifying many tokens is not free.")
    hybrid_dir = Path(target_dir).parent / "hybrid"
    if methods_like is None and (hybrid_dir / "config.json").is_file():
        hybrid_demo(hybrid_dir, draft_dir, max_new_tokens, num_draft_tokens, console, dtype)
    return rows


def plain_row(plain: GenerateOutput) -> dict:
    """The table's first row: plain decoding, the reference every method is checked and timed against."""
    return dict(method="plain decoding", tau=1.0, tokens_per_s=plain.stats["tokens_per_s"], speedup=1.0,
                compile_s=None, match_rate=1.0, first_divergence=None)


def method_rows(target: Target, plain: GenerateOutput, methods: dict[str, dict], max_new_tokens: int) -> list[dict]:
    """One table row per method: greedy decoding of PROMPTS, checked against `plain` (compile run, then timed run)."""
    rows = []
    for name, kwargs in methods.items():
        first = generate(target, PROMPTS, max_new_tokens=max_new_tokens, **kwargs)
        out = generate(target, PROMPTS, max_new_tokens=max_new_tokens, **kwargs)
        agreement = check_agreement(plain.tokens, out.tokens, target.cfg.dtype, name)
        rows.append(dict(method=name, tau=out.stats["acceptance_length"], tokens_per_s=out.stats["tokens_per_s"],
                         speedup=out.stats["tokens_per_s"] / plain.stats["tokens_per_s"],
                         compile_s=first.stats["compile_s"], **agreement.as_dict()))
    return rows


def hybrid_demo(hybrid_dir: Path, draft_dir: Path, max_new_tokens: int, num_draft_tokens: int, console: Console,
                dtype: str | None) -> list[dict]:
    """The embedded hybrid with its own MTP layer and the dense draft model (same tokenizer): the table's rows."""
    target = load(hybrid_dir, dtype=dtype)
    mtp = load_drafter(hybrid_dir, target)
    methods = {"MTP (its own layer), chain of 1": dict(drafter=mtp, num_draft_tokens=1),
               "MTP (its own layer), chain of 3": dict(drafter=mtp, num_draft_tokens=3),
               f"draft model, chain of {num_draft_tokens}": dict(drafter=load_drafter(draft_dir, target),
                                                                 num_draft_tokens=num_draft_tokens),
               f"n-gram, chain of {num_draft_tokens}": dict(drafter=NgramDrafter(), num_draft_tokens=num_draft_tokens)}
    kinds = ", ".join(f"{target.cfg.layer_types.count(k)} {k.replace('_', ' ')}" for k in sorted(set(target.cfg.layer_types)))
    console.rule(f"hybrid target (Qwen3.5-style: {kinds} layers), {target.cfg.num_params() / 1e6:.1f}M params, "
                 f"{target.cfg.dtype}")
    generate(target, PROMPTS, max_new_tokens=max_new_tokens)  # compile
    plain = generate(target, PROMPTS, max_new_tokens=max_new_tokens)
    rows = [plain_row(plain)]
    rows += method_rows(target, plain, methods, max_new_tokens)
    console.print(results_table(rows, str(target.cfg.dtype)))
    return rows


def results_table(rows: list[dict], dtype: str) -> Table:
    """The summary table; its title says whether agreement with plain decoding was enforced or measured."""
    exact = dtype in EXACT_DTYPES
    title = ("greedy output identical to plain decoding for every method (checked)" if exact else
             f"{dtype}: agreement with plain greedy decoding measured (near-ties may flip between verify and decode)")
    table = Table(title=title)
    for col in ("method", "tau", "tokens/s", "speedup", "compile s", "match", "first divergence"):
        table.add_column(col, justify="left" if col in ("method", "first divergence") else "right")
    for r in rows:
        div = r["first_divergence"]
        table.add_row(r["method"], f"{r['tau']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x",
                      "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}", f"{r['match_rate']:.1%}",
                      "-" if div is None else f"row {div['row']} pos {div['position']}")
    return table
