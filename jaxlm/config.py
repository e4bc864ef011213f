"""Typed experiment configuration.

The dataclasses below are the source of truth for every key and its default. Experiment files under
`experiments/configs/` return an `ml_collections.ConfigDict` built from `default_config()` so that absl's
`--config.a.b=v` overrides work; `from_config_dict` turns it back into a typed, validated `Config`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections

CLASSIFIER_POOLINGS = ("cls", "mean", "auto")
CLASSIFIER_HEADS = ("pooler", "dense_tanh", "dense_relu", "transform")
ENCODER_OPTIONS = ("position_start", "rotary_positions", "pre_norm", "gated_mlp", "linear_bias", "norm_bias",
                   "encoder_window", "encoder_global_every", "classifier_head")
QK_NORMS = ("", "head", "full")
ROPE_SCALINGS = ("", "linear", "llama3", "dynamic", "yarn")
BLOCK_NORMS = ("pre", "sandwich", "post")
GLU_ACTIVATIONS = ("silu", "gelu_tanh")


def _ranged(default, low=None, high=None, *, low_open: bool = False, high_open: bool = False, note: str = ""):
  """A numeric field with its allowed range, declared beside it and checked by `validate_ranges` (a one-line error
  naming the key): [low, high], either end open with `low_open` / `high_open`, None for no bound."""
  return dataclasses.field(default=default, metadata={"range": (low, high, low_open, high_open, note)})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = _ranged(8192, 1)  # tokens; the BPE tokenizer is trained to this size when none is given
  num_layers: int = _ranged(6, 1)  # transformer blocks, stacked and scanned
  d_model: int = _ranged(384, 1)  # residual stream width
  num_heads: int = _ranged(6, 1)  # attention heads; d_model must be divisible by it
  d_ff: int = _ranged(0, 0, note="0 means 4 * d_model")  # MLP hidden width; 0 means 4 * d_model
  max_seq_len: int = _ranged(1024, 1)  # learned position table size; must be >= data.seq_len
  layer_norm_eps: float = _ranged(1e-5, 0, low_open=True)  # LayerNorm epsilon (GPT-2 uses 1e-5)
  init_std: float = _ranged(0.02, 0, low_open=True)  # normal init std; residual projections are scaled by
                                                     # 1/sqrt(2 * num_layers)
  param_dtype: str = "float32"  # master weights (kept in f32 for stable updates)
  compute_dtype: str = "bfloat16"  # matmul inputs; use float32 on the CPU, where bf16 matmuls are slow
  document_mask: bool = True  # decoders: packed documents attend only within themselves; False: plain causal
                              # attention across the documents of a row (as GPT-2, nanoGPT and llm.c train)
  flavour: str = "gpt2"  # gpt2 | llama (decoders, see jaxlm/models/gpt.py) | bert (encoder, jaxlm/models/bert.py)
  num_kv_heads: int = _ranged(0, 0, note="0 = model.num_heads")  # key/value heads: 0 = num_heads;
                                                                 # fewer = grouped-query, 1 = multi-query attention
  attention_head_dim: int = _ranged(0, 0, note="0 = d_model / num_heads")  # each head's size, when it is not
                                                                           # d_model / num_heads (Qwen3)
  qkv_bias: bool = False  # llama flavour: biases on the query, key and value projections (Qwen2), none on the output
  qk_norm: str = ""  # decoders: RMSNorm of queries and keys after their projection: "" none | head (over each head,
                     # one scale per head dimension: Qwen3) | full (over all heads together: OLMoE)
  rope_theta: float = _ranged(10000.0, 0, low_open=True)  # rotary position base of the llama flavour
  rope_scaling: str = ""  # rotary frequencies stretched for longer contexts: "" none | linear (all divided by
                          # rope_factor) | llama3 (Llama 3.1: low frequencies divided, high kept, a blend between)
  rope_factor: float = _ranged(1.0, 1)  # how much longer a context the scaled frequencies serve
  rope_low_freq_factor: float = _ranged(1.0, 0, low_open=True)  # llama3: wavelengths above
                                                                # rope_original_max_positions / this are divided
  rope_high_freq_factor: float = _ranged(4.0, 0, low_open=True)  # llama3: wavelengths below
                                                                 # rope_original_max_positions / this are kept
  rope_original_max_positions: int = _ranged(8192, 1)  # llama3, yarn: the context the unscaled frequencies were
                                                       # trained on
  rope_beta_fast: float = _ranged(32.0, 0, low_open=True)  # yarn: rotations above which frequencies are kept
  rope_beta_slow: float = _ranged(1.0, 0, low_open=True)  # yarn: rotations below which frequencies are divided
  rope_attention_factor: float = _ranged(0.0, 0, note="0 = 0.1 ln(rope_factor) + 1")  # yarn: cos and sin scale
  rope_local_theta: float = _ranged(0.0, 0, note="0 = the global layers' tables")  # windowed layers' unscaled
                                         # rotary base (Gemma 3, ModernBERT); 0 = the global layers' tables (Gemma 2)
  sliding_window: int = _ranged(0, 0, note="0 = none")  # decoders: each query sees itself and the window - 1 keys
                                                        # before it (Mistral, Gemma 2/3 local layers); 0 = every key
  global_attention_every: int = _ranged(0, 0, note="0 = every layer windowed")  # with a sliding window: every Nth
                            # layer (N-1, 2N-1, ...) attends to every key (Gemma 2: 2, Gemma 3: 6); 0 = none does
  attention_softcap: float = _ranged(0.0, 0, note="0 = none")  # attention scores s -> c tanh(s / c) (Gemma 2)
  logit_softcap: float = _ranged(0.0, 0, note="0 = none")  # output logits z -> c tanh(z / c) (Gemma 2)
  query_pre_attn_scalar: float = _ranged(0.0, 0, note="0 = the head dim")  # scores scaled by its -1/2 power
                                                                           # instead of the head dim's (Gemma)
  block_norms: str = "pre"  # llama flavour: pre (norm before attention and MLP) | sandwich (also after each, before
                            # the residual add: Gemma 2/3) | post (only after each: OLMo 2)
  glu_activation: str = "silu"  # llama flavour's gated MLP: silu (SwiGLU) | gelu_tanh (GeGLU: Gemma)
  norm_plus_one: bool = False  # llama flavour: RMSNorm scales by (1 + w), its weights stored as w (Gemma)
  scale_embeddings: bool = False  # llama flavour: token embeddings times sqrt(d_model) (Gemma)
  hf_model_type: str = ""  # the HF family to export as when the options alone do not say: "" (from the options) |
                          # phi3 (Llama's weights, stored fused) | xlm-roberta (RoBERTa's architecture)
  tie_embeddings: bool = True  # the output projection reuses the token embedding (GPT-2 always; Llama often not)
  type_vocab_size: int = _ranged(2, 0, note="0 = none")  # bert: token types (sentence A/B) in the token-type
                                                         # embedding; 0 = none, token_type_ids are not taken
                                                         # (DistilBERT, ModernBERT)
  position_start: int = _ranged(0, 0)  # bert learned positions: 0 numbers the positions 0, 1, ... (BERT); > 0 counts
                                       # the attended tokens from it, padding at position_start - 1 (RoBERTa:
                                       # pad_token_id + 1); the table holds max_seq_len + position_start rows
  rotary_positions: bool = False  # bert: rotary positions (model.rope_theta; model.rope_local_theta on local layers)
                                  # instead of a learned table (ModernBERT)
  pre_norm: bool = False  # bert: pre-LayerNorm blocks x + f(norm(x)) and a final norm (ModernBERT; the first block's
                          # attention reads the normed embeddings as they are); False: x = norm(x + f(x)) (BERT)
  gated_mlp: bool = False  # bert: a GELU-gated MLP without biases (GeGLU: ModernBERT) instead of GELU between two
                           # biased layers
  linear_bias: bool = True  # bert: biases on the attention projections and the heads' dense layers (ModernBERT: none)
  norm_bias: bool = True  # bert: biases in the LayerNorms (ModernBERT: none)
  encoder_window: int = _ranged(0, 0, note="0 = none")  # bert: local layers' queries see the keys at most
                                                        # encoder_window // 2 positions away (ModernBERT's
                                                        # local_attention); 0 = every layer sees every key
  encoder_global_every: int = _ranged(1, 1)  # bert with an encoder_window: layers 0, N, 2N, ... see every key, the
                                             # others are local (ModernBERT's global_attn_every_n_layers)
  classifier_pooling: str = "cls"  # bert classifiers: cls (HF's tanh pooler on [CLS]) | mean (mean of the tokens'
                                   # last hidden states, as sentence-transformers models are trained) | auto (fine-
                                   # tuning: what init_from was trained for: mean with a mean-pooling 1_Pooling/)
  classifier_head: str = "pooler"  # bert classifiers, between the pooled state and the last linear layer: pooler
                                   # (BERT: the encoder's tanh pooler on [CLS]; none with mean pooling) | dense_tanh
                                   # (RoBERTa) | dense_relu (DistilBERT): a dense layer of the head and its activation |
                                   # transform (ModernBERT: the masked-LM head's dense layer, GELU and LayerNorm)
  # Mixture of experts (decoders; jaxlm/models/moe.py): every block's MLP becomes num_experts MLPs and a router.
  num_experts: int = _ranged(0, 0, note="0 = dense MLPs")  # experts per MoE layer; 0 = a dense MLP
  experts_per_token: int = _ranged(2, 1)  # experts each token is routed to (top-k)
  expert_d_ff: int = _ranged(0, 0, note="0 = the dense MLP width")  # each expert's MLP width; 0 = model.d_ff's
  shared_expert_d_ff: int = _ranged(0, 0, note="0 = none")  # width of a dense MLP beside the experts that every
                                                            # token takes (0 = none)
  router_normalize_topk: bool = True  # the chosen experts' weights rescaled to sum to 1 (Mixtral, Qwen3-MoE);
                                      # False keeps their softmax probabilities (OLMoE)
  router_balance_weight: float = _ranged(0.01, 0)  # weight of the load-balancing loss in the objective
  router_z_weight: float = _ranged(0.001, 0)  # weight of the router z-loss in the objective

  @property
  def mlp_width(self) -> int:
    return self.d_ff or 4 * self.d_model

  @property
  def expert_width(self) -> int:
    return self.expert_d_ff or self.mlp_width

  @property
  def expert_params(self) -> int:
    """One expert's MLP weights (SwiGLU's gate, up and down for llama; in and out for gpt2)."""
    return (3 if self.flavour == "llama" else 2) * self.d_model * self.expert_width

  @property
  def head_dim(self) -> int:
    return self.attention_head_dim or self.d_model // self.num_heads

  @property
  def kernel_needs(self) -> dict:
    """What the model asks of its kernels (`jaxlm.kernels.resolve`'s head_dim, window and softcaps)."""
    caps = (("attention", self.attention_softcap), ("cross_entropy", self.logit_softcap))
    return {"head_dim": self.head_dim, "window": bool(self.sliding_window),
            "softcaps": tuple(op for op, cap in caps if cap)}


@dataclasses.dataclass(frozen=True)
class KernelsConfig:
  """How the model is executed: none of these change the function it computes (each implementation is tested equal
  to the reference) but matmul=fp8, which rounds the weight matmuls' operands to 8 bits. Each op and execution
  choice takes `auto` or a name the kernel registry lists for it (jaxlm/kernels/registry.py: IMPLEMENTATIONS,
  EXECUTION); `auto` picks the fastest tested one for the platform, compute dtype and mesh. The resolved choice is
  printed at start-up and written to config.json."""
  attention: str = "auto"
  attention_block: int = _ranged(32, 1)  # queries per block of causal_blocks and cpu_fused
  matmul: str = "auto"  # the weight matmuls (fp8: in float8 on Ada/Hopper GPUs, an explicit choice only)
  cross_entropy: str = "auto"
  cross_entropy_chunk: int = _ranged(0, 0, note="0 = auto")  # tokens per chunk of the chunked cross-entropy; 0 = auto
  norm: str = "auto"  # LayerNorm / RMSNorm
  glu: str = "auto"  # Llama's gated MLP projection
  grouped_matmul: str = "auto"  # mixture-of-experts layers: each expert's matmul on the tokens routed to it
  fuse_qkv: str = "auto"  # q, k, v from one matmul or three
  layers: str = "auto"  # a scan over the stacked layers or a Python loop
  scan_unroll: int = _ranged(1, 1)  # layers per iteration of the scan
  remat: str = "auto"  # activation recomputation per block


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # pure data-parallel replicas; -1 = all devices left after the other axes
  fsdp: int = 1  # devices that shard params, grads and optimizer state (and the batch)
  tensor: int = 1  # devices that split attention heads and the MLP width (Megatron style)
  preset: str = ""  # dp | fsdp | tp | dp_tp | fsdp_tp: sets data/fsdp/tensor (see MESH_PRESETS)
  gradient_sync: str = "auto"  # gspmd: GSPMD inserts the collectives | shard_map: one explicit psum over the batch
                               # axes | auto: shard_map for pure data parallel with grad_accum > 1, else gspmd
  sequence_parallel: bool = False  # Megatron-SP: the residual stream (norms, residual adds) is sharded along the
                                   # sequence over the tensor axis; all-reduces become reduce-scatter + all-gather
  expert: int = 1  # devices that split every mixture-of-experts layer's experts (model.num_experts); they are
                   # data-parallel replicas for the rest of the model (docs/parallelism.md)
  context: int = 1  # devices that split every row's sequence for the whole model (ring attention; each holds an
                    # early and a late chunk); data.seq_len must be divisible by 2 * mesh.context
  pipeline: int = 1  # pipeline stages: each holds model.num_layers / pipeline consecutive blocks, and the
                     # train.grad_accum micro-batches flow through them (docs/performance.md#pipeline-parallelism)
  pipeline_schedule: str = "gpipe"  # gpipe: all forwards, then all backwards (keeps all micro-batch inputs) |
                                    # 1f1b: backwards interleaved, at most 2 * pipeline - 1 kept; same bubble


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = "demo"  # demo (Python stdlib sources, no network) | files | hf: prepared into the shared cache
                        # (jaxlm/data/corpus_cache.py) | prepared: data.prepared / data.mixture folders
  prepared: str = ""  # source=prepared: a folder written by experiments/prepare_data.py
  mixture: str = ""  # source=prepared: several folders mixed by tokens, "folder=weight,folder=weight" (weights are
                     # normalised; changing them on resume applies from the resumed step)
  cache_dir: str = ""  # shared cache of prepared corpora; empty = $JAXLM_DATA_CACHE, else ~/.cache/jaxlm/corpora
  workers: int = _ranged(0, 0, note="0 = one per core")  # tokenizer processes when preparing (0 = one per core)
  train_files: tuple[str, ...] = ()  # .txt, .jsonl/.json or .parquet files (source=files)
  eval_files: tuple[str, ...] = ()  # held-out files; empty = hold out data.eval_fraction of the documents
  hf_name: str = ""  # HF dataset name or local dataset folder (source=hf)
  hf_config: str = ""  # HF dataset config name, if any
  hf_split: str = "train"  # HF split to read
  text_column: str = "text"  # column holding the text in JSONL/Parquet/HF data
  seq_len: int = 256  # tokens per packed training sequence; fine-tuning: 0 = chosen from the data
                      # (jaxlm/recipes/data_defaults.py: the 99th percentile of the tokenized training lengths,
                      # capped by the model's positions)
  eval_fraction: float = _ranged(0.02, 0, 1, high_open=True)  # fraction of documents held out for eval when no
                                                              # eval_files are given
  max_documents: int = _ranged(0, 0, note="0 = no cap")  # cap on documents read (0 = no cap)
  max_bytes: int = _ranged(0, 0, note="0 = no cap")  # cap on bytes of text read (0 = no cap); the console says
                                                     # when a cap cut the data
  tokenizer: str = ""  # path to a tokenizer.json; empty = train a byte-level BPE and save it in the workdir
  shuffle: bool = True  # shuffle packed sequences each epoch (seeded by train.seed)
  # Fine-tuning (experiments/finetune.py; data.seq_len is then the longest tokenized example, longer ones are cut).
  prompt_column: str = "prompt"  # instruction tuning (a decoder's init_from): the column of the prompts
  response_column: str = "response"  # instruction tuning: the column of the responses (the only tokens with a loss)
  chosen_column: str = "chosen"  # preference tuning: the preferred response (a string, or a list of messages)
  rejected_column: str = "rejected"  # preference tuning: the dispreferred response, in the chosen column's form
  messages_column: str = ""  # instruction tuning on conversations: the column holding each record's list of
                             # {role, content} turns (optional system turn), written with init_from's chat template
                             # and the loss on the assistant turns only (jaxlm/data/conversations.py); "" = pairs.
                             # A conversation longer than data.seq_len is cut there (its later turns dropped), not
                             # dropped; without a template it is an error
  label_column: str = "label"  # column holding the class: an integer id or a string name
  text_pair_column: str = ""  # second text of a pair (sentence B, e.g. the hypothesis of NLI); empty = single texts
  labels: tuple[str, ...] = ()  # class names in id order; empty = sorted training labels (int labels: 0..max)
  hf_eval_split: str = ""  # HF split for evaluation (source=hf without eval_files); empty = hold out eval_fraction
  batching: str = "bucket"  # dynamic: pad each batch to its longest example (rounded to a multiple of 16) |
                            # bucket: also group similar lengths into batches | max: pad every batch to seq_len


OPTIMIZERS = ("adamw", "muon")  # jaxlm/training/optim.py, jaxlm/training/muon.py


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000  # optimizer steps; 0 = train.epochs passes over the training examples (fine-tuning)
  epochs: float = _ranged(0.0, 0)  # with train.steps=0: steps = ceil(epochs * training examples / batch_size)
                                   # (jaxlm/recipes/data_defaults.py)
  batch_size: int = _ranged(32, 1)  # global batch in sequences (all micro-batches, all processes)
  grad_accum: int = _ranged(1, 1)  # micro-batches per step; batch_size must be divisible by it
  seed: int = 0  # seeds init, data order and sampling
  learning_rate: float = _ranged(6e-4, 0, note="0 = fine-tuning's rate for the method")  # peak rate; 0: the
  # fine-tuning recipes choose it (5e-5 full, 1e-3 LoRA: jaxlm/recipes/data_defaults.py)
  min_lr_ratio: float = _ranged(0.1, 0, 1)  # cosine decays to learning_rate * min_lr_ratio
  warmup_steps: int = 100  # linear warmup from 0; -1 = train.warmup_fraction of the steps
  warmup_fraction: float = _ranged(0.1, 0, 1, high_open=True)  # the warmup's share of train.steps when
                                                               # train.warmup_steps=-1
  weight_decay: float = _ranged(0.1, 0)  # AdamW decoupled weight decay (not applied to biases, norms)
  b1: float = _ranged(0.9, 0, 1, high_open=True)  # Adam beta1
  b2: float = _ranged(0.95, 0, 1, high_open=True)  # Adam beta2
  eps: float = _ranged(1e-8, 0, low_open=True)  # Adam epsilon
  optimizer: str = "adamw"  # adamw | muon: Muon on the blocks' weight matrices (w_*), this AdamW on the rest
  muon_beta: float = _ranged(0.95, 0, 1, high_open=True)  # Muon momentum
  muon_nesterov: bool = True  # Muon: Nesterov momentum
  muon_ns_steps: int = _ranged(5, 1)  # Muon: Newton-Schulz iterations per update
  muon_consistent_rms: float = _ranged(0.2, 0, note="0 = width scaling")  # Muon updates scaled to this RMS
                        # (Moonlight's 0.2 matches AdamW's, so AdamW's rate and weight decay carry over); 0 = optax's
                        # width scaling sqrt(max(1, fan_out / fan_in)) (with a larger train.muon_learning_rate_ratio)
  muon_learning_rate_ratio: float = _ranged(1.0, 0, low_open=True)  # Muon leaves learn at this x the rate
  layer_lr_decay: float = _ranged(1.0, 0, 1, low_open=True, note="1 turns it off")  # layer-wise learning-rate decay:
                               # block l of L learns at decay^(L-1-l) x the rate, the embeddings at decay^L, the head
                               # at 1 (1 = off; fine-tuning's config uses 0.8)
  grad_clip: float = _ranged(1.0, 0, note="0 = off")  # global-norm clipping threshold (0 = off)
  eval_every_steps: int = _ranged(0, 0, note="0 = only at the end")  # run eval on held-out data every N steps
                                                                     # (0 = only at the end)
  eval_batches: int = _ranged(4, 1)  # batches per eval
  max_consecutive_nonfinite: int = _ranged(5, 1)  # NaN/inf steps are skipped; this many in a row stop the run
  best_metric: str = "f1_macro"  # fine-tuning: eval metric whose best value keeps <workdir>/best_model (higher is
                                 # better, except names ending in "loss")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = _ranged(500, 0, note="0 = only at the end")  # save a checkpoint every N steps
                                                                  # (and always at the end)
  keep: int = _ranged(2, 1)  # checkpoints to keep


@dataclasses.dataclass(frozen=True)
class LogConfig:
  every_steps: int = _ranged(10, 1)  # write metrics.jsonl / TensorBoard every N steps
  progress_bar: bool = True  # show a tqdm bar
  sample_tokens: int = _ranged(64, 0)  # tokens generated for the report's text sample (0 = none)
  sample_prompt: str = "def "  # prompt for the report's text sample


# Growth stops here: the scaled loss and the scale itself stay far inside float32's range on any run length.
LOSS_SCALE_MAX = 2.0**24


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  """Dynamic loss scaling (jaxlm/training/loss_scale.py): used only when model.compute_dtype=float16; bf16/f32 never
  scale."""
  init: float = _ranged(2.0**15, 0, low_open=True)  # the first scale the loss sum is multiplied by before
                                                    # differentiating
  growth_interval: int = _ranged(2000, 1)  # steps applied in a row after which the scale is multiplied by `factor`
  factor: float = _ranged(2.0, 1, low_open=True, note="2 is the usual choice")  # an overflow divides the scale by it,
                                                                                # growth multiplies it (powers of two
                                                                                # unscale exactly)
  min: float = _ranged(2.0**-8, 0, low_open=True)  # the floor: an overflow at this scale counts as a non-finite step
                                                   # (max_consecutive_nonfinite)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Low-rank adapters (jaxlm/adapters/lora.py): the base weights frozen (and out of the optimizer),
  W + (alpha/rank) A @ B."""
  rank: int = _ranged(0, 0, note="0 = off")  # adapter rank r; 0 = off (full fine-tuning / training)
  alpha: float = _ranged(16.0, 0, low_open=True)  # adapter scale numerator: the update is (alpha / rank) * x @ A @ B
  targets: str = "all"  # attention | mlp | all | a comma list of weight names (w_q,w_k,w_v,w_o,w_in,w_out,...)
  base: str = "float"  # storage of the frozen base (QLoRA): float | int8 (per output channel) | nf4 (4-bit NF4)


PREFERENCE_LOSSES = ("dpo", "ipo", "simpo")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
  """Preference tuning of a decoder on (prompt, chosen, rejected) pairs (jaxlm/recipes/preference_tuning.py), with
  the losses as TRL computes them (jaxlm/training/preference_loss.py)."""
  loss: str = ""  # "" = off | dpo (sigmoid) | ipo (length-averaged log-probs) | simpo (reference-free)
  beta: float = _ranged(0.1, 0, low_open=True)  # the reward scale (DPO, IPO's regulariser 1/(2 beta), SimPO)
  label_smoothing: float = _ranged(0.0, 0, 0.5)  # dpo, simpo: the assumed rate of flipped labels
  simpo_gamma: float = _ranged(0.5, 0)  # simpo: the target reward margin (TRL's simpo_gamma)
  rpo_alpha: float = _ranged(0.0, 0)  # weight of the chosen response's negative log-likelihood (its mean over the
                                      # pair's response tokens) added to every loss (TRL's rpo_alpha); 0 = off
  reference: str = ""  # dpo/ipo: "" = init_from's weights before tuning, or an HF folder / jaxlm run workdir
  padding_free: bool = True  # pairs packed whole into rows, no padding (jaxlm/data/tuning/pair_packing.py);
                             # train.batch_size then counts padded pairs' token slots, filled with whole pairs
  row_pairs: int = _ranged(0, 0, note="0 = chosen from the data")  # padding_free: a row holds this many padded
                                                                     # pairs' slots (2 * data.seq_len each)


RL_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo")
RL_IMPORTANCE_SAMPLING = ("token", "sequence")
RL_REWARD_SCALINGS = ("group", "batch", "none")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """Online RL of a decoder on its own sampled completions (jaxlm/recipes/policy_optimization.py), the losses as
  TRL's GRPOTrainer computes them (jaxlm/training/policy_loss.py)."""
  loss: str = ""  # "" = off | grpo | dr_grpo | dapo (TRL's default) | bnpo
  importance_sampling: str = "token"  # token | sequence (GSPO: one ratio per completion)
  num_generations: int = _ranged(8, 2)  # completions sampled per prompt (G); train.batch_size counts completions
  epsilon: float = _ranged(0.2, 0, low_open=True)  # the ratio's lower clip 1 - epsilon
  epsilon_high: float = _ranged(0.0, 0, note="0 = rl.epsilon")  # the ratio's upper clip 1 + epsilon_high (DAPO)
  beta: float = _ranged(0.0, 0)  # weight of the k3 KL to the reference (init_from's weights); 0 = no reference
  scale_rewards: str = "group"  # advantages divided by the reward std of: group | batch | none
  mask_truncated_completions: bool = False  # completions that hit rl.max_completion_length leave the loss
  num_iterations: int = _ranged(1, 1)  # policy updates per rollout batch (the sampling-time log-probs kept)
  max_completion_length: int = _ranged(256, 1)  # new tokens per completion at most
  temperature: float = _ranged(1.0, 0, low_open=True)  # sampling temperature of the rollouts
  top_p: float = _ranged(1.0, 0, 1, low_open=True)  # nucleus of the rollouts; 1 = off
  top_k: int = _ranged(0, 0, note="0 = off")  # the rollouts draw from the k most likely tokens; 0 = off
  stop_tokens: tuple[str, ...] = ()  # tokens (as the tokenizer spells them) that end a completion besides the EOS
  rewards: tuple[str, ...] = ()  # reward functions, "module:function" or "path.py:function", comma-separated
  reward_weights: tuple[float, ...] = ()  # one weight per reward function; empty = all 1
  max_prompt_length: int = _ranged(0, 0, note="0 = what the position table leaves")  # longer prompts are dropped
  eval_prompts: int = _ranged(256, 0, note="0 = all")  # held-out prompts answered greedily at each evaluation
  rollouts_logged: int = _ranged(4, 0)  # completions per logged step written to rollouts.jsonl


DISTILL_LOSSES = ("forward_kl", "reverse_kl", "jsd")
DISTILL_TEACHER_DTYPES = ("bfloat16", "float32", "int8")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """Knowledge distillation of the trained decoder from a frozen teacher (jaxlm/recipes/distillation.py), the
  divergence as TRL's generalized JSD computes it (jaxlm/training/distill_loss.py)."""
  teacher: str = ""  # "" = off | an HF decoder folder or a jaxlm run workdir with the student's tokenizer
  loss: str = "forward_kl"  # forward_kl: KL(teacher || student) | reverse_kl: KL(student || teacher) | jsd
  beta: float = _ranged(0.5, 0, 1)  # jsd: the mixture's weight, TRL's beta, strictly between 0 and 1
  temperature: float = _ranged(1.0, 0, low_open=True)  # both models' logits are divided by it
  alpha: float = _ranged(0.0, 0, 1)  # weight of the usual next-token cross-entropy; the divergence gets 1 - alpha
                                     # (off-policy only)
  on_policy: float = _ranged(0.0, 0, 1)  # instruction tuning: the share of batches whose responses the student
                                         # samples itself (TRL's lmbda), with rl.max_completion_length and
                                         # rl.temperature / top_p / top_k
  teacher_dtype: str = "bfloat16"  # the frozen teacher's weights: bfloat16 | float32 | int8 (weight-only)


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  kernels: KernelsConfig = KernelsConfig()
  mesh: MeshConfig = MeshConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  log: LogConfig = LogConfig()
  lora: LoRAConfig = LoRAConfig()
  loss_scale: LossScaleConfig = LossScaleConfig()
  preference: PreferenceConfig = PreferenceConfig()
  rl: RLConfig = RLConfig()
  distill: DistillConfig = DistillConfig()
  init_from: str = ""  # fine-tuning: an HF checkpoint folder (config.json + safetensors) or a jaxlm run workdir


_TOP_LEVEL_KEYS = ("init_from",)  # Config fields that are values, not sections


def default_config() -> ml_collections.ConfigDict:
  """Every key with its default, as a ConfigDict that experiment files edit and absl flags override."""
  return ml_collections.ConfigDict(_to_plain(dataclasses.asdict(Config())))


def _to_plain(value: Any) -> Any:
  # ConfigDict keeps tuples, but list/tuple overrides from flags vary; store sequences as tuples.
  if isinstance(value, dict):
    return {k: _to_plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(value)
  return value


def from_config_dict(cd: ml_collections.ConfigDict | dict) -> Config:
  """Validates and converts a ConfigDict (or nested dict) into a typed Config; unknown keys are an error."""
  raw = cd.to_dict() if isinstance(cd, ml_collections.ConfigDict) else dict(cd)
  sections = {}
  for field in dataclasses.fields(Config):
    if field.name in _TOP_LEVEL_KEYS:  # plain values beside the sections, e.g. init_from
      sections[field.name] = str(raw.pop(field.name, field.default) or "")
      continue
    section_cls = field.type if not isinstance(field.type, str) else globals()[field.type]
    values = dict(raw.pop(field.name, {}) or {})
    known = {f.name: f for f in dataclasses.fields(section_cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
      raise ValueError(f"unknown config key {field.name}.{unknown[0]}; known keys: {', '.join(sorted(known))}")
    for name, value in values.items():
      if isinstance(value, (list, tuple)) and known[name].type == "tuple[float, ...]":  # flags may give strings
        values[name] = tuple(float(v) for v in value if v != "")
      elif isinstance(value, (list, tuple)) and known[name].type == "tuple[str, ...]":  # `--config.x=` is empty;
        # ml_collections reads `--config.x=a,b` for a tuple as ("a,b",): a comma separates values there as in a string
        values[name] = tuple(p for v in value for p in (v.split(",") if isinstance(v, str) else [v]) if p != "")
      elif isinstance(value, list):
        values[name] = tuple(value)
      elif isinstance(value, str) and known[name].type in ("tuple[str, ...]",):
        values[name] = tuple(p for p in value.split(",") if p)
      elif isinstance(value, str) and known[name].type == "tuple[float, ...]":
        values[name] = tuple(float(p) for p in value.split(",") if p)
    sections[field.name] = section_cls(**values)
  if raw:
    raise ValueError(f"unknown config section {sorted(raw)[0]!r}; "
                     f"known: {', '.join(f.name for f in dataclasses.fields(Config))}")
  config = Config(**sections)
  validate(config)
  return config


def from_run_file(path: str) -> Config:
  """A run's config.json as a Config with `kernels` back to auto: the run recorded what resolved on its machine and
  mesh, and whoever reads it later (generation, optimization) resolves them for its own."""
  with open(path) as f:
    config = from_config_dict(json.load(f))
  return dataclasses.replace(config, kernels=KernelsConfig())


def validate(config: Config) -> None:
  """One-line errors for values that cannot work, raised before anything is compiled."""
  m, d, t = config.model, config.data, config.train
  validate_ranges(config)
  if m.flavour != "llama" and (m.qk_norm or m.attention_head_dim or m.qkv_bias):
    raise ValueError("model.qk_norm, model.attention_head_dim and model.qkv_bias are options of model.flavour=llama; "
                     "leave them unset")
  if m.rope_scaling not in ROPE_SCALINGS:
    raise ValueError(f"model.rope_scaling={m.rope_scaling!r} is not one of {', '.join(repr(r) for r in ROPE_SCALINGS)}")
  if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
    raise ValueError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                     f"model.rope_low_freq_factor={m.rope_low_freq_factor} (llama3 rotary scaling)")
  if m.qk_norm not in QK_NORMS:
    raise ValueError(f"model.qk_norm={m.qk_norm!r} is not one of {', '.join(repr(n) for n in QK_NORMS)}")
  validate_decoder_options(m)
  validate_encoder_options(m)
  if not m.attention_head_dim and m.d_model % m.num_heads:
    raise ValueError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}")
  if d.seq_len > m.max_seq_len:
    raise ValueError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise model.max_seq_len")
  if t.grad_accum < 1 or t.batch_size % t.grad_accum:
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
  if m.flavour not in ("gpt2", "llama", "bert"):
    raise ValueError(f"model.flavour={m.flavour!r} is not one of gpt2, llama, bert")
  if m.classifier_pooling not in CLASSIFIER_POOLINGS:
    raise ValueError(f"model.classifier_pooling={m.classifier_pooling!r} is not one of "
                     f"{', '.join(CLASSIFIER_POOLINGS)}")
  if m.num_kv_heads < 0 or m.num_heads % (m.num_kv_heads or m.num_heads):
    raise ValueError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}")
  if m.num_experts:
    validate_experts(m)
    if mesh_sizes(config.mesh)[2] != 1 or config.mesh.context != 1:
      raise ValueError(f"model.num_experts={m.num_experts} runs with mesh.data, mesh.fsdp and mesh.expert; set "
                       "mesh.tensor=1 and mesh.context=1")
  if m.flavour == "llama" and m.head_dim % 2:
    raise ValueError(f"the head size {m.head_dim} (model.attention_head_dim, or d_model / num_heads) must be even "
                     "for rotary positions (llama)")
  for name in ("param_dtype", "compute_dtype"):
    if getattr(m, name) not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"model.{name}={getattr(m, name)!r} is not one of float32, bfloat16, float16")
  if d.source not in ("demo", "files", "hf", "prepared"):
    raise ValueError(f"data.source={d.source!r} is not one of demo, files, hf, prepared")
  if d.source == "prepared" and not (d.prepared or d.mixture):
    raise ValueError("data.source=prepared needs data.prepared=<folder> (experiments/prepare_data.py --out) or "
                     "data.mixture=folder=weight,folder=weight")
  if d.prepared and d.mixture:
    raise ValueError("give data.prepared or data.mixture, not both (a mixture lists every folder)")
  if d.batching not in ("dynamic", "bucket", "max"):
    raise ValueError(f"data.batching={d.batching!r} is not one of dynamic, bucket, max")
  if d.source == "files" and not d.train_files:
    raise ValueError("data.source=files needs data.train_files (comma-separated paths)")
  if d.source == "hf" and not d.hf_name:
    raise ValueError("data.source=hf needs data.hf_name")
  if config.mesh.gradient_sync not in ("auto", "gspmd", "shard_map"):
    raise ValueError(f"mesh.gradient_sync={config.mesh.gradient_sync!r} is not one of auto, gspmd, shard_map")
  if config.mesh.gradient_sync == "shard_map" and (config.mesh.expert != 1 or config.mesh.context != 1):
    raise ValueError("mesh.gradient_sync=shard_map reduces data-parallel gradients by hand and holds every parameter "
                     "whole; with mesh.expert or mesh.context > 1 use gradient_sync=auto")
  if config.mesh.expert != 1:
    validate_expert_axis(config)
  if config.mesh.context != 1:
    validate_context_axis(config)
  if config.mesh.pipeline != 1 or config.mesh.pipeline_schedule != MeshConfig.pipeline_schedule:
    validate_pipeline(config)
  if t.optimizer not in OPTIMIZERS:
    raise ValueError(f"train.optimizer={t.optimizer!r} is not one of {', '.join(OPTIMIZERS)}; set "
                     "train.optimizer=adamw or train.optimizer=muon")
  if t.steps < 0 or (t.steps == 0 and t.epochs <= 0):
    raise ValueError(f"train.steps={t.steps} must be >= 1, or 0 with train.epochs > 0 (steps from the data)")
  if t.warmup_steps < -1:
    raise ValueError(f"train.warmup_steps={t.warmup_steps} must be >= 0, or -1 for train.warmup_fraction of the steps")
  if t.steps and t.warmup_steps > t.steps:
    raise ValueError(f"train.warmup_steps={t.warmup_steps} exceeds train.steps={t.steps}: the rate would never reach "
                     f"train.learning_rate; lower train.warmup_steps (or -1 for train.warmup_fraction of the steps)")
  if d.seq_len < 0:
    raise ValueError(f"data.seq_len={d.seq_len} must be >= 1, or 0 to choose it from the data (fine-tuning)")
  validate_lora(config.lora)
  validate_loss_scale(config.loss_scale)
  validate_preference(config.preference)
  validate_rl(config)
  validate_distill(config)


def validate_preference(p: PreferenceConfig) -> None:
  if p.loss and p.loss not in PREFERENCE_LOSSES:
    raise ValueError(f"preference.loss={p.loss!r} is not one of {', '.join(PREFERENCE_LOSSES)} (or '' for off)")
  if p.loss == "simpo" and p.reference:
    raise ValueError(f"preference.loss=simpo needs no reference model; unset preference.reference={p.reference!r}")


def validate_distill(config: Config) -> None:
  d = config.distill
  if d.loss not in DISTILL_LOSSES:
    raise ValueError(f"distill.loss={d.loss!r} is not one of {', '.join(DISTILL_LOSSES)}")
  if d.teacher_dtype not in DISTILL_TEACHER_DTYPES:
    raise ValueError(f"distill.teacher_dtype={d.teacher_dtype!r} is not one of {', '.join(DISTILL_TEACHER_DTYPES)}")
  if d.loss == "jsd" and not 0 < d.beta < 1:
    raise ValueError(f"distill.loss=jsd needs 0 < distill.beta < 1 (got {d.beta}); for beta 0 or 1 use "
                     "distill.loss=forward_kl or reverse_kl")
  if d.on_policy and d.alpha:
    raise ValueError(f"distill.alpha={d.alpha} with distill.on_policy={d.on_policy} would train the student on the "
                     "cross-entropy of its own samples; set distill.alpha=0 or distill.on_policy=0")
  if d.teacher and config.mesh.pipeline > 1:
    raise ValueError("distill.teacher with mesh.pipeline > 1: the pipeline trains the language model's own loss; "
                     "set mesh.pipeline=1")
  if d.on_policy and not d.teacher:
    raise ValueError(f"distill.on_policy={d.on_policy} needs a distill.teacher to grade the sampled responses")
  if d.teacher and (config.preference.loss or config.rl.loss):
    raise ValueError("distill.teacher is set together with preference.loss or rl.loss; a run trains one objective: "
                     "unset one of them")


def validate_rl(config: Config) -> None:
  r = config.rl
  if not r.loss:
    return
  for key, value, allowed in (("loss", r.loss, RL_LOSSES), ("importance_sampling", r.importance_sampling,
                                                            RL_IMPORTANCE_SAMPLING),
                              ("scale_rewards", r.scale_rewards, RL_REWARD_SCALINGS)):
    if value not in allowed:
      raise ValueError(f"rl.{key}={value!r} is not one of {', '.join(allowed)}")
  if config.preference.loss:
    raise ValueError(f"rl.loss={r.loss} and preference.loss={config.preference.loss} are two recipes; set one")
  if not r.rewards:
    raise ValueError("rl.rewards is empty; name at least one reward function, e.g. "
                     "--config.rl.rewards=jaxlm.recipes.rewards:exact_answer")
  if r.reward_weights and len(r.reward_weights) != len(r.rewards):
    raise ValueError(f"rl.reward_weights has {len(r.reward_weights)} weights for {len(r.rewards)} reward functions; "
                     "give one per function or none")
  b, g = config.train.batch_size, r.num_generations
  if b % g:
    raise ValueError(f"train.batch_size={b} counts completions and must be divisible by rl.num_generations={g}")


def validate_encoder_options(m: ModelConfig) -> None:
  """The options of the bert flavour that the other encoder families carry (RoBERTa, DistilBERT, ModernBERT)."""
  changed = {f.name: getattr(m, f.name) for f in dataclasses.fields(ModelConfig) if f.name in ENCODER_OPTIONS
             and getattr(m, f.name) != f.default}
  if m.flavour != "bert" and changed:
    raise ValueError(f"model.{next(iter(changed))} is an option of model.flavour=bert; leave it unset for {m.flavour}")
  if m.classifier_head not in CLASSIFIER_HEADS:
    raise ValueError(f"model.classifier_head={m.classifier_head!r} is not one of {', '.join(CLASSIFIER_HEADS)}")
  if m.hf_model_type and (m.hf_model_type == "xlm-roberta") != (m.flavour == "bert"):
    raise ValueError(f"model.hf_model_type={m.hf_model_type!r} does not fit model.flavour={m.flavour} (xlm-roberta is "
                     "an encoder's, phi3 a decoder's)")
  if m.rotary_positions and (m.position_start or m.head_dim % 2):
    raise ValueError(f"model.rotary_positions needs model.position_start=0 (it has no position table; here "
                     f"{m.position_start}) and an even head size (here {m.head_dim})")
  if m.encoder_window and m.encoder_global_every < 2:
    raise ValueError(f"model.encoder_window={m.encoder_window} needs model.encoder_global_every >= 2 (with 1 every "
                     "layer sees every key); or set model.encoder_window=0")


def validate_experts(m: ModelConfig) -> None:
  if m.flavour not in ("gpt2", "llama"):
    raise ValueError(f"model.num_experts={m.num_experts} needs a decoder (model.flavour gpt2 or llama), not "
                     f"model.flavour={m.flavour}; set model.num_experts=0")
  if m.experts_per_token > m.num_experts:
    raise ValueError(f"model.experts_per_token={m.experts_per_token} exceeds model.num_experts={m.num_experts}; "
                     "route each token to at most num_experts experts")
  if m.glu_activation != "silu":
    raise ValueError(f"model.glu_activation={m.glu_activation} with model.num_experts={m.num_experts}: the experts' "
                     "MLPs are SwiGLU; use model.glu_activation=silu")


def validate_expert_axis(config: Config) -> None:
  mesh, m = config.mesh, config.model
  if mesh.expert < 1:
    raise ValueError(f"mesh.expert={mesh.expert} must be >= 1")
  if not m.num_experts:
    raise ValueError(f"mesh.expert={mesh.expert} splits the experts of a mixture-of-experts model; this one has none "
                     "(model.num_experts=0): set mesh.expert=1 or model.num_experts")
  if m.num_experts % mesh.expert:
    raise ValueError(f"model.num_experts={m.num_experts} is not divisible by mesh.expert={mesh.expert}; choose a "
                     "mesh.expert that divides the experts")
  if mesh_sizes(mesh)[2] != 1 or mesh.pipeline != 1:
    raise ValueError(f"mesh.expert={mesh.expert} combines with mesh.data and mesh.fsdp only; set mesh.tensor=1 and "
                     "mesh.pipeline=1")


def validate_decoder_options(m: ModelConfig) -> None:
  """The options of the llama flavour that other model families carry (Gemma, Mistral, OLMo 2)."""
  if m.block_norms not in BLOCK_NORMS:
    raise ValueError(f"model.block_norms={m.block_norms!r} is not one of {', '.join(BLOCK_NORMS)}")
  if m.hf_model_type not in ("", "phi3", "xlm-roberta"):
    raise ValueError(f"model.hf_model_type={m.hf_model_type!r} is not one of '', 'phi3', 'xlm-roberta'")
  if m.glu_activation not in GLU_ACTIVATIONS:
    raise ValueError(f"model.glu_activation={m.glu_activation!r} is not one of {', '.join(GLU_ACTIVATIONS)}")
  llama_only = {"block_norms": m.block_norms != "pre", "glu_activation": m.glu_activation != "silu",
                "norm_plus_one": m.norm_plus_one, "scale_embeddings": m.scale_embeddings,
                "rope_local_theta": bool(m.rope_local_theta) and m.flavour != "bert"}
  if m.flavour != "llama" and any(llama_only.values()):
    key = next(k for k, v in llama_only.items() if v)
    raise ValueError(f"model.{key} is an option of model.flavour=llama; leave it unset for {m.flavour}")
  windowed = {"sliding_window": m.sliding_window, "attention_softcap": m.attention_softcap,
              "logit_softcap": m.logit_softcap, "query_pre_attn_scalar": m.query_pre_attn_scalar}
  if m.flavour == "bert" and any(windowed.values()):
    key = next(k for k, v in windowed.items() if v)
    raise ValueError(f"model.{key} is an option of the decoders; leave it unset for bert")
  if m.global_attention_every and not m.sliding_window:
    raise ValueError(f"model.global_attention_every={m.global_attention_every} alternates windowed and global "
                     "layers: set model.sliding_window too")
  if m.rope_local_theta and not m.global_attention_every and not m.encoder_window:
    raise ValueError("model.rope_local_theta is the rotary base of windowed layers between global ones: set "
                     "model.sliding_window and model.global_attention_every too (bert: model.encoder_window)")


def validate_context_axis(config: Config) -> None:
  mesh = config.mesh
  if mesh.context < 1:
    raise ValueError(f"mesh.context={mesh.context} must be >= 1")
  if config.model.flavour not in ("gpt2", "llama"):
    raise ValueError(f"mesh.context={mesh.context} splits a decoder's sequences; model.flavour={config.model.flavour} "
                     "is not one: set mesh.context=1")
  if config.data.seq_len % (2 * mesh.context):
    raise ValueError(f"data.seq_len={config.data.seq_len} is not divisible by 2 * mesh.context={2 * mesh.context} "
                     "(each device holds an early and a late chunk); choose a seq_len or mesh.context that divides")
  if mesh_sizes(mesh)[2] != 1 or mesh.pipeline != 1 or mesh.expert != 1 or mesh.sequence_parallel:
    raise ValueError(f"mesh.context={mesh.context} combines with mesh.data and mesh.fsdp only; set mesh.tensor=1, "
                     "mesh.pipeline=1, mesh.expert=1 and mesh.sequence_parallel=False")
  if config.model.sliding_window or config.model.attention_softcap:
    raise ValueError(f"mesh.context={mesh.context}: ring attention has no sliding window or score soft-capping "
                     "(model.sliding_window, model.attention_softcap); set mesh.context=1")


def _range_error(key: str, value: Any, low, high, low_open: bool, high_open: bool, note: str) -> str | None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return f"{key}={value!r} must be a number"
  too_low = low is not None and (value <= low if low_open else value < low)
  too_high = high is not None and (value >= high if high_open else value > high)
  if not (too_low or too_high or value != value):  # value != value: NaN
    return None
  if high is None:
    allowed = f"{'>' if low_open else '>='} {low:g}"
  elif low is None:
    allowed = f"{'<' if high_open else '<='} {high:g}"
  else:
    allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
  return f"{key}={value} must be {allowed}" + (f"; {note}" if note else "")


def validate_ranges(config: Config) -> None:
  """Every numeric key against the range declared beside it (`_ranged`): the first one outside, as one line."""
  for section in dataclasses.fields(Config):
    values = getattr(config, section.name)
    if not dataclasses.is_dataclass(values):
      continue
    for field in dataclasses.fields(values):
      if "range" in field.metadata:
        error = _range_error(f"{section.name}.{field.name}", getattr(values, field.name), *field.metadata["range"])
        if error:
          raise ValueError(error)


def validate_loss_scale(c: LossScaleConfig) -> None:
  if not 0 < c.min <= c.init <= LOSS_SCALE_MAX:
    raise ValueError(f"loss_scale.init={c.init} and loss_scale.min={c.min} need "
                     f"0 < min <= init <= {LOSS_SCALE_MAX:g}")


LORA_BASES = ("float", "int8", "nf4")
# What `lora.targets` names: a group, "all", or weight names of a block (jaxlm/adapters/lora.py resolves them).
LORA_TARGET_GROUPS = {"attention": ("w_q", "w_k", "w_v", "w_o"), "mlp": ("w_in", "w_out", "w_gate", "w_up", "w_down")}
LORA_MATMUL_WEIGHTS = LORA_TARGET_GROUPS["attention"] + LORA_TARGET_GROUPS["mlp"]


def validate_lora(lora: LoRAConfig) -> None:
  """Values that cannot work whatever the model; targets that match no weight are jaxlm.adapters.lora's check."""
  if lora.base not in LORA_BASES:
    raise ValueError(f"lora.base={lora.base!r} is not one of {', '.join(LORA_BASES)}")
  if lora.base != "float" and not lora.rank:
    raise ValueError(f"lora.base={lora.base} (QLoRA) needs lora.rank > 0")
  if lora.rank and not lora.targets.strip(", "):
    raise ValueError("lora.targets is empty; use attention, mlp, all or a comma list of weight names")


# Named layouts (data, fsdp, tensor); -1 takes the devices left over. `fsdp_tp`/`dp_tp` put 2 devices on tensor.
MESH_PRESETS = {"dp": (-1, 1, 1), "fsdp": (1, -1, 1), "tp": (1, 1, -1), "dp_tp": (-1, 1, 2), "fsdp_tp": (1, -1, 2)}


def mesh_sizes(config: MeshConfig) -> tuple[int, int, int]:
  """(data, fsdp, tensor) as configured, with a preset expanded; a preset beside explicit sizes is an error."""
  sizes = (config.data, config.fsdp, config.tensor)
  if not config.preset:
    return sizes
  if config.preset not in MESH_PRESETS:
    raise ValueError(f"mesh.preset={config.preset!r} is not one of {', '.join(MESH_PRESETS)}")
  if sizes != (MeshConfig.data, MeshConfig.fsdp, MeshConfig.tensor):
    raise ValueError(f"mesh.preset={config.preset} also sets mesh.data/fsdp/tensor; give either the preset or sizes")
  return MESH_PRESETS[config.preset]


SCHEDULES = ("gpipe", "1f1b")  # jaxlm.training.pipeline's schedules


def validate_schedule(num_stages: int, num_microbatches: int, schedule: str) -> None:
  """One-line errors for a schedule that cannot run with these sizes."""
  if schedule not in SCHEDULES:
    raise ValueError(f"mesh.pipeline_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
  if num_stages < 1:
    raise ValueError(f"mesh.pipeline={num_stages} must be >= 1")
  if num_stages > 1 and num_microbatches < num_stages:
    # Fewer micro-batches than stages leaves a stage idle for the whole step: the pipeline then only adds a bubble.
    raise ValueError(f"train.grad_accum={num_microbatches} is smaller than mesh.pipeline={num_stages}; the "
                     f"{schedule} schedule needs at least one micro-batch per stage (raise train.grad_accum)")


def stage_layer_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
  """Layers per stage (equal, since the stacked layer axis is sharded evenly), or a one-line error."""
  if num_stages < 1 or num_layers % num_stages:
    raise ValueError(f"model.num_layers={num_layers} is not divisible by mesh.pipeline={num_stages}; choose a "
                     "pipeline size that divides the layers")
  return (num_layers // num_stages,) * num_stages


def validate_pipeline(config: Config) -> None:
  """One-line errors for `mesh.pipeline` / `mesh.pipeline_schedule` with the rest of a jaxlm.config.Config."""
  mesh = config.mesh
  validate_schedule(mesh.pipeline, config.train.grad_accum, mesh.pipeline_schedule)
  if mesh.pipeline == 1:
    return
  stage_layer_counts(config.model.num_layers, mesh.pipeline)
  if config.model.flavour not in ("gpt2", "llama"):
    raise ValueError(f"mesh.pipeline={mesh.pipeline} serves the decoders (model.flavour gpt2 or llama), not "
                     f"model.flavour={config.model.flavour}; use mesh.pipeline=1")
  if (tensor := mesh_sizes(mesh)[2]) != 1:
    raise ValueError(f"mesh.pipeline={mesh.pipeline} with mesh.tensor={tensor} is not supported; combine the pipeline "
                     "with mesh.data and mesh.fsdp only")
  if mesh.sequence_parallel:
    raise ValueError("mesh.sequence_parallel needs mesh.tensor > 1, which mesh.pipeline > 1 does not support")
  if config.model.global_attention_every:
    raise ValueError(f"model.global_attention_every={config.model.global_attention_every} (windowed and global "
                     f"layers) with mesh.pipeline={mesh.pipeline} is not supported; use mesh.pipeline=1")
  if mesh.gradient_sync != "auto":
    raise ValueError(f"mesh.gradient_sync={mesh.gradient_sync} does not apply with mesh.pipeline={mesh.pipeline} "
                     "(the pipeline reduces its own gradients); leave it auto")
  if config.lora.rank:
    raise ValueError(f"lora.rank={config.lora.rank} with mesh.pipeline={mesh.pipeline} is not supported; use "
                     "mesh.pipeline=1 (adapters fit on one device's share)")
  if config.model.num_experts:
    raise ValueError(f"model.num_experts={config.model.num_experts} with mesh.pipeline={mesh.pipeline} is not "
                     "supported; use mesh.pipeline=1 (and mesh.expert to spread the experts)")
