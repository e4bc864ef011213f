"""Generate text from a decoder, with the KV-cache decoder: the latest checkpoint of a jaxlm training run, or an HF
checkpoint folder.

  python experiments/generate.py --workdir=runs/demo --prompt="def " --prompt="class Foo" --max_new_tokens=96
  python experiments/generate.py --init_from=path/to/hf_folder --prompt="The capital of France is" --temperature=0

--workdir reads <workdir>/config.json (the run's config), <workdir>/tokenizer.json and the newest readable checkpoint
under <workdir>/checkpoints; prints each prompt with its continuation and writes them to <workdir>/generate.json
(flat: `checkpoint_step`, `sample_<i>_prompt`, `sample_<i>_text`, `sample_<i>_tokens` (the generated ids), the
sampling settings and the KV cache's bytes).
--init_from takes an HF decoder folder (config.json + model.safetensors + tokenizer.json, as transformers'
save_pretrained writes it; float32) or a jaxlm run workdir (jaxlm.recipes.trained_runs.load_decoder); it only reads
the folder: the JSON is written where --output says, if it says. Give one of the two.
--temperature=0 is greedy; --top_k / --top_p filter the distribution; a sample ends at the tokenizer's
end-of-document token (and, for an HF folder, at the eos_token_id of its generation_config.json or config.json, as
transformers' generate). --chat wraps each prompt as a user turn (after --system) in the chat template the folder
holds (chat_template.jinja, or tokenizer_config.json's) and ends samples at the template's end-of-turn tokens.
--kv_cache=int8 keeps the cache in int8 and also generates with the float cache (same seed)
to report how many generated tokens agree (`kv_cache_token_agreement`: the shared prefix of each pair of samples,
over all float-cache tokens; `kv_cache_teacher_forced_argmax_agreement`: on the float cache's tokens, how often the
int8 cache's logits pick the same next token; `kv_cache_max_logit_gap_relative`) and the bytes saved.
--weights=weight_only or w8a8_dynamic generates with int8 weights (jaxlm.compress.quantization), with either cache.
Runtime: about 15 s for the demo model on a 2-core CPU (mostly start-up and compilation); --kv_cache=int8 adds the
float run and the comparison.
"""

from __future__ import annotations

import functools
import json
import os

import jax
from absl import flags, logging

from jaxlm import cli
from jaxlm import data as data_lib
from jaxlm.data.tuning import chat
from jaxlm.inference import generate
from jaxlm.recipes import trained_runs

_WORKDIR = flags.DEFINE_string("workdir", None, "training run folder (config.json, tokenizer.json, checkpoints/)")
_INIT_FROM = flags.DEFINE_string("init_from", None, f"instead of --workdir: {trained_runs.FOLDER_HELP}; only read")
_PROMPT = flags.DEFINE_multi_string("prompt", ["def "], "prompt text; repeat the flag for a batch of prompts")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 96, "tokens generated after each prompt (at most)")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "sampling temperature; 0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 40, "sample among the k most likely tokens (0 = all)")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "sample within the smallest set of tokens with this probability mass")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_TENSOR = flags.DEFINE_integer("mesh_tensor", 1, "devices that split heads (the other devices split the batch)")
_KV_CACHE = flags.DEFINE_enum("kv_cache", "float", list(generate.KV_CACHES),
                              "KV cache: float (the compute dtype) or int8 (per-token scales; compared with float)")
_WEIGHTS = flags.DEFINE_enum("weights", "float", list(trained_runs.WEIGHTS),
                             "float (as trained) or int8 weights (jaxlm.compress.quantization's weight_only or "
                             "w8a8_dynamic)")
_OUTPUT = flags.DEFINE_string("output", "", "JSON file for the samples (default: <workdir>/generate.json with "
                              "--workdir, none with --init_from)")
_CHAT = flags.DEFINE_bool("chat", False, "each prompt is a user turn under the chat template in the workdir or "
                          "--init_from folder (chat_template.jinja or tokenizer_config.json); samples end at its "
                          "end-of-turn tokens")
_SYSTEM = flags.DEFINE_string("system", "", "with --chat: a system turn before each prompt")


load_run = trained_runs.load_decoder_run  # (config, graphdef, params, tokenizer, step) of a run's newest checkpoint


def shared_prefix(a: list[int], b: list[int]) -> int:
  """How many leading tokens two samples share."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def teacher_forced_comparison(graphdef, params, prompts: list[list[int]], outputs: list[list[int]], pad_id: int):
  """Feeds each prompt + its float-cache continuation through the decoder with a float and an int8 cache (one
  prefill each: the int8 cache quantizes every key and value as it is written, exactly as step-by-step decoding
  does) and compares the logits at the continuation's positions: (fraction of equal argmax tokens, largest logit
  difference relative to the largest |logit|)."""
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  width = max(len(p) + len(o) for p, o in zip(prompts, outputs))
  tokens = np.full((len(prompts), width), pad_id, np.int32)  # right padding: causal, so no real token sees it
  scored = np.zeros((len(prompts), width), bool)
  for row, (prompt, out) in enumerate(zip(prompts, outputs)):
    tokens[row, :len(prompt) + len(out)] = prompt + out
    scored[row, len(prompt) - 1:len(prompt) + len(out) - 1] = True  # the positions that predicted `out`

  @functools.partial(jax.jit, static_argnames="quantized")
  def logits(params, tokens, quantized):
    model = nnx.merge(graphdef, params)
    return model.decode(tokens, model.init_cache(tokens.shape[0], tokens.shape[1], quantized=quantized))[0]

  float_logits = np.asarray(logits(params, tokens, quantized=False))
  int8_logits = np.asarray(logits(params, tokens, quantized=True))
  agree = (float_logits.argmax(-1) == int8_logits.argmax(-1))[scored].mean()
  gap = np.abs(float_logits - int8_logits)[scored].max() / np.abs(float_logits[scored]).max()
  return float(agree), float(gap)


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  folder = trained_runs.chosen_folder(_WORKDIR.value, _INIT_FROM.value)
  if _INIT_FROM.value:
    trained_runs.check_decoder_folder(folder)  # no folder, an encoder: before anything else
  if _CHAT.value:
    chat.require(folder)  # a folder without a template fails before the model loads
  if _WORKDIR.value:
    config, graphdef, params, tokenizer, step = load_run(folder, _TENSOR.value)
  else:
    config, graphdef, params, tokenizer, step = trained_runs.load_decoder(folder, _TENSOR.value)
  graphdef, params = trained_runs.with_weights(graphdef, params, _WEIGHTS.value)
  eos = data_lib.eos_id(tokenizer)
  stop_tokens = tuple(trained_runs.stop_ids(folder, tokenizer))
  if _CHAT.value:
    system = [{"role": "system", "content": _SYSTEM.value}] if _SYSTEM.value else []
    prompts = [chat.prompt_ids(folder, system + [{"role": "user", "content": p}]).tolist()
               for p in _PROMPT.value]
    stop_tokens = tuple(chat.end_of_turn_ids(folder))
  else:
    prompts = [tokenizer.encode(p).ids or [eos] for p in _PROMPT.value]
  limit = config.model.max_seq_len if config.model.flavour == "gpt2" else None
  new_tokens = _MAX_NEW_TOKENS.value
  if limit is not None:  # the learned position table bounds prompt + continuation
    prompts = [p[-(limit - 1):] for p in prompts]
    new_tokens = min(new_tokens, limit - max(len(p) for p in prompts))
  settings = dict(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value, stop_tokens=stop_tokens,
                  seed=_SEED.value, pad_id=eos)
  outputs = generate.generate(graphdef, params, prompts, new_tokens, kv_cache=_KV_CACHE.value, **settings)
  result = {"checkpoint_step": step, "model": folder, "temperature": _TEMPERATURE.value, "top_k": _TOP_K.value,
            "top_p": _TOP_P.value, "seed": _SEED.value, "kv_cache": _KV_CACHE.value, "weights": _WEIGHTS.value}
  slots = generate.prompt_width(config.model, max(len(p) for p in prompts), new_tokens) + new_tokens
  for kind in generate.KV_CACHES:  # the cache generate allocates for this batch, from shapes alone
    result[f"kv_cache_bytes_{kind}"] = generate.kv_cache_bytes(graphdef, params, len(prompts), slots, kind)
  if _KV_CACHE.value == "int8":
    reference = generate.generate(graphdef, params, prompts, new_tokens, kv_cache="float", **settings)
    shared = sum(shared_prefix(a, b) for a, b in zip(outputs, reference))
    result["kv_cache_token_agreement"] = shared / max(1, sum(len(r) for r in reference))
    result["kv_cache_identical_samples"] = sum(a == b for a, b in zip(outputs, reference))
    result["kv_cache_bytes_saved_fraction"] = 1 - result["kv_cache_bytes_int8"] / result["kv_cache_bytes_float"]
    agree, gap = teacher_forced_comparison(graphdef, params, prompts, reference, eos)
    result["kv_cache_teacher_forced_argmax_agreement"], result["kv_cache_max_logit_gap_relative"] = agree, gap
    print(f"int8 KV cache: {result['kv_cache_bytes_int8']} bytes vs {result['kv_cache_bytes_float']} float "
          f"({100 * result['kv_cache_bytes_saved_fraction']:.1f}% saved); generated tokens shared with the float "
          f"cache: {100 * result['kv_cache_token_agreement']:.1f}%, identical samples "
          f"{result['kv_cache_identical_samples']}/{len(prompts)}; on the float cache's tokens the int8 cache's argmax "
          f"agrees at {100 * agree:.2f}% of positions, largest logit gap {100 * gap:.2f}% of the largest |logit|")
  for i, (prompt, ids, out) in enumerate(zip(_PROMPT.value, prompts, outputs)):
    text = tokenizer.decode(ids + out)
    result[f"sample_{i}_prompt"], result[f"sample_{i}_text"] = prompt, text
    result[f"sample_{i}_tokens"] = out  # the generated token ids
    print(f"--- sample {i} ({folder if step is None else f'checkpoint step {step}'}) ---\n{text}")
  output = _OUTPUT.value or (os.path.join(_WORKDIR.value, "generate.json") if _WORKDIR.value else "")
  if output and jax.process_index() == 0:
    with open(output, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  cli.run(main)
