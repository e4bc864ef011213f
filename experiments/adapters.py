"""LoRA adapters as PEFT folders: inspect one on its base model, or merge it into the base as an ordinary HF folder.

  python experiments/adapters.py --base=BASE_HF_FOLDER --adapter=runs/lora/topics_r8/adapter            # inspect
  python experiments/adapters.py --base=BASE_HF_FOLDER --adapter=ADAPTER_FOLDER --merged=runs/x/merged  # merge

A LoRA fine-tune (`lora.rank > 0`, experiments/finetune.py) writes its adapters to <workdir>/adapter/, which
`peft.PeftModel.from_pretrained(hf_base_model, folder)` loads; this script reads such a folder (jaxlm's or one
written by peft for a GPT-2, Llama or BERT base) onto the HF base with jaxlm/interop/peft_folders.py and prints what it
adapts.
--merged folds the adapters into the weights (W + alpha / r * A B) and writes config.json + model.safetensors
(and the base's tokenizer files) that transformers loads without peft. --base may be a jaxlm fine-tune's base, e.g.
the all-MiniLM-L6-v2 folder of experiments/configs/finetune_bert.py (minilm_folder()).
"""

from __future__ import annotations

import os
import shutil

import jax
from absl import app, flags
from flax import nnx

from jaxlm.adapters import lora
from jaxlm.interop import hf_weights, peft_folders

_BASE = flags.DEFINE_string("base", None, "HF checkpoint folder of the base model (config.json + safetensors)")
_ADAPTER = flags.DEFINE_string("adapter", None, "PEFT LoRA folder (adapter_config.json + adapter_model.safetensors)")
_MERGED = flags.DEFINE_string("merged", "", "write the merged model here as an HF folder (empty: only inspect)")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def main(argv):
  del argv
  model = peft_folders.from_pretrained(_BASE.value, _ADAPTER.value)
  flat = lora._flat(nnx.state(model, nnx.Param).to_pure_dict())
  adapted = {p: v for p, v in flat.items() if isinstance(v, lora.LoRAWeight)}
  scale = float(jax.device_get(next(iter(adapted.values())).scale).reshape(-1)[0])
  adapter_params = sum(v.a.size + v.b.size for v in adapted.values())
  print(f"{type(model).__name__} ({model.config.flavour}, {model.config.num_layers} layers) with adapters on "
        f"{', '.join(sorted(adapted))}: rank {next(iter(adapted.values())).a.shape[-1]}, scale {scale:g}, "
        f"{adapter_params} adapter parameters")
  if _MERGED.value:
    if os.path.exists(_MERGED.value) and os.listdir(_MERGED.value):
      raise ValueError(f"--merged={_MERGED.value!r} exists and is not empty; choose a new folder")
    hf_weights.save_pretrained(model, _MERGED.value)  # each weight merged on its own (jaxlm.hf.save_pretrained)
    for name in TOKENIZER_FILES:
      if os.path.isfile(os.path.join(_BASE.value, name)):
        shutil.copy(os.path.join(_BASE.value, name), _MERGED.value)
    print(f"merged model written to {_MERGED.value} (transformers' from_pretrained loads it)")


if __name__ == "__main__":
  flags.mark_flags_as_required(["base", "adapter"])
  app.run(main)
