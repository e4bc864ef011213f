"""Reward functions of online RL (jaxlm/recipes/policy_optimization.py), called as TRL 1.16's GRPOTrainer calls them.

  functions = load_reward_functions(config.rl.rewards, config.rl.reward_weights)
  scores = score(functions, prompts, completions, completion_ids, columns)    # [N, F] float64, None -> NaN
  total = weighted_total(scores, [f.weight for f in functions])              # [N], NaN where all were None
  metrics = reward_metrics(scores, functions)    # rewards/<name>/mean, rewards/<name>/std, reward, reward_std

A reward function is named "module:function" (imported) or "path/to/file.py:function" (the file loaded as a module)
and has TRL's signature
  f(prompts, completions, completion_ids, **columns) -> list[float | None]
all by keyword: `prompts` and `completions` (strings, or TRL's conversational lists of messages), `completion_ids`
(lists of token ids), and every other dataset column as a list aligned with the completions. None means "not scored
here" (NaN): the total and the metrics skip it, as TRL does. TRL also passes `trainer_state`, `log_extra` and
`log_metric`; jaxlm passes none of them, so a function taking `**kwargs` runs in both.

Built-in rewards (name them jaxlm.recipes.rewards:exact_answer and jaxlm.recipes.rewards:answer_format):
  exact_answer   1.0 when the completion's final answer equals the `answer` column, else 0.0 (`final_answer`,
                 `same_answer`); math-verify (the `rl` extra) compares LaTeX and symbolic answers
  answer_format  1.0 when the completion ends with a GSM8K-style final line "#### <number>", else 0.0
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import hashlib
import importlib
import importlib.util
import logging
import numbers
import os
import re
import threading
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

WRITE_IT = ("write module:function (e.g. jaxlm.recipes.rewards:exact_answer) or path/to/file.py:function in "
            "rl.rewards")


class RewardError(ValueError):
  """A reward function raised, or returned something other than one float (or None) per completion."""


@dataclasses.dataclass(frozen=True)
class RewardFunction:
  name: str  # the function's __name__, as TRL names its metrics rewards/<name>/mean
  fn: Callable[..., Sequence[float | None]]
  weight: float = 1.0
  source: str = ""  # as written in rl.rewards


# ----------------------------------------------------------------------------------------------- loading


def load_reward_functions(names: Sequence[str], weights: Sequence[float]) -> list[RewardFunction]:
  """The functions `names` name ("module:function" or "path/to/file.py:function"), with `weights` (empty: all
  1.0). A name that cannot be imported, or is not callable, is a one-line ValueError naming it."""
  names, weights = list(names), [float(w) for w in weights]
  if weights and len(weights) != len(names):
    raise ValueError(f"rl.reward_weights has {len(weights)} weights for {len(names)} reward functions; give one per "
                     "function or none")
  files: dict[str, Any] = {}  # one module per file, however many of its functions are named
  functions = []
  for i, name in enumerate(names):
    fn = _load(name.strip(), files)
    functions.append(RewardFunction(callable_name(fn), fn, weights[i] if weights else 1.0, name.strip()))
  seen: dict[str, str] = {}
  for f in functions:  # two functions of one name would log into one metric
    if f.name in seen:
      raise ValueError(f"reward functions {seen[f.name]} and {f.source} share the name {f.name!r}, which names "
                       f"their metrics rewards/{f.name}/mean; rename one")
    seen[f.name] = f.source
  return functions


def callable_name(fn: Callable) -> str:
  """The name TRL gives a reward function (trl.trainer.utils.get_callable_name): a partial's function's, else
  __name__, else the class name."""
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, "__name__", type(fn).__name__)


def _load(name: str, files: dict[str, Any]) -> Callable:
  target, _, attribute = name.rpartition(":")
  if not target or not attribute:
    raise ValueError(f"reward function {name!r} names no function; {WRITE_IT}")
  if target.endswith(".py") or "/" in target or os.sep in target:
    module = _load_file(name, target, files)
  else:
    try:
      module = importlib.import_module(target)
    except Exception as e:  # noqa: BLE001  whatever the import raised, one line that names it
      raise ValueError(f"reward function {name!r}: cannot import {target!r} ({_one_line(e)}); {WRITE_IT}") from e
  fn: Any = module
  for part in attribute.split("."):  # a class's method, e.g. file.py:Rewards.length
    if not hasattr(fn, part):
      raise ValueError(f"reward function {name!r}: {target} has no {attribute!r}; {WRITE_IT}")
    fn = getattr(fn, part)
  if not callable(fn):
    raise ValueError(f"reward function {name!r} is a {type(fn).__name__}, not a function; name a function "
                     "f(prompts, completions, **columns) -> list[float | None]")
  return fn


def _load_file(name: str, path: str, files: dict[str, Any]):
  path = os.path.abspath(os.path.expanduser(path))
  if path in files:
    return files[path]
  if not os.path.isfile(path):
    raise ValueError(f"reward function {name!r}: {path} is not a file; {WRITE_IT}")
  # A name of its own per file, so that two files called rewards.py stay two modules.
  stem = os.path.splitext(os.path.basename(path))[0]
  module_name = f"jaxlm_reward_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
  spec = importlib.util.spec_from_file_location(module_name, path)
  if spec is None or spec.loader is None:
    raise ValueError(f"reward function {name!r}: {path} cannot be loaded as a Python module; {WRITE_IT}")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # noqa: BLE001
    raise ValueError(f"reward function {name!r}: loading {path} raised {_one_line(e)}; fix the file") from e
  files[path] = module
  return module


def _one_line(e: BaseException) -> str:
  return " ".join(f"{type(e).__name__}: {e}".split())


# ----------------------------------------------------------------------------------------------- scoring


def score(functions: Sequence[RewardFunction], prompts: Sequence[Any], completions: Sequence[Any],
          completion_ids: Sequence[Sequence[int]], columns: Mapping[str, Sequence[Any]]) -> np.ndarray:
  """[N, F] float64: each function's reward of each completion, None as NaN (TRL). A function that raises, or
  returns other than N numbers (or None), is a RewardError naming it."""
  n = len(completions)
  for what, values in (("prompts", prompts), ("completion_ids", completion_ids), *columns.items()):
    if len(values) != n:
      raise ValueError(f"{what} has {len(values)} rows for {n} completions; pass every column aligned with the "
                       "completions")
  kwargs = {k: list(v) for k, v in columns.items()}
  ids = [[int(t) for t in row] for row in completion_ids]
  scores = np.empty((n, len(functions)), np.float64)
  for j, f in enumerate(functions):
    try:
      result = f.fn(prompts=list(prompts), completions=list(completions), completion_ids=ids, **kwargs)
    except Exception as e:  # noqa: BLE001  the user's code: any exception, reported in one line
      raise RewardError(f"reward function {f.name} raised {_one_line(e)}") from e
    scores[:, j] = _as_rewards(f.name, result, n)
  return scores


def _as_rewards(name: str, result: Any, n: int) -> np.ndarray:
  if isinstance(result, np.ndarray) and result.ndim != 1:
    raise RewardError(f"reward function {name} returned an array of shape {result.shape}, expected a list of {n} "
                      "floats (or None); return one reward per completion")
  if isinstance(result, (str, bytes, Mapping)) or not hasattr(result, "__len__"):
    raise RewardError(f"reward function {name} returned a {type(result).__name__}, expected a list of {n} floats "
                      "(or None); return one reward per completion")
  if len(result) != n:
    raise RewardError(f"reward function {name} returned {len(result)} rewards, expected {n}; return one reward "
                      "(a float, or None) per completion")
  out = np.empty(n, np.float64)
  for i, value in enumerate(result):
    if value is None:
      out[i] = np.nan
    elif isinstance(value, numbers.Real) or (hasattr(value, "__float__") and not isinstance(value, (str, bytes))):
      out[i] = _float(name, value, i, n)
    else:
      raise RewardError(f"reward function {name} returned {value!r} ({type(value).__name__}) for completion {i}, "
                        f"expected {n} floats (or None); return one number per completion")
  return out


def _float(name: str, value: Any, i: int, n: int) -> float:
  try:  # numpy and torch scalars too, as TRL's torch.tensor takes them
    return float(value)
  except (TypeError, ValueError) as e:
    raise RewardError(f"reward function {name} returned {value!r} ({type(value).__name__}) for completion {i}, "
                      f"expected {n} floats (or None); return one number per completion") from e


def weighted_total(scores: np.ndarray, weights: Sequence[float]) -> np.ndarray:
  """[N]: the weighted sum of each row's rewards, NaN skipped (TRL's nansum), NaN where every function returned
  None (TRL marks those unscorable)."""
  scores = np.asarray(scores, np.float64)
  weights = np.asarray(weights, np.float64)
  if scores.ndim != 2 or weights.shape != (scores.shape[1],):
    raise ValueError(f"weighted_total needs scores [N, F] and F weights; got scores {scores.shape} and "
                     f"{weights.size} weights")
  total = np.nansum(scores * weights[None, :], axis=1)
  total[np.isnan(scores).all(axis=1)] = np.nan
  return total


def nanstd(x: np.ndarray) -> float:
  """The standard deviation of the non-NaN values with Bessel's correction, NaN below two values (TRL's
  trl.trainer.utils.nanstd)."""
  x = np.asarray(x, np.float64)
  x = x[~np.isnan(x)]
  if x.size < 2:
    return float("nan")
  return float(np.std(x, ddof=1))


def _nanmean(x: np.ndarray) -> float:
  x = np.asarray(x, np.float64)
  x = x[~np.isnan(x)]
  return float(np.mean(x)) if x.size else float("nan")


def reward_metrics(scores: np.ndarray, functions: Sequence[RewardFunction]) -> dict[str, float]:
  """TRL's reward metrics of one rollout batch: rewards/<name>/mean and rewards/<name>/std over the completions
  each function scored, `reward` and `reward_std` of the weighted totals over the scorable completions."""
  scores = np.asarray(scores, np.float64)
  metrics = {}
  for j, f in enumerate(functions):
    metrics[f"rewards/{f.name}/mean"] = _nanmean(scores[:, j])
    metrics[f"rewards/{f.name}/std"] = nanstd(scores[:, j])
  total = weighted_total(scores, [f.weight for f in functions])
  metrics["reward"] = _nanmean(total)
  metrics["reward_std"] = nanstd(total)
  return metrics


# ----------------------------------------------------------------------------------------------- built-in rewards


def completion_text(completion: Any) -> str:
  """A completion's text: the string itself, or the content of the last message of TRL's conversational form
  [{"role": "assistant", "content": ...}] (content blocks' texts joined)."""
  if isinstance(completion, str):
    return completion
  if isinstance(completion, Mapping):
    completion = [completion]
  if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
    content = completion[-1].get("content", "")
    if isinstance(content, str):
      return content
    if isinstance(content, Sequence):  # [{"type": "text", "text": ...}, ...]
      return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
  return "" if completion is None else str(completion)


def _last_boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} that is not inside another (nested braces matched), None when there is
  none that closes."""
  found, start = None, text.find("\\boxed{")
  while start >= 0:
    i, depth = start + len("\\boxed{"), 1
    while i < len(text) and depth:
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      i += 1
    if depth:  # an unclosed \\boxed{ ends the search: the last closed one before it stands
      break
    found = text[start + len("\\boxed{"):i - 1]
    start = text.find("\\boxed{", i)
  return found


# A number as written in answers: sign, thousands separators, decimals, a fraction a/b.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+")


def final_answer(text: str) -> str | None:
  """A completion's final answer: the content of its last \\boxed{...}, else the first line after its last "####",
  else its last number (None when it has none of the three)."""
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed.strip()
  if "####" in text:
    after = text.rsplit("####", 1)[1].strip()
    return after.splitlines()[0].strip() if after else None
  found = _NUMBER.findall(text)
  return found[-1] if found else None


def gold_answer(text: Any) -> str | None:
  """The `answer` column's answer: after its last "####" (GSM8K's whole solutions), else its last \\boxed{...},
  else the whole text."""
  if text is None:
    return None
  text = str(text)
  if "####" in text:
    after = text.rsplit("####", 1)[1].strip()
    return after.splitlines()[0].strip() if after else None
  boxed = _last_boxed(text)
  return (boxed if boxed is not None else text).strip() or None


_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def as_number(answer: str) -> fractions.Fraction | None:
  """An answer as an exact number, or None when it is not one: spaces, thousands separators, "$" (also \\$), a
  trailing "." dropped; 3/4, \\frac{3}{4}, 0.75, 0.750 and 1e3 read as numbers."""
  s = answer.strip()
  s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
  s = s.replace("\\$", "").replace("$", "").replace("{,}", "").replace("\\,", "").replace("\\!", "")
  s = s.replace("\\left", "").replace("\\right", "")
  s = _FRAC.sub(r"(\1)/(\2)", s)
  s = re.sub(r"\s+", "", s).rstrip(".")
  if re.fullmatch(r"[-+]?(?:\d{1,3}(?:,\d{3})+)(?:\.\d*)?", s):  # only thousands separators lose their commas
    s = s.replace(",", "")
  m = re.fullmatch(r"([-+]?)\(?([-+]?[\d.]+(?:e[-+]?\d+)?)\)?(?:/\(?([-+]?[\d.]+)\)?)?", s, re.IGNORECASE)
  if not m:
    return None
  try:
    value = fractions.Fraction(m.group(2))
    value = value / fractions.Fraction(m.group(3)) if m.group(3) else value
  except (ValueError, ZeroDivisionError):
    return None
  return -value if m.group(1) == "-" else value


def _normalised_text(answer: str) -> str:
  s = answer.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
  s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s).replace("$", "")
  return re.sub(r"\s+", "", s).rstrip(".").lower()


@functools.lru_cache(maxsize=None)
def _math_verify():
  try:
    import math_verify  # noqa: PLC0415  the `rl` extra, optional
  except ImportError:
    return None
  logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warnings off the main thread
  return math_verify


def same_answer(predicted: str, gold: str) -> bool:
  """Whether two answers are equal: as numbers when both are numbers (`as_number`); else with math-verify when it is
  installed (parse + verify of each as inline LaTeX); else as normalised strings (no spaces, $, \\left, \\right,
  \\text; lower case)."""
  a, b = as_number(predicted), as_number(gold)
  if a is not None and b is not None:
    return a == b
  math_verify = _math_verify()
  if math_verify is not None:
    # math-verify times out with signal.alarm, which only the main thread may set (as TRL's accuracy_reward).
    main = threading.current_thread() is threading.main_thread()
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gold_parsed = math_verify.parse(f"${gold}$", parsing_timeout=5 if main else None)
        predicted_parsed = math_verify.parse(f"${predicted}$", parsing_timeout=5 if main else None)
        if gold_parsed and predicted_parsed:
          return bool(math_verify.verify(gold_parsed, predicted_parsed, timeout_seconds=5 if main else None))
    except Exception:  # noqa: BLE001  a parse it cannot do: the string comparison decides
      pass
  return _normalised_text(predicted) == _normalised_text(gold)


def exact_answer(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **_) -> list[float | None]:
  """1.0 where the completion's final answer (`final_answer`: last \\boxed{...}, else after the last "####", else
  the last number) equals the `answer` column's (`gold_answer`; `same_answer` compares), else 0.0; None (not
  scored) where the answer column is empty."""
  del prompts
  rewards: list[float | None] = []
  for completion, gold_text in zip(completions, answer):
    gold = gold_answer(gold_text)
    if gold is None:
      rewards.append(None)
      continue
    predicted = final_answer(completion_text(completion))
    rewards.append(1.0 if predicted is not None and same_answer(predicted, gold) else 0.0)
  return rewards


# The last line is "#### <number>": an optional sign, digits with optional thousands separators and decimals; then
# only whitespace or end-of-text tokens (<|endoftext|>, <|im_end|>, </s>) may follow.
ANSWER_LINE = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
                         r"(?:\s|<\|[^|<>\s]*\|>|</s>)*\Z")


def answer_format(prompts: Sequence[Any], completions: Sequence[Any], **_) -> list[float]:
  """1.0 where the completion ends with a GSM8K-style final-answer line "#### <number>" (`ANSWER_LINE`: the line
  starts with ####; -1,234.5 style numbers; trailing whitespace and end-of-text tokens allowed), else 0.0."""
  del prompts
  return [1.0 if ANSWER_LINE.search(completion_text(c)) else 0.0 for c in completions]
