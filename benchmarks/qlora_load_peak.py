"""Peak memory of a QLoRA run's start and merged export: the whole-tree path against jaxlm/interop/streaming.py's one
leaf at a time, each in a fresh process on the CPU (one device: device memory is host memory, so the peak RSS counts
both).

  python benchmarks/qlora_load_peak.py --workdir=runs/qlora_load_peak                 # a ~270M Llama, NF4 base
  python benchmarks/qlora_load_peak.py --workdir=runs/qlora_load_peak --base=int8 --layers=8

A random Llama is saved as an HF folder first (in its own process). Then, per path, a process builds the LoRA train
state, loads the folder into its frozen base and writes the merged HF folder:
  whole   the train state with lora.LoRASplit (random base), lora.load_base (the float model from
          hf_weights.from_pretrained, merged into the dequantized state, quantized again), lora.merge of the whole
          tree + every tensor on the host, then one safetensors write (the code before lora_io)
  whole_load  the same from the train state with lora.LoRASplit(empty_base=True): the whole-tree load and export alone
  leaf    the train state with lora.LoRASplit(empty_base=True), streaming.hf_source + streaming.load_base,
          streaming.save_merged
Each (with the same non-zero adapters) reports its peak RSS after each phase (getrusage's ru_maxrss); the two merged
folders are then compared tensor by tensor (float32 rounding apart, they agree). Writes <workdir>/qlora_load_peak.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from absl import app, flags

flags.DEFINE_string("workdir", "runs/qlora_load_peak", "where the HF folders and the result go")
flags.DEFINE_string("base", "nf4", "lora.base: nf4 | int8 | float")
flags.DEFINE_integer("layers", 16, "Llama blocks")
flags.DEFINE_integer("d_model", 1024, "model width")
flags.DEFINE_integer("d_ff", 2816, "MLP width")
flags.DEFINE_integer("vocab", 32000, "vocabulary size")
flags.DEFINE_string("mode", "", "internal: prepare | whole | leaf (one process each)")
FLAGS = flags.FLAGS
MiB = 2**20


def _model_config():
  from jaxlm.config import ModelConfig
  return ModelConfig(flavour="llama", vocab_size=FLAGS.vocab, num_layers=FLAGS.layers, d_model=FLAGS.d_model,
                     num_heads=FLAGS.d_model // 64, num_kv_heads=FLAGS.d_model // 64, d_ff=FLAGS.d_ff,
                     tie_embeddings=False, max_seq_len=512, compute_dtype="float32")


def _peak_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _whole_export(graphdef, params, folder: str) -> None:
  """The merged export before lora_io: the whole merged model, then every parameter and HF tensor on the host."""
  import numpy as np
  from flax import nnx
  from safetensors.numpy import save_file

  from jaxlm.adapters import lora
  from jaxlm.interop import hf_weights
  model = nnx.merge(graphdef, lora.merge(params))
  host = {k: hf_weights._to_host(v) for k, v in lora._flat(nnx.state(model, nnx.Param).to_pure_dict()).items()}
  tensors = {}
  for hf_prefix, jax_prefix, rule in hf_weights._rules(model)[0]:
    arrays = [host[jax_prefix + p] for p in rule.jax]
    for i in range(model.config.num_layers) if rule.per_layer else [None]:
      out = hf_weights._to_hf(rule, [a[i] for a in arrays] if rule.per_layer else arrays)
      tensors[hf_prefix + rule.hf.format(i=i)] = np.ascontiguousarray(out)
  os.makedirs(folder, exist_ok=True)
  save_file(tensors, os.path.join(folder, hf_weights.WEIGHTS), metadata={"format": "pt"})


def _run(mode: str) -> dict:
  import jax
  from flax import nnx

  from jaxlm.adapters import lora
  from jaxlm.config import LoRAConfig, MeshConfig, TrainConfig
  from jaxlm.interop import hf_weights, streaming
  from jaxlm.kernels import Kernels
  from jaxlm.training.state import Features, init_train_state
  from jaxlm.models.gpt import GPT
  from jaxlm.parallel import sharding
  from jaxlm.recipes import instruction_tuning
  from jaxlm.training import optim
  model_config, folder = _model_config(), os.path.join(FLAGS.workdir, "base")
  make = lambda rngs: GPT(model_config, kernels=Kernels(), rngs=rngs)
  if mode == "prepare":
    params = jax.jit(lambda: nnx.split(make(nnx.Rngs(7)))[1])()  # one compile
    hf_weights.save_pretrained(nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: make(nnx.Rngs(0)))), params), folder)
    return {}
  peaks = {"start": _peak_mib()}
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  optimizer, lora_config = optim.make_optimizer(TrainConfig(steps=10)), LoRAConfig(rank=8, base=FLAGS.base,
                                                                                    targets="all")
  started = time.time()
  split = lora.LoRASplit(lora.make_plan(abstract, lora_config), empty_base=mode != "whole")
  _, state, shardings = init_train_state(make, 0, mesh, optimizer, Features(split))
  jax.block_until_ready(state)
  peaks["init"] = _peak_mib()
  if mode != "leaf":
    full = nnx.state(hf_weights.from_pretrained(folder), nnx.Param).to_pure_dict()
    state, _ = lora.load_base(state, shardings, lora_config, make, mesh, lambda p, s: (
        instruction_tuning.place_params(full, p, s, folder), None))
    del full
  else:
    state, _ = streaming.load_base(state, shardings, lora_config, make, mesh, streaming.hf_source(folder)[1], folder)
  jax.block_until_ready(state)
  peaks["load"] = _peak_mib()
  # Trained-looking adapters (B not zero), the same in every process.
  trainable = jax.jit(lambda t: jax.tree.map(lambda x: x + 1e-3 * jax.random.normal(jax.random.key(1), x.shape), t))(
      state["params"])
  params = lora.combine(trainable, state["frozen"])
  out = os.path.join(FLAGS.workdir, f"merged_{mode}")
  (streaming.save_merged if mode == "leaf" else _whole_export)(graphdef, params, out)
  peaks["export"] = _peak_mib()
  return {"peak_rss_mib": peaks, "seconds": time.time() - started,
          "frozen_base_mib": lora.per_device_bytes(state["frozen"]) / MiB}


def _compare(a: str, b: str) -> dict:
  """The two merged folders' tensors: the same names and dtypes, the largest difference relative to the weight."""
  import numpy as np
  from safetensors import safe_open
  worst = 0.0
  with safe_open(a, framework="numpy") as fa, safe_open(b, framework="numpy") as fb:
    assert sorted(fa.keys()) == sorted(fb.keys())
    for name in fa.keys():
      x, y = fa.get_tensor(name), fb.get_tensor(name)
      assert x.dtype == y.dtype, name
      worst = max(worst, float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30)))
    return {"tensors": len(list(fa.keys())), "max_difference_over_max_weight": worst}


def main(argv):
  del argv
  if FLAGS.mode:
    print("RESULT " + json.dumps(_run(FLAGS.mode)), flush=True)
    return
  os.makedirs(FLAGS.workdir, exist_ok=True)
  args = [a for a in sys.argv[1:] if not a.startswith("--mode")]
  results = {}
  for mode in ("prepare", "whole", "whole_load", "leaf"):
    done = subprocess.run([sys.executable, __file__, f"--mode={mode}", *args], check=True, capture_output=True,
                          text=True)
    results[mode] = json.loads(next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))[7:])
    print(mode, results[mode], flush=True)
  del results["prepare"]
  import numpy as np
  from flax import nnx

  from jaxlm.adapters import lora
  from jaxlm.models.gpt import GPT
  abstract = nnx.split(nnx.eval_shape(lambda: GPT(_model_config(), rngs=nnx.Rngs(0))))[1]
  leaves = [x for x in lora._flat(abstract.to_pure_dict()).values()]
  weights = os.path.join(FLAGS.workdir, "merged_{}", "model.safetensors")
  summary = {
      "command": "python benchmarks/qlora_load_peak.py " + " ".join(args), "base": FLAGS.base,
      "params": int(sum(np.prod(x.shape) for x in leaves)),
      "float_model_mib": sum(np.prod(x.shape) * x.dtype.itemsize for x in leaves) / MiB,
      "largest_float_leaf_mib": max(np.prod(x.shape) * x.dtype.itemsize for x in leaves) / MiB,
      "merged_whole_vs_leaf": _compare(weights.format("whole"), weights.format("leaf")), **results}
  with open(os.path.join(FLAGS.workdir, "qlora_load_peak.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
