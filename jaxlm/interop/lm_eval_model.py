"""jaxlm decoders as a model of EleutherAI's lm-evaluation-harness (`lm-eval`), and tasks that stay offline.

  lm = harness.JaxlmLM(graphdef, params, tokenizer, batch_size=16)   # float, int8 (jaxlm.compress.quantization) or
                                                                     # pruned weights
  results = harness.evaluate(lm, ["my_task"], include_path="tasks/")  # lm-eval's results dict
  metrics = harness.task_metrics(lm, ["my_task"], include_path="tasks/")  # {"my_task/acc": ...}, flat

The model answers the harness's three requests: `loglikelihood` (context, continuation) pairs and
`loglikelihood_rolling` (whole texts, in windows of the model's context) from one batched forward per group of
requests, and `generate_until` through `jaxlm.inference.generate` (KV cache, float or int8). With `chat_folder` (a
folder holding the model's chat template, jaxlm.data.tuning.chat) the model also answers lm-eval's chat calls
(`apply_chat_template`, `chat_template`, `tokenizer_name`), so `evaluate(..., apply_chat_template=True)` writes each
request as a conversation under the template, and generation stops at the template's end-of-turn tokens as well as
at the task's `until` strings. Requests are sorted by
length and padded to a multiple of LENGTH_BUCKET tokens in fixed-size batches, so a task compiles a handful of programs.
Parameters sharded over a mesh (NamedShardings) run on that mesh, batch split like activations.

Tasks come from lm-eval's registry or from task YAMLs in `include_path`; a task reading local files (`dataset_path:
json` or `csv` with `dataset_kwargs.data_files`) runs without a network. A task whose data would be downloaded from
the Hugging Face hub fails with a one-line ValueError naming it when the hub is unreachable (`check_offline`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import socket
import sys
from typing import Any, Sequence
from urllib.parse import urlparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.data.tuning import chat
from jaxlm.inference import generate
from jaxlm.parallel import sharding
from jaxlm.data.tokenizer import eos_id

# experiments/lm_eval.py would shadow the package for every script in experiments/ (a script's folder comes first on
# sys.path), so folders holding a plain lm_eval.py are left out while the package is imported.
_SEARCH_PATH = list(sys.path)
sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or os.curdir, "lm_eval.py"))]
try:
  import lm_eval
  from lm_eval.api.model import TemplateLM
  from lm_eval.tasks import TaskManager
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as error:  # an optional extra: the rest of jaxlm works without it
  raise ImportError("jaxlm.interop.lm_eval_model needs lm-eval: pip install -e '.[eval]'") from error
finally:
  sys.path[:] = _SEARCH_PATH

LENGTH_BUCKET = 16  # scored sequences are right-padded to a multiple of this many tokens (one compile per bucket)
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")  # datasets' builders that read given files


def _score_fn(graphdef: nnx.GraphDef, out_sharding):
  """jit: (params, inputs [B, T], targets [B, T]) -> (log p(target) [B, T], target == argmax [B, T])."""

  def score(params, inputs_BT, targets_BT):
    logits_BTV = nnx.merge(graphdef, params)(inputs_BT)  # right padding: causal, so no real token sees it
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    greedy_BT = jnp.argmax(logits_BTV, axis=-1) == targets_BT
    if out_sharding is not None:
      logp_BT, greedy_BT = (jax.lax.with_sharding_constraint(x, out_sharding) for x in (logp_BT, greedy_BT))
    return logp_BT, greedy_BT

  return jax.jit(score)


class JaxlmLM(TemplateLM):
  """A `jaxlm.models.gpt.GPT` (split into graphdef and params) with its tokenizer (a `tokenizers.Tokenizer`), as
  an lm-eval model. `max_length` defaults to the model's max_seq_len; `kv_cache` is generate_until's cache;
  `chat_folder` holds the chat template (chat_template.jinja or tokenizer_config.json's) the model was tuned with."""

  def __init__(self, graphdef: nnx.GraphDef, params: Any, tokenizer, *, batch_size: int = 8,
               max_length: int | None = None, max_gen_toks: int = 256, kv_cache: str = "float",
               chat_folder: str | None = None):
    super().__init__()
    if batch_size < 1:
      raise ValueError(f"batch_size={batch_size} must be at least 1")
    if kv_cache not in generate.KV_CACHES:
      raise ValueError(f"kv_cache={kv_cache!r} is not one of {', '.join(generate.KV_CACHES)}")
    config = nnx.merge(graphdef, params).config
    if config.flavour not in ("gpt2", "llama"):
      raise ValueError(f"lm-eval scores decoders; model.flavour={config.flavour!r} is not one")
    self.graphdef, self.params, self.jaxlm_tokenizer = graphdef, params, tokenizer
    self.batch_size = batch_size
    self.max_length = min(max_length or config.max_seq_len, config.max_seq_len)
    self.max_gen_toks = max_gen_toks
    self.kv_cache = kv_cache
    self._eot = eos_id(tokenizer)
    self._chat = chat.require(chat_folder) if chat_folder else None
    self._end_of_turn = chat.end_of_turn_ids(chat_folder) if self._chat else []
    self._mesh = generate.mesh_of(params)
    self._score = _score_fn(graphdef, None if self._mesh is None else sharding.replicated(self._mesh))

  @property
  def eot_token_id(self) -> int:
    return self._eot

  @property
  def tokenizer_name(self) -> str:
    """lm-eval's key for its request cache: requests written with a template are cached apart, per template."""
    if self._chat is None:
      return "jaxlm"
    return "jaxlm-chat-" + hashlib.sha256(self._chat.text.encode()).hexdigest()[:16]

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    """The template's jinja source (lm-eval logs it), or None when chat templates are not asked for."""
    if not chat_template:
      return None
    if self._chat is None:
      raise ValueError("apply_chat_template needs a chat template: give JaxlmLM a chat_folder that holds one")
    return self._chat.text

  def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """lm-eval's request (few-shot turns and the question, as {role, content} messages) as the template writes it,
    with the assistant's header when `add_generation_prompt`; tok_encode turns its special tokens into their ids."""
    self.chat_template(True)  # the one-line error without a template
    return chat.render(self._chat, chat_history, add_generation_prompt=add_generation_prompt)

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    return self.jaxlm_tokenizer.encode(string, add_special_tokens=False).ids

  def tok_decode(self, ids: Sequence[int]) -> str:
    return self.jaxlm_tokenizer.decode(list(ids))

  # ------------------------------------------------------------------------------------------- scoring

  def score_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per (context ids,
    continuation ids) pair. The context is cut from the left to fit max_length + 1 tokens with the continuation."""
    rows = []
    for context, continuation in pairs:
      whole = (list(context) + list(continuation))[-(self.max_length + 1):]
      rows.append((whole[:-1], whole[1:], min(len(continuation), len(whole) - 1)))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths share a batch
    results: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
    for start in range(0, len(order), self.batch_size):
      chunk = order[start:start + self.batch_size]
      width = min(-(-max(1, len(rows[chunk[0]][0])) // LENGTH_BUCKET) * LENGTH_BUCKET, self.max_length)
      inputs = np.full((self.batch_size, width), self._eot, np.int32)  # a full last batch: one compiled shape
      targets = np.full((self.batch_size, width), self._eot, np.int32)
      for row, i in enumerate(chunk):
        inputs[row, :len(rows[i][0])], targets[row, :len(rows[i][1])] = rows[i][0], rows[i][1]
      logp, greedy = self._run(inputs, targets)
      for row, i in enumerate(chunk):
        length, scored = len(rows[i][0]), rows[i][2]
        results[i] = (float(logp[row, length - scored:length].sum()), bool(greedy[row, length - scored:length].all()))
    return results

  def _run(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if self._mesh is None:
      out = self._score(self.params, inputs, targets)
    else:
      with jax.set_mesh(self._mesh):  # the models' activation constraints split the batch over the mesh
        out = self._score(self.params, inputs, targets)
    return tuple(np.asarray(jax.device_get(x)) for x in out)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    results = self.score_tokens([(context, continuation) for _, context, continuation in requests])
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """log p(text) of each whole text, conditioned on the end-of-document token, in disjoint windows of max_length
    tokens (every token scored once, lm-eval's convention); all windows of all texts are batched together."""
    windows, owners = [], []
    for index, (text,) in enumerate(request.args for request in requests):
      for window in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1):
        windows.append(make_disjoint_window(window))
        owners.append(index)
    totals = [0.0] * len(requests)
    for owner, (logp, _) in zip(owners, self.score_tokens(windows)):
      totals[owner] += logp
    for request, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
    return totals

  # ------------------------------------------------------------------------------------------- generation

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy (or sampled, with do_sample and temperature) continuations through jaxlm.inference.generate's KV cache,
    ended by the end-of-document token or (with a chat template) an end-of-turn token, and cut before the first of
    the request's `until` strings; requests with the same settings are batched."""
    groups: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
      groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
    outputs = [""] * len(requests)
    for indices in groups.values():
      settings = dict(requests[indices[0]].args[1])
      until = settings.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      until = [u for u in until + [self.tok_decode([self._eot])] if u]
      new_tokens = max(1, min(int(settings.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1))
      temperature = float(settings.pop("temperature", 0.0)) if settings.pop("do_sample", False) else 0.0
      # A stop string that is a single token ends a row early; the text is cut at the string below either way.
      stops = {self._eot, *self._end_of_turn} | {ids[0] for ids in (self.tok_encode(u) for u in until)
                                                  if len(ids) == 1}
      prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - new_tokens):] or [self._eot]
                 for i in indices]
      order = sorted(range(len(indices)), key=lambda j: -len(prompts[j]))
      for start in range(0, len(order), self.batch_size):
        chunk = order[start:start + self.batch_size]
        batch = [prompts[j] for j in chunk]
        batch += [batch[-1]] * (self.batch_size - len(batch))  # a full batch: one compiled shape per bucket
        generated = generate.generate(self.graphdef, self.params, batch, new_tokens, temperature=temperature,
                                      top_k=int(settings.get("top_k", 0)), top_p=float(settings.get("top_p", 1.0)),
                                      stop_tokens=sorted(stops), pad_id=self._eot, kv_cache=self.kv_cache)
        for j, tokens in zip(chunk, generated):
          text = self.tok_decode([t for t in tokens if t != self._eot and t not in self._end_of_turn])
          for stop in until:
            text = text.split(stop)[0]
          outputs[indices[j]] = text
          self.cache_hook.add_partial("generate_until", requests[indices[j]].args, text)
    return outputs


# ----------------------------------------------------------------------------------------------- tasks


def task_manager(tasks: Sequence[str], include_path: str | Sequence[str] | None = None) -> TaskManager:
  """lm-eval's task index: only `include_path` when it defines every task (indexing the built-in tasks takes
  seconds), else the built-in tasks too. An unknown task name is a ValueError."""
  paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
  for path in paths:
    if not os.path.isdir(path):
      raise ValueError(f"lm-eval include_path {path!r} is not a folder of task YAMLs")
  if paths:
    manager = TaskManager(include_path=paths, include_defaults=False)
    if all(name in manager.task_index for name in tasks):
      return manager
  manager = TaskManager(include_path=paths or None)
  unknown = [name for name in tasks if name not in manager.task_index and not os.path.isfile(name)]
  if unknown:
    raise ValueError(f"lm-eval task {unknown[0]!r} is not a registered task, group or tag"
                     + (f" nor defined in {', '.join(paths)}" if paths else "; pass its YAML folder as include_path"))
  return manager


def _leaf_configs(manager: TaskManager, name: str, depth: int = 0) -> list[tuple[str, dict]]:
  """(task name, config) of every task under a task, group or tag name (as the index holds them)."""
  entry = manager.task_index.get(name)
  if entry is None or depth > 8:
    return []
  kind = entry.kind.name
  if kind == "TAG":
    return [leaf for member, e in manager.task_index.items() if name in e.tags
            for leaf in _leaf_configs(manager, member, depth + 1)]
  if kind == "GROUP":
    children = (entry.cfg or {}).get("task", [])
    leaves = []
    for child in children if isinstance(children, list) else [children]:
      if isinstance(child, str):
        leaves += _leaf_configs(manager, child, depth + 1)
      elif isinstance(child, dict) and "task" in child:
        base = manager.task_index.get(child["task"]) if isinstance(child["task"], str) else None
        leaves.append((str(child["task"]), {**((base.cfg or {}) if base else {}), **child}))
    return leaves
  return [(name, entry.cfg or {})]


def _hub_dataset(config: dict) -> str | None:
  """The hub dataset a task config downloads, or None if it reads local files (a missing one is a ValueError)."""
  path = config.get("dataset_path")
  if not isinstance(path, str):
    return None  # a Python task with its own loader: the load itself is checked (evaluate)
  kwargs = config.get("dataset_kwargs") or {}
  if path in LOCAL_BUILDERS:
    files = kwargs.get("data_files") or kwargs.get("data_dir")
    if not files:
      raise ValueError(f"lm-eval task {config.get('task')!r}: dataset_path {path!r} needs dataset_kwargs.data_files")
    for file in _flatten(files):
      if urlparse(str(file)).scheme in ("http", "https", "hf"):
        return str(file)
      if not glob.glob(os.path.expanduser(str(file))):
        raise ValueError(f"lm-eval task {config.get('task')!r}: data file {file!r} does not exist")
    return None
  return None if os.path.exists(os.path.expanduser(path)) else path


def _flatten(files: Any) -> list:
  if isinstance(files, dict):
    return [f for value in files.values() for f in _flatten(value)]
  return [f for value in files for f in _flatten(value)] if isinstance(files, (list, tuple)) else [files]


def hub_reachable(timeout: float = 3.0) -> bool:
  """Whether the Hugging Face hub (HF_ENDPOINT) answers a TCP connection: the machine can download task data."""
  if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in (
      "0", ""):
    return False
  host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
  try:
    socket.create_connection((host, 443), timeout=timeout).close()
    return True
  except OSError:
    return False


def check_offline(manager: TaskManager, tasks: Sequence[str], reachable: bool | None = None) -> None:
  """A one-line ValueError naming the first task whose data needs a download this machine cannot make."""
  for name in tasks:
    for task, config in _leaf_configs(manager, name):
      dataset = _hub_dataset(config)
      if dataset is None:
        continue
      if reachable is None:
        reachable = hub_reachable()
      if not reachable:
        raise ValueError(
            f"lm-eval task {task!r}{f' (in {name!r})' if task != name else ''} downloads its data ({dataset!r}) "
            "from the Hugging Face hub, which this machine cannot reach; define the task from local files (a task "
            "YAML with dataset_path: json and dataset_kwargs.data_files, docs/optimization.md) in include_path")


def evaluate(lm: JaxlmLM, tasks: Sequence[str], *, include_path: str | Sequence[str] | None = None,
             limit: int | float | None = None, num_fewshot: int | None = None, bootstrap_iters: int = 0,
             seed: int = 0, manager: TaskManager | None = None, apply_chat_template: bool = False,
             system_instruction: str | None = None) -> dict:
  """lm-eval's `simple_evaluate` of `tasks` (names of tasks, groups or tags) on `lm`: its results dict. `manager`:
  a `task_manager(tasks, include_path)` already built (it is built here otherwise). `apply_chat_template`: each
  request is a conversation under the model's template (few-shot examples as earlier turns; lm needs a
  chat_folder), after `system_instruction` as a system turn if given."""
  if not tasks:
    raise ValueError("no lm-eval task given")
  if apply_chat_template:
    lm.chat_template(True)  # a model without a template fails here, before any task loads
  manager = manager or task_manager(tasks, include_path)
  check_offline(manager, tasks)
  loaded = []
  for name in tasks:  # one at a time, so that a failing load names its task
    try:
      built = manager.load([name])
    except (OSError, ConnectionError) as error:  # includes datasets' and huggingface_hub's download errors
      first_line = (str(error).strip().splitlines() or [""])[0][:200]
      raise ValueError(f"lm-eval task {name!r} could not load its data ({type(error).__name__}: {first_line}); "
                       "define the task from local files (dataset_path: json with dataset_kwargs.data_files) in "
                       "include_path") from error
    loaded += [built["groups"][name]] if name in built.get("groups", {}) else list(built["tasks"].values())
  return lm_eval.simple_evaluate(model=lm, tasks=loaded, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                 bootstrap_iters=bootstrap_iters, random_seed=seed, numpy_random_seed=seed,
                                 torch_random_seed=None, fewshot_random_seed=seed, log_samples=False,
                                 apply_chat_template=apply_chat_template, fewshot_as_multiturn=apply_chat_template,
                                 system_instruction=system_instruction)


def flat_metrics(results: dict) -> dict[str, float]:
  """{"<task>/<metric>": value} from lm-eval's results (filters other than "none" keep their name)."""
  flat = {}
  for task, metrics in results.get("results", {}).items():
    for key, value in metrics.items():
      metric, comma, filter_name = key.partition(",")  # "acc,none"; keys without a filter are bookkeeping
      if comma and isinstance(value, (int, float)) and not isinstance(value, bool) and "_stderr" not in metric:
        flat[f"{task}/{metric}" + (f"/{filter_name}" if filter_name not in ("", "none") else "")] = float(value)
  return flat


def task_metrics(model: nnx.Module, tokenizer, tasks: Sequence[str], *, include_path=None, limit=None,
                 batch_size: int = 8, kv_cache: str = "float") -> dict[str, float]:
  """Flat downstream metrics of a decoder (float, int8 or pruned) on lm-eval `tasks`: the hook of
  experiments/optimize.py (`--lm_eval_tasks`)."""
  graphdef, params = nnx.split(model)
  lm = JaxlmLM(graphdef, params, tokenizer, batch_size=batch_size, kv_cache=kv_cache)
  return flat_metrics(evaluate(lm, tasks, include_path=include_path, limit=limit))
