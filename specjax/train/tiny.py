"""The embedded default pair (checkpoints/tiny/): configs, held-out prompts, acceptance estimates.

scripts/train_tiny.py trains a small Llama-shaped target on the standard library's source and a
draft model several times smaller by distillation; the helpers here are shared with the tests.
"""

from __future__ import annotations

import numpy as np

from specjax.config import ModelConfig
from specjax.generate import generate
from specjax.loading.drafter import load_drafter

EOT_ID = 0  # <|endoftext|>: BOS and EOS (tokenizer.py puts it at id 0)


def llama_hf_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int = 4096,
                    context: int = 512) -> dict:
    """A Hugging Face LlamaForCausalLM config.json dict with tied embeddings and fp32 weights."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "vocab_size": vocab,
        "max_position_embeddings": context, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": EOT_ID, "eos_token_id": EOT_ID, "torch_dtype": "float32",
    }


TARGET_HF = llama_hf_config(hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2)
DRAFT_HF = llama_hf_config(hidden=128, intermediate=344, layers=2, heads=4, kv_heads=2)


def model_config(hf: dict) -> ModelConfig:
    return ModelConfig.from_hf(hf)


def held_out_prompts(texts: dict[str, str], count: int, context_lines: int = 12) -> list[dict]:
    """Prompts ending at a function signature: the first top-level `def ...:` line (after enough
    context) of each file in path order, with the lines before it. [{"file", "line", "text"}].

    The text stops right after the colon, so the model's first token is the body's newline and
    indent (a prompt ending in "\\n" would split a token the tokenizer always merges).
    """
    prompts = []
    for rel in sorted(texts):
        lines = texts[rel].splitlines()
        for i, line in enumerate(lines):
            if i >= context_lines and line.startswith("def ") and line.rstrip().endswith(":"):
                prompts.append({"file": rel, "line": i + 1,
                                "text": "\n".join(lines[i - context_lines: i + 1]).rstrip()})
                break
        if len(prompts) == count:
            break
    return prompts


def greedy_tau(agree_T: np.ndarray, k: int) -> tuple[float, int]:
    """Greedy chain acceptance implied by teacher-forced top-1 agreement along the target's own output.

    agree_T[t] says whether the draft's argmax after the first t generated tokens equals token t.
    With greedy verification a round starting at t keeps the run of agreeing positions (at most k)
    plus the target's bonus token, and the next round starts after them. Returns (tau, rounds).
    """
    t, rounds, kept = 1, 0, 0  # token 0 comes from the prefill, before any round
    n = len(agree_T)
    while t < n:
        run = 0
        while run < k and t + run < n and agree_T[t + run]:
            run += 1
        step = min(run + 1, n - t)
        rounds, kept, t = rounds + 1, kept + step, t + step
    return (kept / rounds if rounds else 0.0), rounds


def head_acceptance(target, head_dir, prompts: list[str], chains: list[int], max_new_tokens: int,
                    log=print) -> dict[str, dict]:
    """Greedy tau of a written drafter head in the real speculative loop, per chain length, for its manifest entry.

    Every speculative output is checked equal to plain greedy decoding (a RuntimeError otherwise).
    Returns {"chain_K": record} with tau, per-position acceptance, drafter passes per token and the call.
    """
    drafter = load_drafter(head_dir, target)
    plain = generate(target, prompts, max_new_tokens=max_new_tokens)
    records = {}
    for k in chains:
        out = generate(target, prompts, max_new_tokens=max_new_tokens, drafter=drafter, num_draft_tokens=k)
        if out.tokens != plain.tokens:
            raise RuntimeError(f"speculative output with {head_dir} (chain of {k}) differs from plain greedy decoding")
        per_pos = [float(x) for x in out.stats["per_position_acceptance"]]
        log(f"tau (chain of {k}): {out.stats['acceptance_length']:.3f}, per position {[round(x, 3) for x in per_pos]}")
        records[f"chain_{k}"] = {
            "measured_greedy_tau": float(out.stats["acceptance_length"]), "per_position_acceptance": per_pos,
            "max_per_position_acceptance": max(per_pos), "num_draft_tokens": k, "max_new_tokens": max_new_tokens,
            "drafter_calls_per_token": float(out.stats["drafter_calls_per_token"]),
            "rounds": int(out.stats["rounds"]), "outputs_equal_plain_greedy": True,
            "measured_with": f"generate(target, held_out_prompts, max_new_tokens={max_new_tokens}, "
                             f"drafter=load_drafter('{head_dir}', target), num_draft_tokens={k})"}
    return records
