"""A byte-level BPE tokenizer trained with Hugging Face `tokenizers`.

One special token, <|endoftext|> (id 0), is both BOS and EOS: a post-processor puts it in
front of every encoded text, and documents are joined with it, so the model learns where a
file starts and when to stop.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """Train byte-level BPE on texts; <|endoftext|> is id 0 and is prepended as BOS on encode."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)])
    return tok


def eot_id(tok: Tokenizer) -> int:
    """The id of <|endoftext|> (BOS and EOS)."""
    token_id = tok.token_to_id(EOT)
    if token_id is None:
        raise ValueError(f"this tokenizer has no {EOT} token; train it with train_tokenizer")
    return token_id
