"""Tiny Llama-style students and teachers, a word-level tokenizer and datasets, all built in memory
(no downloads) for the end-to-end trainer tests; seconds on CPU."""

import torch

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(58)]  # V = 61: not a round number
PAD, EOS = 0, 1


def tokenizer(padding_side="right"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side=padding_side)


def llama(hidden, seed, vocab=len(WORDS), init=0.02, **config):
    """A one-layer LlamaForCausalLM; `init` is the weights' std (a large one makes a peaked teacher)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD,
                      eos_token_id=EOS, bos_token_id=None, tie_word_embeddings=False, initializer_range=init, **config)
    return LlamaForCausalLM(cfg)


def sentences(n, seed, lo=3, hi=12):
    """n space-separated word sequences of random lengths in [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (), generator=g))
        out.append(" ".join(WORDS[3 + int(i)] for i in torch.randint(0, len(WORDS) - 3, (length,), generator=g)))
    return out


def counting(n, seed, lo=3, hi=12):
    """n runs of consecutive words (w5 w6 w7 ..., wrapping around): a next token the student can learn."""
    g = torch.Generator().manual_seed(seed)
    m = len(WORDS) - 3
    out = []
    for _ in range(n):
        start, length = int(torch.randint(0, m, (), generator=g)), int(torch.randint(lo, hi, (), generator=g))
        out.append(" ".join(WORDS[3 + (start + i) % m] for i in range(length)))
    return out
