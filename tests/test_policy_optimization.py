"""Online RL through the one loop (jaxlm/recipes/policy_optimization.py) on a small random Llama saved by
transformers: the run writes TRL's metrics, rollouts.jsonl, start_eval.json and eval.json and raises its reward;
kill-and-resume (inside a cycle of rl.num_iterations) repeats the same rollouts and losses bit for bit; one device
gives the losses of four; the reference of a LoRA run is the base (KL 0 before the first update) and full tuning's
is a frozen copy; a reward function that raises names itself and leaves the checkpoints."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import load_script, write_jsonl, xla_flags_without_device_count

torch = pytest.importorskip("torch", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")

from experiments import conversations as conversation_data  # noqa: E402
from jaxlm import config as config_lib  # noqa: E402
from jaxlm.recipes import policy_optimization, rewards  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "apple river stone cloud maple tiger lemon piano silver garden".split()
STEPS = 6
STOPPED_AT = 3  # the one-device run's last step: two rollouts, the second after an update
# A dense reward a random model can climb in a few steps: completions of low token ids score higher.
REWARDS = '''
def low_ids(prompts, completions, completion_ids, **_):
  return [1.0 - sum(ids) / (320.0 * max(len(ids), 1)) for ids in completion_ids]


def broken(prompts, completions, **_):
  raise KeyError("no column named solution")
'''


def _rows(count: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(count):
    words = [WORDS[i] for i in rng.choice(len(WORDS), size=int(rng.integers(1, 4)), replace=False)]
    rows.append({"prompt": "Say a word: " + " ".join(words), "answer": words[0]})
  return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  folder = tmp_path_factory.mktemp("rl")
  train, held_out = _rows(48, 0), _rows(8, 1)
  chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]}
           for r in train]
  tokenizer = conversation_data.write_chat_tokenizer(str(folder / "tokenizer"), chats, 320, 64)
  torch.manual_seed(1)
  hf_config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                       max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)
  transformers.LlamaForCausalLM(hf_config).save_pretrained(str(folder / "policy"))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tokenizer, name), folder / "policy")
  (folder / "rewards.py").write_text(REWARDS)
  setup = dict(folder=folder, policy=str(folder / "policy"), train=write_jsonl(folder / "train.jsonl", train),
               eval=write_jsonl(folder / "eval.jsonl", held_out), rewards=str(folder / "rewards.py"))
  setup["run"] = str(folder / "run")
  policy_optimization.policy_optimize(_config(setup), setup["run"])  # the uninterrupted run the tests compare with
  return setup


def _overrides(setup, **changes) -> dict:
  values = {"init_from": setup["policy"], "model.flavour": "llama", "model.compute_dtype": "float32",
            "data.source": "files", "data.seq_len": 0, "data.train_files": (setup["train"],),
            "data.eval_files": (setup["eval"],), "rl.loss": "dapo", "rl.rewards": (f"{setup['rewards']}:low_ids",),
            "rl.num_generations": 4, "rl.max_completion_length": 6, "rl.beta": 0.04, "rl.num_iterations": 2,
            "rl.epsilon_high": 0.28, "lora.rank": 8, "train.steps": STEPS, "train.batch_size": 16,
            "train.learning_rate": 1e-2, "train.warmup_steps": 0, "train.weight_decay": 0.0,
            "train.eval_every_steps": 0, "checkpoint.every_steps": 0, "log.every_steps": 1,
            "log.progress_bar": False}
  values.update(changes)
  return values


def _config(setup, **changes):
  config = load_script("experiments/configs/finetune_rl.py").get_config()  # what the one-device command reads
  config.rl.reward_weights, config.rl.stop_tokens = (), ()  # the tiny tokenizer's EOS ends completions
  for key, value in _overrides(setup, **changes).items():
    if "." in key:
      section, name = key.split(".")
      setattr(config[section], name, value)
    else:
      setattr(config, key, value)
  return config_lib.from_config_dict(config)


def _lines(workdir: str, name: str = "metrics.jsonl") -> list[dict]:
  return [json.loads(line) for line in open(os.path.join(workdir, name))]


def test_a_run_writes_trls_metrics_and_raises_its_reward(setup):
  lines = _lines(setup["run"])
  assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
  expected = {"reward", "reward_std", "rewards/low_ids/mean", "rewards/low_ids/std", "frac_reward_zero_std",
              "completions/mean_length", "completions/min_length", "completions/max_length",
              "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
              "kl", "entropy", "sampled_tokens_per_sec", "loss"}
  assert expected <= set(lines[0])
  # Step 5 samples; step 6 trains again on step 5's rollout (num_iterations 2) and samples nothing.
  assert {"sampling_share", "tokens_per_sec", "mfu"} <= set(lines[-1]) and lines[-1]["sampling_share"] == 0
  assert 0 < lines[-2]["sampling_share"] < 1
  # LoRA's reference is the base: before the first update the policy is the base and the KL is 0 exactly.
  assert lines[0]["kl"] == 0.0 and lines[-1]["kl"] > 0
  # The second update of a rollout (num_iterations 2) sees the policy moved: ratios leave 1, some are clipped.
  assert lines[1]["clip_ratio/region_mean"] > 0 or lines[3]["clip_ratio/region_mean"] > 0
  assert np.mean([x["reward"] for x in lines[2:]]) > lines[0]["reward"] + 0.02
  result = json.load(open(os.path.join(setup["run"], "eval.json")))
  start = json.load(open(os.path.join(setup["run"], "start_eval.json")))
  assert result["eval_reward"] > start["eval_reward"] + 0.02 and "eval_reward/low_ids" in result
  assert result["rollout_compiles"] <= 2  # one prompt bucket: the rollout's program and the greedy evaluation's
  rollouts = _lines(setup["run"], "rollouts.jsonl")
  assert {x["step"] for x in rollouts} == {1, 3, 5} and set(rollouts[0]) == {
      "step", "prompt", "completion", "rewards", "advantage"}
  report = open(os.path.join(setup["run"], "report.md")).read()
  assert "reward_curve.png" in report and "After tuning" in report
  assert os.path.isdir(os.path.join(setup["run"], "adapter")) and os.path.isdir(os.path.join(setup["run"], "hf_model"))


def test_kill_and_resume_inside_a_cycle_repeats_the_rollouts_and_losses_bit_for_bit(setup):
  workdir = str(setup["folder"] / "resumed")
  config = _config(setup)
  policy_optimization.policy_optimize(config, workdir, stop_at_step=3)  # step 3 samples; step 4 reuses its rollout
  policy_optimization.policy_optimize(config, workdir)
  ours, reference = _lines(workdir), _lines(setup["run"])
  for key in ("loss", "reward", "kl", "entropy", "grad_norm"):
    assert [x[key] for x in ours] == [x[key] for x in reference], key
  assert _lines(workdir, "rollouts.jsonl") == _lines(setup["run"], "rollouts.jsonl")


def test_one_device_gives_the_losses_of_four(setup, tmp_path):
  """The same run as the command a user types, in a subprocess on one CPU device, to its second rollout (step 3)."""
  workdir = tmp_path / "one_device"
  env = dict(os.environ, XLA_FLAGS=f"{xla_flags_without_device_count()} --xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu")
  kernels = json.load(open(os.path.join(setup["run"], "config.json")))["kernels"]
  flags = [f"--config.{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in _overrides(setup).items()]
  command = [sys.executable, os.path.join(ROOT, "experiments", "finetune.py"),
             "--config=" + os.path.join(ROOT, "experiments", "configs", "finetune_rl.py"), f"--workdir={workdir}",
             f"--stop_at_step={STOPPED_AT}",
             "--config.rl.reward_weights=", "--config.rl.stop_tokens=", *flags,
             # one device picks the CPU's fused attention and BLAS matmuls: the 4-device run's kernels instead, so
             # the two runs differ by their layout alone
             *[f"--config.kernels.{k}={v}" for k, v in kernels.items()]]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"stopped after step {STOPPED_AT} (checkpoint saved)" in done.stdout
  ours, reference = _lines(str(workdir)), _lines(setup["run"])[:STOPPED_AT]
  rollouts = [x for x in _lines(setup["run"], "rollouts.jsonl") if x["step"] <= STOPPED_AT]
  assert _lines(str(workdir), "rollouts.jsonl") == rollouts  # the same samples
  # Within 1e-5 absolute: a policy loss is a sum of terms that cancel to about 0 (advantages have zero mean), so
  # its relative rounding error is larger than its terms'.
  for key in ("loss", "reward", "entropy"):
    np.testing.assert_allclose([x[key] for x in ours], [x[key] for x in reference], rtol=1e-5, atol=1e-5)
  # k3's exp(log-ratio) magnifies the parameters' rounding drift once the policy is a nat away from the base
  np.testing.assert_allclose([x["kl"] for x in ours], [x["kl"] for x in reference], rtol=1e-4)


def test_full_tuning_keeps_a_frozen_reference_and_sequence_ratios_train(setup):
  workdir = str(setup["folder"] / "full")
  config = _config(setup, **{"lora.rank": 0, "rl.loss": "grpo", "rl.importance_sampling": "sequence",
                             "rl.num_iterations": 1, "train.steps": 2, "train.learning_rate": 1e-3})
  policy_optimization.policy_optimize(config, workdir)
  lines = _lines(workdir)
  assert lines[0]["kl"] == 0.0 and lines[1]["kl"] > 0  # the copy of init_from's weights stayed where it was
  assert np.isfinite(lines[1]["loss"]) and "adapter" not in os.listdir(workdir)


def test_a_reward_function_that_raises_names_itself_and_keeps_the_checkpoints(setup):
  workdir = str(setup["folder"] / "broken")
  shutil.copytree(setup["run"], workdir)
  config = _config(setup, **{"train.steps": STEPS + 2, "rl.rewards": (f"{setup['rewards']}:broken",)})
  with pytest.raises(rewards.RewardError, match="broken.*KeyError.*no column named solution"):
    policy_optimization.policy_optimize(config, workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == sorted(
      os.listdir(os.path.join(setup["run"], "checkpoints")))
