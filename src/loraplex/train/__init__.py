"""LoRA fine-tuning (`loraplex train`): dense and MoE models, PEFT-format adapters.

data.py JSONL -> ids + labels; lora.py LoRA wrappers injected into a transformers model;
moe.py grouped expert GEMMs (base + LoRA, never B A); routing.py routing replay under
gradient checkpointing; trainer.py the loop; checkpoint.py resumable state; save.py the
PEFT layout; run.py the command's flags.
"""
