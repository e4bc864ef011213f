"""jaxlm decoders as an lm-eval model (jaxlm.interop.lm_eval_model): loglikelihoods equal jaxlm's own scoring (the
training loss kernel) for float and int8 weights, on one device and a mesh; rolling loglikelihoods are summed token
log-probs; tasks defined from local files run offline end to end; a task that needs a download is a one-line error;
under a chat template generation stops at the end-of-turn token and lm-eval's apply_chat_template writes the turns."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

# Through jaxlm.interop.lm_eval_model, which keeps experiments/lm_eval.py from shadowing the package.
harness = pytest.importorskip("jaxlm.interop.lm_eval_model",
                              reason="lm-eval is not installed (pip install -e '.[eval]')")
from lm_eval.api.instance import Instance  # noqa: E402

from jaxlm import data as data_lib  # noqa: E402
from jaxlm.config import MeshConfig, ModelConfig  # noqa: E402
from jaxlm.inference import generate  # noqa: E402
from jaxlm.models.gpt import GPT  # noqa: E402
from jaxlm.parallel import sharding

CONFIG = ModelConfig(vocab_size=300, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, flavour="llama",
                     d_ff=48, max_seq_len=32, rope_theta=100.0, compute_dtype="float32")
CORPUS = ["def f(x):\n  return x + 1\n", "class Box:\n  pass\n", "the cat sat on the mat.\n"] * 20
CHOICES = [{"question": "def f(x):", "choices": [" return", " class", " cat"], "answer": 0},
           {"question": "the cat sat on", "choices": [" the", " def", " pass"], "answer": 0},
           {"question": "class Box:", "choices": ["\n  pass", " mat", " x + 1"], "answer": 0}]
TEXTS = ["the cat sat on the mat. " * 11, "def f(x): return x"]
BATCH = 4


def _yaml(name, data_file, body):
  return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_file}\n"
          f"test_split: test\n{body}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  folder = tmp_path_factory.mktemp("lm_eval")
  tokenizer = data_lib.train_bpe(CORPUS, CONFIG.vocab_size, str(folder / "tokenizer.json"))
  graphdef, state = nnx.split(GPT(CONFIG, rngs=nnx.Rngs(0)))
  params = state.to_pure_dict()
  tasks = folder / "tasks"
  tasks.mkdir()
  for name, rows in (("choice", CHOICES), ("text", [{"text": t} for t in TEXTS]),
                     ("gen", [{"prompt": "def f(x):", "answer": " return"}, {"prompt": "class", "answer": " Box"}])):
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tasks / "choice.yaml").write_text(_yaml("local_choice", folder / "choice.jsonl", (
      "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
      "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")))
  (tasks / "text.yaml").write_text(_yaml("local_text", folder / "text.jsonl", (
      "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
      "metric_list:\n  - metric: word_perplexity\n")))
  (tasks / "gen.yaml").write_text(_yaml("local_gen", folder / "gen.jsonl", (
      "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
      "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\nmetric_list:\n  - metric: exact_match\n")))
  lm = harness.JaxlmLM(graphdef, params, tokenizer, batch_size=BATCH)
  return dict(folder=folder, tasks=str(tasks), tokenizer=tokenizer, graphdef=graphdef, params=params, lm=lm)


@pytest.fixture(scope="module")
def reference():
  """jaxlm's own scoring: -(training loss sum) of one row of max_seq_len + 1 tokens, only the last n weighted."""
  cache = {}

  def score(graphdef, params, context_ids, continuation_ids):
    if graphdef not in cache:
      cache[graphdef] = jax.jit(lambda p, x, y, w: nnx.merge(graphdef, p).loss_sums(x, y, w))
    whole = (list(context_ids) + list(continuation_ids))[-(CONFIG.max_seq_len + 1):]
    inputs, targets = np.zeros((1, CONFIG.max_seq_len), np.int32), np.zeros((1, CONFIG.max_seq_len), np.int32)
    weights = np.zeros((1, CONFIG.max_seq_len), np.float32)
    n = len(whole) - 1
    inputs[0, :n], targets[0, :n] = whole[:-1], whole[1:]
    weights[0, n - min(len(continuation_ids), n):n] = 1.0
    loss, sums = cache[graphdef](params, inputs, targets, weights)
    correct = sums["correct"]
    return -float(loss), bool(float(correct) == weights.sum())

  return score


def _requests(kind, args):
  return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _pairs(tokenizer, requests):
  """(context ids, continuation ids) as lm-eval's causal models split them: a context's trailing spaces move to the
  continuation, the whole text is encoded once, and an empty context is the end-of-document token."""
  eos = data_lib.eos_id(tokenizer)
  pairs = []
  for context, continuation in requests:
    if not context:
      pairs.append(([eos], tokenizer.encode(continuation).ids))
      continue
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer.encode(context).ids
    pairs.append((context_ids, tokenizer.encode(context + continuation).ids[len(context_ids):]))
  return pairs


LOGLIKELIHOOD_REQUESTS = ([(d["question"], c) for d in CHOICES for c in d["choices"]] +
                          [("", "the cat"), ("def f(x): ", "return x"), (TEXTS[0] * 2, " sat")])  # > max_seq_len


def test_loglikelihoods_equal_jaxlm_scoring_for_float_and_int8_weights_and_on_a_mesh(setup, reference):
  from jaxlm.compress import quantization

  lm, tokenizer = setup["lm"], setup["tokenizer"]
  pairs = _pairs(tokenizer, LOGLIKELIHOOD_REQUESTS)
  assert len(pairs[-1][0]) > CONFIG.max_seq_len  # the long context is cut from the left
  ours = lm.loglikelihood(_requests("loglikelihood", LOGLIKELIHOOD_REQUESTS))
  expected = [reference(setup["graphdef"], setup["params"], *p) for p in pairs]
  np.testing.assert_allclose([o[0] for o in ours], [e[0] for e in expected], rtol=1e-5)
  assert [o[1] for o in ours] == [e[1] for e in expected]

  int8_def, int8_params = nnx.split(quantization.quantize(nnx.merge(setup["graphdef"], setup["params"]), "weight_only"))
  int8_lm = harness.JaxlmLM(int8_def, int8_params, tokenizer, batch_size=BATCH)
  int8_ours = int8_lm.loglikelihood(_requests("loglikelihood", LOGLIKELIHOOD_REQUESTS[:BATCH]))
  int8_expected = [reference(int8_def, int8_params, *p) for p in pairs[:BATCH]]
  np.testing.assert_allclose([o[0] for o in int8_ours], [e[0] for e in int8_expected], rtol=1e-5)
  assert not np.allclose([o[0] for o in int8_ours], [o[0] for o in ours[:BATCH]], rtol=1e-7, atol=0)

  mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
  model_state = nnx.split(nnx.merge(setup["graphdef"], setup["params"]))[1]
  sharded = jax.device_put(setup["params"], sharding.param_shardings(model_state, mesh))
  mesh_lm = harness.JaxlmLM(setup["graphdef"], sharded, tokenizer, batch_size=BATCH)
  mesh_ours = mesh_lm.loglikelihood(_requests("loglikelihood", LOGLIKELIHOOD_REQUESTS[:BATCH]))
  np.testing.assert_allclose([o[0] for o in mesh_ours], [o[0] for o in ours[:BATCH]], rtol=1e-5)


def test_rolling_loglikelihood_is_the_sum_of_token_logprobs(setup, reference):
  lm, tokenizer = setup["lm"], setup["tokenizer"]
  eos, length = data_lib.eos_id(tokenizer), CONFIG.max_seq_len
  short, long = tokenizer.encode(TEXTS[1]).ids, tokenizer.encode(TEXTS[0]).ids
  assert len(short) < length < 2 * length < len(long)  # one window; three windows, the last one partial
  ours = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(TEXTS[1],), (TEXTS[0],)]))
  np.testing.assert_allclose(ours[0], reference(setup["graphdef"], setup["params"], [eos], short)[0], rtol=1e-5)
  # Every token is scored once, with as much context as fits: the first window after the end-of-document token,
  # each later one after the `length` tokens before its first scored token.
  expected = reference(setup["graphdef"], setup["params"], [eos], long[:length])[0]
  for start in range(length, len(long), length):
    end = min(start + length, len(long))
    expected += reference(setup["graphdef"], setup["params"], long[max(0, end - length - 1):start], long[start:end])[0]
  np.testing.assert_allclose(ours[1], expected, rtol=1e-5)


def test_local_tasks_run_offline_and_their_metrics_follow_the_scores(setup, reference):
  lm, tokenizer = setup["lm"], setup["tokenizer"]
  metrics = harness.flat_metrics(harness.evaluate(lm, ["local_choice", "local_text", "local_gen"],
                                                  include_path=setup["tasks"]))
  assert set(metrics) == {"local_choice/acc", "local_text/word_perplexity", "local_gen/exact_match"}
  correct = 0
  for doc in CHOICES:  # lm-eval prepends a space-free context: "question" + choice, as _pairs splits it
    scores = [reference(setup["graphdef"], setup["params"], *_pairs(tokenizer, [(doc["question"], c)])[0])[0]
              for c in doc["choices"]]
    correct += int(np.argmax(scores) == doc["answer"])
  assert metrics["local_choice/acc"] == pytest.approx(correct / len(CHOICES))
  # Word perplexity: exp(-sum log p / words) over all documents, words counted as lm-eval does (split on \s+).
  words = sum(len(re.split(r"\s+", t)) for t in TEXTS)
  rolling = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(t,) for t in TEXTS]))
  assert metrics["local_text/word_perplexity"] == pytest.approx(np.exp(-sum(rolling) / words), rel=1e-5)
  # generate_until: jaxlm.inference.generate's greedy tokens, cut before the first stop string.
  prompt = tokenizer.encode("def f(x):").ids
  free = tokenizer.decode(generate.generate(setup["graphdef"], setup["params"], [prompt] * BATCH, 6,
                                            pad_id=lm.eot_token_id)[0])
  stop = free[len(free) // 2]
  (text,) = lm.generate_until(_requests("generate_until", [("def f(x):", {"until": [stop], "max_gen_toks": 6})]))
  assert text == free.split(stop)[0] and 0.0 <= metrics["local_gen/exact_match"] <= 1.0


def test_a_task_that_needs_a_download_is_a_one_line_error_and_nothing_is_deleted(setup, tmp_path):
  tasks = tmp_path / "tasks"
  tasks.mkdir()
  body = "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{c}}'\ndoc_to_target: '{{a}}'\n"
  (tasks / "hub.yaml").write_text(f"task: hub_choice\ndataset_path: someorg/some_dataset\ntest_split: test\n{body}")
  (tasks / "missing.yaml").write_text(_yaml("missing_file", tmp_path / "absent.jsonl", body))
  before = sorted(p.name for p in tasks.iterdir())
  manager = harness.task_manager(["hub_choice"], str(tasks))
  with pytest.raises(ValueError, match=r"^lm-eval task 'hub_choice' downloads its data \('someorg/some_dataset'\) "
                                       r"from the Hugging Face hub.*define the task from local files") as error:
    harness.check_offline(manager, ["hub_choice"], reachable=False)
  assert "\n" not in str(error.value)
  if not harness.hub_reachable():  # here: the whole evaluate call stops at the same check, before any load
    with pytest.raises(ValueError, match="'hub_choice'.*local files"):
      harness.evaluate(setup["lm"], ["hub_choice"], include_path=str(tasks))
  with pytest.raises(ValueError, match="'missing_file': data file .*absent.jsonl' does not exist"):
    harness.evaluate(setup["lm"], ["missing_file"], include_path=str(tasks))
  assert sorted(p.name for p in tasks.iterdir()) == before


def _bigram_chat_model(chain):
  """A Qwen2-style decoder whose greedy next token depends only on the current one, following `chain` (token ids,
  each followed by the next; the last by `chain[-2]`): attention and MLP outputs zeroed, so the residual stream is
  the token's embedding, and each output row aligned with the embedding of the token it follows."""
  config = ModelConfig(vocab_size=300, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, flavour="llama",
                       qkv_bias=True, d_ff=48, max_seq_len=64, tie_embeddings=False, compute_dtype="float32")
  graphdef, state = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
  params = jax.tree.map(np.asarray, state.to_pure_dict())
  params["blocks"]["attn"]["w_o"] = np.zeros_like(params["blocks"]["attn"]["w_o"])
  params["blocks"]["mlp"]["w_down"] = np.zeros_like(params["blocks"]["mlp"]["w_down"])
  embedding, head = params["token_embed"]["embedding"], np.zeros_like(params["lm_head"]["embedding"])
  for current, following in zip(chain, [*chain[1:], chain[-2]]):
    head[following] += 10 * embedding[current] / np.linalg.norm(embedding[current])
  params["lm_head"]["embedding"] = head
  return graphdef, params


def test_generate_until_stops_at_the_chat_templates_end_of_turn_and_lm_eval_applies_the_template(tmp_path):
  from experiments import conversations as conversation_data
  from jaxlm.data.tuning import chat

  folder = str(tmp_path / "chat")  # a ChatML template and a tokenizer
  conversation_data.write_chat_tokenizer(folder, conversation_data.conversation_rows(40, seed=0), 300, 64)
  tokenizer = data_lib.load_tokenizer(folder)
  question = [{"role": "user", "content": "Reverse the words: river stone"}]
  newline, im_end = chat.prompt_ids(folder, question)[-1], tokenizer.token_to_id("<|im_end|>")
  reply, after = tokenizer.encode("stone river").ids, tokenizer.encode(" tiger lemon").ids
  # After the assistant's header (its last token a newline): the reply, <|im_end|>, then more words, in a loop.
  graphdef, params = _bigram_chat_model([int(newline), *reply, im_end, *after])
  lm = harness.JaxlmLM(graphdef, params, tokenizer, batch_size=2, chat_folder=folder)
  context = lm.apply_chat_template(question)
  assert context == chat.render(chat.load(folder), question, add_generation_prompt=True)
  assert context.endswith("<|im_start|>assistant\n") and lm.chat_template(True) == chat.load(folder).text
  request = _requests("generate_until", [(context, {"until": ["Q:"], "max_gen_toks": 12})])
  assert lm.generate_until(request) == ["stone river"]
  plain = harness.JaxlmLM(graphdef, params, tokenizer, batch_size=2)  # no template: no end-of-turn stop
  (free,) = plain.generate_until(request)
  assert free.startswith("stone river ti") and lm.tokenizer_name != plain.tokenizer_name

  # lm-eval's apply_chat_template: each question becomes a user turn under the template, answered up to <|im_end|>.
  tasks = tmp_path / "tasks"
  tasks.mkdir()
  (tmp_path / "gen.jsonl").write_text(json.dumps({"question": question[0]["content"], "answer": "stone river"}))
  (tasks / "gen.yaml").write_text(_yaml("chat_gen", tmp_path / "gen.jsonl", (
      "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
      "generation_kwargs:\n  until: ['Q:']\n  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n")))
  metrics = harness.flat_metrics(harness.evaluate(lm, ["chat_gen"], include_path=str(tasks),
                                                  apply_chat_template=True))
  assert metrics == {"chat_gen/exact_match": 1.0}
  with pytest.raises(ValueError, match=r"^apply_chat_template needs a chat template: give JaxlmLM a chat_folder"):
    harness.evaluate(plain, ["chat_gen"], include_path=str(tasks), apply_chat_template=True)


# Gemma 2's options (windowed and global layers, soft-capped scores and logits) and Mistral's (every layer windowed:
# generation keeps a rolling cache): lm-eval's three request kinds run, and a choice scores as the training loss does.
FAMILIES = {"gemma2": dict(sliding_window=5, global_attention_every=2, attention_softcap=5.0, logit_softcap=3.0,
                           block_norms="sandwich", norm_plus_one=True, scale_embeddings=True,
                           glu_activation="gelu_tanh", query_pre_attn_scalar=12.0),
            "mistral": dict(sliding_window=5)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lm_eval_runs_on_windowed_and_soft_capped_families(setup, reference, family):
  config = dataclasses.replace(CONFIG, **FAMILIES[family])
  graphdef, state = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
  params = state.to_pure_dict()
  lm = harness.JaxlmLM(graphdef, params, setup["tokenizer"], batch_size=BATCH)
  metrics = harness.flat_metrics(harness.evaluate(lm, ["local_choice", "local_text", "local_gen"],
                                                  include_path=setup["tasks"]))
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  (context, continuation), = _pairs(setup["tokenizer"], [(CHOICES[0]["question"], CHOICES[0]["choices"][0])])
  ours = lm.loglikelihood(_requests("loglikelihood", [(CHOICES[0]["question"], CHOICES[0]["choices"][0])]))[0][0]
  np.testing.assert_allclose(ours, reference(graphdef, params, context, continuation)[0], rtol=1e-5)
