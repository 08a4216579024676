"""LoRA fine-tuning (`loraplex train`): dense and MoE models, PEFT-format adapters.

data.py JSONL -> ids + labels; lora.py LoRA wrappers injected into a transformers model;
expert_gemm.py grouped expert GEMMs (base + LoRA, never B A; folded stacks); moe.py the
expert projections' autograd functions over expert-sorted pairs; routing.py routing
replay under gradient checkpointing; attention.py, norms.py, rope.py, loss.py the fused
pieces of a step; graphed.py steps replayed from CUDA graphs; trainer.py the loop;
checkpoint.py resumable state; save.py the PEFT layout; run.py the command's flags;
quantized_base.py and quantized.py a frozen quantized base.
"""
