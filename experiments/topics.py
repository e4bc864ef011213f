"""A small labelled set built offline: short English sentences about four topics (sports, cooking, computers,
weather), for fine-tuning demos and tests.

  python experiments/topics.py --out=runs/topics            # writes train.csv and eval.csv (text,label)

Sentences come from templates with slot words; the eval rows use other slot words than the training rows, so the
held-out accuracy measures generalisation to unseen wording rather than memorised sentences.
"""

from __future__ import annotations

import csv
import os
import random

from absl import app, flags

TOPICS = {
    "sports": {
        "templates": ["the {a} scored in the last minute of the {b}", "our {a} trained hard before the {b}",
                      "fans cheered when the {a} won the {b}", "the coach praised the {a} after the {b}",
                      "a {a} broke the record at the {b}"],
        "a": ["striker", "goalkeeper", "team", "sprinter", "captain", "midfielder", "swimmer", "runner",
              "tennis player", "cyclist", "defender", "boxer"],
        "b": ["match", "final", "tournament", "league game", "championship", "derby", "relay race", "cup tie",
              "marathon", "olympics", "semifinal", "season opener"],
    },
    "cooking": {
        "templates": ["stir the {a} slowly and add the {b}", "she baked the {a} with fresh {b}",
                      "the recipe needs {a} and a pinch of {b}", "roast the {a} in the oven with {b}",
                      "the chef seasoned the {a} with {b}"],
        "a": ["soup", "bread", "chicken", "pasta", "cake", "vegetables", "sauce", "potatoes", "rice", "fish",
              "dough", "stew"],
        "b": ["garlic", "butter", "basil", "olive oil", "salt", "pepper", "onions", "cream", "lemon", "thyme",
              "sugar", "parsley"],
    },
    "computers": {
        "templates": ["the {a} crashed after the {b} update", "install the {b} before you restart the {a}",
                      "my {a} runs the {b} much faster now", "the engineer debugged the {b} on the {a}",
                      "a bug in the {b} froze the {a}"],
        "a": ["laptop", "server", "computer", "database", "network", "processor", "graphics card", "keyboard",
              "operating system", "web browser", "cluster", "hard drive"],
        "b": ["software", "driver", "compiler", "firmware", "kernel", "program", "spreadsheet", "python script",
              "security patch", "antivirus", "email client", "backup tool"],
    },
    "weather": {
        "templates": ["heavy {a} is expected {b}", "the forecast says {a} will arrive {b}",
                      "we stayed inside because of the {a} {b}", "strong {a} hit the coast {b}",
                      "the farmers hoped for {a} {b}"],
        "a": ["rain", "snow", "wind", "fog", "thunderstorms", "hail", "sunshine", "frost", "drizzle", "clouds",
              "heat", "showers"],
        "b": ["tomorrow", "this weekend", "tonight", "in the morning", "across the north", "over the hills",
              "later today", "along the valley", "next week", "by the evening", "near the lake", "all afternoon"],
    },
}


def topic_rows(split: str, count: int, seed: int) -> list[tuple[str, str]]:
  """`count` (text, label) rows; train uses the first 8 slot words of each list, eval the last 4."""
  rng = random.Random(f"{seed}-{split}")
  rows = []
  for i in range(count):
    label = sorted(TOPICS)[i % len(TOPICS)]
    topic = TOPICS[label]
    pick = lambda words: rng.choice(words[:8] if split == "train" else words[8:])
    rows.append((rng.choice(topic["templates"]).format(a=pick(topic["a"]), b=pick(topic["b"])), label))
  rng.shuffle(rows)
  return rows


def write_topic_dataset(folder: str, train_rows: int = 240, eval_rows: int = 80, seed: int = 0) -> tuple[str, str]:
  """Writes <folder>/train.csv and <folder>/eval.csv (columns text,label) and returns their paths."""
  os.makedirs(folder, exist_ok=True)
  paths = []
  for split, count in (("train", train_rows), ("eval", eval_rows)):
    path = os.path.join(folder, f"{split}.csv")
    with open(path, "w", newline="", encoding="utf-8") as f:
      writer = csv.writer(f)
      writer.writerow(["text", "label"])
      writer.writerows(topic_rows(split, count, seed))
    paths.append(path)
  return paths[0], paths[1]


def main(argv):
  del argv
  print(*write_topic_dataset(_OUT.value, _TRAIN.value, _EVAL.value, _SEED.value))


if __name__ == "__main__":  # flags only when run as a script: tests import this module beside other scripts
  _OUT = flags.DEFINE_string("out", "runs/topics", "folder for train.csv and eval.csv")
  _TRAIN = flags.DEFINE_integer("train_rows", 240, "training rows")
  _EVAL = flags.DEFINE_integer("eval_rows", 80, "held-out rows")
  _SEED = flags.DEFINE_integer("seed", 0, "seed")
  app.run(main)
