"""Synthetic inputs for benchmarks and tests: a word-level tokenizer whose word `t<i>` is
token i (so a prompt of N words is exactly N tokens), a byte-level BPE tokenizer that
can spell any text (structured outputs), and random PEFT LoRA adapters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.adapters.experts import ExpertShape

LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_word_tokenizer(
    out_dir: str | Path, vocab_size: int, bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> None:
    """Write tokenizer.json + tokenizer_config.json: word `t<i>` <-> id i."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {}
    for role, token_id in (("bos_token", bos_token_id), ("eos_token", eos_token_id)):
        if token_id is not None:
            # single_word: "t1" must not match inside "t177".
            special[role] = AddedToken(f"t{token_id}", single_word=True, special=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.save_pretrained(str(out_dir))


BYTE_TOKENIZER_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
_BPE_CORPUS = (
    '{"name": "Ada", "age": 36, "ok": true, "tags": ["a", "b"], "score": -1.5e3, "none": null}\n'
    "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
    "yes no maybe red green blue 0123456789 function arguments parameters properties string "
)


def write_byte_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """Write a byte-level BPE tokenizer (GPT-2's scheme) of exactly `vocab_size` tokens:
    <unk>, <s> (bos), </s> (eos), the 256 bytes, then merges learned from a little JSON
    and English. Any text round-trips through it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BYTE_TOKENIZER_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_BPE_CORPUS] * 4, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"a byte tokenizer needs {vocab_size} >= 259 tokens and text to learn merges from")
    unk, bos, eos = BYTE_TOKENIZER_SPECIALS
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, bos_token=bos, eos_token=eos)
    fast.save_pretrained(str(out_dir))


def write_random_model(out_dir: str | Path, hf_config, seed: int = 0, max_shard_size=None) -> Path:
    """Save a transformers model of `hf_config` with random weights, plus a word tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out_dir), **kwargs)
    write_word_tokenizer(
        out_dir, hf_config.vocab_size, hf_config.bos_token_id, _first(hf_config.eos_token_id)
    )
    return Path(out_dir)


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def word_prompt(token_ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in token_ids)


def write_random_adapter(
    out_dir: str | Path,
    projections: dict[str, tuple[int, int]],
    rank: int,
    alpha: float | None = None,
    targets: tuple[str, ...] = LINEAR_TARGETS,
    use_rslora: bool = False,
    b_std: float = 1e-2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    experts: Mapping[str, ExpertShape] | None = None,
) -> Path:
    """Write a PEFT LoRA adapter with random A and B for every projection whose name is
    in `targets`. projections: module path -> (in_features, out_features). With
    "experts" in `targets`, also every expert's gate_up and down projections of each
    experts module in `experts`, in PEFT's target_parameters layout."""
    # On a GPU when there is one: MoE adapters hold billions of values (one tensor at a
    # time, so the device needs little free memory).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    tensors = {}
    for module, x in sorted((experts or {}).items()) if "experts" in targets else ():
        e, h, i = x.num_experts, x.hidden_size, x.intermediate_size
        for key, (in_f, out_f) in ((f"{module}.base_layer", (h, 2 * i)), (module, (i, h))):
            prefix = f"base_model.model.{key}"
            tensors[f"{prefix}.lora_A.weight"] = (randn(e * rank, in_f) / in_f**0.5).to(dtype).cpu()
            tensors[f"{prefix}.lora_B.weight"] = (randn(out_f, e * rank) * b_std).to(dtype).cpu()
    for module, (in_f, out_f) in sorted(projections.items()):
        if module.rsplit(".", 1)[-1] not in targets:
            continue
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = (randn(rank, in_f) / in_f**0.5).to(dtype).cpu()
        tensors[f"{prefix}.lora_B.weight"] = (randn(out_f, rank) * b_std).to(dtype).cpu()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": sorted(t for t in targets if t != "experts"),
        "use_rslora": use_rslora,
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    if "experts" in targets and experts:
        config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
