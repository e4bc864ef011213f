"""A verifiable task for online RL (GRPO) on a small base model, generated offline, and the base model's accuracy on
it: does RL teach an answer the model can already reach to come as a last line "#### <number>", on questions of
kinds it never trained on?

  python experiments/rl_tasks.py --out=runs/rl_tasks                     # train.jsonl (512), eval.jsonl (128)
  python experiments/rl_tasks.py --measure=runs/gemma3_270m \\
      --results=benchmarks/results/rl_task_baseline.json                 # base accuracy of each candidate design

Rows have `prompt` (plain text for a base model: an instruction, one worked example, a question), `answer` (the
number as a string) and `kind`. Training questions ask for a count or a price stated in the question, or the larger
of two numbers; held-out ones ask for a person's age or height (`DESIGNS[...]["eval_kinds"]`: templates and questions
no training row has). Gemma 3 270M (base) has the held-out number within reach (greedy exact_answer 0.91, first
number written 0.61) but rarely writes the "#### <number>" line for those kinds (0.06; 0.59 for the training
ones): that line is what RL has to teach and what has to carry over. Arithmetic was screened out: the model gets one-digit sums wrong, so
there would be no reward to learn from.

Stop rule: generate to <eos> (id 1) or to a token that is only newlines ("\\n\\n" id 108, and longer). Greedy, the
model goes on after its answer with a new "Question: ..."; it almost never emits <eos> there (p about 0.02), so
with <eos> alone no sampled completion ends with the answer line and answer_format has nothing to learn from.

--measure generates with HF transformers (torch, CPU, float32), batched with left padding: greedy answers to
--measure_prompts train and held-out prompts per design, and --samples completions (temperature 1, top_p 1, top_k
off, as TRL's GRPOConfig) to each of --sample_prompts train prompts, scored under three stop rules (`endings`). The
scorers copy the rules of jaxlm/recipes/rewards.py for integer answers without importing it: exact_answer (the last
\\boxed{...}, else the first line after the last "####" (its leading number), else the last number, equals the
answer) and answer_format (the completion ends with a line "#### <number>").
"""

import json
import os
import random
import re
import sys
import time

from absl import flags

from jaxlm import cli

_OUT = flags.DEFINE_string("out", "", "folder for train.jsonl and eval.jsonl")
_TRAIN = flags.DEFINE_integer("train", 512, "training prompts")
_EVAL = flags.DEFINE_integer("eval", 128, "held-out prompts")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the numbers, names and templates")
_DESIGN = flags.DEFINE_string("design", "read_oneshot_sep", "prompt design (a key of DESIGNS)")
_MEASURE = flags.DEFINE_string("measure", "", "an HF model folder: measure the base model on --designs instead")
_DESIGNS = flags.DEFINE_list("designs", [], "designs to measure (default: all)")
_RESULTS = flags.DEFINE_string("results", "", "json file for the measurement")
_MEASURE_PROMPTS = flags.DEFINE_integer("measure_prompts", 64, "greedy prompts per split and design")
_SAMPLE_PROMPTS = flags.DEFINE_integer("sample_prompts", 16, "train prompts sampled per design")
_SAMPLES = flags.DEFINE_integer("samples", 8, "sampled completions per prompt (a GRPO group)")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "completion length limit")
_BATCH = flags.DEFINE_integer("batch", 64, "generation batch")
_THREADS = flags.DEFINE_integer("threads", 2, "torch threads")

NAMES = "Tom Sara Ben Lily Sam Anna Max Emma Leo Mia Jack Nora Owen Ruth Paul Kate".split()
THINGS = "apples marbles stickers pencils cards coins shells books cookies stamps balloons toys".split()
PLACES = [("the red box", "the blue box"), ("the bag", "the basket"), ("the shelf", "the drawer"),
          ("the left jar", "the right jar")]


def _lookup(rng):
  # Two counts in a sentence; the question names one of them: the number is in the prompt.
  (p, q), thing = rng.choice(PLACES), rng.choice(THINGS)
  a, b = rng.sample(range(3, 60), 2)
  first = rng.random() < 0.5
  return f"There are {a} {thing} in {p} and {b} {thing} in {q}. How many {thing} are in {p if first else q}?", (
      a if first else b)


def _ages(rng):
  x, y = rng.sample(NAMES, 2)
  a, b = rng.sample(range(6, 80), 2)
  first = rng.random() < 0.5
  return f"{x} is {a} years old and {y} is {b} years old. How old is {x if first else y}?", a if first else b


def _larger(rng):
  a, b = rng.sample(range(10, 99), 2)
  return rng.choice([f"Which number is larger, {a} or {b}?", f"Which is bigger: {a} or {b}?"]), max(a, b)


def _price(rng):
  (x, a), (y, b) = zip(rng.sample(["a pen", "a cap", "a book", "a lamp", "a ball", "a mug", "a kite"], 2),
                       rng.sample(range(2, 60), 2))
  first = rng.random() < 0.5
  return f"In a shop {x} costs {a} dollars and {y} costs {b} dollars. How many dollars does {x if first else y} cost?", (
      a if first else b)


def _heights(rng):
  x, y = rng.sample(NAMES, 2)
  a, b = rng.sample(range(120, 195), 2)
  first = rng.random() < 0.5
  return f"{x} is {a} cm tall and {y} is {b} cm tall. How tall is {x if first else y} in cm?", a if first else b


KINDS = {"lookup": _lookup, "price": _price, "larger": _larger, "ages": _ages, "heights": _heights}

# One worked example, of a kind neither split has, shows the answer's form.
EXAMPLE = "Question: How many legs does a cat have?\nAnswer: A cat has 4 legs.\n#### 4"
INSTRUCTION = 'Answer the question. Write the final answer on its own last line as "#### <number>".\n\n'
READ = dict(train_kinds=("lookup", "price", "larger"), eval_kinds=("ages", "heights"))
DESIGNS = {
    # Train: reading a count or a price off the question, the larger of two numbers; held out: a person's age or
    # height (other templates, other questions). The model often reaches these numbers; what it lacks is the line
    # "#### <number>" and ending there.
    "read_oneshot": dict(head=INSTRUCTION + EXAMPLE + "\n\n", **READ),
    # The example set apart by "---" (as another document): the model copies its "#### <number>" line less often.
    "read_oneshot_sep": dict(head=INSTRUCTION + EXAMPLE + "\n\n---\n\n", **READ),
    "read_example_sep": dict(head=INSTRUCTION + "Example:\n" + EXAMPLE + "\n\n---\n\n", **READ),
    "read_zeroshot": dict(head=INSTRUCTION, **READ),
}


def rows(design: str, count: int, seed: int, held_out: bool) -> list[dict]:
  spec, rng = DESIGNS[design], random.Random(seed)
  kinds = spec["eval_kinds" if held_out else "train_kinds"]
  out = []
  for i in range(count):
    kind = kinds[i % len(kinds)]  # balanced kinds
    question, answer = KINDS[kind](rng)
    out.append({"prompt": f"{spec['head']}Question: {question}\nAnswer:", "answer": str(answer), "kind": kind})
  rng.shuffle(out)
  return out


# -- scoring (a copy of jaxlm/recipes/rewards.py's rules for integer answers) --

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
ANSWER_LINE = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
                         r"(?:\s|<\|[^|<>\s]*\|>|</s>)*\Z")
_ANSWER_LINE_THEN_NEWLINE = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?[ \t]*\n")


def final_answer(text: str) -> str | None:
  boxed = text.rfind("\\boxed{")
  if boxed >= 0 and "}" in text[boxed:]:
    return text[boxed + len("\\boxed{"):text.index("}", boxed)].strip()
  if "####" in text:
    after = text.rsplit("####", 1)[1].strip()
    line = after.splitlines()[0].strip() if after else ""
    # rewards.py compares the whole line (math-verify reads "12 apples" as 12): its leading number stands for it
    lead = _NUMBER.match(line)
    return lead.group(0) if lead else (line or None)
  found = _NUMBER.findall(text)
  return found[-1] if found else None


def exact_answer(text: str, answer: str) -> bool:
  predicted = final_answer(text)
  try:
    return predicted is not None and float(predicted.replace(",", "").rstrip(".")) == float(answer)
  except ValueError:
    return False


def answer_format(text: str) -> bool:
  return bool(ANSWER_LINE.search(text))


def cut(text: str) -> str:
  """The completion as a newline stop after a "#### <number>" line would leave it."""
  m = _ANSWER_LINE_THEN_NEWLINE.search(text)
  return text[:m.end() - 1] if m else text


def first_number(text: str, answer: str) -> bool:
  """Whether the first number the completion writes is the answer: is the number within the model's reach."""
  found = _NUMBER.findall(text)
  return bool(found) and float(found[0].replace(",", "")) == float(answer)


def scores(by_rule: dict[str, list[str]], answers: list[str]) -> dict:
  """Greedy accuracies under each way of ending a completion (`endings`)."""
  n, out = max(1, len(answers)), {}
  for rule, texts in by_rule.items():
    ex = [exact_answer(t, a) for t, a in zip(texts, answers)]
    fo = [answer_format(t) for t in texts]
    out[rule] = {"exact_answer": sum(ex) / n, "answer_format": sum(fo) / n,
                 "exact_and_format": sum(e and f for e, f in zip(ex, fo)) / n}
  out["first_number"] = sum(first_number(t, a) for t, a in zip(by_rule["eos"], answers)) / n
  return out


def group_scores(by_rule: dict[str, list[str]], answers: list[str], k: int) -> dict:
  """Sampled completions, k per prompt in a row (a GRPO group): how many groups have a success to learn from."""
  out = {}
  for rule, texts in by_rule.items():
    both = [exact_answer(t, a) and answer_format(t) for t, a in zip(texts, answers)]
    exact = [exact_answer(t, a) for t, a in zip(texts, answers)]
    hits = [both[j:j + k] for j in range(0, len(both), k)]
    exact_hits = [exact[j:j + k] for j in range(0, len(exact), k)]
    out[rule] = {"mean_exact_and_format": sum(both) / len(both),
                 "groups_with_a_hit": sum(map(any, hits)) / len(hits),
                 "groups_with_variance": sum(any(h) and not all(h) for h in hits) / len(hits),
                 "mean_exact_answer": sum(exact) / len(exact),
                 "groups_with_an_exact_answer": sum(map(any, exact_hits)) / len(exact_hits)}
  return out


# -- measuring the base model --

_ANSWER_NUMBER = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _generate(model, tok, prompts, sample: bool, seed: int = 0):
  """Completions (ended by <eos> or max_new_tokens only), their token ids and, per row, p(<eos>) at each step."""
  import torch  # noqa: PLC0415  only --measure needs torch
  from transformers import LogitsProcessor, LogitsProcessorList  # noqa: PLC0415

  class EosProbability(LogitsProcessor):
    # Records p(<eos>) of each step's distribution (greedy and temperature 1: the raw logits) and changes nothing.
    def __init__(self):
      self.steps = []

    def __call__(self, input_ids, scores):
      self.steps.append(torch.softmax(scores.float(), -1)[:, tok.eos_token_id])
      return scores

  texts, token_ids, eos_probs = [], [], []
  for i in range(0, len(prompts), _BATCH.value):
    enc = tok(prompts[i:i + _BATCH.value], return_tensors="pt", padding=True)
    start, record = enc.input_ids.shape[1], EosProbability()
    torch.manual_seed(seed + i)
    with torch.no_grad():
      # Sampling as TRL's GRPOConfig defaults: temperature 1, top_p 1, top_k 0 (off).
      how = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if sample else dict(do_sample=False)
      ids = model.generate(**enc, **how, max_new_tokens=_MAX_NEW.value, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([record]))
    texts += tok.batch_decode(ids[:, start:], skip_special_tokens=True)
    token_ids += ids[:, start:].tolist()
    eos_probs += torch.stack(record.steps, 1).tolist()
  return texts, token_ids, eos_probs


def eos_after_answer(tok, token_ids: list[list[int]], eos_probs: list[list[float]]) -> dict:
  """Over greedy completions that write a "#### <number>" line: the mean p(<eos>) right after the number and one
  token later (after the newline): how often a sampled completion would end there, where GRPO learns to stop."""
  after, lengths = [[], []], []
  for ids, probs in zip(token_ids, eos_probs):
    text = tok.decode(ids, skip_special_tokens=True)
    m = _ANSWER_NUMBER.search(text)
    if not m:
      continue
    k = next((k for k in range(len(ids) + 1) if len(tok.decode(ids[:k], skip_special_tokens=True)) >= m.end()), None)
    if k is None:
      continue
    lengths.append(k)
    for offset in (0, 1):
      if k + offset < len(probs):
        after[offset].append(probs[k + offset])
  mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
  return {"rows": len(after[0]), "p_eos_after_number": mean(after[0]), "p_eos_one_token_later": mean(after[1]),
          "tokens_through_answer_line": {"mean": mean(lengths), "max": max(lengths, default=None)}}


def endings(tok, token_ids: list[list[int]]) -> dict[str, list[str]]:
  """Each completion as three stop rules would leave it: "eos" (<eos> or the length limit: as generated), "cut"
  (also the first newline after a "#### <number>" line: a regex stop) and "blank_line" (also the first token that is
  only newlines, "\\n\\n" = id 108 and longer: a stop-token list)."""
  blank = {i for t, i in tok.get_vocab().items() if len(t) >= 2 and set(t) == {"\n"}}
  eos = tok.batch_decode(token_ids, skip_special_tokens=True)
  firsts = [next((j + 1 for j, i in enumerate(ids) if i in blank), len(ids)) for ids in token_ids]
  return {"eos": eos, "cut": [cut(t) for t in eos],
          "blank_line": tok.batch_decode([ids[:j] for ids, j in zip(token_ids, firsts)], skip_special_tokens=True)}


def measure(folder: str) -> dict:
  import torch  # noqa: PLC0415
  from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415
  torch.set_num_threads(_THREADS.value)
  tok = AutoTokenizer.from_pretrained(folder)
  tok.padding_side = "left"  # generation continues every row from its last prompt token
  model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  result = {"command": "python " + " ".join(sys.argv), "model": folder, "max_new_tokens": _MAX_NEW.value,
            "stop": " ".join(endings.__doc__.split()), "designs": {}}
  n, k = _MEASURE_PROMPTS.value, _SAMPLES.value
  for design in _DESIGNS.value or list(DESIGNS):
    t0 = time.time()
    entry = {"head": DESIGNS[design]["head"], "train_kinds": DESIGNS[design]["train_kinds"],
             "eval_kinds": DESIGNS[design]["eval_kinds"]}
    for split, held_out in (("train", False), ("eval", True)):
      data = rows(design, n, _SEED.value + held_out, held_out)
      _, token_ids, eos_probs = _generate(model, tok, [r["prompt"] for r in data], sample=False)
      by_rule = endings(tok, token_ids)
      entry[f"greedy_{split}"] = scores(by_rule, [r["answer"] for r in data])
      entry[f"greedy_{split}_by_kind"] = {
          kind: scores({rule: [t for t, r in zip(texts, data) if r["kind"] == kind] for rule, texts in by_rule.items()},
                       [r["answer"] for r in data if r["kind"] == kind])
          for kind in sorted({r["kind"] for r in data})}
      entry[f"greedy_{split}_eos"] = eos_after_answer(tok, token_ids, eos_probs)
      entry[f"examples_{split}"] = [{"question": r["prompt"].rsplit("Question: ", 1)[1], "answer": r["answer"],
                                     "completion": t} for r, t in list(zip(data, by_rule["eos"]))[:4]]
    data = rows(design, _SAMPLE_PROMPTS.value, _SEED.value + 2, False)
    _, token_ids, _ = _generate(model, tok, [r["prompt"] for r in data for _ in range(k)], sample=True,
                                seed=_SEED.value)
    by_rule = endings(tok, token_ids)
    entry[f"sampled_train_{k}_per_prompt"] = group_scores(by_rule, [r["answer"] for r in data for _ in range(k)], k)
    entry["sample_examples"] = by_rule["eos"][:4]
    entry["seconds"] = round(time.time() - t0, 1)
    result["designs"][design] = entry
    print(json.dumps({design: {key: v for key, v in entry.items() if not key.startswith(("examples", "sample_ex"))}}),
          flush=True)
  return result


def main(argv):
  del argv
  if _MEASURE.value:
    result = measure(_MEASURE.value)
    if _RESULTS.value:
      with open(_RESULTS.value, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return
  if not _OUT.value:
    raise SystemExit("error: give --out=<folder> (or --measure=<HF folder>)")
  os.makedirs(_OUT.value, exist_ok=True)
  for name, data in (("train", rows(_DESIGN.value, _TRAIN.value, _SEED.value, False)),
                     ("eval", rows(_DESIGN.value, _EVAL.value, _SEED.value + 1, True))):
    path = os.path.join(_OUT.value, f"{name}.jsonl")
    with open(path, "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in data)
    print(f"{path}: {len(data)} prompts")


if __name__ == "__main__":
  cli.run(main)
