"""Knowledge distillation: the trained decoder (the student) learns a frozen teacher's next-token distribution, in
pretraining (train_lm.py) and instruction tuning (finetune.py), when `distill.teacher` is set.

  teacher     an HF decoder folder or a jaxlm run workdir with the student's tokenizer (the same vocabulary, token
              for token: a one-line error otherwise), loaded on the run's mesh and sharded as the student is, in
              `distill.teacher_dtype` (bfloat16, float32, or int8 weights). It is frozen and stays outside the train
              state: every step takes its parameters as an input (steps.FrozenInputs), so checkpoints hold the
              student alone.
  loss        per token, (1 - distill.alpha) * the generalized JSD between the teacher's and the student's
              distributions at distill.temperature (TRL's convention: `forward_kl` is KL(teacher || student),
              `reverse_kl` KL(student || teacher), `jsd` the beta-mixture between them) + distill.alpha * the usual
              cross-entropy, summed over the loss mask and divided by its token count like every jaxlm loss. Both
              models' output projections run inside the fused loss a chunk of tokens at a time
              (jaxlm/kernels/distillation.py), so neither model's [B, T, V] logits exist whole.
  eval        the student's held-out cross-entropy as always (eval_loss) and its divergence to the teacher
              (eval_distill_divergence) on the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx
from jax.sharding import Mesh

from jaxlm.config import Config, DistillConfig, ModelConfig
from jaxlm.inference import generate
from jaxlm.parallel import sharding
from jaxlm.recipes import rollouts, trained_runs
from jaxlm.training import distill_loss
from jaxlm.training import steps as steps_lib
from jaxlm.training import telemetry


@dataclasses.dataclass
class Teacher:
  graphdef: nnx.GraphDef
  params: Any  # on the run's mesh layout, sharded as the student's parameters are
  model_config: ModelConfig


def load_teacher(config: Config, seq_len: int, student_tokenizer: tokenizers.Tokenizer | None, student_source: str,
                 fix: str) -> Teacher:
  """distill.teacher on the run's mesh layout in distill.teacher_dtype, checked against the student's tokenizer,
  vocabulary size and `seq_len`. `student_source` names where the student's tokenizer came from and `fix` what to
  change when the vocabularies differ (the two recipes take the tokenizer from different keys)."""
  d, m = config.distill, config.model
  float_dtype = m.compute_dtype if d.teacher_dtype == "int8" else d.teacher_dtype
  loaded, graphdef, params, tokenizer, _ = trained_runs.load_decoder(
      d.teacher, mesh_config=config.mesh, compute_dtype=m.compute_dtype, param_dtype=float_dtype)
  check_same_vocabulary(student_tokenizer, tokenizer, student_source, d.teacher, fix)
  teacher_config = loaded.model
  if teacher_config.vocab_size != m.vocab_size:
    raise ValueError(f"distill.teacher={d.teacher!r} has {teacher_config.vocab_size} output rows and the student "
                     f"{m.vocab_size}; {fix}")
  if teacher_config.max_seq_len < seq_len:
    raise ValueError(f"distill.teacher={d.teacher!r} has {teacher_config.max_seq_len} positions, fewer than "
                     f"data.seq_len={seq_len}; lower data.seq_len to {teacher_config.max_seq_len}")
  # A jaxlm run is restored in its own precision: the teacher's storage is distill.teacher_dtype all the same.
  params = jax.tree.map(lambda x: x.astype(float_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  if d.teacher_dtype == "int8":
    graphdef, params = trained_runs.with_weights(graphdef, params, "weight_only")
  return Teacher(graphdef, params, teacher_config)


def check_same_vocabulary(student: tokenizers.Tokenizer | None, teacher: tokenizers.Tokenizer, student_source: str,
                          teacher_source: str, fix: str) -> None:
  """Teacher and student must number the same tokens alike: the divergence compares their distributions id by id."""
  if student is None:
    raise ValueError(f"distillation compares the student's vocabulary with the teacher's, and {student_source} has "
                     f"no tokenizer.json; {fix}")
  s_vocab, t_vocab = student.get_vocab(with_added_tokens=True), teacher.get_vocab(with_added_tokens=True)
  if s_vocab != t_vocab:
    differing = sorted((set(s_vocab.items()) ^ set(t_vocab.items())), key=lambda kv: kv[1])
    token, index = differing[0] if differing else ("?", -1)
    raise ValueError(f"the student's vocabulary ({student_source}: {len(s_vocab)} tokens) and the teacher's "
                     f"({teacher_source}: {len(t_vocab)} tokens) differ, first at id {index} ({token!r}); {fix}")


def teacher_flops_per_token(teacher: Teacher, seq_len: int) -> float:
  """The teacher's forward FLOPs per token (a third of training's forward + backward), for the step's MFU."""
  return telemetry.flops_per_token(teacher.model_config, seq_len) / 3


def frozen_inputs(config: Config, graphdef: nnx.GraphDef, teacher: Teacher) -> steps_lib.FrozenInputs:
  """The teacher's parameters as the steps' frozen input, with the distillation loss and its evaluation."""
  shardings = jax.tree.map(lambda x: x.sharding, teacher.params)
  return steps_lib.FrozenInputs(
      teacher.params, shardings,
      loss_of=lambda teacher_params: make_loss_fn(graphdef, teacher.graphdef, teacher_params, config.distill),
      eval_of=lambda teacher_params: make_eval_fn(graphdef, teacher.graphdef, teacher_params, config.distill))


def _token_sums(graphdef, teacher_graphdef, params, teacher_params, batch: dict, distill: DistillConfig,
                alpha: float) -> tuple[dict, jax.Array]:
  """The fused kernel's sums over the batch's loss-masked tokens, and the mask."""
  student = nnx.merge(graphdef, params)
  teacher = nnx.merge(teacher_graphdef, jax.lax.stop_gradient(teacher_params))
  mask_BT = batch["loss_mask"].astype(jnp.float32)
  args = (batch["inputs"], batch["positions"], batch["segment_ids"])
  x_BTD, router_sums = student.features_and_router_sums(batch["inputs"], mask_BT, *args[1:])
  teacher_x_BTE = jax.lax.stop_gradient(teacher.features(*args))
  b, t, _ = x_BTD.shape
  sums = student.kernels.distillation_sums(
      x_BTD.reshape(b * t, -1), student.output_table(), teacher_x_BTE.reshape(b * t, -1),
      jax.lax.stop_gradient(teacher.output_table()), batch["targets"].reshape(b * t), mask_BT.reshape(b * t),
      beta=distill_loss.loss_beta(distill.loss, distill.beta), temperature=distill.temperature, alpha=alpha,
      student_softcap=student.config.logit_softcap, teacher_softcap=teacher.config.logit_softcap)
  return {**sums, **router_sums}, mask_BT


def make_loss_fn(graphdef, teacher_graphdef, teacher_params, distill: DistillConfig):
  """(params, batch) -> (objective sum, (token count, sums)): a SumLossFn of the student's parameters."""

  def loss_fn(params, batch):
    sums, mask_BT = _token_sums(graphdef, teacher_graphdef, params, teacher_params, batch, distill, distill.alpha)
    objective = sums.pop("objective") + sums.get("aux_loss", 0.0)  # a student MoE's router losses, as in pretraining
    metrics = {"distill_divergence": sums.pop("divergence"), **sums}
    return objective, (mask_BT.sum(), metrics)

  return loss_fn


def make_eval_fn(graphdef, teacher_graphdef, teacher_params, distill: DistillConfig):
  """(params, batch) -> the summed held-out cross-entropy (eval_loss) and divergence to the teacher."""

  def eval_fn(params, batch):
    sums, mask_BT = _token_sums(graphdef, teacher_graphdef, params, teacher_params, batch, distill, 0.0)
    return {"loss_sum": sums["cross_entropy"], "tokens": mask_BT.sum(), "correct": sums["correct"],
            "distill_divergence": sums["divergence"]}

  return eval_fn


class OnPolicyRows:
  """distill.on_policy: on a seeded share of the steps the student answers the step's prompts itself (one sampled
  response each, with rl.max_completion_length, rl.temperature / top_p / top_k) and the teacher grades those tokens,
  as TRL's GKD does with lmbda; the other steps keep the data's responses. The prompts are the training examples'
  tokens before their first loss token (a pair's prompt, or a conversation's turns before its first reply, under the
  chat template as the data writes them), and a response stops at the data's stop tokens. A step's choice and its
  samples are pure functions of (train.seed, step, params), so a resumed run trains on the same rows."""

  def __init__(self, config: Config, graphdef: nnx.GraphDef, features, state_shardings, mesh: Mesh,
               prompts: list[list[int]], stop_ids: tuple[int, ...], pad_id: int, seq_len: int):
    rl, t = config.rl, config.train
    # The sampler left-pads a batch's prompts to a bucketed width P; a row holds P + C - 1 inputs, and the rows take
    # the data rows' compiled step when they fit data.seq_len.
    width = generate.prompt_width(config.model, max(len(p) for p in prompts), rl.max_completion_length)
    if width + rl.max_completion_length - 1 > seq_len:
      raise ValueError(f"distill.on_policy: the longest prompt, padded to {width} tokens, + rl.max_completion_length="
                       f"{rl.max_completion_length} exceeds data.seq_len={seq_len} + 1; lower "
                       f"rl.max_completion_length to {max(seq_len + 1 - width, 1)} or raise data.seq_len")
    if len(prompts) < t.batch_size:
      raise ValueError(f"distill.on_policy needs at least train.batch_size={t.batch_size} training examples; the "
                       f"data has {len(prompts)}")
    self.share, self.seed, self.seq_len, self.prompt_ids = config.distill.on_policy, t.seed, seq_len, prompts
    self.prompt_batches = rollouts.PromptBatches(len(prompts), t.batch_size, t.seed)
    self.sampler = rollouts.RolloutSampler(graphdef, features, state_shardings, mesh, rl, stop_ids, pad_id=pad_id,
                                           overrides=sharding.rule_overrides(config.mesh))
    self.features = features

  def samples_at(self, step: int) -> bool:
    return bool(np.random.default_rng([self.seed, step]).random() < self.share)

  def __call__(self, state, step: int, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if not self.samples_at(step):
      return rows
    prompt_ids = [self.prompt_ids[i] for i in self.prompt_batches.indices(step)]
    key = jax.random.fold_in(jax.random.key(self.seed), step)
    tokens, pads, completions = self.sampler.sample(self.features.model_params(state), prompt_ids, key, 1)
    return rollouts.local_rows(response_rows(tokens, pads, completions, self.sampler.stop_set, self.seq_len))


def response_rows(tokens_NP: np.ndarray, pads_N: np.ndarray, completions_NC: np.ndarray, stop_ids: set[int],
                  seq_len: int) -> dict[str, np.ndarray]:
  """Rows of left-padded prompts followed by their sampled responses, laid out as instruction tuning's rows (inputs,
  targets, positions, segment_ids, loss_mask [N, W]), the loss on the response tokens up to and including the stop
  token, padded to W = seq_len (>= P + C - 1) so that they take the data rows' compiled step."""
  p, c = tokens_NP.shape[1], completions_NC.shape[1]
  lengths, _ = rollouts.completion_lengths(completions_NC, stop_ids)
  full = np.concatenate([tokens_NP, completions_NC], axis=1)
  slots = np.arange(p + c - 1)[None, :]
  rows = {"inputs": full[:, :-1], "targets": full[:, 1:],
          "positions": np.maximum(slots - pads_N[:, None], 0), "segment_ids": (slots >= pads_N[:, None]),
          # target slot j predicts full[j + 1]: the response's k-th token sits at target slot p - 1 + k
          "loss_mask": (slots >= p - 1) & (slots < p - 1 + lengths[:, None])}
  dtypes = {"loss_mask": np.float32}
  return {k: np.pad(v, [(0, 0), (0, seq_len - v.shape[1])]).astype(dtypes.get(k, np.int32)) for k, v in rows.items()}
