"""Tiny random-weight models built by transformers, PEFT adapters, and the HF oracle.

Tests run on CPU in float32 by default. LORAPLEX_TEST_DEVICE=cuda and
LORAPLEX_TEST_DTYPE=bfloat16 run the same suite on a GPU in bf16, with the tolerances
of `tolerance()`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loraplex.bench.synthetic import write_random_model

DEVICE = os.environ.get("LORAPLEX_TEST_DEVICE", "cpu")
if DEVICE == "cpu":  # Triton kernels run on CPU tensors in the interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
DTYPE = os.environ.get("LORAPLEX_TEST_DTYPE", "float32")
VOCAB = 384
BOS, EOS = 1, 2

# Every dense architecture, at a size a CPU runs in milliseconds. Each one exercises its
# own feature: llama3 rope scaling, Qwen2 qkv bias + tied embeddings, Qwen3 q/k norm with
# head_dim != hidden / heads, Mistral sliding window (shorter than test prompts).
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.08,
)
ARCHS = {
    "llama": ("LlamaConfig", dict(
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64),
    )),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(sliding_window=12)),
    # Gemma 3: sandwich norms with (1 + w), GELU-tanh, scaled embeddings, q/k norm, local
    # and global layers with their own rope bases, query_pre_attn_scalar != head_dim,
    # final logit soft-capping (real Gemma 3 leaves it off; this exercises the path).
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=32, num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=10,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        final_logit_softcapping=30.0,
    )),
}


def tolerance() -> dict:
    """Max |logprob difference| allowed against the HF oracle, per dtype.

    float32: both sides compute the same float32 math in a different order. bfloat16:
    loraplex and transformers each round to bf16 at different points (fused q/k/v,
    float32 LoRA intermediates), ~3 significant digits.
    """
    return {"float32": 1e-4, "bfloat16": 6e-2, "float16": 2e-2}[DTYPE]


def batch_tolerance() -> float:
    """Max |logprob difference| for the same request run in different batches or chunks:
    float32 differs only in summation order; bf16 matmuls of other shapes round
    differently, ~1e-2 on logprobs of this size."""
    return {"float32": 1e-5, "bfloat16": 3e-2, "float16": 1e-2}[DTYPE]


def build_tiny_model(out_dir: Path, arch: str, seed: int = 0, max_shard_size=None) -> Path:
    import transformers

    cls_name, extra = ARCHS[arch]
    config = getattr(transformers, cls_name)(**{**_COMMON, **extra})
    return write_random_model(out_dir, config, seed, max_shard_size)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def chat_model(model_dirs, tmp_path_factory):
    """The tiny Qwen3 with a chat template (prompt = the messages' words)."""
    from serving import make_chat_model

    return make_chat_model(model_dirs["qwen3"], tmp_path_factory.mktemp("chat") / "qwen3")


# Adapters that differ in rank, targets, scaling rule and per-module patterns.
ADAPTERS = {
    "all7-r8": dict(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qv-r4-rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp-o-r16-patterns": dict(
        r=16, lora_alpha=32, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 6}, alpha_pattern={"gate_proj": 5},
    ),
}


def make_peft_adapter(model_dir: Path, out_dir: Path, seed: int = 0, **lora_kwargs) -> Path:
    """Save a PEFT adapter with random A and B (PEFT's own init_lora_weights=False)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():  # keep deltas noticeable but the model sane
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def adapter_dirs(model_dirs, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """arch -> adapter name -> PEFT adapter directory."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        arch: {
            name: make_peft_adapter(model_dirs[arch], root / arch / name, seed=i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())
        }
        for arch in ARCHS
    }


class HFOracle:
    """transformers (+ PEFT) on the same weights, float32 on CPU: the reference. (dtype
    bfloat16: the same on CPU in bf16, to tell bf16's own effects, such as a router tie
    that flips, from loraplex's.)"""

    def __init__(self, model_dir: Path, adapter_dir: Path | None = None, dtype=torch.float32):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_dir)
        self.model = model.eval()

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0].float()

    def prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1]: logprob of ids[i + 1] given ids[: i + 1]."""
        lp = self.logits(ids).log_softmax(-1)
        return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]

    def greedy(self, ids: list[int], n: int) -> list[int]:
        ids = list(ids)
        out = []
        for _ in range(n):
            out.append(int(self.logits(ids)[-1].argmax()))
            ids.append(out[-1])
        return out


def make_llm(model_dir: Path, **kwargs):
    from loraplex import LLM

    kwargs.setdefault("device", DEVICE)
    kwargs.setdefault("ops_backend", os.environ.get("LORAPLEX_TEST_BACKEND", "auto"))
    kwargs.setdefault("dtype", DTYPE)
    kwargs.setdefault("cudagraph_mode", os.environ.get("LORAPLEX_TEST_CUDAGRAPH_MODE", "FULL"))
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("max_loras", 4)
    kwargs.setdefault("max_lora_rank", 16)
    kwargs.setdefault("max_num_seqs", 16)
    return LLM(str(model_dir), **kwargs)


def assert_same_greedy_tokens(a, b):
    """float32: identical greedy tokens. bf16 rounds differently in batches of other
    shapes, so two greedy runs may part at a near-tie: up to the first difference the
    tokens agree, and there both picks are within batch_tolerance() in b's logprobs."""
    if DTYPE == "float32":
        assert a.token_ids == b.token_ids
        return
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            scores = b.logprobs[i]
            assert x in scores, f"step {i}: {x} is not among the top tokens of {scores}"
            assert scores[y].logprob - scores[x].logprob <= batch_tolerance(), (i, scores)
            return


def random_prompts(n: int, length_range=(5, 40), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(*length_range, (n,), generator=gen).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=gen).tolist() for k in lengths]


def pytest_terminal_summary(terminalreporter):
    """The abuse suite's count of cases tried and failed (tests/test_abuse.py)."""
    import sys

    abuse = sys.modules.get("test_abuse")
    if abuse is None or not abuse.TALLY:
        return
    tally = abuse.TALLY
    kinds = sorted({k.rsplit(" ", 1)[0] for k in tally})
    tried = sum(tally[f"{k} tried"] for k in kinds)
    failed = sum(tally[f"{k} failed"] for k in kinds)
    terminalreporter.section("abuse suite")
    for k in kinds:
        if tally[f"{k} failed"]:
            terminalreporter.write_line(f"  {k}: {tally[f'{k} failed']} of {tally[f'{k} tried']} failed")
    terminalreporter.write_line(f"abuse suite: {tried} cases tried, {failed} failed")
