"""A tiny random-weight Llama (2 layers, hidden 128, a 512-token byte-level BPE vocabulary) for the
real SGLang pair of ``tests/test_sglang_pair.py``: float32 safetensors plus a fast tokenizer.

Run with ``.venv-sglang/bin/python tests/_sglang_pair_model.py OUT_DIR``; deterministic (the
tokenizer is trained on a fixed text, the weights drawn from a fixed seed), so a directory made
once is reused (``OUT_DIR/.made`` holds the recipe's version).
"""

from __future__ import annotations

import sys
from pathlib import Path

VERSION = "2"


def corpus() -> list[str]:
    # A fixed training text: the same vocabulary on every machine and Python build.
    words = ["def", "class", "return", "import", "from", "for", "while", "if", "else", "elif", "try", "with"]
    triples = zip(words, words[3:], words[5:], strict=False)
    lines = [f"{a} {b}(x, y): {c} x + y  # {i}" for i, (a, b, c) in enumerate(triples)]
    return lines * 20 + ["hello world, the quick brown fox jumps over the lazy dog 0123456789"] * 20


def main(out: Path) -> None:
    stamp = out / ".made"
    if stamp.is_file() and stamp.read_text() == VERSION:
        return
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # type: ignore[import-not-found]
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # type: ignore[import-not-found]

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=2048
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=len(fast),
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    stamp.write_text(VERSION)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
