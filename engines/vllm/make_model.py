"""Make the real-serving suite's model from local files only (no hub): a tiny Llama.

A byte-level BPE tokenizer (vocabulary 1024) trained on the standard library's own ``*.py``
files, and a ``LlamaForCausalLM`` (hidden 128, 4 heads, 2 KV heads, 2 layers, float32) with
random weights from a fixed seed, saved as safetensors (about 2 MB). Greedy output is a fixed
function of the prompt, so a KV block that belongs to another request shows up as different
text. Run by engines/vllm/setup.sh with the engine environment's Python:

    python engines/vllm/make_model.py OUT_DIR
"""

from __future__ import annotations

import glob
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def make(out: str) -> None:
    corpus = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:200]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=2048
    )
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
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
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python engines/vllm/make_model.py OUT_DIR")
    make(sys.argv[1])
