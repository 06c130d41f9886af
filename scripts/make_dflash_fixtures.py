"""Build the DFlash parity fixtures by running the original PyTorch drafter (z-lab/dflash).

    python scripts/make_dflash_fixtures.py --dflash-repo /path/to/dflash --out tests/fixtures/dflash

The original is imported from the local checkout given (dflash/model.py, commit 44947fb checked):
`DFlashDraftModel` (its forward: fc + hidden_norm on the context, every layer prepending the
context's K/V to the block's, no causal mask) and `extract_context_feature`, run unchanged.
Its decoding loop `dflash_generate` is batch-1 and chooses how many drafts to accept from the
target, so the rounds are driven here with the same calls it makes, in the same order: target
prefill with hidden states; draft pass on (new context rows + block) at positions
[draft cache length, start + block_size) with the draft DynamicCache, then `crop(start)`;
target verify pass over the block; the accepted rows' hidden states as the next context. The
number of drafts accepted between rounds is forced (0, some, all) instead of compared with the
target, so each way the draft cache is cropped and extended is covered. Nothing is downloaded
and no code of the original is copied into specjax; CI never runs this script.

Compatibility shim (here, never in the original): the original calls `DynamicCache.crop(start)`
meaning "keep the first `start` positions", as transformers 4.5x had it; transformers 5.x's crop
takes a negative count of tokens to remove and refuses a positive one. `_ensure_crop` below puts
the 4.5x meaning back on DynamicCache before the original is imported. Everything else it uses
runs unchanged under 5.x (eager attention with no mask attends to every cached row).

The tiny models: a random Qwen3ForCausalLM target (6 layers, hidden 32, 4 heads / 2 KV heads,
head_dim 16, vocab 128, untied lm_head) built from a config at runtime, and a random DFlash
drafter (2 layers, same widths, intermediate 64, taps target_layer_ids [0, 2, 4], block_size 5,
mask_token_id 127, rope_theta 1e6), both fp32 with weights ~ 1/sqrt(fan-in) so logits are O(1).

The case directory (`--out`/basic) holds
  config.json, model.safetensors   the drafter in the z-lab checkpoint format (older config
                                   style: top-level block_size and rope_theta; dflash_config
                                   {mask_token_id, target_layer_ids}; num_target_layers);
  io.npz                           inputs and the original's outputs, B = 2 rows of equal length:
    target_embed [V, H], target_lm_head [V, H]   the target's tables (torch layout)
    prompt_ids [B, T]                            the prompt
    r1_features [B, T, n*H]                      extract_context_feature of the prefill
    r1_anchor [B]                                the target's first token (block row 0)
    r1_hidden [B, K, H]                          the drafter's output (after its final norm)
    r1_logits [B, K-1, V]                        target lm_head of block rows 1..K-1 (the drafts' logits)
    r1_k, r1_v [L, B, Hkv, T, D]                 the draft cache after crop(start): context rows only
    a{a}_features [B, a+1, n*H]                  for a = 0, 2, 4 accepted drafts: the verify pass's
                                                 features at the anchor and the accepted drafts
    a{a}_anchor [B]                              the next anchor (the target's token after them)
    a{a}_hidden, a{a}_logits, a{a}_k, a{a}_v     round 2 as above (cache rows T + a + 1)
  meta.json                        versions and settings.

Round trip (a drafter exported by specjax, in the original):

    python scripts/make_dflash_fixtures.py --dflash-repo /path/to/dflash --round-trip DIR --target TARGET_DIR

loads DIR (config.json + model.safetensors) into the original `DFlashDraftModel`, runs one draft
pass over random context features with TARGET_DIR's embedding and lm_head (read by specjax),
and checks specjax's drafter (read from the same DIR) gives the same block logits and context
cache (1e-4, fp32). Nothing is written; the exit status says whether they match.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

TARGET = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=128, hidden_size=32,
              intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
              hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
DRAFTER = dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=128, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
               hidden_act="silu", attention_bias=False, block_size=5, num_target_layers=6,
               dflash_config={"mask_token_id": 127, "target_layer_ids": [0, 2, 4]}, torch_dtype="float32")
BATCH, PROMPT_LEN, SEED = 2, 7, 0
ACCEPTED = (0, 2, 4)  # drafts accepted after round 1: none, some, all (block_size - 1)


def _ensure_crop(DynamicCache) -> None:
    """Give DynamicCache the 4.5x `crop(max_length)`: keep the first max_length positions of every layer.

    The original calls `crop(start)` with the absolute length to keep. transformers 5.x's crop takes
    a negative number of tokens to remove and refuses a positive argument, so the 4.5x meaning is
    restored here (a negative argument still removes that many tokens, as in both versions).
    """
    def crop(self, max_length: int) -> None:
        length = self.get_seq_length()
        keep = length - abs(max_length) if max_length < 0 else max_length
        if length <= keep:
            return
        for layer in self.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :keep, :]
                layer.values = layer.values[..., :keep, :]

    DynamicCache.crop = crop


def randomize(torch, model, seed: int) -> None:
    """Norms ~ 1 + 0.1 N(0,1), embeddings / lm_head ~ N(0,1), other matrices ~ N(0, 1/fan_in)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)


def build(torch, transformers, dmodel, seed: int):
    """(target, drafter): the tiny random models, eager attention, fp32."""
    tcfg = transformers.Qwen3Config(**{k: v for k, v in TARGET.items() if k != "architectures"})
    tcfg._attn_implementation = "eager"
    target = transformers.Qwen3ForCausalLM(tcfg).eval()
    randomize(torch, target, seed)
    dcfg = transformers.Qwen3Config(**{k: v for k, v in DRAFTER.items() if k != "architectures"})
    dcfg._attn_implementation = "eager"
    drafter = dmodel.DFlashDraftModel(dcfg).eval()
    randomize(torch, drafter, seed + 1)
    assert drafter.block_size == DRAFTER["block_size"] and drafter.target_layer_ids == [0, 2, 4]
    theta = DRAFTER["rope_theta"]
    expected = 1.0 / theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    assert torch.allclose(drafter.rotary_emb.inv_freq, expected), "the drafter's RoPE base is not rope_theta"
    return target, drafter


def cache_kv(cache, num_layers: int):
    """The draft cache's K/V as [L, B, Hkv, T, D] arrays (RoPE applied, the original's layout)."""
    ks = [cache.layers[i].keys.numpy() for i in range(num_layers)]
    vs = [cache.layers[i].values.numpy() for i in range(num_layers)]
    return np.stack(ks), np.stack(vs)


def draft_pass(torch, drafter, target, dmodel, context, anchor, cache, start: int):
    """One draft pass as dflash_generate makes it: context rows + block, then crop(start).

    Returns (hidden [B, K, H] after the final norm, block logits [B, K-1, V], draft argmax [B, K-1]).
    """
    b, k = anchor.shape[0], drafter.block_size
    block = torch.full((b, k), drafter.mask_token_id, dtype=torch.long)
    block[:, 0] = anchor
    positions = torch.arange(cache.get_seq_length(), start + k)[None].expand(b, -1)
    hidden = drafter(target_hidden=context, noise_embedding=target.model.embed_tokens(block), position_ids=positions,
                     past_key_values=cache, use_cache=True, is_causal=False)
    cache.crop(start)
    logits = target.lm_head(hidden[:, 1 - k:, :])
    return hidden, logits, dmodel.sample(logits)


def run_case(torch, transformers, dmodel, out_dir: Path, commit: str) -> None:
    target, drafter = build(torch, transformers, dmodel, SEED)
    DynamicCache = transformers.DynamicCache
    gen = torch.Generator().manual_seed(100 + SEED)
    prompt = torch.randint(3, TARGET["vocab_size"] - 1, (BATCH, PROMPT_LEN), generator=gen)
    n_layers, k = DRAFTER["num_hidden_layers"], DRAFTER["block_size"]
    arrays = dict(target_embed=target.model.embed_tokens.weight.detach().numpy(),
                  target_lm_head=target.lm_head.weight.detach().numpy(), prompt_ids=prompt.numpy().astype(np.int32))
    with torch.no_grad():
        tcache = DynamicCache()
        out = target(prompt, position_ids=torch.arange(PROMPT_LEN)[None].expand(BATCH, -1), past_key_values=tcache,
                     use_cache=True, output_hidden_states=True)
        anchor = out.logits[:, -1].argmax(-1)
        context = dmodel.extract_context_feature(out.hidden_states, drafter.target_layer_ids)
        dcache = DynamicCache()
        start = PROMPT_LEN
        hidden, logits, drafts = draft_pass(torch, drafter, target, dmodel, context, anchor, dcache, start)
        r1_k, r1_v = cache_kv(dcache, n_layers)
        arrays |= dict(r1_features=context.numpy(), r1_anchor=anchor.numpy().astype(np.int32),
                       r1_hidden=hidden.numpy(), r1_logits=logits.numpy(), r1_drafts=drafts.numpy().astype(np.int32),
                       r1_k=r1_k, r1_v=r1_v)
        # The target's verify pass over the block [anchor, drafts], as dflash_generate runs it.
        block = torch.cat([anchor[:, None], drafts], dim=1)
        vcache = DynamicCache()
        target(prompt, past_key_values=vcache, use_cache=True)
        verify = target(block, position_ids=torch.arange(start, start + k)[None].expand(BATCH, -1),
                        past_key_values=vcache, use_cache=True, output_hidden_states=True)
        posterior = verify.logits.argmax(-1)
        for a in ACCEPTED:  # force a accepted drafts: the next context is the anchor + a drafts
            cache = DynamicCache()
            draft_pass(torch, drafter, target, dmodel, context, anchor, cache, start)  # round 1 again, fresh cache
            ctx2 = dmodel.extract_context_feature(verify.hidden_states, drafter.target_layer_ids)[:, :a + 1, :]
            anchor2 = posterior[:, a]
            hidden2, logits2, drafts2 = draft_pass(torch, drafter, target, dmodel, ctx2, anchor2, cache,
                                                   start + a + 1)
            k2, v2 = cache_kv(cache, n_layers)
            assert k2.shape[3] == start + a + 1
            arrays |= {f"a{a}_features": ctx2.numpy(), f"a{a}_anchor": anchor2.numpy().astype(np.int32),
                       f"a{a}_hidden": hidden2.numpy(), f"a{a}_logits": logits2.numpy(),
                       f"a{a}_drafts": drafts2.numpy().astype(np.int32), f"a{a}_k": k2, f"a{a}_v": v2}

    case_dir = out_dir / "basic"
    case_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(case_dir / "io.npz", **arrays)
    from safetensors.torch import save_file

    state = {name: t.contiguous() for name, t in drafter.state_dict().items()}
    save_file(state, str(case_dir / "model.safetensors"), metadata={"format": "pt"})
    (case_dir / "config.json").write_text(json.dumps(DRAFTER, indent=2) + "\n")
    meta = dict(dflash_commit=commit, torch=torch.__version__, transformers=transformers.__version__, batch=BATCH,
                prompt_len=PROMPT_LEN, seed=SEED, accepted=list(ACCEPTED), target=TARGET)
    (case_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"basic: round-1 drafts {arrays['r1_drafts'].tolist()}, tensors {sorted(state)[:4]}...")


def round_trip(torch, transformers, dmodel, head_dir: Path, target_dir: Path, seq: int = 9, tol: float = 1e-4) -> bool:
    """The exported drafter in the original vs in specjax: one draft pass's block logits and context cache."""
    import jax.numpy as jnp
    from safetensors.torch import load_file

    import specjax
    from specjax.drafters import dflash
    from specjax.loading.drafter import dflash_drafter
    from specjax.models.cache import KVCache

    target = specjax.load(target_dir, dtype="float32", attn_impl="xla")
    raw = json.loads((head_dir / "config.json").read_text())
    dcfg = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    dcfg._attn_implementation = "eager"
    model = dmodel.DFlashDraftModel(dcfg).eval()
    state = {k: v.float() for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        print(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        return False
    embed = torch.from_numpy(np.array(target.params["embed"], np.float32))
    head = embed if target.cfg.tie_word_embeddings else torch.from_numpy(np.array(target.params["lm_head"],
                                                                                     np.float32).T)
    drafter = dflash_drafter(head_dir, target, dtype="float32", attn_impl="xla")
    cfg, params = drafter.cfg, drafter.params
    gen = torch.Generator().manual_seed(0)
    n = cfg.num_taps
    feats = torch.randn(1, seq, n * cfg.hidden_size, generator=gen)
    anchor = torch.randint(0, cfg.layers.vocab_size, (1,), generator=gen)
    block = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long)
    block[:, 0] = anchor
    with torch.no_grad():
        cache = transformers.DynamicCache()
        hidden = model(target_hidden=feats, noise_embedding=embed[block], position_ids=torch.arange(seq + cfg.block_size)[None],
                       past_key_values=cache, use_cache=True, is_causal=False)
        cache.crop(seq)
        theirs = (hidden[:, 1:] @ head.T).numpy()
        their_k = cache.layers[0].keys.numpy()
    taps = tuple(jnp.asarray(f) for f in np.split(feats.numpy(), n, axis=-1))
    backbone, vocab = dflash.backbone(cfg, params), dflash.tables(cfg, params)
    kv = backbone.init_cache(1, 64)
    kv = backbone.write_context(backbone.context(taps), kv)
    kv = KVCache(kv.k, kv.v, kv.lengths + seq)
    h, kv = backbone.block_hidden(vocab.block_embeddings(jnp.asarray(anchor.numpy())), kv, attn_impl="xla")
    ours = np.asarray(vocab.logits(h[:, 1:]))
    k0 = np.asarray(kv.k[0])[:, :seq].transpose(0, 2, 1, 3)  # layer 0's [B, S, Hkv, D] in either layout
    ok = True
    for name, a, b in (("block logits", ours, theirs), ("layer-0 context K", k0, their_k)):
        diff, scale = float(np.max(np.abs(a - b))), float(np.max(np.abs(b)))
        print(f"{name}: max |specjax - original| = {diff:.2e} (max |value| {scale:.2f})")
        ok &= diff <= tol * max(1.0, scale)
    print(f"round trip {'OK' if ok else 'MISMATCH'}: {head_dir} (taps {list(cfg.feature_layers)}, "
          f"block_size {cfg.block_size})")
    return ok


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dflash-repo", required=True, type=Path, help="local checkout of z-lab/dflash")
    ap.add_argument("--out", type=Path, help="fixture directory, e.g. tests/fixtures/dflash")
    ap.add_argument("--round-trip", type=Path, metavar="DIR",
                    help="instead: load the exported drafter in DIR into the original and compare with specjax")
    ap.add_argument("--target", type=Path, help="with --round-trip: the drafter's target (embedding, lm_head, taps)")
    args = ap.parse_args(argv)
    if (args.out is None) == (args.round_trip is None):
        ap.error("give exactly one of --out and --round-trip")
    if args.round_trip is not None and args.target is None:
        ap.error("--round-trip needs --target (the drafter's embedding, lm_head and tap range come from it)")
    model_file = args.dflash_repo / "dflash" / "model.py"
    if not model_file.is_file():
        raise SystemExit(f"{model_file} not found: --dflash-repo must be a checkout of z-lab/dflash")

    import torch
    import transformers

    torch.set_num_threads(1)
    _ensure_crop(transformers.DynamicCache)
    sys.path.insert(0, str(args.dflash_repo.resolve()))
    from dflash import model as dmodel  # noqa: PLC0415 (the original, from the checkout given)

    try:
        commit = subprocess.run(["git", "-C", str(args.dflash_repo), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = "44947fb (unpacked archive, no git metadata)"
    if args.round_trip is not None:
        raise SystemExit(0 if round_trip(torch, transformers, dmodel, args.round_trip, args.target) else 1)
    run_case(torch, transformers, dmodel, args.out, commit)


if __name__ == "__main__":
    main()
