"""`specjax.inspect_draft`: the first drafting round of any drafter, for looking at in a notebook.

Runs the target's prefill (greedy root), the drafter's `init` and one `propose`, and returns
what the drafter proposed and why: the draft tokens, the logits each was chosen from (target
vocabulary, after any vocabulary mapping; -inf outside a reduced draft vocabulary), the
drafter's confidences when it has them, and the whole tree when a tree was asked for.
"""

from __future__ import annotations

import dataclasses
import html
from functools import partial
from typing import Sequence

import jax
import numpy as np

from specjax.config import SamplingConfig
from specjax.decoding.decode import GREEDY, LoopConfig, prefill
from specjax.decoding.drafter import Drafter, PrefillContext, Settings, check_drafter_argument
from specjax.decoding.request import prepare, run_compiled
from specjax.decoding.sampling import choose_token, row_keys, split_rows
from specjax.decoding.speculative import check_drafter_fits
from specjax.decoding.tree import parse_tree
from specjax.models.model import merge
from specjax.models.target import Target
from specjax.multihost import to_host


@dataclasses.dataclass
class DraftInspection:
    """What a drafter proposes in the first round for one prompt, as `specjax.inspect_draft` returns it.

    Attributes:
        root: the target's greedy first token: node 0 of the draft.
        tokens: int [N - 1], the drafted tokens in node order (a chain: in sequence order).
        logits: float32 [N - 1, V], what each draft was chosen from; None for model-free drafters (n-gram).
        confidence: float32 [N - 1], P(accept | prefix accepted), for drafters that estimate it (DSpark); else None.
        tree_tokens: int [N], the whole tree's tokens, root first.
        tree_parents: int [N], each node's parent index, -1 for the root.
    """
    root: int  # the target's greedy first token: node 0 of the draft
    tokens: np.ndarray  # int [N - 1]: the drafted tokens in node order (a chain: in sequence order)
    logits: np.ndarray | None  # float32 [N - 1, V]: what each was chosen from; None for model-free drafters
    confidence: np.ndarray | None  # float32 [N - 1]: P(accept | prefix accepted), for drafters that estimate it
    tree_tokens: np.ndarray  # int [N]: root first
    tree_parents: np.ndarray  # int [N]: -1 for the root

    def __repr__(self) -> str:
        """One line: the root, the drafted tokens (the first 16) and confidences; shapes, not whole logit arrays."""
        toks = self.tokens.tolist()
        shown = ", ".join(map(str, toks[:16])) + (f", ... ({len(toks)} in all)" if len(toks) > 16 else "")
        parts = [f"root={self.root}", f"tokens=[{shown}]"]
        if self.confidence is not None:
            parts.append("confidence=[" + ", ".join(f"{c:.2f}" for c in self.confidence[:16].tolist())
                         + (", ..." if len(toks) > 16 else "") + "]")
        if self.logits is not None:
            parts.append(f"logits=<{self.logits.dtype} {list(self.logits.shape)}>")
        if len(self.tree_tokens) != len(toks) + 1 or any(p != i - 1 for i, p in enumerate(self.tree_parents.tolist())):
            parts.append(f"tree of {len(self.tree_tokens)} nodes")
        return f"DraftInspection({', '.join(parts)})"

    def _repr_html_(self) -> str:
        """A notebook cell: one row per drafted node (the first 64): its token, parent and confidence."""
        conf = self.confidence.tolist() if self.confidence is not None else [None] * len(self.tokens)
        rows = "".join(f"<tr><td>{i + 1}</td><td>{t}</td><td>{p}</td><td>{'-' if c is None else f'{c:.3f}'}</td></tr>"
                       for i, (t, p, c) in enumerate(zip(self.tokens.tolist(), self.tree_parents[1:].tolist(), conf))
                       if i < 64)
        return (f"<div><code>{html.escape(repr(self))}</code><table><tr><th>node</th><th>token</th><th>parent</th>"
                f"<th>confidence</th></tr>{rows}</table></div>")


@partial(jax.jit, static_argnames=("lc", "drafter"))
def first_draft(params, draft_params, prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B, rows, *, lc: LoopConfig,
                drafter: Drafter):
    """Prefill, choose the root, init the drafter, propose once: (root [B], Draft)."""
    del max_new_B, rows  # one greedy round
    keys_B, sub_B = split_rows(row_keys(seeds_B, fold_B), 2)
    model = merge(lc.model, params)
    cache = model.init_cache(prompt_BT.shape[0], lc.cache_len)
    logits_BV, features, _ = prefill(model, lc, cache, prompt_BT, prompt_len_B, capture=drafter.feature_layers)
    root_B = choose_token(sub_B, logits_BV, GREEDY)
    state = drafter.init(draft_params, PrefillContext(prompt_BT, prompt_len_B, root_B, features))
    draft, _ = drafter.propose(draft_params, state, root_B, keys_B)
    return root_B, draft


def inspect_draft(target: Target, drafter: Drafter, prompt: str | Sequence[int], *, num_draft_tokens: int | None = None,
                  tree=None, seed: int = 0) -> DraftInspection:
    """The first round's draft for one prompt (greedy root and greedy drafting).

    Args:
        target: the model, from `specjax.load`.
        drafter: any drafter (`specjax.load_drafter`, `NgramDrafter`, ...).
        prompt: a string (needs the target's tokenizer) or a list of token ids.
        num_draft_tokens: a chain of K drafts (default 4).
        tree: instead of num_draft_tokens, a tree shape as `generate` takes it ("kary:2,1", choice paths,
            "dynamic:...").
        seed: the round's random seed.

    Returns:
        A `DraftInspection`: the root, the drafted tokens, the logits each was chosen from, confidences, the tree.

    Raises:
        ValueError: both num_draft_tokens and tree.
        TypeError: a prompt that is neither a string nor a list of token ids.

    Example:
        ```python
        d = specjax.inspect_draft(target, drafter, "def f(x):", num_draft_tokens=4)
        d.tokens, d.logits.shape          # the drafts, and [K, V]
        ```
    """
    if num_draft_tokens is not None and tree is not None:
        raise ValueError("pass either num_draft_tokens (a chain) or tree, not both")
    if not isinstance(prompt, str) and (not isinstance(prompt, Sequence) or any(not isinstance(t, (int, np.integer))
                                                                                for t in prompt)):
        raise TypeError(f"inspect_draft looks at one prompt, a string or a list of token ids; got "
                        f"{repr(prompt)[:60]}: for a list of prompts call it once per prompt (e.g. prompts[0])")
    check_drafter_argument(drafter)
    spec = parse_tree(tree, num_draft_tokens)
    check_drafter_fits(drafter, target)
    sampling = SamplingConfig()
    req = prepare(target, [prompt], 1, sampling, None, None, seed, draft_nodes=spec.cache_slots)
    configured = drafter.configure(Settings(spec, sampling, req.lc.cache_len, req.lc.out_len, record_logits=True))
    (root_B, draft), _, _ = run_compiled(
        target, ("inspect", req.lc, configured, req.prompt_BT.shape), first_draft,
        (target.params, configured.params, *req.arrays()), {"lc": req.lc, "drafter": configured})
    root_B, draft = to_host((root_B, draft))
    row = jax.tree.map(lambda x: x[0], draft)
    return DraftInspection(
        root=int(root_B[0]), tokens=row.tokens[1:],
        logits=None if row.logits is None else row.logits[1:],
        confidence=None if row.confidence is None else row.confidence[1:],
        tree_tokens=row.tokens, tree_parents=row.parents)
