"""Test set-up: 4 simulated CPU devices, strict rank promotion and one XLA compilation cache for the session, before
anything imports jax."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

_flags = os.environ.get("XLA_FLAGS", "")
# XLA:CPU's older fusion emitters: they compile faster, and run some models' steps slower (WORKSPACE.md).
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
CHEAP_BACKEND = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=4").strip()
if "xla_backend_optimization_level" not in _flags:
  # The suite compiles hundreds of small programs and runs each for a few steps (compiling is two thirds of its
  # time): XLA's cheapest CPU backend settings and its older loop emitters for fusions compile in about half the time
  # and change results only by float rounding (measured in WORKSPACE.md). Set here once, in the pytest process; its
  # xdist workers and their subprocesses inherit them.
  os.environ["XLA_FLAGS"] += " " + CHEAP_BACKEND
  # jaxlib 0.11 has no such flag, and XLA aborts on a flag it does not know: ask a throwaway process first.
  if subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                    env=dict(os.environ, XLA_FLAGS=LOOP_EMITTERS, JAX_PLATFORMS="cpu")).returncode == 0:
    os.environ["XLA_FLAGS"] += " " + LOOP_EMITTERS
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _session_path(variable: str, name: str) -> str | None:
  """Sets `variable` to a path of this test session's own (shared by both xdist workers, children of the pytest
  process, and the subprocesses they start) unless it is set already; returns the path it set, or None."""
  if variable in os.environ:
    return None
  owner = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
  os.environ[variable] = os.path.join(tempfile.gettempdir(), f"{name}-{owner}")
  return os.environ[variable]


# One persistent XLA cache for the session: the suite compiles the same programs again and again (a run, its stop,
# its resume; each CLI subprocess), and a cache hit skips the compile. Programs that compile in under a quarter of a
# second stay out: writing and reading them back costs about what compiling them again does.
CACHE_MIN_COMPILE_S = 0.25
_OWN_CACHE = _session_path("JAX_COMPILATION_CACHE_DIR", "jaxlm-test-xla-cache")
if _OWN_CACHE:
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(CACHE_MIN_COMPILE_S)
# One shared cache of prepared corpora (jaxlm/data/corpora/corpus_cache.py): the demo corpus is tokenized once, not
# once per run; its file lock lets both workers share it.
_OWN_DATA_CACHE = _session_path("JAXLM_DATA_CACHE", "jaxlm-test-data-cache")
# The CPU's matmul peak (MFU's denominator) measured once for the session, not again in every CLI subprocess
# (seconds each: jaxlm/training/telemetry.py).
_OWN_PEAK_CACHE = _session_path("JAXLM_PEAK_FLOPS_CACHE", "jaxlm-test-peak-flops.json")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
if _OWN_CACHE:  # in case a plugin imported jax before this file set the variables
  jax.config.update("jax_compilation_cache_dir", _OWN_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)


def pytest_sessionfinish(session, exitstatus):
  """The pytest process (not an xdist worker) removes the session's XLA and data caches."""
  del session, exitstatus
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    for cache in (_OWN_CACHE, _OWN_DATA_CACHE):
      if cache:
        shutil.rmtree(cache, ignore_errors=True)
    if _OWN_PEAK_CACHE and os.path.exists(_OWN_PEAK_CACHE):
      os.remove(_OWN_PEAK_CACHE)


# The files that take longest, started first: both xdist workers (--dist loadfile: one file to one worker) then end
# together instead of one waiting on a long file handed out last.
LONGEST_FIRST = ("test_finetune", "test_slurm", "test_plan", "test_preferences", "test_gpu_checks", "test_kernels",
                 "test_parallel", "test_policy_optimization", "test_multiprocess", "test_distillation", "test_train",
                 "test_generate", "test_lora", "test_reliability_soak", "test_hf", "test_optimize", "test_moe",
                 "test_muon", "test_distill", "test_distill_loss", "test_pipeline", "test_lm_eval",
                 "test_quantization", "test_prune", "test_context", "test_conversations", "test_loss_scale",
                 "test_instructions", "test_policy_loss", "test_base_install", "test_peft_folders",
                 "test_commands_init_from", "test_plan_moe", "test_streaming", "test_config_ranges", "test_mfu_lora",
                 "test_hf_encoders", "test_fp8", "test_foreign_shards", "test_model", "test_kernels_tokamax",
                 "test_reliability", "test_cpu_attention", "test_families", "test_policy_loss_trl", "test_plan_rl",
                 "test_sft_trl", "test_telemetry", "test_reliability_inputs", "test_launch", "test_bad_inputs")


def pytest_collection_modifyitems(session, config, items):
  del session, config
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the order inside a file is kept


def xla_flags_without_device_count(cheap_compile: bool = True) -> str:
  """The suite's XLA flags (its cheaper compile settings) for a subprocess that chooses its own device count;
  `cheap_compile=False` leaves those settings out, for one that runs long enough to prefer XLA's optimized code."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  if not cheap_compile:
    flags = flags.replace(LOOP_EMITTERS, "").replace(CHEAP_BACKEND, "")
  return " ".join(flags.split())


def load_script(relative_path: str):
  """A script under experiments/ or benchmarks/ as the module `script_<name>`, loaded once per process. Its folder
  never goes on sys.path, where experiments/lm_eval.py would shadow the lm-eval package. A script that defines absl
  flags when imported is refused: absl's FLAGS are one per process, and flags left there (a required --workdir) fail
  the absl parse of whichever test file `make test` happens to run next in that worker; see `script_with_flags`."""
  from absl import flags  # noqa: PLC0415
  name = _script_name(relative_path)
  if name not in sys.modules:
    _exec_script(relative_path)
    if defined := [flag.name for flag in flags.FLAGS.flags_by_module_dict().get(name, [])]:
      _forget_script(name)
      raise RuntimeError(f"{relative_path} defines absl flags when imported (--{', --'.join(defined)}): load it with "
                         "`with conftest.script_with_flags(...)`, which removes them again")
  return sys.modules[name]


@contextlib.contextmanager
def script_with_flags(relative_path: str):
  """A script that defines absl flags when imported (experiments/generate.py, train_lm.py, ...) as `load_script` would
  load it, for the length of a `with`. On the way out the flag values parsed inside are undone, the script's own
  flags are deleted and the module is forgotten, so absl's process-global FLAGS are left as found. The flags that its
  imports define (absl.logging's, grain's, orbax's) stay: those modules stay imported and read them."""
  from absl import flags  # noqa: PLC0415
  from absl.testing import flagsaver  # noqa: PLC0415
  name = _script_name(relative_path)
  if name in sys.modules:
    raise RuntimeError(f"{relative_path} is loaded already: one `script_with_flags` at a time")
  parsed = flags.FLAGS.is_parsed()
  module = _exec_script(relative_path)
  saved = flagsaver.save_flag_values()
  try:
    yield module
  finally:
    # Restores the saved values; flags defined inside the `with` (by a lazy import) are kept, not deleted.
    flagsaver.restore_flag_values({**flagsaver.save_flag_values(), **saved})
    _forget_script(name)
    if not parsed and flags.FLAGS.is_parsed():
      flags.FLAGS.unparse_flags()


def _script_name(relative_path: str) -> str:
  return "script_" + os.path.splitext(os.path.basename(relative_path))[0]


def _exec_script(relative_path: str):
  import importlib.util  # noqa: PLC0415
  name = _script_name(relative_path)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(name, os.path.join(root, relative_path))
  sys.modules[name] = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(sys.modules[name])
  except BaseException:
    _forget_script(name)
    raise
  return sys.modules[name]


def _forget_script(name: str) -> None:
  """Deletes the absl flags that module `name` defined and drops the module."""
  from absl import flags  # noqa: PLC0415
  for flag in list(flags.FLAGS.flags_by_module_dict().get(name, [])):  # a copy: deleting a flag edits the list
    for key in (flag.name, flag.short_name):
      if key and key in flags.FLAGS:
        delattr(flags.FLAGS, key)
  sys.modules.pop(name, None)


def write_jsonl(path, rows) -> str:
  """`rows` as a JSON-lines file at `path`; returns the path as a string."""
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


REVERSE_WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]


def reverse_pairs(count: int, seed: int) -> list[dict]:
  """Prompt/response pairs that reverse 1-4 words: a task a tiny decoder learns in a few steps."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(count):
    words = list(rng.choice(REVERSE_WORDS, size=int(rng.integers(1, 5))))
    rows.append({"prompt": f"reverse: {' '.join(words)}\n", "response": " ".join(reversed(words))})
  return rows


def write_token_corpus(path) -> None:
  """300 JSONL documents of 5-30 random code-like words: a tiny corpus for multi-process and launcher runs."""
  import json  # noqa: PLC0415
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "return", "def", "(", ")", ":", "=", "1"]
  with open(path, "w") as f:
    for _ in range(300):
      f.write(json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(5, 30)))}) + "\n")


def write_labelled_words(folder, train_rows: int, eval_rows: int) -> int:
  """train.csv / eval.csv of random word strings labelled "many" (more than one "alpha") or "few", and a word-level
  tokenizer.json of those words in `folder`; returns the vocabulary size."""
  import csv  # noqa: PLC0415

  import tokenizers  # noqa: PLC0415
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "return", "def", "value", "one", "two"]
  for split, rows in (("train", train_rows), ("eval", eval_rows)):
    with open(os.path.join(folder, f"{split}.csv"), "w", newline="") as f:
      writer = csv.writer(f)
      writer.writerow(["text", "label"])
      for _ in range(rows):
        text = list(rng.choice(words, size=rng.integers(3, 12)))
        writer.writerow([" ".join(text), "many" if text.count("alpha") > 1 else "few"])
  vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", *words])}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.save(os.path.join(folder, "tokenizer.json"))
  return len(vocab)


def demo_config(overrides: dict):
  """experiments/configs/demo.py with `section.key` overrides (as the scripts' --config.section.key flags)."""
  from jaxlm import config as config_lib  # noqa: PLC0415
  cd = load_script("experiments/configs/demo.py").get_config()
  for key, value in overrides.items():
    section, name = key.split(".")
    cd[section][name] = (value,) if name == "train_files" else value
  return config_lib.from_config_dict(cd)


def relative_difference(ours, reference) -> float:
  """max|ours - reference| / max|reference| in float64: how the parity tests compare with transformers."""
  ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
  return float(np.abs(ours - reference).max() / np.abs(reference).max())


def perturbed(hf_model):
  """An HF model with noise on every parameter (HF initialises biases to 0 and norms to 1; noise makes parity cover
  all of them), in eval mode."""
  import torch  # noqa: PLC0415  (the hf extra's: only the parity tests call this)

  torch.manual_seed(0)
  with torch.no_grad():
    for p in hf_model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return hf_model.eval()


def write_llama_style_tokenizer(folder: str, texts: list[str], template: str | None) -> str:
  """A byte-level BPE trained on `texts`, saved by transformers: a BOS (<s>) before every text, EOS </s>, and
  `template` (none: no chat template), whose end of turn (<|im_end|>) is not the EOS."""
  import tokenizers  # noqa: PLC0415
  import transformers  # noqa: PLC0415  (the hf extra: only the tests that need it call this)
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: PLC0415

  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                       pad_token="<pad>", chat_template=template).save_pretrained(folder)
  return folder


def save_random_llama(folder: str, tokenizer_folder: str, seed: int, layers: int = 2) -> str:
  """A small random Llama (vocabulary 320, 128 positions, untied head) saved by transformers into `folder`, with the
  tokenizer files of `tokenizer_folder`: a checkpoint for the fine-tuning recipes' tests."""
  import torch  # noqa: PLC0415  (the hf extra: only the tests that need it call this)
  import transformers  # noqa: PLC0415
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                    max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False,
                                    rms_norm_eps=1e-6)
  transformers.LlamaForCausalLM(config).save_pretrained(folder)
  for name in os.listdir(tokenizer_folder):
    shutil.copy(os.path.join(tokenizer_folder, name), folder)
  return folder
