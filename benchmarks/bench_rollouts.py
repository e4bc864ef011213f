"""Rollout speed for online RL (GRPO): sampled tokens/s of jaxlm's group sampler against HF transformers' generate,
same model, prompts, lengths and sampling settings, in ONE process.

  python experiments/hf_from_gguf.py --out=runs/gemma3_270m          # the model (see the script for its packages)
  JAX_PLATFORMS=cpu python benchmarks/bench_rollouts.py --model=runs/gemma3_270m \
      --out=benchmarks/results/rollout_speed.json
  JAX_PLATFORMS=cpu python benchmarks/bench_rollouts.py --shapes=1x1 --settings=greedy --new_tokens=4   # smoke

jaxlm: `jaxlm.inference.generate.sample_groups` inside one jitted function (as an RL step calls it): one prefill
of the prompts, the KV cache repeated G times, then the decode loop. HF: `model.generate` in eager torch on the CPU,
float32, the prompts left-padded with an attention mask, each repeated G times (as `num_return_sequences=G`
does before its prefill; greedy search refuses that argument). --shapes lists prompts x
generations (1x1: batch 1; 1x8 and 8x8: 8 and 64 rows). --settings: greedy; sampled (temperature 1, no filter);
top_k50_top_p095 (temperature 1, top-k 50, then top-p 0.95). Neither stops early: jaxlm gets no stop tokens and HF
no eos_token_id, so every row makes exactly --new_tokens tokens (checked). Each (shape, setting, framework) is
called once untimed (jaxlm compiles, HF warms up), then timed --rounds times, the frameworks taking turns, and the
median reported (a shared machine's load comes in bursts); the time includes the prefill and the tokens' copy to the
host. tokens/s = rows x new tokens / seconds.

Beside them, the limit a decode step can reach on this machine: the bytes of the weights one step reads (every
parameter once: the layers and the [V, D] output table) over the memory bandwidth of a large numpy copy (read +
write bytes per second), and, for wide batches where the step is arithmetic-bound, the step's matmul FLOPs (2 x
parameters x rows) over a large numpy f32 matmul's FLOP/s. Writes --out (JSON: every number, the command, the
machine) and a markdown table beside it (--out with .md).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np
from absl import flags, logging
from flax import nnx

from jaxlm import cli
from jaxlm.inference import generate
from jaxlm.recipes import trained_runs
from jaxlm.training import atomic_files

_MODEL = flags.DEFINE_string("model", "runs/gemma3_270m", "HF decoder folder (experiments/hf_from_gguf.py makes one)")
_SHAPES = flags.DEFINE_list("shapes", ["1x1", "1x8", "8x8"], "prompts x generations per prompt")
_SETTINGS = flags.DEFINE_list("settings", ["greedy", "sampled", "top_k50_top_p095"], "sampling settings")
_FRAMEWORKS = flags.DEFINE_list("frameworks", ["jaxlm", "hf"], "jaxlm and/or hf")
_NEW = flags.DEFINE_integer("new_tokens", 32, "tokens generated per row (no early stop)")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "timed calls per framework and setting (after one untimed call); the "
                               "median is reported")
_OUT = flags.DEFINE_string("out", "", "results JSON (and a .md beside it)")
_RESUME = flags.DEFINE_bool("resume", False, "keep the rows --out already holds for the same model, lengths and "
                            "rounds, and measure only the others (a run that was cut short)")

SETTINGS = {  # (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "sampled": (1.0, 0, 1.0),
    "top_k50_top_p095": (1.0, 50, 0.95),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "Question: What is 17 times 23? Answer:", "The three laws of thermodynamics are",
           "import numpy as np\n", "Dear hiring manager, I am writing to apply for the position of",
           "In 1969, Neil Armstrong"]


def machine() -> dict:
  """What ran it: CPU model and count, memory, load, library versions."""
  cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
             platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory / 2**30, 1),
          "load_average_at_start": list(os.getloadavg()), "jax": jax.__version__, "jax_backend": jax.default_backend(),
          "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
          "transformers": transformers.__version__, "python": platform.python_version()}


def copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
  """Bytes per second a numpy copy of `gib` GiB moves (read + write), best of `repeats`."""
  src = np.ones(int(gib * 2**30) // 4, np.float32)
  dst = np.empty_like(src)
  best = min(_timed(lambda: np.copyto(dst, src))[1] for _ in range(repeats))
  return 2 * src.nbytes / best


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
  """f32 FLOP/s of a numpy n x n matmul, best of `repeats`."""
  a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
  return 2 * n**3 / min(_timed(lambda: a @ a)[1] for _ in range(repeats))


def _timed(fn):
  started = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - started


def jaxlm_runner(graphdef, params, config, prompts, generations, new_tokens):
  """run(settings, seed) -> tokens [rows, new_tokens] from sample_groups in one jitted program per shape (the
  settings are traced: one compile for all three)."""
  longest = max(map(len, prompts))
  tokens, pads = generate.left_pad(prompts, generate.prompt_width(config.model, longest, new_tokens))

  @jax.jit
  def rollouts(params, tokens, pads, key, temperature, top_k, top_p):
    return generate.sample_groups(nnx.merge(graphdef, params), tokens, pads, key, num_generations=generations,
                                  max_new_tokens=new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)

  def run(settings, seed):
    temperature, top_k, top_p = settings
    return np.asarray(rollouts(params, tokens, pads, jax.random.key(seed), np.float32(temperature),
                               np.int32(top_k), np.float32(top_p)))

  return run


def hf_runner(model, prompts, generations, new_tokens):
  """run(settings, seed) -> tokens [rows, new_tokens] from HF generate (left padding, each prompt G times)."""
  import torch  # noqa: PLC0415

  width = max(map(len, prompts))
  ids = torch.zeros((len(prompts), width), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for row, prompt in enumerate(prompts):
    ids[row, width - len(prompt):] = torch.tensor(prompt)
    mask[row, width - len(prompt):] = 1
  # Each prompt G times in a row: what num_return_sequences does before the prefill, which greedy search refuses.
  ids, mask = ids.repeat_interleave(generations, dim=0), mask.repeat_interleave(generations, dim=0)

  def run(settings, seed):
    temperature, top_k, top_p = settings
    torch.manual_seed(seed)
    sampling = (dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) if temperature > 0 else
                dict(do_sample=False))
    with torch.inference_mode():
      out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0, **sampling)
    return out[:, width:].numpy()

  return run


def markdown(result: dict) -> str:
  rows = ["| setting | prompts x generations (rows) | jaxlm tokens/s | HF tokens/s | jaxlm / HF | jaxlm ms per step "
          "| memory limit tokens/s | compute limit tokens/s | jaxlm / limit |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for key, row in result["rows"].items():
    setting, shape = key.split("/")
    cell = lambda name, fmt="{:,.1f}": fmt.format(row[name]) if name in row else "-"  # noqa: E731
    rows.append(f"| {setting} | {shape} ({row['rows']}) | {cell('jaxlm_tokens_per_s')} | {cell('hf_tokens_per_s')} "
                f"| {cell('jaxlm_vs_hf', '{:.2f}x')} | {cell('jaxlm_ms_per_step')} "
                f"| {row['memory_limit_tokens_per_s']:,.1f} | {row['compute_limit_tokens_per_s']:,.1f} "
                f"| {cell('jaxlm_of_limit', '{:.0%}')} |")
  limit = result["decode_step_limit"]
  m = result["machine"]
  return "\n".join([
      "# Rollout speed: jaxlm's group sampler against HF transformers' generate",
      "",
      f"`{result['command']}`",
      "",
      f"{result['model']}, {result['new_tokens']} new tokens per row (no early stop), prompts of "
      f"{min(result['prompt_tokens'])}-{max(result['prompt_tokens'])} tokens; after an untimed first call, the median "
      f"of {result['rounds']} timed calls, the frameworks taking turns, prefill included. Machine: {m['cpu']}, "
      f"{m['cores']} cores, {m['memory_gib']} GiB, load average "
      f"{m['load_average_at_start'][0]:.1f} at the start and {m['load_average_at_end'][0]:.1f} at the end (shared "
      f"with other work); jax {m['jax']}, torch {m['torch']} ({m['torch_threads']} threads), transformers "
      f"{m['transformers']}.",
      "",
      *rows,
      "",
      *([f"Resumed {len(result['resumed'])} time(s) after the run was cut short: the rows were measured in separate "
         "processes (each row's `measured_at` and load average are in the JSON), against the first run's limits.",
         ""] if result.get("resumed") else []),
      f"Limits: a decode step reads the {limit['weight_bytes'] / 1e9:.2f} GB of weights once; a numpy copy moves "
      f"{limit['copy_bandwidth_gb_per_s']:.1f} GB/s (read + write), so a step takes at least "
      f"{limit['memory_floor_ms_per_step']:.1f} ms (memory limit = rows / that). Its matmuls do 2 x "
      f"{limit['parameters'] / 1e6:.0f}M FLOPs per row; a numpy f32 matmul runs {limit['matmul_gflop_per_s']:.1f} "
      f"GFLOP/s (compute limit). The lower of the two is each row's limit.",
      ""])


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  unknown = [s for s in _SETTINGS.value if s not in SETTINGS] + [f for f in _FRAMEWORKS.value
                                                                 if f not in ("jaxlm", "hf")]
  if unknown:
    raise ValueError(f"{unknown[0]!r} is not a setting ({', '.join(SETTINGS)}) or framework (jaxlm, hf)")
  shapes = [tuple(map(int, s.split("x"))) for s in _SHAPES.value]
  if max(p for p, _ in shapes) > len(PROMPTS):
    raise ValueError(f"--shapes: at most {len(PROMPTS)} prompts")
  command = " ".join(["python", *sys.argv])
  result = {"command": command, "model": _MODEL.value, "new_tokens": _NEW.value, "rounds": _ROUNDS.value,
            "machine": machine(), "rows": {}}
  if _RESUME.value and _OUT.value and os.path.exists(_OUT.value):
    with open(_OUT.value) as f:
      previous = json.load(f)
    same = {key: previous.get(key) for key in ("model", "new_tokens", "rounds")}
    if same != {key: result[key] for key in same}:
      raise ValueError(f"--resume: {_OUT.value} holds a run of {same}, not of this command's settings")
    result = previous
    result.setdefault("resumed", []).append({"command": command, "at": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                      time.gmtime()),
                                              "load_average": list(os.getloadavg())})
  config, graphdef, params, tokenizer, _ = trained_runs.load_decoder(_MODEL.value)
  bos = 2  # Gemma's <bos>, first in every prompt for both frameworks
  prompts = [[bos] + [t for t in tokenizer.encode(text).ids if t != bos] for text in PROMPTS]
  result["prompt_tokens"] = [len(p) for p in prompts]
  hf_model = None
  if "hf" in _FRAMEWORKS.value:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(_MODEL.value, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None  # no early stop, as jaxlm without stop tokens

  parameters = sum(int(x.size) for x in jax.tree.leaves(params))
  weight_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
  if "decode_step_limit" in result:  # resumed: the limits the rows were measured against
    bandwidth = result["decode_step_limit"]["copy_bandwidth_gb_per_s"] * 1e9
    flops = result["decode_step_limit"]["matmul_gflop_per_s"] * 1e9
  else:
    bandwidth, flops = copy_bandwidth(), matmul_flops()
  floor_s = weight_bytes / bandwidth
  result["decode_step_limit"] = {"parameters": parameters, "weight_bytes": weight_bytes,
                                 "copy_bandwidth_gb_per_s": bandwidth / 1e9, "matmul_gflop_per_s": flops / 1e9,
                                 "memory_floor_ms_per_step": 1e3 * floor_s}
  print(f"decode step limit: {weight_bytes / 1e9:.2f} GB of weights / {bandwidth / 1e9:.1f} GB/s copy bandwidth = "
        f"{1e3 * floor_s:.1f} ms per step; matmuls {flops / 1e9:.1f} GFLOP/s", flush=True)

  for n_prompts, g in shapes:
    chosen = prompts[:n_prompts]
    rows = n_prompts * g
    runners = {}
    if "jaxlm" in _FRAMEWORKS.value:
      runners["jaxlm"] = jaxlm_runner(graphdef, params, config, chosen, g, _NEW.value)
    if hf_model is not None:
      runners["hf"] = hf_runner(hf_model, chosen, g, _NEW.value)
    for setting in _SETTINGS.value:
      key = f"{setting}/{n_prompts}x{g}"
      if all(f"{name}_tokens_per_s" in result["rows"].get(key, {}) for name in runners):
        continue  # measured by the run this one resumes
      row = result["rows"][key] = {"rows": rows, "load_average_at_start": list(os.getloadavg()),
                                   "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
      # Memory-bound until the matmuls' arithmetic takes longer than reading the weights.
      step_s = max(floor_s, 2 * parameters * rows / flops)
      row["memory_limit_tokens_per_s"] = rows / floor_s
      row["compute_limit_tokens_per_s"] = flops / (2 * parameters)  # per token, whatever the batch
      row["limit_tokens_per_s"] = rows / step_s
      outputs = {}
      for r in range(_ROUNDS.value):  # the frameworks take turns, so a burst of load from elsewhere hits both
        for name, run in runners.items():
          if r == 0:  # compiles (jaxlm) or warms up (HF)
            row[f"{name}_first_call_s"] = _timed(functools.partial(run, SETTINGS[setting], 0))[1]
          out, seconds = _timed(functools.partial(run, SETTINGS[setting], 1 + r))
          if out.shape != (rows, _NEW.value):
            raise RuntimeError(f"{name} made {out.shape} tokens, not {(rows, _NEW.value)}: it stopped early")
          outputs[name] = out
          row.setdefault(f"{name}_times_s", []).append(seconds)
          print(f"{setting:18s} {n_prompts}x{g} ({rows:2d} rows)  {name:5s} round {r}: "
                f"{1e3 * seconds / _NEW.value:.0f} ms per token step", flush=True)
      for name in outputs:
        seconds = statistics.median(row[f"{name}_times_s"])
        row[f"{name}_s"] = seconds
        row[f"{name}_tokens_per_s"] = rows * _NEW.value / seconds
        row[f"{name}_ms_per_step"] = 1e3 * seconds / _NEW.value
        print(f"{setting:18s} {n_prompts}x{g} ({rows:2d} rows)  {name:5s} {row[f'{name}_tokens_per_s']:8.1f} tokens/s "
              f"(median of {_ROUNDS.value}; first call {row[f'{name}_first_call_s']:.1f} s)", flush=True)
      if "jaxlm" in outputs:
        row["jaxlm_of_limit"] = row["jaxlm_tokens_per_s"] / row["limit_tokens_per_s"]
      if len(outputs) == 2:
        row["jaxlm_vs_hf"] = row["jaxlm_tokens_per_s"] / row["hf_tokens_per_s"]
        if setting == "greedy":  # the same model: greedy tokens agree until float rounding flips a near-tie
          row["greedy_tokens_equal_fraction"] = float((outputs["jaxlm"] == outputs["hf"]).mean())
      if _OUT.value:  # after every row: a run cut short keeps what it measured
        result["machine"]["load_average_at_end"] = list(os.getloadavg())
        os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
        atomic_files.write_json(_OUT.value, result)
        atomic_files.write_text(os.path.splitext(_OUT.value)[0] + ".md", markdown(result))
  result["machine"]["load_average_at_end"] = list(os.getloadavg())
  print(markdown(result))


if __name__ == "__main__":
  cli.run(main)
