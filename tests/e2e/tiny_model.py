"""Build a tiny Llama target, EAGLE-3 and P-EAGLE head configs and a locally trained tokenizer (no hub,
no weights).

vLLM loads them with ``load_format=dummy``. Run with the vLLM virtualenv's Python (needs
``tokenizers``): ``python -m tests.e2e.tiny_model OUT_DIR`` writes ``OUT_DIR/target``,
``OUT_DIR/eagle3`` and ``OUT_DIR/peagle`` (the EAGLE-3 head plus a mask token, run with
``parallel_drafting``). Head dim 32: vLLM's CPU attention supports 32, 64, 80 and up;
``SPECCONTROL_E2E_HEAD_DIM`` overrides it (scripts/gpu_check.sh uses 64, which every GPU backend has).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

VOCAB = 2048
_TEXT = (
    "the quick brown fox jumps over the lazy dog speculative decoding draft token accept reject engine "
    "scheduler metrics controller vllm llama model alpha beta gamma delta epsilon zeta eta theta iota"
)
_WORDS = _TEXT.split(" ")


def _layers(n: int) -> dict[str, object]:
    head_dim = int(os.environ.get("SPECCONTROL_E2E_HEAD_DIM", "32"))
    return {
        "model_type": "llama",
        "hidden_size": 4 * head_dim,
        "intermediate_size": 8 * head_dim,
        "num_hidden_layers": n,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def build(out: Path) -> tuple[Path, Path]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    target, head = out / "target", out / "eagle3"
    target.mkdir(parents=True, exist_ok=True)
    head.mkdir(parents=True, exist_ok=True)
    corpus = [
        " ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(12)) + f" {i}" for i in range(2000)
    ]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": 4096,
                "add_bos_token": False,
            }
        )
    )
    (target / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        **_layers(2),
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    (target / "config.json").write_text(json.dumps(cfg, indent=1))
    (target / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    )
    # EAGLE-3 aux layer ids must be distinct ([0, 1, 1] breaks combine_hidden_states).
    eagle = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layers(1),
        "draft_vocab_size": VOCAB,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
    }
    (head / "config.json").write_text(json.dumps(eagle, indent=1))
    # The same head shape as a P-EAGLE head (parallel drafting): masked slots need a mask token.
    peagle = out / "peagle"
    peagle.mkdir(parents=True, exist_ok=True)
    (peagle / "config.json").write_text(json.dumps({**eagle, "mask_token_id": 2}, indent=1))
    return target, head


if __name__ == "__main__":
    t, h = build(Path(sys.argv[1]))
    print(t, h)
