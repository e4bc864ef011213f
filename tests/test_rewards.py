"""jaxlm.recipes.rewards: loading reward functions by module and by file path, one-line errors for bad names, raising
functions and bad results, None as NaN, the weighted totals and TRL's metrics (against hand-computed values and
TRL 1.16's own nanstd and callable names), and the built-in exact_answer and answer_format on tables of cases, with
and without math-verify."""

import functools
import math
import textwrap

import numpy as np
import pytest

from jaxlm.recipes import rewards

NAN = float("nan")


def _length(prompts, completions, **_):
  return [float(len(c)) for c in completions]


def _write(tmp_path, name, source):
  path = tmp_path / name
  path.write_text(textwrap.dedent(source))
  return str(path)


def test_loading_by_module_and_by_file_path(tmp_path):
  path = _write(tmp_path, "my_rewards.py", """
    CALLS = []
    def shout(prompts, completions, completion_ids, **columns):
      CALLS.append(sorted(columns))
      return [float(c.endswith("!")) for c in completions]
    def ids(prompts, completions, completion_ids, **_):
      return [float(sum(row)) for row in completion_ids]
    class Scores:
      @staticmethod
      def first(prompts, completions, **_):
        return [None] * len(completions)
  """)
  functions = rewards.load_reward_functions(
      ["jaxlm.recipes.rewards:exact_answer", f"{path}:shout", f"{path}:ids", f"{path}:Scores.first"],
      [2.0, 0.5, 1.0, 1.0])
  assert [f.name for f in functions] == ["exact_answer", "shout", "ids", "first"]
  assert [f.weight for f in functions] == [2.0, 0.5, 1.0, 1.0]
  assert functions[0].fn is rewards.exact_answer and functions[1].source == f"{path}:shout"
  # One module per file: both functions see the same module state.
  assert functions[1].fn.__globals__ is functions[2].fn.__globals__
  columns = {"answer": ["4", "6"], "level": [1, 2]}
  scores = rewards.score(functions, ["p", "q"], ["so 4!", "5"], [[1, 2], [3]], columns)
  assert scores.dtype == np.float64 and scores.shape == (2, 4)
  np.testing.assert_array_equal(scores[:, :3], [[1.0, 1.0, 3.0], [0.0, 0.0, 3.0]])
  assert np.isnan(scores[:, 3]).all()
  assert functions[1].fn.__globals__["CALLS"] == [["answer", "level"]]  # extra columns by keyword, no trainer_state
  assert [f.weight for f in rewards.load_reward_functions(["tests.test_rewards:_length"] * 1, [])] == [1.0]


def test_reward_names_follow_trl():
  from trl.trainer.utils import get_callable_name
  partial = functools.partial(_length, scale=2)
  assert rewards.callable_name(partial) == get_callable_name(partial) == "_length"
  callable_object = type("Judge", (), {"__call__": lambda self, **_: []})()
  assert rewards.callable_name(callable_object) == get_callable_name(callable_object) == "Judge"


@pytest.mark.parametrize("name, message", [
    ("exact_answer", "reward function 'exact_answer' names no function; write module:function"),
    ("no_such_module_xyz:f", "reward function 'no_such_module_xyz:f': cannot import 'no_such_module_xyz' "
                             "\\(ModuleNotFoundError: No module named 'no_such_module_xyz'\\); write module:function"),
    ("jaxlm.recipes.rewards:nope", "reward function 'jaxlm.recipes.rewards:nope': jaxlm.recipes.rewards has no "
                                   "'nope'; write module:function"),
    ("jaxlm.recipes.rewards:WRITE_IT", "reward function 'jaxlm.recipes.rewards:WRITE_IT' is a str, not a function; "
                                       "name a function f\\(prompts, completions, \\*\\*columns\\)"),
    ("missing/file.py:f", "reward function 'missing/file.py:f': .*missing/file.py is not a file; write module:"),
])
def test_bad_names_are_one_line_errors_that_say_what_to_write(name, message):
  with pytest.raises(ValueError, match=message) as e:
    rewards.load_reward_functions([name], [])
  assert "\n" not in str(e.value)


def test_bad_files_weights_and_duplicate_names(tmp_path):
  broken = _write(tmp_path, "broken.py", "raise RuntimeError('no\\nway')\n")
  with pytest.raises(ValueError, match=r"loading .*broken.py raised RuntimeError: no way; fix the file$"):
    rewards.load_reward_functions([f"{broken}:f"], [])
  with pytest.raises(ValueError, match="rl.reward_weights has 1 weights for 2 reward functions; give one per"):
    rewards.load_reward_functions(["jaxlm.recipes.rewards:exact_answer", "jaxlm.recipes.rewards:answer_format"],
                                  [1.0])
  other = _write(tmp_path, "other.py", "def exact_answer(prompts, completions, **_):\n  return [0.0] * len(prompts)\n")
  with pytest.raises(ValueError, match="share the name 'exact_answer', which names their metrics "
                                       "rewards/exact_answer/mean; rename one"):
    rewards.load_reward_functions(["jaxlm.recipes.rewards:exact_answer", f"{other}:exact_answer"], [])


def _function(fn, name=None):
  return rewards.RewardFunction(name or fn.__name__, fn, 1.0)


def test_a_raising_function_and_bad_results_are_reward_errors_naming_the_function():
  def boom(prompts, completions, **_):
    raise KeyError("the\nanswer")

  with pytest.raises(rewards.RewardError, match=r"^reward function boom raised KeyError: 'the\\nanswer'$") as e:
    rewards.score([_function(boom)], ["p"], ["c"], [[1]], {})
  assert isinstance(e.value, ValueError) and isinstance(e.value.__cause__, KeyError)

  def missing_column(prompts, completions, answer, **_):
    return [1.0]

  with pytest.raises(rewards.RewardError, match="reward function missing_column raised TypeError: .*'answer'"):
    rewards.score([_function(missing_column)], ["p"], ["c"], [[1]], {})
  cases = [
      (lambda **_: [1.0], "returned 1 rewards, expected 2; return one reward"),
      (lambda **_: [1.0, 2.0, 3.0], "returned 3 rewards, expected 2; return one reward"),
      (lambda **_: 1.0, "returned a float, expected a list of 2 floats"),
      (lambda **_: "10", "returned a str, expected a list of 2 floats"),
      (lambda **_: np.zeros((2, 1)), r"returned an array of shape \(2, 1\), expected a list of 2 floats"),
      (lambda **_: [1.0, "yes"], "returned 'yes' \\(str\\) for completion 1, expected 2 floats \\(or None\\)"),
  ]
  for fn, message in cases:
    with pytest.raises(rewards.RewardError, match=f"^reward function bad {message}"):
      rewards.score([_function(fn, "bad")], ["p", "q"], ["c", "d"], [[1], [2]], {})
  with pytest.raises(ValueError, match="answer has 1 rows for 2 completions"):
    rewards.score([_function(_length)], ["p", "q"], ["c", "d"], [[1], [2]], {"answer": ["1"]})


def test_none_is_nan_and_numbers_of_any_kind_are_floats():
  got = rewards.score([_function(lambda **_: [None, np.float32(0.5), True, 3], "mixed")], list("abcd"), list("abcd"),
                      [[1]] * 4, {})
  np.testing.assert_array_equal(got[:, 0], [NAN, 0.5, 1.0, 3.0])
  assert got.dtype == np.float64


SCORES = np.array([[1.0, NAN, 2.0],
                   [0.0, 1.0, NAN],
                   [NAN, NAN, NAN],
                   [1.0, 0.5, 4.0],
                   [NAN, 2.0, NAN]])
WEIGHTS = [1.0, 2.0, 0.5]


def test_weighted_totals_and_metrics_by_hand():
  total = rewards.weighted_total(SCORES, WEIGHTS)
  np.testing.assert_array_equal(total, [1.0 + 1.0, 0.0 + 2.0, NAN, 1.0 + 1.0 + 2.0, 4.0])
  functions = [rewards.RewardFunction(n, _length, w) for n, w in zip(("a", "b", "c"), WEIGHTS)]
  metrics = rewards.reward_metrics(SCORES, functions)
  sample_std = lambda xs: math.sqrt(sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1))
  assert metrics["rewards/a/mean"] == pytest.approx(2 / 3)
  assert metrics["rewards/a/std"] == pytest.approx(sample_std([1.0, 0.0, 1.0]))
  assert metrics["rewards/b/mean"] == pytest.approx(3.5 / 3)
  assert metrics["rewards/c/std"] == pytest.approx(sample_std([2.0, 4.0]))
  assert metrics["reward"] == pytest.approx(12 / 4)
  assert metrics["reward_std"] == pytest.approx(sample_std([2.0, 2.0, 4.0, 4.0]))
  assert list(metrics) == ["rewards/a/mean", "rewards/a/std", "rewards/b/mean", "rewards/b/std", "rewards/c/mean",
                           "rewards/c/std", "reward", "reward_std"]
  # One value: no spread (NaN, as TRL); no value at all: NaN mean.
  one = rewards.reward_metrics(np.array([[1.0, NAN], [NAN, NAN]]), functions[:2])
  assert one["rewards/a/mean"] == 1.0 and math.isnan(one["rewards/a/std"])
  assert math.isnan(one["rewards/b/mean"]) and math.isnan(one["rewards/b/std"]) and math.isnan(one["reward_std"])
  with pytest.raises(ValueError, match=r"weighted_total needs scores \[N, F\] and F weights"):
    rewards.weighted_total(SCORES, [1.0])


def test_totals_and_metrics_match_trls_own_code():
  torch = pytest.importorskip("torch")
  from trl.trainer.utils import nanstd
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(16, 3))
  scores[rng.random(scores.shape) < 0.3] = NAN
  scores[5] = NAN
  weights = [0.3, 1.0, 2.5]
  per_func = torch.tensor(scores, dtype=torch.float64)
  # GRPOTrainer._generate_and_score_completions, the logged part
  trl_total = (per_func * torch.tensor(weights, dtype=torch.float64).unsqueeze(0)).nansum(dim=1)
  trl_total[torch.isnan(per_func).all(dim=1)] = torch.nan
  total = rewards.weighted_total(scores, weights)
  np.testing.assert_allclose(total, trl_total.numpy(), rtol=1e-12)
  functions = [rewards.RewardFunction(n, _length, w) for n, w in zip(("a", "b", "c"), weights)]
  metrics = rewards.reward_metrics(scores, functions)
  for j, name in enumerate("abc"):
    assert metrics[f"rewards/{name}/mean"] == pytest.approx(torch.nanmean(per_func[:, j]).item(), rel=1e-12)
    # TRL's Bessel factor count / (count - 1) divides integer tensors: float32, so 1e-7 apart
    assert metrics[f"rewards/{name}/std"] == pytest.approx(nanstd(per_func[:, j]).item(), rel=1e-6)
  assert metrics["reward"] == pytest.approx(torch.nanmean(trl_total).item(), rel=1e-12)
  assert metrics["reward_std"] == pytest.approx(nanstd(trl_total).item(), rel=1e-6)
  for column in (torch.tensor([1.0, NAN], dtype=torch.float64), torch.tensor([NAN, NAN], dtype=torch.float64)):
    assert math.isnan(rewards.nanstd(column.numpy())) and math.isnan(nanstd(column).item())


EXACT = [  # completion, answer column, reward
    ("So she pays 1,234 dollars.", "1234", 1.0),
    ("The total is $1,234.00", "1,234", 1.0),
    ("She has 1234 apples", "1235", 0.0),
    ("Half of it: 3/4", "0.75", 1.0),
    ("so x = 0.750", "3/4", 1.0),
    (r"Therefore \boxed{\frac{3}{4}}.", "0.75", 1.0),
    (r"\boxed{-\dfrac{1}{2}} is it", "-0.5", 1.0),
    (r"First 5, then \boxed{7} and finally 9", "7", 1.0),
    (r"\boxed{\text{12}}", "12", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", 1.0),
    ("#### 72.0\n", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),  # GSM8K's whole solution as the answer column
    ("#### 18 \nThe end 5", "18", 1.0),  # the line after ####, whatever follows
    ("I think 4, no, 5", "4", 0.0),  # the last number
    ("I do not know", "3", 0.0),
    ("#### 3", "", None),  # no answer in the column: not scored
    ("#### 3", None, None),
]


@pytest.mark.parametrize("completion, answer, expected", EXACT)
def test_exact_answer(completion, answer, expected):
  assert rewards.exact_answer(["p"], [completion], [answer]) == [expected]
  conversational = [[{"role": "assistant", "content": completion}]]
  assert rewards.exact_answer([[{"role": "user", "content": "p"}]], conversational, [answer]) == [expected]


SYMBOLIC = [  # completion, answer column, reward with math-verify, without
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0, 0.0),
    (r"\boxed{x^2 + 2x}", "2x+x^2", 1.0, 0.0),
    (r"\boxed{x^2 + 2x}", "x^2+2x", 1.0, 1.0),  # the same string, spaces aside
    (r"\boxed{\left(1, 2\right)}", "(1,2)", 1.0, 1.0),
    (r"\boxed{\pi}", r"2\pi", 0.0, 0.0),
]


@pytest.mark.parametrize("completion, answer, with_math_verify, without", SYMBOLIC)
def test_exact_answer_symbolic_with_and_without_math_verify(monkeypatch, completion, answer, with_math_verify,
                                                            without):
  pytest.importorskip("math_verify")
  assert rewards.exact_answer(["p"], [completion], [answer]) == [with_math_verify]
  monkeypatch.setattr(rewards, "_math_verify", lambda: None)  # as where the rl extra is not installed
  assert rewards.exact_answer(["p"], [completion], [answer]) == [without]
  assert rewards.exact_answer(["p"], ["So 1,234.5"], ["1234.50"]) == [1.0]  # numbers need no math-verify


def test_final_answer_and_numbers():
  assert rewards.final_answer(r"\boxed{1} \boxed{\frac{a}{\boxed{b}}} then \boxed{c") == r"\frac{a}{\boxed{b}}"
  assert rewards.final_answer("a #### b #### 12,000\nmore") == "12,000"
  assert rewards.final_answer("-3 and -4.5") == "-4.5"
  assert rewards.as_number("1,234,567") == 1234567 and rewards.as_number("1,23") is None
  assert rewards.as_number(r"\$5.") == 5 and rewards.as_number("1e3") == 1000 and rewards.as_number("3/0") is None


ANSWER_FORMAT = [
    ("Natalia sold 24 clips.\n#### 72", 1.0),
    ("#### 72", 1.0),
    ("work\n#### -1,234.5  \n\n", 1.0),
    ("work\n  #### 72<|endoftext|>", 1.0),
    ("work\n#### 72</s>", 1.0),
    ("work\n####72\n", 1.0),
    ("The answer is #### 72", 0.0),  # not a line of its own
    ("#### 72 apples", 0.0),
    ("#### 72\nand more text", 0.0),  # not the end
    ("#### seventy-two", 0.0),
    (r"\boxed{72}", 0.0),
]


def test_answer_format():
  completions = [c for c, _ in ANSWER_FORMAT]
  assert rewards.answer_format(["p"] * len(completions), completions) == [r for _, r in ANSWER_FORMAT]
  conversational = [[{"role": "assistant", "content": [{"type": "text", "text": "x\n#### 1"}]}]]
  assert rewards.answer_format(["p"], conversational) == [1.0]
