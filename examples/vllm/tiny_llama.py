"""Make a tiny Llama that vLLM can serve, from nothing on the network.

Random weights (a few MB) and a byte-level BPE tokenizer trained here on
generated text: enough for vLLM to load, schedule and decode real steps, so
that cpupin's plugin can be tried against a real server on any machine.

    python examples/vllm/tiny_llama.py /tmp/tiny-llama
    HF_HUB_OFFLINE=1 python -m vllm.entrypoints.openai.api_server --model /tmp/tiny-llama ...

Needs ``transformers`` and ``tokenizers`` (both come with vLLM).
"""

from __future__ import annotations

import argparse
import os
import random


def corpus(lines: int, seed: int) -> list[str]:
    """Sentences of common English words, reproducible from ``seed``."""
    words = (
        "the a of to and in is it that for on with as was he she they we you at by this "
        "from or one had not but what all were when there can an your which their said "
        "if do will each about how up out them then many some so these would other into "
        "has more her two like him see time could no make than first been its who now "
        "people my made over did down only way find use may water long little very after "
        "words called just where most know get through back much before go good new write "
        "our used me man too any day same right look think also around another came come "
        "work three word must because does part even place well such here take why things "
        "help put years different away again off went old number great tell men say small "
        "cpu core thread pin step token model server worker engine cache memory node queue"
    ).split()
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(4, 24))).capitalize() + "."
        for _ in range(lines)
    ]


def make(out: str, *, vocab: int = 1024, layers: int = 2, hidden: int = 256, seed: int = 0) -> str:
    """Write the model and tokenizer to ``out``; returns ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the directory to write the model to")
    parser.add_argument("--vocab", type=int, default=1024, help="tokenizer vocabulary size")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--seed", type=int, default=0, help="weights' and corpus's seed")
    args = parser.parse_args(argv)
    print(make(args.out, vocab=args.vocab, layers=args.layers, hidden=args.hidden, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
