"""A generated preference set whose chosen responses follow a rule the prompt states, and a scorer for a tuned
model's answers: does a decoder learn, by DPO, to follow the rule it is told?

  python experiments/preference_pairs.py --out=runs/rule_pairs                 # train.jsonl, eval.jsonl
  python experiments/finetune.py --config=experiments/configs/finetune_preferences.py --workdir=runs/dpo_rules \
      --config.init_from=runs/gemma3_270m
  python experiments/preference_pairs.py --score=runs/dpo_rules                # rule-following before and after

Each prompt asks for three items of a category and states one rule: capital letters, numbered items, or items
separated by semicolons. The chosen response follows the rule; the rejected one lists the same items following
another of the rules, so only reading the prompt's rule tells them apart. The held-out prompts ask for categories the training prompts never
name (held out by prompt). --score reads <workdir>/answers.json (greedy answers to the held-out prompts before and
after tuning, written by jaxlm/recipes/preference_tuning.py) and prints how many follow their prompt's rule.
"""

import json
import os
import random

from absl import flags

from jaxlm import cli

_OUT = flags.DEFINE_string("out", "", "folder for train.jsonl and eval.jsonl")
_TRAIN = flags.DEFINE_integer("train", 240, "training pairs")
_EVAL = flags.DEFINE_integer("eval", 48, "held-out pairs")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the items and rules")
_SCORE = flags.DEFINE_string("score", "", "a preference-tuning workdir: score its answers.json instead")

CATEGORIES = {
    "fruits": "apple pear plum cherry mango lemon peach grape",
    "animals": "horse tiger rabbit wolf camel zebra otter mouse",
    "colours": "red blue green yellow purple orange brown white",
    "tools": "hammer saw drill wrench chisel pliers file axe",
    "vegetables": "carrot onion potato pepper cabbage leek radish pea",
    "instruments": "piano violin flute drum guitar harp trumpet cello",
    "metals": "iron copper silver gold tin zinc lead nickel",
    "trees": "oak pine birch maple willow cedar elm ash",
    "drinks": "tea coffee milk juice water cocoa cider soda",
    "birds": "robin eagle crow swan owl sparrow heron duck",
    "sports": "tennis rugby soccer golf hockey rowing boxing cricket",
    "fabrics": "cotton wool silk linen denim velvet nylon felt",
}
HELD_OUT = ("birds", "sports", "fabrics")  # categories only the held-out prompts name
RULES = {
    "capitals": "Write the answer in capital letters.",
    "numbered": "Number the items.",
    "semicolons": "Separate the items with semicolons.",
}


def _follow(rule: str, items: list[str]) -> str:
  if rule == "capitals":
    return ", ".join(items).upper()
  if rule == "numbered":
    return " ".join(f"{i + 1}. {item}" for i, item in enumerate(items))
  return "; ".join(items)


def _shows(rule: str, text: str) -> bool:
  letters = [c for c in text if c.isalpha()]
  if rule == "capitals":
    return bool(letters) and all(c.isupper() for c in letters)
  if rule == "numbered":
    return text.startswith("1.") and "2." in text
  return text.count(";") >= 2


def follows_rule(rule: str, answer: str) -> bool:
  """Whether `answer` (a model's reply, up to its first blank line or next question) follows `rule` and none of the
  other rules."""
  text = answer.strip().split("\n\n")[0].split("Question:")[0].strip()
  return _shows(rule, text) and not any(_shows(other, text) for other in RULES if other != rule)


def pair(rng: random.Random, categories: list[str]) -> dict:
  category, rule = rng.choice(categories), rng.choice(sorted(RULES))
  other = rng.choice([r for r in sorted(RULES) if r != rule])
  items = rng.sample(CATEGORIES[category].split(), 3)
  # The answer starts on its own line, as a pretrained model continues "Answer:" (a reply starting with a space would
  # share that first token between chosen and rejected, and greedy decoding never takes it).
  return {"prompt": f"Question: Name three {category}. {RULES[rule]}\nAnswer:\n", "chosen": _follow(rule, items),
          "rejected": _follow(other, items), "rule": rule}


def pairs(count: int, seed: int, held_out: bool) -> list[dict]:
  rng = random.Random(seed)
  categories = list(HELD_OUT) if held_out else [c for c in CATEGORIES if c not in HELD_OUT]
  return [pair(rng, categories) for _ in range(count)]


def rule_of(prompt: str) -> str:
  return next(rule for rule, text in RULES.items() if text in prompt)


def score(workdir: str) -> dict:
  with open(os.path.join(workdir, "answers.json")) as f:
    answers = json.load(f)
  result = {}
  for when in ("before", "after"):
    hits = [follows_rule(rule_of(p), a) for p, a in zip(answers["prompts"], answers[when])]
    result[f"follows_rule_{when}"] = sum(hits) / max(1, len(hits))
  result["answers"] = len(answers["prompts"])
  return result


def main(argv):
  del argv
  if _SCORE.value:
    print(json.dumps(score(_SCORE.value)))
    return
  if not _OUT.value:
    raise SystemExit("error: give --out=<folder> (or --score=<workdir>)")
  os.makedirs(_OUT.value, exist_ok=True)
  for name, rows in (("train", pairs(_TRAIN.value, _SEED.value, False)),
                     ("eval", pairs(_EVAL.value, _SEED.value + 1, True))):
    path = os.path.join(_OUT.value, f"{name}.jsonl")
    with open(path, "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"{path}: {len(rows)} pairs")


if __name__ == "__main__":
  cli.run(main)
