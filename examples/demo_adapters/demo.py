"""Answer a few chat prompts with the default model, then with each demo adapter.

    python examples/demo_adapters/demo.py ["question" ...]

Greedy (temperature 0), the model's own chat template and stop string, all requests in
one batch.
"""

from __future__ import annotations

import sys

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.entrypoints.default_model import default_model_dir, demo_adapters

PROMPTS = sys.argv[1:] or [  # none of them is in the training data
    "Who wrote Hamlet?",
    "Describe a tiger.",
    "Who discovered penicillin?",
    "What is 9 times 7?",
]


def main() -> None:
    llm = LLM(str(default_model_dir()), max_loras=2, max_lora_rank=8, max_model_len=256)
    tok = llm.get_tokenizer()
    loras = [None] + [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(demo_adapters())]
    chats = [{"prompt_token_ids": tok.encode(  # as the server does: the template writes <bos>
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)} for p in PROMPTS]
    jobs = [(p, c, lora) for p, c in zip(PROMPTS, chats) for lora in loras]
    outs = llm.generate([c for _, c, _ in jobs], SamplingParams(temperature=0, max_tokens=48),
                        [lora for _, _, lora in jobs], use_tqdm=False)
    for (prompt, _, lora), out in zip(jobs, outs):
        if lora is None:
            print(f"\nUser: {prompt}")
        print(f"  [{lora.lora_name if lora else 'base'}] {out.outputs[0].text.strip()}")


if __name__ == "__main__":
    main()
