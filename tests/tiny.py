"""Tiny random-weight targets with a real (trained) BPE tokenizer and a ChatML template.

Deterministic from a seed, a few hundred KB on disk, fast enough that the whole suite runs in minutes on
two cores. Weights are drawn wider than HF's default init (std 0.02 makes every logit nearly equal, which
turns greedy decoding into a string of near-ties); at std 0.25 the top-2 gap is usually decisive.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_WORDS = ("the a of to and in is it you that he was for on are with as I his they be at one have this from "
          "or had by hot word but what some we can out other were all there when up use your how said an each "
          "she which do their time if will way about many then them write would like so these her long make "
          "thing see him two has look more day could go come did number sound no most people my over know "
          "water than call first who may down side been now find def return print import class for while "
          "( ) [ ] { } : , . = + - * / 0 1 2 3 4 5 6 7 8 9 \n").split(" ")


def _corpus(seed: int, lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def make_tokenizer(out: Path, vocab_size: int = 384, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return fast


def make_target(out: Path, kind: str = "llama", seed: int = 0, layers: int = 8, hidden: int = 64,
                std: float = 0.25) -> Path:
    """A tiny `kind` ("llama" with tied embeddings, or "qwen3" with q/k norm) checkpoint in `out`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    out = Path(out)
    tok = make_tokenizer(out, seed=seed)
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  initializer_range=std)
    if kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif kind == "qwen3":
        cfg = Qwen3Config(**common, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF init leaves norms at 1 and draws linears/embeddings at initializer_range
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    model.save_pretrained(out)
    return out
