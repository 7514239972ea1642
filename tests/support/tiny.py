"""Small, fast settings for tests: the tiny model shrunk further, short sequences."""

TINY = [
    "+exp=tiny_full",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.num_layers=4",
    "data.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "eval.interval=0",
    "checkpoint.interval=0",
    "checkpoint.save_at_end=false",
    "logger.progress=lines",
    # this shrunken shape has no pretrained base: LoRA tests here check the math, not what it learns
    "model.allow_random_base=true",
]
