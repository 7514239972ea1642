"""Regenerate the bundled tiny tokenizer: byte-level BPE, Llama-3-style special tokens and chat template.

    python -m ftcore.assets.make_tokenizer [--out ftcore/assets/tokenizer]

Trained with the `tokenizers` library on text of the sample data's domain (make_data.py), so the
tiny model sees short sequences. The vocabulary is exactly VOCAB_SIZE (conf/model/tiny.yaml):
BPE tokens first, then the Llama 3 special tokens, then reserved special tokens filling up to the
size (as Llama 3 does). Digits are split one by one, which makes arithmetic learnable for a tiny
model. Deterministic: the same corpus and settings give the same tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ftcore.assets import make_data
from ftcore.data.templates import LLAMA3_TEMPLATE

VOCAB_SIZE = 2048
BOS, EOS_TEXT, EOT, PAD = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
)
SPECIALS = [BOS, EOS_TEXT, "<|start_header_id|>", "<|end_header_id|>", EOT, PAD]
MIN_RESERVED = 10

# Llama 3's split pattern, with single digits (\p{N}) instead of groups of up to three.
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    LLAMA3_TEMPLATE  # ftcore.data.templates: the same text `data.chat_template=llama3` uses
)


def corpus(seed: int = 1) -> list[str]:
    """Text of the sample domain: rendered prompts and answers, plus the plain word list."""
    train, val = make_data.generate(seed, 20000, 0)
    words = " ".join(make_data.WORDS)
    lines = ["system user assistant", words, words.upper(), words.title()] * 2
    for rec in train + val:
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        lines.append(f"user\n\n{user}")
        lines.append(f"assistant\n\n{rec['output']}")
    return lines


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIALS) - MIN_RESERVED,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    n_reserved = VOCAB_SIZE - tok.get_vocab_size()
    tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(n_reserved)])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3: plain `tokenizer(text)` starts with bos; chat rendering adds it in the template.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save(tok: Tokenizer, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    # The chat template lives in tokenizer_config.json (read by every transformers version), and the
    # class is the generic fast tokenizer, so older and newer transformers load the directory alike.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("backend", None)
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": BOS, "eos_token": EOT, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "tokenizer")
    args = ap.parse_args(argv)
    tok = build()
    save(tok, args.out)
    print(f"wrote a {tok.get_vocab_size()}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
