"""A stand-in tokenizer for a random target: one printable word per token id, so a random preset has text.

A random preset (bench/spec.py `random_model`) has no checkpoint and so no tokenizer.json, yet serving it needs
text: `bench serve` (as vLLM's) times the first token by the first streamed chunk with content, its `random`
dataset decodes ids drawn from a tokenizer's vocabulary, and stop strings are matched on text. This builds a real
`tokenizers.Tokenizer` (the class `load` reads a checkpoint's tokenizer.json into) covering exactly the target's
vocabulary, so streaming detokenization, usage counts and the load generator run on it unchanged:

- id i is the word " t{i}" (its leading space is part of the token, as byte-level BPE tokens carry theirs), so
  decoding concatenates the words and text(a + b) == text(a) + text(b): a completion's text appended to its
  prompt's is the text of all the ids, and every token decodes alone to non-empty text;
- the special ids (the config's BOS and EOS) are the special tokens "<|t{i}|>", left out of decoded text with
  skip_special_tokens as a checkpoint's are, and out of the `random` dataset's draws;
- encode(decode(ids, skip_special_tokens=False)) == ids for every id sequence; text that is not such words (a
  piece that is neither " t{i}" nor a special token) encodes to id 0, the vocabulary's unknown word.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers


def stand_in_tokenizer(vocab_size: int, special_ids: Iterable[int] = ()) -> Tokenizer:
    """A word-level tokenizer with one distinct printable token per id in [0, vocab_size).

    Args:
        vocab_size: the target's vocabulary size (its `cfg.vocab_size`); the tokenizer has exactly this many ids.
        special_ids: ids to mark as special tokens (the config's BOS and EOS ids).

    Returns:
        A `tokenizers.Tokenizer`: id i decodes to " t{i}" (special ids to "<|t{i}|>") and the words encode back
        to their ids.

    Raises:
        ValueError: vocab_size is not a positive integer, or a special id is outside [0, vocab_size).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer (the target's cfg.vocab_size), got {vocab_size!r}")
    special = sorted(set(special_ids))
    outside = [i for i in special if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"special_ids must be token ids in [0, {vocab_size}), got {outside}")
    words = [f" t{i}" for i in range(vocab_size)]
    for i in special:
        words[i] = f"<|t{i}|>"
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?\S+"), behavior="isolated")  # " t1 t2" -> " t1", " t2"
    tokenizer.decoder = decoders.Fuse()  # words joined as they are: their spaces are their own
    tokenizer.add_special_tokens([AddedToken(words[i], special=True, normalized=False) for i in special])
    return tokenizer
