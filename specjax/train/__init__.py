"""Training with optax and orbax: the tiny default models and, later, drafter heads.

corpus     the Python standard library's source, split by a hash of each file's path
tokenizer  byte-level BPE with <|endoftext|> as BOS/EOS
data       token streams, step-indexed batches, target-generated continuations
model      a cache-free training forward that shares the serving decoder's layers
losses     loss hooks `loss_fn(params, batch, frozen) -> (loss, metrics)`: LM, distillation
trainer    AdamW + warm-up/cosine, a jitted step around any loss hook, resumable orbax runs
tiny       configs and acceptance helpers of checkpoints/tiny (scripts/train_tiny.py)
"""

from specjax.train.losses import distill_loss, lm_loss
from specjax.train.model import train_forward, train_logits
from specjax.train.trainer import TrainConfig, evaluate, train

__all__ = ["TrainConfig", "distill_loss", "evaluate", "lm_loss", "train", "train_forward", "train_logits"]
