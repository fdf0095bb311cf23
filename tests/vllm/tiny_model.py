"""Build a tiny random-weight Llama that vLLM can serve, from local files only.

Run with the vLLM environment's Python (it has torch, transformers and tokenizers):

    <vllm-venv>/bin/python tests/vllm/tiny_model.py OUT_DIR

The model is random: it answers with nonsense, rarely stops on its own (send `max_tokens`,
and `ignore_eos` for exact lengths) and exists only so that a real vLLM engine runs real
batches, KV cache and metrics on a CPU in seconds. No download is needed: the byte-level
BPE tokenizer is trained on this repository's own text.

Sizes: hidden 128 with 4 heads gives head size 32, one of the sizes vLLM's CPU attention
supports (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 256
VOCAB = 2048
MAX_POSITIONS = 2048
SEED = 0

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
REPO = Path(__file__).resolve().parents[2]


def training_text(root: Path = REPO) -> list[str]:
    """This repository's Markdown and Python files, in a fixed order (deterministic merges)."""
    files = sorted([*root.glob("*.md"), *root.glob("worker/**/*.py"), *root.glob("router/**/*.py")])
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in files]
    if not texts:
        raise SystemExit(f"no text to train the tokenizer on under {root}")
    return texts


def build_tokenizer(out: Path) -> dict[str, int]:
    """Train a byte-level BPE of VOCAB tokens; write tokenizer.json and tokenizer_config.json."""
    from tokenizers import (  # type: ignore[import-not-found]  # the vLLM venv has it
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    if tokenizer.get_vocab_size() > VOCAB:
        raise SystemExit(f"tokenizer has {tokenizer.get_vocab_size()} tokens, over {VOCAB}")
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2))
    return ids


def build_model(out: Path, ids: dict[str, int]) -> None:
    """Random float32 weights in safetensors, with config.json and generation_config.json."""
    import torch  # type: ignore[import-not-found]  # the vLLM venv has these
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found]

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD],
    )
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the model into")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out)
    build_model(out, ids)
    print(f"tiny llama written to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
