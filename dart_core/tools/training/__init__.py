"""Training draft heads: data, the target-state cache, the draft vocabulary, checkpoints, logging.

Compute is the scarce resource (a 2-core CPU runs the 135M target teacher-forced at ~500 tokens/s),
so the target runs over the data exactly once: `build_cache` stores, per token, the three captured
hidden states (the head's input) and the final-normed hidden state (from which the teacher's
distribution over the draft vocabulary is recomputed with the target's LM head rows). Every epoch
then reuses the cache. Labels are the target's own distributions (distillation); the data's texts
only supply the contexts (or the target's own answers, with self-distillation).

Two objectives share everything but the forward that produces the draft rows (`train_head`):
  DART    one prefix-packed forward per record: D mask slots after each sampled anchor give D+1 rows;
  EAGLE3  the training-time test: a causal forward over the record, then D unrolled steps at the
          sampled anchors, each fed the head's own previous output state (what drafting does).
Both minimise Σ_j γ^j · KL(target ‖ draft) over their rows (`rows_loss`).

Cache layout (a directory):
    meta.json                     target, draft vocab, shard list, token counts
    {split}-{k:05d}.safetensors   tokens (N,) int32, offsets (R+1,) int64 record boundaries,
                                  aux (N, 3H) bf16, final (N, H) bf16, answer_start (R,) int64
                                  (where each record's answer begins: anchors are drawn from there on;
                                  absent in older caches: 0); a self-distilled corpus (training/corpus.py)
                                  adds index, sampled and last, and keeps its draft vocabulary in
                                  draft_vocab.json

Modules: `cache` (records, self-distillation, the state cache and its shards, the draft vocabulary),
`corpus` (the self-distilled corpus: the target answers a prompt pool in continuous batches),
`objectives` (DART and EAGLE3 rows and their loss), `loop` (the shared training loop). Everything but
`corpus`, a tool of its own (dart_core.training.corpus), is re-exported here.
"""

from __future__ import annotations

from .cache import (
    CACHE_META,
    DRAFT_VOCAB_FILE,
    MIN_RECORD_TOKENS,
    SELF_DISTILL_FILE,
    SHARD_TOKENS,
    CacheConfig,
    CachedRecord,
    answer_start,
    build_cache,
    cache_meta,
    draft_vocabulary,
    load_split,
    mmap_safetensors,
    record_tensors,
    vocab_mapping,
    write_shard,
)
from .loop import (
    OBJECTIVES,
    TrainConfig,
    adopt_vocabulary,
    cosine_lr,
    evaluate,
    new_head_from_target,
    sample_anchors,
    target_argmax,
    train_dart,
    train_eagle3,
    train_head,
)
from .objectives import (
    dart_anchor_logits,
    dart_attention_mask,
    dart_record_loss,
    eagle3_anchor_logits,
    eagle3_record_loss,
    rows_loss,
)

__all__ = [
    "CACHE_META",
    "DRAFT_VOCAB_FILE",
    "MIN_RECORD_TOKENS",
    "OBJECTIVES",
    "SELF_DISTILL_FILE",
    "SHARD_TOKENS",
    "CacheConfig",
    "CachedRecord",
    "TrainConfig",
    "adopt_vocabulary",
    "answer_start",
    "build_cache",
    "cache_meta",
    "cosine_lr",
    "dart_anchor_logits",
    "dart_attention_mask",
    "dart_record_loss",
    "draft_vocabulary",
    "eagle3_anchor_logits",
    "eagle3_record_loss",
    "evaluate",
    "load_split",
    "mmap_safetensors",
    "new_head_from_target",
    "rows_loss",
    "record_tensors",
    "sample_anchors",
    "target_argmax",
    "train_dart",
    "train_eagle3",
    "train_head",
    "vocab_mapping",
    "write_shard",
]
