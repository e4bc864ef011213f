"""Padding-free preference pairs (jaxlm/data/tuning/pair_packing.py): best-fit decreasing puts every pair in exactly
one row, each row's sequences are exactly the padded layout's (chosen then rejected, positions restarting, the loss
on response targets only), and the row sizes the recipe may choose split the batch evenly."""

import numpy as np
import pytest

from jaxlm.data.tuning import pair_packing
from jaxlm.data.tuning import preferences as pref_data


def test_best_fit_decreasing_puts_each_item_in_the_fullest_bin_it_fits():
  # 7 opens bin 0 (room 1), 5 bin 1 (room 3), 4 bin 2 (room 4); 3 fills bin 1, 2 goes to bin 2, 1 fills bin 0.
  assert pair_packing.best_fit_decreasing([5, 3, 7, 2, 4, 1], 8) == [[2, 5], [0, 1], [3, 4]]
  assert pair_packing.best_fit_decreasing([], 8) == []
  rng = np.random.default_rng(0)
  for _ in range(20):
    lengths = rng.integers(1, 41, size=int(rng.integers(1, 60))).tolist()
    bins = pair_packing.best_fit_decreasing(lengths, 40)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every item exactly once
    assert all(sum(lengths[i] for i in b) <= 40 for b in bins)
    # Best fit never leaves two bins that could be merged (the second would have fit into the first).
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > 40


def _pairs(rng: np.random.Generator, count: int) -> list[pref_data.Pair]:
  """Pairs whose prompt ends with a token naming the pair (1000 + i; a cut keeps the prompt's end), of varied
  lengths, some longer than a row."""
  pairs = []
  for i in range(count):
    prompt = [*rng.integers(3, 100, size=int(rng.integers(0, 9))).tolist(), 1000 + i]
    chosen, rejected = (rng.integers(3, 100, size=int(rng.integers(1, 8))).tolist() + [2] for _ in range(2))
    pairs.append(pref_data.Pair(prompt, chosen, rejected, ("p", "c", "r")))
  return pairs


def test_packed_rows_hold_each_pair_once_as_the_padded_layout_cuts_it():
  seq_len, pad = 12, 0
  pairs = _pairs(np.random.default_rng(1), 30)
  padded, padded_cut = pref_data.lay_out(pairs, seq_len, pad)
  packed, cut = pair_packing.pack_pairs(pairs, seq_len, pad, row_pairs=2)
  rows = packed.rows
  n, length = rows["inputs"].shape
  assert length == 2 * 2 * seq_len and cut == padded_cut > 0  # some pairs are cut, as the padded layout cuts them
  assert rows["ref_logp"].shape == (n, rows["pair_weight"].shape[1], 2)
  seen = []
  for r in range(n):
    segments = rows["segment_ids"][r]
    held = int(rows["pair_weight"][r].sum())
    assert held >= 1 and np.all(rows["pair_weight"][r, :held] == 1) and np.all(rows["pair_weight"][r, held:] == 0)
    used = int((segments > 0).sum())
    # Sequences side by side from the row's start, segments 1, 2, 3, ... in order, then padding only.
    np.testing.assert_array_equal(segments[:used], np.sort(segments[:used]))
    assert set(segments[:used]) == set(range(1, 2 * held + 1)) and np.all(segments[used:] == 0)
    assert np.all(rows["inputs"][r, used:] == pad) and np.all(rows["loss_mask"][r, used:] == 0)
    for j in range(held):
      chosen_inputs = rows["inputs"][r, segments == 2 * j + 1]
      i = int(chosen_inputs[chosen_inputs >= 1000][0]) - 1000  # the chosen sequence names its pair
      seen.append(i)
      for side in (0, 1):  # chosen (segment 2j + 1), then rejected (2j + 2)
        at = segments == 2 * j + 1 + side
        k = int(at.sum())
        np.testing.assert_array_equal(rows["positions"][r, at], np.arange(k))  # positions restart per sequence
        for key in ("inputs", "targets", "loss_mask"):
          np.testing.assert_array_equal(rows[key][r, at], padded.rows[key][i, side, :k], err_msg=key)
        assert np.all(padded.rows["segment_ids"][i, side, k:] == 0)  # all of the padded sequence, nothing more
        mask = rows["loss_mask"][r, at]
        # The loss is on the targets that are response tokens: from the prompt's last input on.
        prompt_length = int(np.argmax(mask))
        assert mask[:prompt_length].sum() == 0 and np.all(mask[prompt_length:] == 1)
  assert sorted(seen) == list(range(len(pairs)))  # every pair in exactly one row
  assert int(rows["loss_mask"].sum()) == int(padded.rows["loss_mask"].sum())
  assert n < len(pairs) / 2 + 1  # fewer rows than the padded layout's slots would need


def test_every_split_gets_the_same_pair_slots_and_row_pairs_is_chosen_from_the_training_pairs():
  rng = np.random.default_rng(2)
  splits = {"train": _pairs(rng, 40), "eval": _pairs(rng, 5)}
  laid = pair_packing.packing_layout(0, (1, 2, 4))(splits, 16, 0)
  (train, _), (eval_, _) = laid["train"], laid["eval"]
  assert train.rows["pair_weight"].shape[1] == eval_.rows["pair_weight"].shape[1]  # one shape for the reference
  lengths = [pair_packing.pair_length(x, 16) for x in splits["train"]]
  chosen = pair_packing.choose_row_pairs(lengths, 16, (1, 2, 4))
  assert train.rows["inputs"].shape[1] == eval_.rows["inputs"].shape[1] == 2 * 16 * chosen
  fills = {k: pair_packing.fill(lengths, 2 * 16 * k) for k in (1, 2, 4)}
  # The fewest pairs' slots whose rows are GOOD_FILL full, or else the fullest.
  good = [k for k in (1, 2, 4) if fills[k] >= pair_packing.GOOD_FILL]
  assert chosen == (good[0] if good else max(fills, key=fills.get))
  assert fills[chosen] > 1 - float((pref_data.lay_out(splits["train"], 16, 0)[0].rows["segment_ids"] == 0).mean())


@pytest.mark.parametrize("batch_size, divisor, expected", [(8, 1, (1, 2, 4, 8)), (8, 4, (1, 2)), (6, 1, (1, 2)),
                                                            (16, 2, (1, 2, 4, 8)), (3, 2, ())])
def test_allowed_row_pairs_leave_whole_rows_divisible_by_the_shards(batch_size, divisor, expected):
  assert pair_packing.allowed_row_pairs(batch_size, divisor) == expected
