"""Write a LoRA adapter for the tiny model (tests/vllm/tiny_model.py): rank 8 on q_proj
and v_proj, random weights, in PEFT's layout (adapter_config.json and
adapter_model.safetensors), the files vLLM's /v1/load_lora_adapter reads.
Run with the vLLM environment's Python (it has torch and safetensors):
    <vllm-venv>/bin/python tests/vllm/tiny_lora.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RANK = 8
TARGETS = ("q_proj", "v_proj")


def build_lora(model_dir: Path, out: Path) -> None:
    import torch  # type: ignore[import-not-found]  # the vLLM venv has these
    from safetensors.torch import save_file  # type: ignore[import-not-found]

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head = hidden // config["num_attention_heads"]
    widths = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head}
    torch.manual_seed(1)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(widths[target], RANK) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    build_lora(args.model_dir, args.out)


if __name__ == "__main__":
    main()
